#!/usr/bin/env bash
# Sets up a fresh clone: a virtualenv with kvidx and its test tools, and Apache Kafka's jars
# (fetched once with Maven, cached in ~/.cache/kvidx). Needs python3 (3.11+), java 17+ and mvn; with cargo
# (Rust) it also builds kvidx's compiled core, native/; with go, helm (for the chart's test).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v java >/dev/null || { echo "setup: java 17+ is needed for the local Kafka broker" >&2; exit 1; }
command -v mvn >/dev/null || { echo "setup: maven (mvn) is needed to fetch the Kafka jars" >&2; exit 1; }
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# setuptools tells every editable install, as a warning, to beware of folders named like a package:
# an FYI (its InformationOnly class), not a problem; real warnings and errors still show
PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip install -q -e '.[test]'
# the compiled core (native/: Rust, built from source by maturin, fetched from PyPI as its build backend);
# without cargo, kvidx/core/maskmap.py falls back to its pure-Python reference of the same API
if ! command -v cargo >/dev/null && [ -x "$HOME/.cargo/bin/cargo" ]; then
  export PATH="$HOME/.cargo/bin:$PATH"  # rustup's default place, where a login shell's PATH has it
fi
if command -v cargo >/dev/null; then
  if ! .venv/bin/python -m pip install -q ./native; then
    [ "${KVIDX_REQUIRE_NATIVE:-}" = 1 ] && { echo "setup: the compiled core (native/) did not build" >&2; exit 1; }
    echo "setup: the compiled core (native/) did not build (above): kvidx runs its pure-Python core" >&2
  fi
else
  echo "setup: no Rust toolchain: kvidx runs its pure-Python core" >&2
fi
# Helm, for the chart's render and lint test (deploy/helm/kvidx): built from its Go module (the Go module
# proxy is reachable where chart registries are not), once, into .venv/bin
HELM_VERSION=v3.22.0
if [ ! -x .venv/bin/helm ]; then
  if command -v go >/dev/null && GOBIN="$PWD/.venv/bin" go install "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"; then
    :
  else
    [ "${KVIDX_REQUIRE_HELM:-}" = 1 ] && { echo "setup: helm $HELM_VERSION did not build (Go needed)" >&2; exit 1; }
    echo "setup: no helm (it builds where Go is installed): the chart test is skipped" >&2
  fi
fi
.venv/bin/kvidx kafka fetch >/dev/null
echo "setup: done (.venv ready, Kafka jars cached)" >&2
