"""A simulated fleet of vLLM replicas, in virtual time, feeding the index through the real relay code.

Per request (in arrival order, virtual time `now`):
1. every engine message whose delivery time is <= now reaches its relay (relays.run.Relay: sequence
   checks, replay of gaps, the mirror, canonical re-hashing) and the relay's batches reach the shards
   (in process, or through a Kafka broker and index_service's KafkaFollower);
2. the router looks the prompt up (ModelShard.lookup in process, or POST /v1/lookup/binary on the
   real FastAPI service) and picks a replica by its policy;
3. the chosen engine (kvidx.sim.vllm_engine.SimVllmEngine: vLLM's block pool, LRU free queue, sha256
   block hashes, real vLLM 0.32 wire payloads) serves the request and reports its `cached_tokens`;
   what the index credited on that replica is compared with it (kvidx.shadow.Agreement);
4. the engine's messages go on the "network": each is delivered `delay` after the engine step
   (uniform in [lo, hi] ms, in order per replica, so replicas reorder against each other), or lost
   with probability `drop_rate` (the relay sees the gap at the replica's next message and fills it
   from the engine's replay buffer, or, with replay off, clears the replica).

Engines run a request's cache step at its arrival (continuous batching admits it at once); the
queueing that load causes is modelled apart, per replica, as a FIFO prefill server (prefill tokens /
`prefill_tps`) and in-flight decodes (`decode_ms_per_token`): it gives the routers their load
signals and an estimated time to first token.

Engines publish into an in-process outbox (no sockets on the hot path); their payloads are exactly
what they would send on their ZMQ PUB socket.
"""

from __future__ import annotations

import heapq
import http.client
import itertools
import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from index_service.store import ShardStore
from kvidx.core.hashing import prompt_hashes
from kvidx.shadow import Agreement
from kvidx.sim.vllm_engine import SimVllmEngine
from kvidx.sim.workloads import SimRequest
from relays.run import Relay
from relays.vllm_relay import Frame, VllmPublisherRelay
from schemas.events import EventBatch

POLICIES = ("kv", "random", "round_robin", "least_loaded")
_inproc_ids = itertools.count()


class OutboxVllmEngine(SimVllmEngine):
    """A SimVllmEngine whose messages go to `outbox` (seq, payload) instead of its PUB socket (which
    is bound on an unused inproc endpoint), stamped with the simulation's clock (`now`)."""

    def __init__(self, name: str, num_blocks: int, block_size: int, buffer_steps: int = 1000) -> None:
        super().__init__(num_blocks, block_size, endpoint=f"inproc://kvidx-sim-{next(_inproc_ids)}",
                         bind=True, buffer_steps=buffer_steps)
        self.name = name
        self.now = 0.0
        self.outbox: list[tuple[int, bytes]] = []

    def _publish_events(self, events: list[dict[str, Any]]) -> None:
        self._publish(self._enc.encode([self.now, events, self.dp_rank]))
        self.batches += 1

    def _publish(self, payload: bytes) -> int:
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        self.outbox.append((seq, payload))
        return seq

    def replay_from(self, start_seq: int) -> list[tuple[int, bytes]]:
        """What the engine's replay endpoint answers: the buffered messages from `start_seq` on."""
        return [(s, p) for s, p in self._buffer if s >= start_seq]


class EngineReplaySource:
    """The relay's view of an engine's replay endpoint, in process (relays.run.Relay calls
    `replay(first_seq)` to fill a sequence gap; None means the endpoint gave nothing)."""

    def __init__(self, engine: OutboxVllmEngine, enabled: bool, clock: Callable[[], float]) -> None:
        self.engine = engine
        self.endpoint = engine.name
        self.enabled = enabled
        self.clock = clock
        self.requests = 0

    def replay(self, start_seq: int) -> list[Frame] | None:
        self.requests += 1
        if not self.enabled:
            return None
        ns = int(self.clock() * 1e9)
        return [Frame(self.engine.topic, s, p, ns, self.endpoint, "replay")
                for s, p in self.engine.replay_from(start_seq)]

    def close(self) -> None:
        pass


