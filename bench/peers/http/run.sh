#!/usr/bin/env bash
# HTTP lookup service vs HTTP lookup service, same machine, same run, same state, same queries:
#   kvidx `kvidx serve` (FastAPI/uvicorn, fed from a local Kafka broker by kvidx relays)  vs
#   Dynamo's standalone KV indexer (dynamo-kv-router 1.6.1 services::indexer, axum, fed over ZMQ).
# Run `bench/peers/http/run.sh --help` for the options. Everything binds 127.0.0.1; every process this
# script starts is stopped by its PID on exit (and the Kafka broker, if this script started it).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
PEERS=$(dirname "$HERE")
ROOT=$(cd "$PEERS/../.." && pwd)
PB=${PB:-$PEERS/.build}
PY=${PY:-$ROOT/.venv/bin/python}
KVIDX_CLI=${KVIDX_CLI:-$ROOT/.venv/bin/kvidx}
NICE=${NICE:-0}
ROUNDS=3
QUICK=0
REV=""
DO_PROFILE=0
HOLD=0
NQ=${NQ:-2000}
DUR=${DUR:-8}
WARM=${WARM:-2}
KP=${KP:-18480}; DP=${DP:-18490}; ZB=${ZB:-18500}
CMDLINE="bench/peers/http/run.sh $*"

usage() {
  cat <<EOF
Usage: bench/peers/http/run.sh [options]

Builds Dynamo's standalone indexer (dynserver/: a thin main around dynamo-kv-router 1.6.1's
'standalone-indexer' code, bound to 127.0.0.1) and the load generator (loadgen/); starts a local Kafka
broker (kvidx kafka up), 'kvidx serve' and the Dynamo indexer; feeds both the same vLLM-format KV events
of workload A (kvidx through one real relay per worker and Kafka; Dynamo over ZMQ); checks that both
answer alike; then runs the load matrix, interleaved: query forms block hashes (JSON), token ids
(JSON), token ids (kvidx binary vs Dynamo JSON) x closed loop 1/4/16 connections and open loop
500/1,000/2,000 lookups/s. Results and summary.md under \$PB/http/results.

Options:
  --rounds N    rounds of the load matrix (default 3)
  --quick       smoke check: 1 round, 2 s per run, 500 queries
  --rev REV     run commit REV of this repo (git archive into \$PB/kvidx-<sha>) instead of the working
                tree (the repo's .venv/bin/kvidx with PYTHONPATH set to it)
  --profile     afterwards, profile both servers (py-spy on kvidx if .venv/bin/py-spy exists, perf on
                Dynamo if perf works)
  --hold        set up, feed and check as usual, then keep both services up instead of the load matrix
                (ports and PIDs in \$RES/hold.json) until interrupted: for loadgen runs, perf or py-spy by hand
  -h, --help    this text

Environment: PB (scratch folder, default bench/peers/.build), EVENTS (event file, default
\$PB/results/A/events.bin, generated if missing), NQ (queries, 2000), DUR (s per run, 8), WARM (s, 2),
KP/DP/ZB (kvidx port 18480, Dynamo port 18490, first ZMQ port 18500), NICE (0: both servers at the load
generator's priority, as a service runs; runs before 2026-12-04 used 10, which costs a one-thread
server its CPU to every nice-0 task for whole slices: see bench/RESULTS.md, "Where the tail at 2,000/s
came from").
EOF
}

while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) ROUNDS=$2; shift ;;
    --quick) QUICK=1 ;;
    --rev) REV=$2; shift ;;
    --profile) DO_PROFILE=1 ;;
    --hold) HOLD=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ "$QUICK" = 1 ]; then ROUNDS=1; DUR=2; WARM=1; NQ=500; fi

mkdir -p "$PB"
PB=$(cd "$PB" && pwd)
H=$PB/http
RES=${RES:-$H/results}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PB/target}
mkdir -p "$H/logs" "$H/run" "$RES"
rm -rf "$RES"/round* "$RES/summary.md"
log() { echo "[http $(date +%T)] $*"; }

# ---- kvidx: the working tree, or one commit of it ---------------------------------------------
if [ -n "$REV" ]; then
  SHA=$(git -C "$ROOT" rev-parse --verify "$REV^{commit}")
  export KVIDX_ROOT=$PB/kvidx-${SHA:0:12}
  if [ ! -f "$KVIDX_ROOT/kvidx/core/shard.py" ]; then
    mkdir -p "$KVIDX_ROOT" && git -C "$ROOT" archive "$SHA" | tar -x -C "$KVIDX_ROOT"
  fi
  export PYTHONPATH=$KVIDX_ROOT${PYTHONPATH:+:$PYTHONPATH}  # ahead of the editable install
  KVIDX_DESC="${SHA:0:12} (git archive of $REV)"
