#!/usr/bin/env bash
# kvidx's core side by side with Dynamo's and llm-d's KV-cache indexers, in process, on one event
# stream generated from the Mooncake trace; answers checked equal; interleaved rounds; same-round ratios.
# Run `bench/peers/run.sh --help` for the options. Everything it builds or writes goes to $PB.
set -euo pipefail
unset INGEST_TURNS  # (turns.py sets it for the indexers it drives; left set, a plain run would wait on stdin)

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PB=${PB:-$HERE/.build}
PY=${PY:-$ROOT/.venv/bin/python}
NICE=${NICE:-10}
ROUNDS=3
TURNS=3
WORKLOADS=A
QUICK=0
EXTRA=0
LLMD=${LLMD:-1}
REV=""
PROFILE=0
BUILD_ONLY=0
FLEET=""
CMDLINE="bench/peers/run.sh $*"

usage() {
  cat <<EOF
Usage: bench/peers/run.sh [options]

Builds the peers (Dynamo's crate dynamo-kv-router 1.6.1 from the crate registry; llm-d-kv-cache @ 7be76e1
through the Go module proxy), generates each workload's event stream once from the repo's Mooncake
trace (kvidx/sim/data/mooncake_conversation_trace.jsonl), runs interleaved rounds of
  kvidx ModelShard (this repo's pure-Python core) | Dynamo RadixTree | Dynamo CRTC, 1 event thread | llm-d
checks that their answers agree and prints the tables (results/<workload>/summary.md under \$PB).

Options:
  --rounds N        interleaved rounds (default 3)
  --turns N         in each round, once kvidx and Dynamo have run their passes one after the other,
                    one untimed ingest pass each, then their ingest passes alternate N times each,
                    each alone on the host (turns.py; default 3): the ingest figure is the median of
                    those; 0: one ingest pass each, in sequence (the form before 2026-12-07). llm-d
                    runs after them, one pass, as before.
  --quick           smoke check: a small workload (16 workers x 2048 blocks, trace x1, with
                    evictions), 1 round
  --workloads "A B C"
                    A: 64 workers x 8192 blocks, random routing (default); B: 16 workers x 16384,
                    random routing; C: 16 workers x 8192, KV-aware routing
  --workers "64 512 2048"
                    the fleet sweep: one workload per size (w64, w512, ...: N workers x 8192 blocks,
                    random routing, trace x4 up to 64 workers and x32 above), then the fleet table
                    (summarize.py --fleet: per size, kvidx / Dynamo's best on ingest, lookups/s,
                    p99, and bytes per entry), with issue 43's bars at 2,048
  --extra           also Dynamo CRTC with 2 event threads, and llm-d with its default podCacheSize 10
                    (lossy: its answers may differ) once
  --no-llmd         leave llm-d out (same as LLMD=0); it is also left out, with a warning, when its
                    build fails (e.g. the module proxy does not serve llm-d-kv-cache)
  --rev REV         benchmark commit REV of this repo (git archive into \$PB/kvidx-<sha>) instead of
                    the working tree
  --profile         afterwards, cProfile kvidx's ingest and lookup passes on the first workload (and
                    py-spy record it, if .venv/bin/py-spy exists)
  --build-only      build the peers and stop
  -h, --help        this text

Environment:
  PB=DIR            scratch folder for builds, event files and results (default: bench/peers/.build)
  PY=PYTHON         the Python that runs kvidx (default: the repo's .venv/bin/python)
  NICE=N            niceness of every benchmarked process (default 10: a shared machine; same for all)
  LLMD_MODFILE=F    an alternate go.mod for llmdbench (go build -modfile), e.g. the committed one plus
                    a replace directive to a local copy of llm-d-kv-cache at 7be76e1
  CARGO_TARGET_DIR  Rust build folder (default: \$PB/target)

Builds use 'nice -n 10 cargo build --release -j 2' and 'go build -p 2'. The first build takes minutes.
Exit status: 1 if the indexers' answers disagree or a step fails.
EOF
}

while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) ROUNDS=$2; shift ;;
    --turns) [[ "$2" =~ ^[0-9]+$ ]] || { echo "--turns: a number of passes (0: none), not '$2'" >&2; exit 2; }
             TURNS=$2; shift ;;
    --quick) QUICK=1 ;;
    --workloads) WORKLOADS=$2; shift ;;
    --workers) FLEET=$2; shift ;;
    --extra) EXTRA=1 ;;
    --no-llmd) LLMD=0 ;;
    --rev) REV=$2; shift ;;
    --profile) PROFILE=1 ;;
    --build-only) BUILD_ONLY=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$FLEET" ]; then
  WORKLOADS=""
  for N in $FLEET; do
    [[ "$N" =~ ^[0-9]+$ ]] && [ "$N" -ge 1 ] || { echo "--workers: a list of worker counts, e.g. \"64 512 2048\"" >&2; exit 2; }
    WORKLOADS="$WORKLOADS w$N"
  done