class VirtualStoreSink:
    """Folds relay batches straight into a ShardStore, stamped with the simulation's clock."""

    def __init__(self, store: ShardStore, clock: Callable[[], float]) -> None:
        self.store = store
        self.clock = clock
        self.dead: list = []

    def publish(self, batch: EventBatch) -> None:
        self.store.apply(batch, self.clock())

    def dead_letter(self, dl, model: str, replica: str) -> None:
        self.dead.append(dl)

    def flush(self, timeout: float = 10.0) -> int:
        return 0


class TrackingSink:
    """Remembers the last (epoch, seq) published per (model, replica), so the simulator can wait
    until a follower fed through Kafka has applied it."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.last: dict[tuple[str, str], tuple[int, int]] = {}
        self.dead = 0

    def publish(self, batch: EventBatch) -> None:
        self.last[(batch.model, batch.replica)] = (batch.epoch, batch.seq)
        self.inner.publish(batch)

    def dead_letter(self, dl, model: str, replica: str) -> None:
        self.dead += 1
        self.inner.dead_letter(dl, model, replica)

    def flush(self, timeout: float = 10.0) -> int:
        return self.inner.flush(timeout)


@dataclass
class FleetConfig:
    models: list[str]
    replicas: int = 8  # per model
    engine_block: int = 16
    index_block: int = 16
    num_blocks: int = 8192  # GPU blocks per replica
    delay_ms: tuple[float, float] = (1.0, 20.0)
    drop_rate: float = 0.0
    replay: bool = True
    replay_buffer: int = 1000  # engine messages kept for replay
    speed: float = 1.0  # time compression: arrival times are divided by it
    token_scale: float = 1.0  # simulated tokens per workload token (--trace-block-tokens / 512)
    prefill_tps: float = 20000.0  # per replica, in workload tokens per second
    decode_ms_per_token: float = 20.0
    load_weight: float = 1.0  # kv router: weight of the queued prefill tokens in the price
    window_s: float = 60.0  # agreement windows, in simulated seconds
    seed: int = 7
    transport: str = "embedded"  # or "kafka"
    lookup: str = "inproc"  # or "http"
    bootstrap: str | None = None
    topic_prefix: str = ""
    kafka_wait_s: float = 5.0


@dataclass
class RunResult:
    policy: str
    overall: Agreement
    per_model: dict[str, Agreement]
    per_replica: dict[str, Agreement]
    windows: dict[int, Agreement]
    requests_per_replica: dict[str, int]
    ttft_s: np.ndarray
    counters: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0


class _Network:
    """Engine messages in flight: delivery time = engine step + delay, FIFO per replica."""

    def __init__(self, cfg: FleetConfig, rng: random.Random) -> None:
        self.lo, self.hi = (x / 1000.0 for x in cfg.delay_ms)
        self.drop_rate = cfg.drop_rate
        self.rng = rng
        self.heap: list[tuple[float, int, str, int, bytes]] = []
        self.last: dict[str, float] = {}
        self.tie = itertools.count()
        self.sent = 0
        self.dropped = 0
        self.delays: list[float] = []

    def send(self, engine: OutboxVllmEngine, now: float) -> None:
        for seq, payload in engine.outbox:
            self.sent += 1
            if self.drop_rate and self.rng.random() < self.drop_rate:
                self.dropped += 1
                continue
            d = self.rng.uniform(self.lo, self.hi) if self.hi > 0 else 0.0
            at = max(now + d, self.last.get(engine.name, 0.0))
            self.last[engine.name] = at
            self.delays.append(at - now)
            heapq.heappush(self.heap, (at, next(self.tie), engine.name, seq, payload))
        engine.outbox.clear()


class _HttpLookup:
    """The router's client of the real lookup service (POST /v1/lookup/binary, keep-alive)."""

    def __init__(self, store: ShardStore) -> None:
        import socket

        import uvicorn

        from index_service.app import create_app
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(create_app(store), host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        threading.Thread(target=self.server.run, daemon=True, name="simulate-http").start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the lookup service did not start")
            time.sleep(0.02)
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)

    def lookup(self, model: str, prompt: np.ndarray) -> list[dict]:
        self.conn.request("POST", f"/v1/lookup/binary?model={model}", body=prompt.astype("<u4").tobytes(),
                          headers={"Content-Type": "application/octet-stream"})
        r = self.conn.getresponse()
        body = r.read()
        if r.status == 404:  # no event of this model seen yet: nothing cached anywhere
            return []
        if r.status != 200:
            raise RuntimeError(f"lookup failed: HTTP {r.status}: {body[:200]!r}")
        return json.loads(body)["replicas"]

    def close(self) -> None:
        self.conn.close()
        self.server.should_exit = True