else
  export KVIDX_ROOT=$ROOT
  KVIDX_DESC="$(git -C "$ROOT" rev-parse --short=12 HEAD) (working tree)"
fi

# ---- 1. builds, events, queries ----------------------------------------------------------------
log "building dynserver and loadgen (nice -n 10 cargo build --release -j 2)"
(cd "$HERE/dynserver" && nice -n 10 cargo build --release -j 2) >> "$H/logs/build.log" 2>&1
(cd "$HERE/loadgen" && nice -n 10 cargo build --release -j 2) >> "$H/logs/build.log" 2>&1
DYNSERVER=$CARGO_TARGET_DIR/release/dynserver
export LOADGEN=$CARGO_TARGET_DIR/release/loadgen
EVENTS=${EVENTS:-$PB/results/A/events.bin}
if [ ! -f "$EVENTS" ]; then
  log "generating workload A's events -> $EVENTS"
  mkdir -p "$(dirname "$EVENTS")"
  "$PY" "$PEERS/gen/gen_events.py" --out "$EVENTS" --workers 64 --capacity 8192 --dup 4 \
    > "$(dirname "$EVENTS")/gen.log"
fi
Q=$H/queries-$NQ
[ -f "$Q/queries.json" ] || "$PY" "$HERE/mkqueries.py" --events "$EVENTS" --out "$Q" --n "$NQ" > /dev/null

PIDS=()
KAFKA_STARTED=""
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for _ in $(seq 10); do  # up to 5 s for a clean exit, then SIGKILL (own PIDs only)
    alive=0; for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break; sleep 0.5
  done
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  if [ -n "$KAFKA_STARTED" ]; then "$KVIDX_CLI" kafka down --state-dir "$H/kafka" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

# ---- 2. a local Kafka broker (kvidx's own launcher; 127.0.0.1) -------------------------------------
if ! "$KVIDX_CLI" kafka status --state-dir "$H/kafka" 2>/dev/null | grep -q "kafka: serving"; then
  log "starting a local Kafka broker (kvidx kafka up --state-dir $H/kafka)"
  "$KVIDX_CLI" kafka up --state-dir "$H/kafka" > "$H/logs/kafka.log" 2>&1
  KAFKA_STARTED=1
fi
KAFKA_BOOTSTRAP_SERVERS=$("$PY" -c "import json,sys;print(json.load(open(sys.argv[1]))['bootstrap'])" \
  "$H/kafka/kafka.json")
export KAFKA_BOOTSTRAP_SERVERS
PREFIX=phttp$(date +%s).

# ---- 3. the two services ----------------------------------------------------------------------------
log "starting Dynamo's indexer on 127.0.0.1:$DP and kvidx serve on 127.0.0.1:$KP (topic prefix $PREFIX)"
nice -n "$NICE" "$DYNSERVER" --port "$DP" --threads 4 > "$H/logs/dyn.log" 2>&1 &
DPID=$!; PIDS+=("$DPID")
nice -n "$NICE" "$KVIDX_CLI" serve --topic-prefix "$PREFIX" --index-block-size 512 --host 127.0.0.1 \
  --port "$KP" > "$H/logs/kvidx.log" 2>&1 &
KPID=$!; PIDS+=("$KPID")
for _ in $(seq 60); do
  curl -sf "127.0.0.1:$DP/health" >/dev/null 2>&1 && curl -s "127.0.0.1:$KP/healthz" >/dev/null 2>&1 && break
  sleep 0.5
done

# ---- 4. feed both from one vLLM-wire publisher per worker (stays up like a live engine) ------------
log "feeding both services (kvidx: relays -> Kafka; Dynamo: ZMQ)"
rm -f "$H/run/feed_status.json"
"$PY" "$HERE/feed.py" --events "$EVENTS" --dyn-url "http://127.0.0.1:$DP" --zmq-base "$ZB" \
  --bootstrap "$KAFKA_BOOTSTRAP_SERVERS" --topic-prefix "$PREFIX" --status "$H/run/feed_status.json" \
  > "$H/logs/feed.log" 2>&1 &