fi
if [ "$QUICK" = 1 ]; then ROUNDS=1; WORKLOADS=A; FLEET=""; fi

mkdir -p "$PB/logs" "$PB/bin" "$PB/results"
PB=$(cd "$PB" && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PB/target}
log() { echo "[peers $(date +%T)] $*"; }

# ---- kvidx: this repo's working tree, or one commit of it ---------------------------------------
if [ -n "$REV" ]; then
  SHA=$(git -C "$ROOT" rev-parse --verify "$REV^{commit}")
  export KVIDX_ROOT=$PB/kvidx-${SHA:0:12}
  if [ ! -f "$KVIDX_ROOT/kvidx/core/shard.py" ]; then
    mkdir -p "$KVIDX_ROOT" && git -C "$ROOT" archive "$SHA" | tar -x -C "$KVIDX_ROOT"
  fi
  KVIDX_DESC="${SHA:0:12} (git archive of $REV)"
else
  export KVIDX_ROOT=$ROOT
  KVIDX_DESC="$(git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null || echo unknown) (working tree"
  if [ -n "$(git -C "$ROOT" status --porcelain -- kvidx schemas 2>/dev/null)" ]; then
    KVIDX_DESC="$KVIDX_DESC, with uncommitted changes in kvidx/ or schemas/)"
  else
    KVIDX_DESC="$KVIDX_DESC, clean)"
  fi
fi
[ -x "$PY" ] || { echo "no Python at $PY: run scripts/setup.sh first, or set PY" >&2; exit 1; }

# ---- builds -----------------------------------------------------------------------------------
DYN=$CARGO_TARGET_DIR/release/dynbench
log "building dynbench (dynamo-kv-router 1.6.1, crate registry) -> $DYN"
(cd "$HERE/dynbench" && nice -n 10 cargo build --release -j 2 -q) > "$PB/logs/dynbench-build.log" 2>&1 \
  || { tail -30 "$PB/logs/dynbench-build.log"; echo "dynbench build failed" >&2; exit 1; }

LLMD_BIN=$PB/bin/llmdbench
LLMD_NOTE=""
if [ "$LLMD" = 1 ]; then
  MODFILE=${LLMD_MODFILE:-}
  if [ -z "$MODFILE" ]; then  # a copy: go may add go.sum lines; the committed files stay untouched
    mkdir -p "$PB/llmd"
    cp "$HERE/llmdbench/go.mod" "$PB/llmd/go.mod"
    cp "$HERE/llmdbench/go.sum" "$PB/llmd/go.sum"
    MODFILE=$PB/llmd/go.mod
  fi
  log "building llmdbench (llm-d-kv-cache 7be76e1, Go module proxy; modfile $MODFILE) -> $LLMD_BIN"
  if ! (cd "$HERE/llmdbench" && nice -n 10 go build -p 2 -mod=mod -modfile="$MODFILE" -o "$LLMD_BIN" .) \
      > "$PB/logs/llmdbench-build.log" 2>&1; then
    tail -5 "$PB/logs/llmdbench-build.log" | sed 's/^/    /'
    log "WARNING: llmdbench did not build (log: $PB/logs/llmdbench-build.log): llm-d is left out"
    LLMD=0
    LLMD_NOTE="llm-d left out: its build failed"
  fi
