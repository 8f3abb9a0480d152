#!/usr/bin/env bash
# Conformance kit: record an engine release's own KV-event streams and print kvidx's agreement.
#
#   bash tests/conformance/run.sh vllm 0.34.0 [scenario ...]
#   bash tests/conformance/run.sh sglang 0.5.23 [scenario ...]
#
# Makes (or reuses) a throwaway venv /tmp/kvidx-conformance/<engine>-<release>/venv holding the
# release installed with --no-deps plus only what the imported modules need, runs
# tests/conformance/<engine>/make_recordings.py in it (vLLM's own scheduler, KV-cache manager, KV
# connector and event publisher; SGLang's own radix cache, event recorder and publisher; no GPU, no
# weights), writes the recordings to tests/fixtures/vllm-<major.minor>/<scenario>/ or
# tests/fixtures/sglang-<release>/<scenario>/ (override with OUT=dir), then runs `kvidx shadow` on
# each and prints one agreement line per scenario.
#
# Environment: OUT (recordings folder), VENV (engine venv), SHADOW_VERSION (the
# --engine-version given to kvidx shadow; default: the release), PYTHON (python for the venv),
# SHADOW_ONLY=1 (no venv, no recording: step 3 alone, on the recordings already there).
# Never run by CI: the recordings it writes are committed.
set -euo pipefail

engine="${1:?usage: run.sh vllm|sglang RELEASE [scenario ...]}"
release="${2:?usage: run.sh vllm|sglang RELEASE [scenario ...]}"
shift 2
case "$engine" in
    vllm) fixtures="vllm-$(echo "$release" | cut -d. -f1,2)" ;;  # vLLM's format moves with minor releases
    sglang) fixtures="sglang-$release" ;;  # SGLang's moves with patch releases (0.5.22 -> 0.5.23)
    *) echo "run.sh: engine '$engine' has no conformance generator (vllm, sglang; TensorRT-LLM's block" \
            "manager needs CUDA: tests/conformance/README.md)" >&2; exit 2 ;;
esac
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="${OUT:-$repo/tests/fixtures/$fixtures}"
venv="${VENV:-/tmp/kvidx-conformance/$engine-$release/venv}"
py="${PYTHON:-python3}"

if [[ "${SHADOW_ONLY:-0}" == 1 ]]; then
    echo "run.sh: SHADOW_ONLY=1: step 3 alone, on the recordings in $out"
elif [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c "import $engine, torch" 2>/dev/null; then
    echo "run.sh: step 1/3: engine venv $venv ($engine==$release --no-deps + its imports; ~3.5 GB, several minutes)"
    "$py" -m venv "$venv"
    "$venv/bin/pip" install -q --no-warn-conflicts --no-deps "$engine==$release"
    # torch as the release pins it, with the CUDA runtime libraries it links against (PyPI has
    # no CPU build of torch: libtorch_cuda.so must load even though no GPU is used).
    torch_pin="$("$venv/bin/python" - "$engine" <<'EOF'
import importlib.metadata as m, sys
print(next(r.split(";")[0].replace(" ", "") for r in m.requires(sys.argv[1]) if r.startswith("torch=")))
EOF
)"
    "$venv/bin/pip" install -q --no-warn-conflicts "$torch_pin" "setuptools>=77,<81"
    # the modules' other imports, at the release's own pins
    "$venv/bin/python" - "$here/$engine/requirements.txt" "$engine" > "$venv/../requirements.pinned.txt" <<'PY'
import importlib.metadata as m, re, sys
want = {l.split("#")[0].strip().lower().replace("_", "-") for l in open(sys.argv[1])} - {""}
pins = {}
for r in m.requires(sys.argv[2]):
    name = re.split(r"[ <>=!~;\[]", r, maxsplit=1)[0].lower().replace("_", "-")
    if name in want and "extra ==" not in r:
        pins.setdefault(name, r)
for name in sorted(want):
    print(pins.get(name, name))
PY
    "$venv/bin/pip" install -q --no-warn-conflicts -r "$venv/../requirements.pinned.txt"
else
    echo "run.sh: step 1/3: reusing engine venv $venv"
fi
if [[ "${SHADOW_ONLY:-0}" != 1 ]]; then
    "$venv/bin/python" -c "import $engine; assert $engine.__version__ == '$release', $engine.__version__" || {
        echo "run.sh: $venv holds another $engine release; remove it or set VENV" >&2; exit 2; }
    echo "run.sh: step 2/3: recordings -> $out"
    mkdir -p "$out"
    "$venv/bin/python" "$here/$engine/make_recordings.py" --out "$out" ${1:+--scenario "$@"}
fi

echo "run.sh: step 3/3: kvidx shadow on each recording"
kvidx="$repo/.venv/bin/kvidx"
sv="${SHADOW_VERSION:-$release}"
# "at lookup": credited after exactly the events the engine had queued when it looked the request
# up (the release's verdict); "at send": when the request was sent, as a router asks (the gap is
# timing: blocks other requests stored or evicted in the step that scheduled it)
# entries x: the index's entries over those of whole 16-token blocks alone (partial-block keys)
printf '%-34s %8s %26s %26s\n' "" "" "at lookup" "at send"
printf '%-34s %8s %8s %8s %8s %8s %8s %8s %8s\n' scenario requests exact recall over exact recall over "entries x"
for d in "$out"/*/; do
    [[ -f "$d/frames.jsonl" && -f "$d/requests.jsonl" ]] || continue
    name="$(basename "$d")"
    # vLLM: a release kvidx does not pin yet is read as the newest one it does (the line says so once)
    unchecked=""
    [[ "$engine" == vllm ]] && unchecked="--allow-unchecked-engine-version"
    if ! res="$("$kvidx" --log-level ERROR shadow --engine "$engine" --engine-version "$sv" $unchecked \
            --recording "$d/frames.jsonl" --requests "$d/requests.jsonl" --json 2>&1)"; then
        printf '%-34s %s\n' "$name" "shadow refused: $(echo "$res" | tail -1)"
        continue
    fi
    echo "$res" | "$repo/.venv/bin/python" -c '
import json, sys
r = json.loads(sys.stdin.read().strip().splitlines()[-1])
a = r.get("at_lookup") or {"exact_requests": -1, "recall": float("nan"), "over_credit": float("nan")}
cols = (r["requests"], a["exact_requests"], a["recall"], a["over_credit"], r["exact_requests"], r["recall"],
        r["over_credit"], r["index_entries"] / max(1, r["index_entries_whole_blocks"]))
print("%-34s %8d %8d %8.4f %8.4f %8d %8.4f %8.4f %8.2f" % ((sys.argv[1],) + cols))
' "$name"
done