FPID=$!; PIDS+=("$FPID")
T0=$(date +%s)
while [ ! -f "$H/run/feed_status.json" ]; do
  kill -0 "$FPID" 2>/dev/null || { echo "feed failed"; tail -30 "$H/logs/feed.log"; exit 1; }
  sleep 2
done
log "published in $(( $(date +%s) - T0 )) s: $(cat "$H/run/feed_status.json")"
EXPECT=$("$PY" -c "import json,sys;s=json.load(open(sys.argv[1]));print(s['frames']+s['workers'])" \
  "$H/run/feed_status.json")
got=0
for _ in $(seq 600); do
  got=$(curl -s "127.0.0.1:$KP/healthz" | "$PY" -c "import json,sys;print(json.load(sys.stdin)['batches_applied'])" \
        2>/dev/null || echo 0)
  [ "$got" = "$EXPECT" ] && break
  sleep 1
done
log "kvidx applied $got of $EXPECT batches, $(( $(date +%s) - T0 )) s after the feed started"
ticks() { awk '{print $14+$15}' "/proc/$1/stat"; }
for _ in $(seq 60); do  # Dynamo caught up = its CPU is idle
  a=$(ticks "$DPID"); sleep 1; b=$(ticks "$DPID"); [ $((b-a)) -le 1 ] && break
done
cp "$H/run/feed_status.json" "$RES/feed_status.json"
curl -s "127.0.0.1:$KP/v1/models" > "$RES/kvidx_models.json"
curl -s "127.0.0.1:$DP/workers" > "$RES/dyn_workers.json"

# ---- 5. same state? (every query of the set; token forms on the first 200) -------------------------
log "checking that both answer alike"
"$PY" "$HERE/verify.py" --qdir "$Q" --kvidx-port "$KP" --dyn-port "$DP" --zmq-base "$ZB" --tok-n 200 \
  | tee "$RES/verify.json"

# ---- 6. idle CPU of each server (5 s, no load) --------------------------------------------------
a1=$(ticks "$KPID"); b1=$(ticks "$DPID"); sleep 5; a2=$(ticks "$KPID"); b2=$(ticks "$DPID")
"$PY" -c "import json,sys; a1,a2,b1,b2 = map(int, sys.argv[1:]); print(json.dumps(
    {'kvidx_idle_cores': (a2 - a1) / 500, 'dyn_idle_cores': (b2 - b1) / 500}))" "$a1" "$a2" "$b1" "$b2" \
  | tee "$RES/idle.json"
ps -o pid,rss,args -p "$KPID,$DPID" > "$RES/rss.txt"

if [ "$HOLD" = 1 ]; then
  echo "{\"kvidx_port\": $KP, \"kvidx_pid\": $KPID, \"dyn_port\": $DP, \"dyn_pid\": $DPID, \"queries\": \"$Q\", \"loadgen\": \"$LOADGEN\"}" \
    > "$RES/hold.json"
  log "holding: both services up ($RES/hold.json); Ctrl-C (or SIGTERM to this script) stops them"
  while true; do sleep 1; done
fi

# ---- 7. the interleaved load matrix ----------------------------------------------------------------
log "load matrix: $ROUNDS round(s), ${WARM} s warm-up + ${DUR} s per run"
"$PY" "$HERE/bench.py" --qdir "$Q" --out "$RES" --rounds "$ROUNDS" --warmup "$WARM" --duration "$DUR" \
  --kvidx-port "$KP" --kvidx-pid "$KPID" --dyn-port "$DP" --dyn-pid "$DPID" | tee "$H/logs/bench.log"

# ---- 8. profiles (py-spy on kvidx, perf on Dynamo), separate from the timed runs --------------------
if [ "$DO_PROFILE" = 1 ]; then
  bash "$HERE/profile.sh" "$RES/prof" "$KP" "$KPID" "$DP" "$DPID" "$Q"
fi
RUN_KVIDX=$KVIDX_DESC RUN_CMD=$CMDLINE RUN_NICE=$NICE "$PY" -c '
import json, os, sys, time
json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "kvidx": os.environ["RUN_KVIDX"],
           "command": os.environ["RUN_CMD"], "nice": int(os.environ["RUN_NICE"])}, open(sys.argv[1], "w"))' \
  "$RES/run.json"
"$PY" "$HERE/summarize.py" "$RES" > /dev/null
cat "$RES/summary.md"
log "done: $RES/summary.md"