fi
if [ "$BUILD_ONLY" = 1 ]; then log "built"; exit 0; fi

# ---- workloads: one event file each, written once, fed to every indexer -------------------------
declare -A WARGS=( [A]="--workers 64 --capacity 8192 --dup 4" [B]="--workers 16 --capacity 16384 --dup 4"
                   [C]="--workers 16 --capacity 8192 --dup 4 --route kv" )
export HASH_EVERY=4   # the hashing pass covers every 4th query, the same subset for every indexer
STATUS=0
FIRST=""
for W in $WORKLOADS; do
  if [[ "$W" =~ ^w([0-9]+)$ ]]; then  # a fleet size: trace x4 up to 64 workers (= A), x32 above
    N=${BASH_REMATCH[1]}
    WARGS[$W]="--workers $N --capacity 8192 --dup $([ "$N" -le 64 ] && echo 4 || echo 32)"
  fi
  [ -n "${WARGS[$W]:-}" ] || { echo "unknown workload $W" >&2; exit 2; }
  ARGS=${WARGS[$W]}
  R=$PB/results/$W
  WL=$W
  if [ "$QUICK" = 1 ]; then ARGS="--workers 16 --capacity 2048 --dup 1"; R=$PB/results/quick; WL=quick; fi
  FIRST=${FIRST:-$R}
  mkdir -p "$R"
  EV=$R/events.bin
  if [ ! -f "$EV" ] || [ "$(cat "$R/gen.args" 2>/dev/null)" != "$ARGS" ]; then
    log "workload $WL: generating the event stream ($ARGS)"
    KVIDX_ROOT=$KVIDX_ROOT "$PY" "$HERE/gen/gen_events.py" --out "$EV" $ARGS > "$R/gen.log"
    echo "$ARGS" > "$R/gen.args"
  fi
  rm -f "$R"/round*_*.json "$R"/round*_*.err "$R/summary.md"
  LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)
  for r in $(seq 1 "$ROUNDS"); do   # interleaved: every indexer once per round, same order
    log "workload $WL round $r/$ROUNDS, load $(cut -d' ' -f1 /proc/loadavg)"
    run() {  # key, command...
      local key=$1; shift
      if ! nice -n "$NICE" "$@" > "$R/round${r}_$key.json" 2> "$R/round${r}_$key.err"; then
        tail -5 "$R/round${r}_$key.err" >&2; echo "$key failed (round $r)" >&2; STATUS=1
      fi
      echo "    $key: $(figures "$R/round${r}_$key.json")"
    }
    figures() {  # one indexer's result file -> its headline figures
      "$PY" -c "import json,sys; d=json.loads(open(sys.argv[1]).read().splitlines()[-1]); \
print(f\"ingest {d['ingest_blocks_per_s']:,.0f}/s, lookup p50 {d['lookup_p50_us']:.1f} us, \
p99 {d['lookup_p99_us']:.1f} us\")" "$1" 2>/dev/null || echo '?'
    }
    if [ "$TURNS" -gt 0 ]; then  # each indexer's passes in sequence; then the ingest passes alternate
      EXTRA_RUN=()
      if [ "$EXTRA" = 1 ]; then EXTRA_RUN=(--run dyn_crtc2 "$(printf '%q ' "$DYN" "$EV" crtc 2)"); fi
      "$PY" "$HERE/turns.py" --dir "$R" --round "$r" --reps "$TURNS" --nice "$NICE" \
        --run kvidx "$(printf '%q ' "$PY" "$HERE/kvidxbench/bench_kvidx.py" "$EV")" \
        --run dyn_radix "$(printf '%q ' "$DYN" "$EV" radix)" \
        --run dyn_crtc1 "$(printf '%q ' "$DYN" "$EV" crtc 1)" "${EXTRA_RUN[@]}" || STATUS=1
      for key in kvidx dyn_radix dyn_crtc1 $([ "$EXTRA" = 1 ] && echo dyn_crtc2); do
        echo "    $key: $(figures "$R/round${r}_$key.json")"
      done
    else
      run kvidx "$PY" "$HERE/kvidxbench/bench_kvidx.py" "$EV"
      run dyn_radix "$DYN" "$EV" radix
      run dyn_crtc1 "$DYN" "$EV" crtc 1
      if [ "$EXTRA" = 1 ]; then run dyn_crtc2 "$DYN" "$EV" crtc 2; fi
    fi
    if [ "$LLMD" = 1 ]; then run llmd "$LLMD_BIN" "$EV"; fi
  done
  if [ "$EXTRA" = 1 ] && [ "$LLMD" = 1 ]; then  # llm-d's default podCacheSize (lossy), once
    r=1; nice -n "$NICE" "$LLMD_BIN" "$EV" 10 > "$R/round1_llmd_pc10.json" 2> "$R/round1_llmd_pc10.err" || true
  fi
  RUN_KVIDX=$KVIDX_DESC RUN_CMD=$CMDLINE RUN_W=$WL RUN_ARGS=$ARGS RUN_ROUNDS=$ROUNDS RUN_TURNS=$TURNS RUN_LOAD0=$LOAD0 \
  RUN_NOTE=$LLMD_NOTE "$PY" -c '