def run_fleet(requests: list[SimRequest], cfg: FleetConfig, policy: str,
              progress: Callable[[int], None] | None = None) -> RunResult:
    """Simulate the fleet on `requests` with one routing policy; see the module docstring."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r} (known: {', '.join(POLICIES)})")
    t_wall = time.perf_counter()
    rng = random.Random(cfg.seed)  # network: delays and drops
    route_rng = random.Random(cfg.seed + 1)  # random policy and ties
    clock = [0.0]

    def now() -> float:
        return clock[0]

    store = ShardStore(cfg.index_block)
    stack: list[Callable[[], Any]] = []
    kafka_waits: list[float] = []
    kafka_timeouts = 0
    try:
        if cfg.transport == "kafka":
            from index_service.follower import KafkaFollower
            from relays.sinks import KafkaSink
            from schemas.events import topic_names
            names = topic_names(cfg.topic_prefix)
            inner = KafkaSink(cfg.bootstrap, names["events"], names["dead_letters"])
            stack.append(inner.close)
            follower = KafkaFollower(store, cfg.bootstrap, names["events"], names["snapshots"]).start()
            stack.append(follower.stop)
            deadline = time.monotonic() + 60
            while not store.ready:
                if follower.error is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the Kafka follower did not start: {follower.error}")
                time.sleep(0.01)
        else:
            inner = VirtualStoreSink(store, now)
            store.ready = True
        sink = TrackingSink(inner)
        http_lookup = None
        if cfg.lookup == "http":
            http_lookup = _HttpLookup(store)
            stack.append(http_lookup.close)

        engines: dict[str, list[OutboxVllmEngine]] = {}
        relays: dict[str, Relay] = {}
        sources: list[EngineReplaySource] = []
        for model in cfg.models:
            engines[model] = []
            for j in range(cfg.replicas):
                e = OutboxVllmEngine(f"{model}/r{j}", cfg.num_blocks, cfg.engine_block, cfg.replay_buffer)
                stack.append(e.close)
                engines[model].append(e)
                src = EngineReplaySource(e, cfg.replay, now)
                sources.append(src)
                relays[e.name] = Relay(VllmPublisherRelay(model, e.name, cfg.index_block, epoch=0), sink, src)
        net = _Network(cfg, rng)

        def deliver_until(t: float) -> None:
            heap = net.heap
            while heap and heap[0][0] <= t:
                at, _, name, seq, payload = heapq.heappop(heap)
                clock[0] = at
                relays[name].handle(Frame(b"kv", seq, payload, int(at * 1e9), name, "pub"))

        def wait_for_kafka(model: str) -> None:
            nonlocal kafka_timeouts
            sink.flush(0)
            shard = store.shards.get(model)
            want = [(k[1], v) for k, v in sink.last.items() if k[0] == model]
            t0 = time.perf_counter()
            while want:
                shard = shard or store.shards.get(model)
                if shard is not None:
                    want = [(rep, v) for rep, v in want
                            if (st := shard.replicas.get((rep, 0))) is None or (st.epoch, st.seq) < v]
                if not want:
                    break
                if time.perf_counter() - t0 > cfg.kafka_wait_s:
                    kafka_timeouts += 1
                    break
                time.sleep(0.0003)
            kafka_waits.append(time.perf_counter() - t0)

        overall = Agreement()
        per_model: dict[str, Agreement] = {m: Agreement() for m in cfg.models}
        per_replica: dict[str, Agreement] = {e.name: Agreement() for es in engines.values() for e in es}
        windows: dict[int, Agreement] = {}
        served = {name: 0 for name in per_replica}
        busy_until = {name: 0.0 for name in per_replica}
        inflight: dict[str, list[float]] = {name: [] for name in per_replica}
        rr = {m: 0 for m in cfg.models}
        ttft = np.zeros(len(requests))
        tok_rate = cfg.prefill_tps * cfg.token_scale  # simulated tokens per second per replica
        decode_s = cfg.decode_ms_per_token / 1000.0 / cfg.token_scale  # per simulated output token
        ibs = cfg.index_block

        for i, req in enumerate(requests):
            t = req.t / cfg.speed
            deliver_until(t)
            clock[0] = t
            model = req.model
            n = len(req.prompt)
            reps = engines[model]
            if cfg.transport == "kafka":
                wait_for_kafka(model)
            # the router's view: resumable tokens per replica (from the index) and load
            if http_lookup is not None:
                answers = http_lookup.lookup(model, req.prompt)
            else:
                shard = store.shards.get(model)
                answers = shard.lookup(prompt_hashes(req.prompt.astype("<u4").tobytes(), ibs), n, t) \
                    if shard is not None else []
            resumable = {a["replica"]: a["resumable_tokens"] for a in answers if a["dp_rank"] == 0}
            for e in reps:
                q = inflight[e.name]
                while q and q[0] <= t:
                    heapq.heappop(q)
            if policy == "kv":
                w = cfg.load_weight * tok_rate
                prices = [(n - resumable.get(e.name, 0) + w * max(0.0, busy_until[e.name] - t),
                           len(inflight[e.name]), route_rng.random(), k) for k, e in enumerate(reps)]
                chosen = reps[min(prices)[3]]
            elif policy == "random":
                chosen = reps[route_rng.randrange(len(reps))]
            elif policy == "round_robin":
                chosen = reps[rr[model] % len(reps)]
                rr[model] += 1
            else:  # least_loaded: fewest requests in flight, then the shortest prefill queue
                loads = [(len(inflight[e.name]), busy_until[e.name], route_rng.random(), k)
                         for k, e in enumerate(reps)]
                chosen = reps[min(loads)[3]]
            credited = resumable.get(chosen.name, 0)
            chosen.now = t
            reused = chosen.serve(req.prompt.tolist(), req.output.tolist())
            net.send(chosen, t)
            # load model: FIFO prefill, then decode
            start = max(t, busy_until[chosen.name])
            busy_until[chosen.name] = start + (n - reused) / tok_rate
            ttft[i] = busy_until[chosen.name] - t
            heapq.heappush(inflight[chosen.name], busy_until[chosen.name] + len(req.output) * decode_s)
            served[chosen.name] += 1
            win = int(t // cfg.window_s)
            for a in (overall, per_model[model], per_replica[chosen.name],
                      windows.get(win) or windows.setdefault(win, Agreement())):
                a.add(i, n, reused, credited)
            if progress is not None and (i & 63) == 63:
                progress(i + 1)
        deliver_until(float("inf"))
        sink.flush()
        if progress is not None:
            progress(len(requests))

        all_relays = list(relays.values())
        delays = np.asarray(net.delays) * 1000 if net.delays else np.zeros(1)
        counters: dict[str, Any] = {
            "engine_messages": net.sent,
            "dropped_messages": net.dropped,
            "seq_gaps": sum(r.core.counters["gaps"] for r in all_relays),
            "gaps_unfilled": sum(r.core.epoch for r in all_relays),  # each unfilled gap bumps the epoch
            "replay_requests": sum(s.requests for s in sources),
            "dead_letters": sink.dead,
            "delay_ms_p50": round(float(np.percentile(delays, 50)), 3),
            "delay_ms_p99": round(float(np.percentile(delays, 99)), 3),
            "engine_evicted_blocks": sum(e.removed_blocks for es in engines.values() for e in es),
            "engine_stored_blocks": sum(e.stored_blocks for es in engines.values() for e in es),
            "indexed_blocks_end": sum(len(g.any) for s in store.shards.values() for g in s.groups.values()),
        }
        if kafka_waits:
            w = np.asarray(kafka_waits) * 1000
            counters.update(kafka_wait_ms_p50=round(float(np.percentile(w, 50)), 3),
                            kafka_wait_ms_p99=round(float(np.percentile(w, 99)), 3),
                            kafka_wait_timeouts=kafka_timeouts)
        return RunResult(policy, overall, per_model, per_replica, windows, served, ttft, counters,
                         time.perf_counter() - t_wall)
    finally:
        for stop in reversed(stack):
            try:
                stop()
            except Exception:  # best effort: keep stopping the rest
                pass
