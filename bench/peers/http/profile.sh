#!/usr/bin/env bash
# Profiles both servers under the same closed-loop load (4 connections, 9 s) per query form:
# kvidx with py-spy (Python stacks, 250 Hz, --nonblocking; skipped if .venv/bin/py-spy is missing),
# Dynamo with perf (299 Hz, DWARF stacks; skipped if perf is missing).
# Usage: profile.sh OUTDIR KVIDX_PORT KVIDX_PID DYN_PORT DYN_PID QUERY_DIR   (run.sh --profile calls it)
# env: LOADGEN (the loadgen binary), PY
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
OUT=$1; KP=$2; KPID=$3; DP=$4; DPID=$5; Q=$6
PY=${PY:-$ROOT/.venv/bin/python}
LG=${LOADGEN:?set LOADGEN to the loadgen binary}
SPY=$ROOT/.venv/bin/py-spy
mkdir -p "$OUT"
for form in hash tok; do
  if [ -x "$SPY" ]; then
    "$SPY" record -p "$KPID" -d 8 -r 250 --nonblocking -f raw \
        -o "$OUT/kvidx_$form.raw" > "$OUT/kvidx_$form.pyspy.log" 2>&1 &
    SP=$!
    sleep 0.5
    "$LG" --port "$KP" --reqs "$Q/kvidx_$form.reqs" --conns 4 --warmup 0.5 --duration 9 --pid "$KPID" \
        > "$OUT/kvidx_$form.load.json"
    wait $SP || true
    "$PY" "$HERE/pyspy_summary.py" "$OUT/kvidx_$form.raw" 30 > "$OUT/kvidx_$form.summary.txt" || true
  fi
  if command -v perf > /dev/null; then
    perf record -F 299 --call-graph dwarf,16384 -p "$DPID" -o "$OUT/dyn_$form.perf.data" -- sleep 8 \
        > "$OUT/dyn_$form.perf.log" 2>&1 &
    PP=$!
    sleep 0.5
    "$LG" --port "$DP" --reqs "$Q/dyn_$form.reqs" --conns 4 --warmup 0.5 --duration 9 --pid "$DPID" \
        > "$OUT/dyn_$form.load.json"
    wait $PP || true
    "$PY" "$HERE/perf_summary.py" "$OUT/dyn_$form.perf.data" 30 > "$OUT/dyn_$form.summary.txt" || true
  fi
done
