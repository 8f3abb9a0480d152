"""`kvidx demo`: the whole pipeline on one machine.

Simulated vLLM replicas (kvidx.sim) publish real vLLM 0.32-format KV events over ZMQ; one relay per
replica subscribes, re-hashes and publishes; the shards fold the events (in process, or through a
Kafka broker and a faust worker with `--kafka`); the HTTP lookup service answers a router that sends
every request to the replica with the most resumable tokens. At the end it prints the agreement
between what the index credited and what the engines reused, request by request.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from index_service.app import create_app
from index_service.follower import KafkaFollower
from index_service.http_protocol import InProcessServer
from index_service.store import ShardStore
from kvidx import index
from kvidx.client import KvidxClient, KvidxError, Retry, UnknownModel
from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.engines.vllm.sim import SimVllmEngine
from kvidx.shadow import Agreement
from kvidx.sim.prompts import workload_requests
from relays.run import Relay
from relays.sinks import KafkaSink, StoreSink
from relays.zmq_source import ZmqSource
from schemas.answers import ReplicaAnswer

MODEL = "demo-llama"
ENGINE_BLOCK = 32
INDEX_BLOCK = 16


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def _rank(kv: KvidxClient, prompt: list[int]) -> list[ReplicaAnswer]:
    """The router's question: replicas by prefix price, decoded as the index's own answer type."""
    try:
        return kv.rank(MODEL, token_ids=prompt).replicas
    except UnknownModel:  # no event of this model seen yet: nothing is cached anywhere
        return []


def run_demo(replicas: int = 3, requests: int = 300, kafka: bool = False, bootstrap: str | None = None,
             port: int = 0, keep_serving: bool = False, seed: int = 7) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="kvidx-demo-"))
    stack: list = []  # things to stop, last first
    # SIGTERM (e.g. `timeout`) unwinds like Ctrl-C, so the broker and worker it started are stopped
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        store = ShardStore(INDEX_BLOCK)
        # 1. the engines
        engines = [SimVllmEngine(num_blocks=48, block_size=ENGINE_BLOCK, endpoint="tcp://127.0.0.1:*",
                                 replay_endpoint="tcp://127.0.0.1:*") for _ in range(replicas)]
        stack += [e.close for e in engines]
        say(f"{replicas} simulated vLLM 0.32 replicas (block {ENGINE_BLOCK}, 48 blocks each) publishing "
            f"KV events on {', '.join(e.endpoint for e in engines)}")
        # 2. the transport: in process, or Kafka + a faust worker + a follower
        if kafka:
            sinks = _kafka_transport(store, len(engines), bootstrap, tmp, stack)
        else:
            sinks = [StoreSink(store) for _ in engines]
            store.ready = True
            say("in-process mode: relays fold straight into the shards (no broker)")
        # 3. one relay per replica; 4. the lookup service; 5. a router
        _start_relays(engines, sinks, stack)
        base = _start_service(store, port, replicas, stack)
        summary = _route(base, store, engines, requests, seed)
        dead = sum(len(getattr(s, "dead", ())) for s in sinks)
        say(f"dead letters: {dead}; blocks indexed: "
            f"{index.keys_total(store.shards.get(MODEL))}")
        undelivered = sum(s.drain(30.0) for s in sinks if hasattr(s, "drain"))
        if undelivered:  # the run above is not what the engines published: say so, and fail
            print(f"error: {undelivered} event batches were not delivered to Kafka", file=sys.stderr)
            return 1
        if keep_serving:
            say(f"serving lookups on {base} until Ctrl-C")
            try:
                while True:
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
        return 0 if summary["recall"] >= 0.99 else 1
    finally:
        for stop in reversed(stack):
            try:
                stop()
            except Exception:  # best effort: keep stopping the rest
                pass
        shutil.rmtree(tmp, ignore_errors=True)


def _kafka_transport(store: ShardStore, n: int, bootstrap: str | None, tmp: Path, stack: list) -> list:
    """A broker (the given one, or a local one started here), the demo's topics, a faust worker and a
    follower folding into `store`; one Kafka sink per relay."""
    from schemas.events import topic_names
    bootstrap = bootstrap or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if not bootstrap:
        from kvidx.kafka.local import LocalKafka
        broker = LocalKafka(log=lambda m: say(f"kafka: {m}"))
        bootstrap = broker.start(tmp / "kafka")
        stack.append(broker.stop)
    else:
        from kvidx.kafka.reach import require_broker
        require_broker(bootstrap)  # a given cluster that does not answer: one line, exit 1
    prefix = f"demo{int(time.time())}."
    names = topic_names(prefix)
    from kvidx.kafka.topics import ensure_topics
    ensure_topics(bootstrap, names)
    say(f"Kafka at {bootstrap}; topics {names['events']}, {names['snapshots']} (compacted)")
    worker = subprocess.Popen(
        [sys.executable, "-m", "kvidx.cli", "worker", "--bootstrap", bootstrap, "--topic-prefix",
         prefix, "--data-dir", str(tmp / "worker"), "--web-port", "0", "--snapshot-interval", "1"],
        stdout=open(tmp / "worker.log", "w"), stderr=subprocess.STDOUT,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)))
    stack.append(lambda: (worker.terminate(), worker.wait(20)))
    say(f"faust worker (pid {worker.pid}) folds events into RocksDB shards; log {tmp / 'worker.log'}")
    sinks = [KafkaSink(bootstrap, names["events"], names["dead_letters"]) for _ in range(n)]
    stack += [s.close for s in sinks]
    follower = KafkaFollower(store, bootstrap, names["events"], names["snapshots"]).start()
    stack.append(follower.stop)
    return sinks


def _start_relays(engines: list[SimVllmEngine], sinks: list, stack: list) -> None:
    for i, (e, sink) in enumerate(zip(engines, sinks, strict=True)):
        core = VllmPublisherRelay(MODEL, f"replica-{i}", INDEX_BLOCK)
        relay = Relay(core, sink, ZmqSource(e.endpoint, e.replay_endpoint, topic=b"kv"))
        relay.start_fresh()
        t = threading.Thread(target=relay.run_live, args=(0.05,), daemon=True, name=f"relay-{i}")
        t.start()
        stack.append(lambda r=relay, th=t: (r.close(), th.join(5)))  # before its sink closes
    time.sleep(0.3)  # ZMQ subscriptions take a moment to reach the publishers


def _start_service(store: ShardStore, port: int, replicas: int, stack: list) -> str:
    """The lookup service on loopback, once ready and knowing every replica; its base URL."""
    server = InProcessServer(create_app(store), port)
    base = server.start(60)
    stack.append(lambda: server.stop(0))
    deadline = time.monotonic() + 60
    with KvidxClient(base, retry=Retry(attempts=1)) as kv:
        while time.monotonic() < deadline:
            try:
                if kv.health().ready:
                    break
            except KvidxError:  # not listening yet
                pass
            time.sleep(0.1)
    # the router starts once the index knows every replica (their relays' start batches are
    # applied; through Kafka that takes a moment): before that the model is unknown and the
    # first lookup would be a 404
    while time.monotonic() < deadline and not all(_known(store, f"replica-{j}") for j in range(replicas)):
        time.sleep(0.01)
    say(f"lookup service on {base} (POST /v1/lookup, /v1/lookup/binary; GET /healthz, /metrics)")
    return base


def _route(base: str, store: ShardStore, engines: list[SimVllmEngine], requests: int, seed: int) -> dict:
    """A router: rank, record the decision, serve on the chosen engine, compare credit with reuse."""
    replicas = len(engines)
    work = workload_requests(seed, requests, systems=4, sys_len=(64, 200), user_len=(16, 80))
    say(f"routing {len(work)} requests (shared system prompts, multi-turn conversations)")
    agreement = Agreement()
    waits = []
    load = [0] * replicas
    shown = 0
    kv = KvidxClient(base, timeout=5)  # the router's client (kvidx.client): kept-alive connections
    for i, (prompt, output) in enumerate(work):
        # the index must have seen every event the engines published (the router's view lags the
        # engines by the event latency; wait for it so the agreement measures the index, not races)
        t0 = time.perf_counter()
        while any(_applied_seq(store, f"replica-{j}") < e.next_seq - 1 for j, e in enumerate(engines)):
            if time.perf_counter() - t0 > 2:
                break
            time.sleep(0.0005)
        waits.append(time.perf_counter() - t0)
        # the router: the cheapest replica by prefix price (queue + load + prefill left), then the
        # decision is recorded so that every router credits the prompt there at once
        answers = _rank(kv, prompt)
        by_replica = {a.replica: a for a in answers}
        ranked = [int(a.replica.rsplit("-", 1)[1]) for a in answers]
        best = ranked[0] if ranked else min(range(replicas), key=lambda j: load[j])
        chosen = by_replica.get(f"replica-{best}")
        credited = chosen.resumable_tokens if chosen else 0
        kv.route(f"demo-{i}", MODEL, f"replica-{best}", token_ids=prompt, credited_tokens=credited, ttl_s=5)
        reused = engines[best].serve(prompt, output)
        load[best] += 1
        agreement.add(i, len(prompt), reused, credited)
        if credited and shown < 3:
            shown += 1
            tiers = ", ".join(f"{t.tokens} on {t.tier}" for t in chosen.tiers)
            say(f"request {i}: {len(prompt)} prompt tokens -> replica-{best}: index says "
                f"{credited} resumable ({tiers}), engine reused {reused}")
    kv.close()
    summary = agreement.summary()
    w = np.asarray(waits) * 1000
    say(f"requests per replica: {load}")
    say(f"index caught up with the engines before a lookup in p50 {np.percentile(w, 50):.2f} ms, "
        f"p99 {np.percentile(w, 99):.2f} ms")
    say("agreement (credited vs reused, per request): " + json.dumps(summary))
    return summary


def _known(store: ShardStore, replica: str) -> bool:
    """Whether the index has applied anything of the replica (at least its relay's start)."""
    shard = store.shards.get(MODEL)
    return index.replica_of(shard, replica) is not None


def _applied_seq(store: ShardStore, replica: str) -> int:
    shard = store.shards.get(MODEL)
    st = index.replica_of(shard, replica)
    return st.seq if st is not None else -1


def main(args) -> int:
    """`kvidx demo`."""
    try:
        return run_demo(replicas=args.replicas, requests=args.requests, kafka=args.kafka,
                        bootstrap=args.bootstrap, port=args.port, keep_serving=args.serve)
    except KeyboardInterrupt:
        print("[demo] stopped", file=sys.stderr)
        return 130