import json, os, sys, time
e = os.environ
json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "kvidx": e["RUN_KVIDX"],
           "command": e["RUN_CMD"], "workload": e["RUN_W"], "gen_args": e["RUN_ARGS"],
           "rounds": int(e["RUN_ROUNDS"]), "ingest_turns": int(e["RUN_TURNS"]), "load_before": e["RUN_LOAD0"],
           "load_after": " ".join(open("/proc/loadavg").read().split()[:3]), "note": e["RUN_NOTE"]},
          open(sys.argv[1], "w"))' "$R/run.json"
  "$PY" "$HERE/summarize.py" "$R" > "$R/summary.md" || STATUS=1
  if [ -n "$LLMD_NOTE" ]; then echo -e "\nNote: $LLMD_NOTE." >> "$R/summary.md"; fi
  echo
  cat "$R/summary.md"
  echo
  log "workload $WL: $R/summary.md"
done

if [ -n "$FLEET" ]; then
  DIRS=()
  for N in $FLEET; do DIRS+=("$PB/results/w$N"); done
  "$PY" "$HERE/summarize.py" --fleet "${DIRS[@]}" | tee "$PB/results/fleet.md" || STATUS=1
  log "fleet table: $PB/results/fleet.md"
fi

# ---- kvidx profile (first workload): cProfile of the ingest and the lookup pass, py-spy of all ------
if [ "$PROFILE" = 1 ]; then
  R=$FIRST
  for p in ingest lookup; do
    PROFILE=$p PROFILE_OUT=$R/prof_$p.pstats "$PY" "$HERE/kvidxbench/bench_kvidx.py" "$R/events.bin" > /dev/null
    "$PY" -c "import pstats,sys; pstats.Stats(sys.argv[1]).sort_stats('tottime').print_stats(12)" \
      "$R/prof_$p.pstats" > "$R/prof_$p.txt"
  done
  if [ -x "$ROOT/.venv/bin/py-spy" ]; then
    "$ROOT/.venv/bin/py-spy" record -r 500 -f raw -o "$R/pyspy.txt" -- \
      "$PY" "$HERE/kvidxbench/bench_kvidx.py" "$R/events.bin" > /dev/null 2>&1 || true
  fi
  log "profiles: $R/prof_ingest.txt, $R/prof_lookup.txt"
fi
exit $STATUS
