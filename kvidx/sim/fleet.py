"""A simulated fleet of vLLM, SGLang and TensorRT-LLM replicas, in virtual time, feeding the index
through the real relay code.

Engines (`engines`, assigned to a model's replicas round-robin), each publishing its real wire format
through its own relay: vLLM 0.32 (OutboxVllmEngine: block pool, LRU free queue, independent
eviction; VllmPublisherRelay), SGLang (OutboxSglangEngine: radix tree, leaf-only eviction, page
granularity, the wire format of `sglang_version`; SglangPublisherRelay), TensorRT-LLM
(PolledTrtllmEngine: subtree eviction, partial reuse, optional host tier of `host_tier_blocks`;
TrtllmPollRelay fed by pull-API polls at the relay's poll ticks, `trtllm_poll_ms`). Shared pools
(`pool_blocks`): a SimPool per `pool_group` consecutive replicas of a model, publishing vLLM events
in its tier (`pool_tier`) as its own replica; the shard gets the topology (set_pools) and credits
pool blocks to the attached replicas; an engine reuses max(its own hit, the pool's hit) and the
pool's part is counted in the pool's tier. Agreement is kept overall, per model, replica, engine,
tier (the engine's reuse split by where it came from, the credit split by the answer's tier runs)
and time window.

Hybrid models (`hybrid`, "swa:W" or "mamba:K"): the vLLM replicas are FleetHybridEngines
(kvidx/sim/hybrid_engine.py: full attention + a sliding-window group of W tokens, or + a state-space
group checkpointed every K blocks; each group its own capacity and LRU, `hybrid_group_blocks`), publishing
vLLM 0.32's hybrid events; they reuse by vLLM's hybrid rule, and agreement is also kept per group kind
(each group's own hit within the full-attention hit, engine vs index `groups[].hit_tokens`).
vLLM CPU offload (`cpu_offload_blocks`, the offloading connector): OffloadVllmEngine moves every block
evicted from the GPU to a CPU LRU of that many blocks, published as the connector's placeholder events
(block_size 0, no token ids, the chunk's last block hash, medium "CPU"; chunks of one block); after its
GPU hit a request loads the following blocks the CPU holds (vLLM's cached_tokens counts them), split
GPU / CPU in the per-tier agreement. Not simulated: SGLang HiCache.

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
import math
import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from index_service.store import ShardStore
from kvidx.config import Config, PoolConfig
from kvidx.core.hashing import prompt_hashes
from kvidx.engines.contract import Frame
from kvidx.engines.sglang.relay import SglangPublisherRelay
from kvidx.engines.trtllm.relay import TrtllmPollRelay
from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.shadow import Agreement
from kvidx.sim.hybrid_engine import FleetHybridEngine
from kvidx.sim.sglang_engine import SimSglangEngine
from kvidx.sim.trtllm_engine import SimTrtllmEngine
from kvidx.sim.vllm_engine import SimVllmEngine, chain_digests, external_hash
from kvidx.sim.workloads import SimRequest
from relays.run import Relay
from schemas.events import EventBatch, ReplicaCleared

POLICIES = ("kv", "random", "round_robin", "least_loaded")
ENGINES = ("vllm", "sglang", "trtllm")
POOL_TIERS = ("NODE_SHARED", "POOL")
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


class OffloadVllmEngine(OutboxVllmEngine):
    """An OutboxVllmEngine with vLLM's offloading connector (CPU tier of `cpu_blocks` blocks, LRU,
    chunks of one engine block): a block evicted from the GPU moves to the CPU (published as the
    connector's placeholder, vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py
    _placeholder_stored: block_size 0, no token ids, the block's hash, medium "CPU"; the CPU's own
    evictions as BlockRemoved "CPU"). A request's GPU hit is extended by the blocks the CPU holds
    right after it (the connector's lookup starts at the GPU hit and counts consecutive CPU hits),
    below the last prompt token; they are loaded into GPU blocks and cached there again."""

    def __init__(self, name: str, num_blocks: int, block_size: int, cpu_blocks: int,
                 buffer_steps: int = 1000) -> None:
        super().__init__(name, num_blocks, block_size, buffer_steps)
        self.cpu_blocks = cpu_blocks
        self.cpu: OrderedDict[bytes, None] = OrderedDict()
        self.offloaded = self.cpu_evicted = self.cpu_hit_blocks = 0
        self.last_split: dict[str, int] = {}

    def _evict(self, b: Any, events: list[dict[str, Any]]) -> None:
        d = b.digest
        super()._evict(b, events)
        if d is None:
            return
        cpu = self.cpu
        if d in cpu:
            cpu.move_to_end(d)
            return
        while len(cpu) >= self.cpu_blocks:
            old, _ = cpu.popitem(last=False)
            events.append({"type": "BlockRemoved", "block_hashes": [external_hash(old)], "medium": "CPU",
                           "group_idx": 0})
            self.cpu_evicted += 1
        cpu[d] = None
        self.offloaded += 1
        events.append({"type": "BlockStored", "block_hashes": [external_hash(d)], "parent_block_hash": None,
                       "token_ids": [], "block_size": 0, "lora_id": None, "medium": "CPU",
                       "lora_name": None, "group_idx": 0})

    def serve(self, prompt_token_ids: list[int], output_token_ids: list[int] | None = None) -> int:
        prompt = list(prompt_token_ids)
        B = self.block_size
        limit = (len(prompt) - 1) // B
        digests = chain_digests(prompt[:limit * B], B, self._root)
        g = 0
        while g < limit and digests[g] in self._cached:
            g += 1
        c = 0
        cpu = self.cpu
        while g + c < limit and digests[g + c] in cpu:
            cpu.move_to_end(digests[g + c])  # touched by the lookup / load
            c += 1
        self.cpu_hit_blocks += c
        gpu = super().serve(prompt, output_token_ids)
        assert gpu == g * B
        self.last_split = {"GPU": g * B, "CPU": c * B}
        return (g + c) * B


class OutboxSglangEngine(SimSglangEngine):
    """A SimSglangEngine (radix tree, leaf-only LRU eviction, SGLang's real wire format for its
    version) without sockets: each scheduler step's batch goes to `outbox` (seq, payload), stamped
    with the simulation's clock; the last `buffer_steps` stay replayable."""

    def __init__(self, name: str, num_pages: int, page_size: int, version: str = "0.5.23",
                 buffer_steps: int = 1000) -> None:
        self.now = 0.0
        super().__init__(num_pages, page_size, version=version, endpoint=None, buffer_steps=buffer_steps,
                         clock=lambda: self.now)
        self.name = name
        self.outbox: list[tuple[int, bytes]] = []

    def flush(self) -> int | None:  # as SimSglangEngine.flush, without keeping every payload
        if not self._queue:
            return None
        events, self._queue = self._queue, []
        payload = self._enc.encode([self.now, [self._wire(e) for e in events], self.dp_rank])
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        self.outbox.append((seq, payload))
        return seq

    def replay_from(self, start_seq: int) -> list[tuple[int, bytes]]:
        return [(s, p) for s, p in self._buffer if s >= start_seq]

    def close(self) -> None:
        pass


class PolledTrtllmEngine(SimTrtllmEngine):
    """A SimTrtllmEngine (subtree eviction, partial reuse, optional host tier) whose pull API is
    polled once per request: the poll's JSON events go to `outbox` as (last event id, events)."""

    def __init__(self, name: str, num_blocks: int, host_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks=num_blocks, host_blocks=host_blocks, block_size=block_size,
                         partial_reuse=True)
        self.name = name
        self.now = 0.0
        self.host_blocks = host_blocks
        self.self_evicted = self.self_evicted_tokens = 0
        self.outbox: list[tuple[int, Any]] = []
        self.take_poll()  # the `created` event

    def take_poll(self) -> None:
        events = self.poll()
        if events:
            self.outbox.append((events[-1]["event_id"], events))

    def close(self) -> None:
        pass


class SimPool:
    """A node-shared KV cache (LMCache-like) attached to a group of replicas: blocks of `block_size`
    tokens of the prompts the attached engines prefilled, LRU-evicted one by one at `capacity`
    blocks, published as vLLM 0.32 events (medium = the pool's tier) under its own replica name.
    Engines look their prompt up in it when their own cache misses (`hit`), and store every prompt's
    full blocks after prefill (`store`). Its wire hashes chain Python's tuple hash (deterministic for
    ints): any 64-bit chain will do, the relay re-hashes the tokens canonically."""

    topic = b"kv"

    def __init__(self, name: str, capacity: int, block_size: int, tier: str,
                 buffer_steps: int = 1000) -> None:
        self.name = name
        self.capacity = capacity
        self.B = block_size
        self.tier = tier
        self.now = 0.0
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.outbox: list[tuple[int, bytes]] = []
        self._buffer: deque = deque(maxlen=buffer_steps)
        self._seq = 0
        self._enc = msgspec.msgpack.Encoder()
        self.stored_blocks = self.removed_blocks = self.hits = self.hit_tokens = 0

    def hashes(self, prompt: list[int]) -> list[int]:
        B, h, out = self.B, 0, []
        for i in range(len(prompt) // B):
            h = hash((h, tuple(prompt[i * B:(i + 1) * B]))) & 0xFFFFFFFFFFFFFFFF
            out.append(h)
        return out

    def hit(self, hashes: list[int], max_blocks: int) -> int:
        """Leading blocks of the prompt held (at most `max_blocks`), touched as LMCache's lookup does."""
        k = 0
        lru = self.lru
        for h in hashes[:max_blocks]:
            if h not in lru:
                break
            lru.move_to_end(h)
            k += 1
        if k:
            self.hits += 1
            self.hit_tokens += k * self.B
        return k

    def store(self, prompt: list[int], hashes: list[int]) -> None:
        lru = self.lru
        events: list[dict[str, Any]] = []
        run: list[int] = []
        run_start = 0
        for i, h in enumerate(hashes):
            if h in lru:
                lru.move_to_end(h)
                if run:
                    events.append(self._stored(run, hashes, run_start, prompt))
                    run = []
                continue
            while len(lru) >= self.capacity:
                old, _ = lru.popitem(last=False)
                events.append({"type": "BlockRemoved", "block_hashes": [old], "medium": self.tier,
                               "group_idx": 0})
                self.removed_blocks += 1
            lru[h] = None
            self.stored_blocks += 1
            if not run:
                run_start = i
            run.append(h)
        if run:
            events.append(self._stored(run, hashes, run_start, prompt))
        if events:
            payload = self._enc.encode([self.now, events, None])
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
            self.outbox.append((seq, payload))

    def _stored(self, run: list[int], hashes: list[int], start: int, prompt: list[int]) -> dict[str, Any]:
        B = self.B
        return {"type": "BlockStored", "block_hashes": list(run),
                "parent_block_hash": hashes[start - 1] if start else None,
                "token_ids": prompt[start * B:(start + len(run)) * B], "block_size": B, "lora_id": None,
                "medium": self.tier, "lora_name": None, "extra_keys": [None] * len(run), "group_idx": 0,
                "kv_cache_spec_kind": "full_attention"}

    def replay_from(self, start_seq: int) -> list[tuple[int, bytes]]:
        return [(s, p) for s, p in self._buffer if s >= start_seq]

    def close(self) -> None:
        pass


@dataclass
class SimReplica:
    """One routing target: its engine (`kind`), the relay its stream goes through, the pool it reads."""
    name: str
    kind: str
    model: str
    engine: Any
    pool: SimPool | None = None


def serve(rep: SimReplica, prompt: list[int], output: list[int],
          pool_tier: str) -> tuple[int, dict[str, int]]:
    """Run one request on `rep`: (tokens the engine reused, their split by tier). With a pool, the
    engine's own hit is extended by the pool's (vLLM's cached_tokens counts LMCache's hits): reused =
    max(own, pool), the pool's part in its tier; the prompt's blocks are then stored in the pool."""
    eng = rep.engine
    n = len(prompt)
    pool = rep.pool
    pool_hit = 0
    if pool is not None:
        ph = pool.hashes(prompt)
        pool_hit = pool.hit(ph, (n - 1) // pool.B) * pool.B
    if rep.kind == "trtllm":
        predicted = eng.reusable_tokens(prompt) if eng.stats["onboarded"] or eng.host_blocks else 0
        r = eng.generate(prompt, output)
        if r["cached_tokens"] < predicted:
            # onboarding host blocks takes free GPU blocks, whose eviction can free the rest of this very
            # prompt's host prefix (TensorRT-LLM getFreeBlock): the request reuses less than the state it
            # was matched (and credited) against held
            eng.self_evicted += 1
            eng.self_evicted_tokens += predicted - r["cached_tokens"]
        eng.take_poll()
        local = r["cached_tokens"]
        lv = r["cached_tokens_by_level"]
        split = {"GPU": lv["primary"]}
        if lv["secondary"]:
            split["CPU"] = lv["secondary"]
    else:
        local = eng.serve(prompt, output)
        split = eng.last_split if isinstance(eng, OffloadVllmEngine) else {"GPU": local}
    if pool is not None:
        pool.store(prompt, ph)
        if pool_hit > local:
            split[pool_tier] = pool_hit - local
            return pool_hit, split
    return local, split


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
    engines: tuple[str, ...] = ("vllm",)  # engine kinds, assigned to a model's replicas round-robin
    sglang_version: str = "0.5.23"
    host_tier_blocks: int = 0  # TensorRT-LLM: host (secondary) blocks per replica
    trtllm_poll_ms: float = 50.0  # the TensorRT-LLM relay's poll interval
    pool_blocks: int = 0  # shared pool: blocks per pool (0: no pools)
    pool_group: int = 4  # replicas attached to each pool (consecutive replicas of a model)
    pool_tier: str = "NODE_SHARED"
    hybrid: str = ""  # vLLM replicas as hybrid models: "swa:W" (window W tokens) or "mamba:K" (checkpoints)
    hybrid_group_blocks: int = 0  # the second group's blocks (0: GPU blocks / 4 for swa, / (2K) for mamba)
    hybrid_chunk_tokens: int = 2048  # scheduler chunk of the swa model (mamba: K engine blocks)
    hybrid_hashless_p: float = 0.05  # mamba: chunk announcements without a hash
    hybrid_report_full_p: float = 0.1  # hits re-announced (kv_cache_report_mode "full")
    cpu_offload_blocks: int = 0  # vLLM offloading connector: CPU blocks per vLLM replica (0: none)


def hybrid_spec(spec: str) -> tuple[list[tuple[str, int | None]], int]:
    """`swa:W` -> full attention + sliding window of W tokens; `mamba:K` -> full attention + mamba
    checkpointed every K engine blocks. Returns (groups, K or 0)."""
    kind, _, arg = spec.partition(":")
    try:
        v = int(arg)
    except ValueError:
        v = 0
    if kind not in ("swa", "mamba") or v <= 0:
        raise ValueError(f"--hybrid takes swa:W or mamba:K with a positive integer, not {spec!r}")
    if kind == "swa":
        return [("full_attention", None), ("sliding_window", v)], 0
    return [("full_attention", None), ("mamba", None)], v


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
    per_engine: dict[str, Agreement] = field(default_factory=dict)
    per_tier: dict[str, Agreement] = field(default_factory=dict)
    replica_kinds: dict[str, str] = field(default_factory=dict)
    per_group_kind: dict[str, Agreement] = field(default_factory=dict)


class _Network:
    """Engine messages in flight: delivery time = engine step + delay, FIFO per replica. A polled
    engine (TensorRT-LLM, `poll_s` > 0) is read at its relay's next poll tick (a per-replica phase),
    then after the delay; its polls are HTTP responses, never lost."""

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
        self.poll_s = cfg.trtllm_poll_ms / 1000.0
        self.phase: dict[str, float] = {}

    def send(self, engine: Any, now: float) -> None:
        polled = isinstance(engine, PolledTrtllmEngine) and self.poll_s > 0
        for seq, payload in engine.outbox:
            self.sent += 1
            if not polled and self.drop_rate and self.rng.random() < self.drop_rate:
                self.dropped += 1
                continue
            d = self.rng.uniform(self.lo, self.hi) if self.hi > 0 else 0.0
            if polled:
                ph = self.phase.get(engine.name)
                if ph is None:
                    ph = self.phase[engine.name] = self.rng.uniform(0, self.poll_s)
                d += ph + math.ceil((now - ph) / self.poll_s) * self.poll_s - now
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

    for k in cfg.engines:
        if k not in ENGINES:
            raise ValueError(f"unknown engine {k!r} (known: {', '.join(ENGINES)})")
    if cfg.pool_tier not in POOL_TIERS:
        raise ValueError(f"pool tier must be one of {', '.join(POOL_TIERS)}")
    hgroups, hk = hybrid_spec(cfg.hybrid) if cfg.hybrid else ([], 0)
    if hgroups and (cfg.pool_blocks > 0 or cfg.cpu_offload_blocks > 0):
        raise ValueError("hybrid replicas are simulated without pools or CPU offload")
    if hgroups:
        hcap = cfg.hybrid_group_blocks or max(1, cfg.num_blocks // (2 * hk if hk else 4))
        hchunk = hk * cfg.engine_block if hk else cfg.hybrid_chunk_tokens
    mixed = tuple(cfg.engines) != ("vllm",)
    kinds = [cfg.engines[j % len(cfg.engines)] for j in range(cfg.replicas)]
    rep_names = {m: [f"{m}/r{j}-{kinds[j]}" if mixed else f"{m}/r{j}" for j in range(cfg.replicas)]
                 for m in cfg.models}
    pools: dict[str, PoolConfig] = {}
    if cfg.pool_blocks > 0:
        g = max(1, cfg.pool_group)
        for m in cfg.models:
            for k in range(0, cfg.replicas, g):
                pools[f"{m}/pool{k // g}"] = PoolConfig(replicas=rep_names[m][k:k + g], tier=cfg.pool_tier)
    store = ShardStore(cfg.index_block, config=Config(pools=pools))
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

        engines: dict[str, list[SimReplica]] = {}
        relays: dict[str, Any] = {}  # name -> Relay (ZMQ streams) or TrtllmPollRelay (polls)
        sources: list[EngineReplaySource] = []
        pool_engines: dict[str, SimPool] = {}
        net = _Network(cfg, rng)

        def zmq_relay(e: Any, core: VllmPublisherRelay) -> None:
            src = EngineReplaySource(e, cfg.replay, now)
            sources.append(src)
            relays[e.name] = Relay(core, sink, src)

        for model in cfg.models:
            engines[model] = []
            for pname, pc in pools.items():
                if pname.startswith(model + "/pool"):
                    pool = SimPool(pname, cfg.pool_blocks, cfg.engine_block, pc.tier, cfg.replay_buffer)
                    pool_engines[pname] = pool
                    zmq_relay(pool, VllmPublisherRelay(model, pname, cfg.index_block, epoch=0))
            for j in range(cfg.replicas):
                name, kind = rep_names[model][j], kinds[j]
                if kind == "vllm" and hgroups:
                    e = FleetHybridEngine(name, hgroups, cfg.engine_block, [cfg.num_blocks, hcap], hchunk,
                                          seed=cfg.seed * 1009 + j, hashless_p=cfg.hybrid_hashless_p,
                                          report_full_p=cfg.hybrid_report_full_p,
                                          buffer_steps=cfg.replay_buffer)
                    # the relay is configured with the model's groups (as `kvidx relay` is from the
                    # model's configuration); the events carry them too
                    zmq_relay(e, VllmPublisherRelay(model, name, cfg.index_block, epoch=0,
                                                    group_kinds=dict(enumerate(hgroups))))
                elif kind == "vllm":
                    if cfg.cpu_offload_blocks > 0:
                        e = OffloadVllmEngine(name, cfg.num_blocks, cfg.engine_block, cfg.cpu_offload_blocks,
                                              cfg.replay_buffer)
                    else:
                        e = OutboxVllmEngine(name, cfg.num_blocks, cfg.engine_block, cfg.replay_buffer)
                    stack.append(e.close)
                    zmq_relay(e, VllmPublisherRelay(model, name, cfg.index_block, epoch=0))
                elif kind == "sglang":
                    e = OutboxSglangEngine(name, cfg.num_blocks, cfg.engine_block, cfg.sglang_version,
                                           cfg.replay_buffer)
                    zmq_relay(e, SglangPublisherRelay(model, name, cfg.index_block,
                                                      engine_version=cfg.sglang_version, epoch=0))
                else:
                    e = PolledTrtllmEngine(name, cfg.num_blocks, cfg.host_tier_blocks, cfg.engine_block)
                    relays[name] = TrtllmPollRelay(model, name, cfg.index_block, block_size=cfg.engine_block,
                                                   epoch=0)
                    net.send(e, 0.0)
                pool = next((pool_engines[p] for p, pc in pools.items() if name in pc.replicas), None)
                engines[model].append(SimReplica(name, kind, model, e, pool))
                if pool is not None:
                    # a starting relay announces its replica (as `kvidx relay` does): the index knows
                    # it, and credits it its pool's blocks, before its first own event
                    r = relays[name]
                    if isinstance(r, Relay):
                        start = Frame(b"", -1, b"", 0, name, "relay")
                        sink.publish(r.core._wrap([ReplicaCleared("relay_start")], -1, start, 0.0))
                    else:
                        for b in r.start_fresh(0):
                            sink.publish(b)

        def deliver_until(t: float) -> None:
            heap = net.heap
            while heap and heap[0][0] <= t:
                at, _, name, seq, payload = heapq.heappop(heap)
                clock[0] = at
                r = relays[name]
                if isinstance(r, TrtllmPollRelay):
                    out = r.on_poll(payload, int(at * 1e9))
                    for dl in out.dead:
                        sink.dead_letter(dl, r.model, r.replica)
                    for b in out.batches:
                        sink.publish(b)
                else:
                    r.handle(Frame(b"kv", seq, payload, int(at * 1e9), name, "pub"))

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
        kind_of = {e.name: e.kind for es in engines.values() for e in es}
        per_engine = {k: Agreement() for k in dict.fromkeys(kinds)}
        tier_names = ["GPU"]
        if (cfg.host_tier_blocks > 0 and "trtllm" in kinds) or (cfg.cpu_offload_blocks > 0 and "vllm" in kinds
                                                                 and not hgroups):
            tier_names.append("CPU")
        if pools:
            tier_names.append(cfg.pool_tier)
        per_tier = {tn: Agreement() for tn in tier_names}
        # hybrid replicas: per group kind, the group's own hit (engine) vs the answer's groups[].hit_tokens
        per_group_kind = {k: Agreement() for k, _ in hgroups}

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
            by_rep = {a["replica"]: a for a in answers if a["dp_rank"] == 0}
            resumable = {r: a["resumable_tokens"] for r, a in by_rep.items()}
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
            eng = chosen.engine
            eng.now = t
            reused, reused_split = serve(chosen, req.prompt.tolist(), req.output.tolist(), cfg.pool_tier)
            net.send(eng, t)
            if chosen.pool is not None:
                chosen.pool.now = t
                net.send(chosen.pool, t)
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
            per_engine[chosen.kind].add(i, n, reused, credited)
            if hgroups and isinstance(eng, FleetHybridEngine):
                ans = by_rep.get(chosen.name)
                idx_hits = {gr["group"]: gr["hit_tokens"] for gr in ans["groups"]} if ans else {}
                for g, (gkind, _) in enumerate(hgroups):
                    per_group_kind[gkind].add(i, n, eng.last_group_hits.get(g, 0), idx_hits.get(g, 0))
            if len(tier_names) > 1:
                # the credit split by the fastest tier holding each block (the answer's tier runs)
                credited_split: dict[str, int] = {}
                left = credited
                for run in by_rep[chosen.name]["tiers"] if credited else ():
                    k = min(left, run["tokens"])
                    credited_split[run["tier"]] = credited_split.get(run["tier"], 0) + k
                    left -= k
                for tn in tier_names:
                    per_tier[tn].add(i, n, reused_split.get(tn, 0), credited_split.get(tn, 0))
            else:
                per_tier["GPU"].add(i, n, reused, credited)
            if progress is not None and (i & 63) == 63:
                progress(i + 1)
        deliver_until(float("inf"))
        sink.flush()
        if progress is not None:
            progress(len(requests))

        zmq_relays = [r for r in relays.values() if isinstance(r, Relay)]
        polled = [r for r in relays.values() if isinstance(r, TrtllmPollRelay)]
        delays = np.asarray(net.delays) * 1000 if net.delays else np.zeros(1)
        evicted = {k: 0 for k in per_engine}
        stored = {k: 0 for k in per_engine}
        for es in engines.values():
            for r in es:
                e = r.engine
                if r.kind == "vllm":
                    evicted["vllm"] += e.removed_blocks
                    stored["vllm"] += e.stored_blocks
                elif r.kind == "sglang":
                    m = relays[r.name].core.mirror.stats
                    evicted["sglang"] += m["removed"]
                    stored["sglang"] += m["stored"]
                else:
                    evicted["trtllm"] += e.stats["evicted"]
        counters: dict[str, Any] = {
            "engine_messages": net.sent,
            "dropped_messages": net.dropped,
            "seq_gaps": sum(r.core.counters["gaps"] for r in zmq_relays)
            + sum(r.counters["gaps"] for r in polled),
            # each unfilled gap bumps the epoch
            "gaps_unfilled": sum(r.core.epoch for r in zmq_relays)
            + sum(r.counters["gaps"] + r.counters["poll_errors"] for r in polled),  # no replay: unfilled
            "replay_requests": sum(s.requests for s in sources),
            "dead_letters": sink.dead,
            "delay_ms_p50": round(float(np.percentile(delays, 50)), 3),
            "delay_ms_p99": round(float(np.percentile(delays, 99)), 3),
            "engine_evicted_blocks": sum(evicted.values()),
            "engine_stored_blocks": sum(stored.values()),
            "indexed_blocks_end": sum(len(g.any) for s in store.shards.values() for g in s.groups.values()),
        }
        if mixed:
            counters["engine_evicted_blocks_by_engine"] = evicted
        tr = [r.engine for es in engines.values() for r in es if r.kind == "trtllm"]
        if tr:
            keys = ("partial_matches", "taken_over", "copied", "offloaded", "onboarded", "evicted")
            counters["trtllm"] = {k: sum(e.stats[k] for e in tr) for k in keys}
            counters["trtllm"].update(self_evicted_requests=sum(e.self_evicted for e in tr),
                                      self_evicted_tokens=sum(e.self_evicted_tokens for e in tr))
        if pool_engines:
            pe = pool_engines.values()
            counters["pools"] = {"pools": len(pool_engines),
                                 "stored_blocks": sum(p.stored_blocks for p in pe),
                                 "evicted_blocks": sum(p.removed_blocks for p in pe),
                                 "hits": sum(p.hits for p in pe), "hit_tokens": sum(p.hit_tokens for p in pe)}
        vl = [r for es in engines.values() for r in es if r.kind == "vllm"]
        if hgroups:
            he = [r.engine for r in vl]
            ms = [relays[r.name].core.mirror.stats for r in vl]
            counters["hybrid"] = {
                "groups": [f"{k}" + (f":{w}" if w else "") for k, w in hgroups],
                "group_capacity": [cfg.num_blocks, hcap], "chunk_tokens": hchunk,
                "stored_blocks_by_group": [sum(e.stored[g] for e in he) for g in range(len(hgroups))],
                "evicted_blocks_by_group": [sum(e.removed[g] for e in he) for g in range(len(hgroups))],
                "hashless_announced": sum(e.hashless for e in he),
                **{f"relay_{k}": sum(m[k] for m in ms)
                   for k in ("hashless_stored", "reannounced", "extra_copies", "remove_unknown")}}
        if cfg.cpu_offload_blocks > 0 and not hgroups:
            oe = [r.engine for r in vl]
            ms = [relays[r.name].core.mirror.stats for r in vl]
            counters["cpu_offload"] = {
                "cpu_blocks": cfg.cpu_offload_blocks, "offloaded_blocks": sum(e.offloaded for e in oe),
                "cpu_evicted_blocks": sum(e.cpu_evicted for e in oe),
                "cpu_hit_blocks": sum(e.cpu_hit_blocks for e in oe),
                "relay_placeholder_stored": sum(m["placeholder_stored"] for m in ms),
                "relay_placeholder_unknown": sum(m["placeholder_unknown"] for m in ms)}
        if kafka_waits:
            w = np.asarray(kafka_waits) * 1000
            counters.update(kafka_wait_ms_p50=round(float(np.percentile(w, 50)), 3),
                            kafka_wait_ms_p99=round(float(np.percentile(w, 99)), 3),
                            kafka_wait_timeouts=kafka_timeouts)
        return RunResult(policy, overall, per_model, per_replica, windows, served, ttft, counters,
                         time.perf_counter() - t_wall, per_engine, per_tier, kind_of, per_group_kind)
    finally:
        for stop in reversed(stack):
            try:
                stop()
            except Exception:  # best effort: keep stopping the rest
                pass
