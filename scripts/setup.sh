#!/usr/bin/env bash
# Sets up a fresh clone in four steps, each announced with what it is and about how long it takes:
#   1. a virtualenv (.venv) with kvidx and its test tools (pip);
#   2. kvidx's compiled index core (native/: Rust, built from source) where cargo is installed;
#      elsewhere kvidx runs the same core in pure Python;
#   3. Apache Kafka's jars, fetched once with Maven into ~/.cache/kvidx (for the local broker);
#   4. a check that the `kvidx` command runs.
# Needs python3 (3.11+), java 17+ and mvn; cargo optional. Helm (for the chart's test only) is not built
# here: tests/unit/deploy/test_helm_chart.py builds it on its first run where Go is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { echo "[setup] $*" >&2; }
command -v java >/dev/null || { echo "setup: java 17+ is needed for the local Kafka broker" >&2; exit 1; }
command -v mvn >/dev/null || { echo "setup: maven (mvn) is needed to fetch the Kafka jars" >&2; exit 1; }
start=$SECONDS

step "1/4 Python packages into .venv (~1 min the first time, seconds after) ..."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install -q --upgrade pip
# setuptools tells every editable install, as a warning, to beware of folders named like a package:
# an FYI (its InformationOnly class), not a problem; real warnings and errors still show.
# --no-compile: Python compiles a module when it is first imported instead of pip compiling all of
# them now (halves this step: 148 s -> 69 s on 2 busy cores)
PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip install -q --no-compile -e '.[test]'

# the compiled core (native/: Rust, built from source by maturin, fetched from PyPI as its build backend);
# without cargo, kvidx/core/maskmap.py falls back to its pure-Python reference of the same API
if ! command -v cargo >/dev/null && [ -x "$HOME/.cargo/bin/cargo" ]; then
  export PATH="$HOME/.cargo/bin:$PATH"  # rustup's default place, where a login shell's PATH has it
fi
if command -v cargo >/dev/null; then
  step "2/4 the compiled index core, native/ (Rust; ~1-2 min the first time, seconds after) ..."
  if ! .venv/bin/python -m pip install -q ./native; then
    [ "${KVIDX_REQUIRE_NATIVE:-}" = 1 ] && { echo "setup: the compiled core (native/) did not build" >&2; exit 1; }
    echo "setup: the compiled core (native/) did not build (above): kvidx runs its pure-Python core" >&2
  fi
else
  step "2/4 the compiled index core: skipped (no Rust toolchain): kvidx runs its pure-Python core"
fi

step "3/4 Kafka's jars for the local broker (~30 s, once; cached in ~/.cache/kvidx) ..."
.venv/bin/kvidx kafka fetch >/dev/null

step "4/4 checking the kvidx command ..."
.venv/bin/kvidx --help >/dev/null
echo "setup: done in $((SECONDS - start)) s (.venv ready, Kafka jars cached)" >&2
