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
(kvidx/engines/vllm/sim_hybrid.py: full attention + a sliding-window group of W tokens, or + a state-space
group checkpointed every K blocks; one block pool shared by the groups as vLLM's hybrid allocator shares
it, GPU blocks + `hybrid_group_blocks`), publishing
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
3. the chosen engine (kvidx.engines.vllm.sim.SimVllmEngine: vLLM's block pool, LRU free queue, sha256
   block hashes, real vLLM 0.32 wire payloads) serves the request and reports its `cached_tokens`;
   what the index credited on that replica is compared with it (kvidx.shadow.Agreement);
4. the engine's messages go on the "network": each is delivered `delay` after the engine step
   (uniform in [lo, hi] ms, in order per replica, so replicas reorder against each other), or lost
   with probability `drop_rate` (the relay sees the gap at the replica's next message and fills it
   from the engine's replay buffer, or, with replay off, clears the replica).

Engines run a request's cache step at its arrival (continuous batching admits it at once); the
queueing that load causes is modelled apart (kvidx/sim/serving.py), per replica, as a FIFO prefill server
(the load of reused tokens held below GPU memory at the tier's rate, `load_tps`, then prefill tokens /
`prefill_tps`) and in-flight decodes (`decode_ms_per_token`): it gives the routers their load
signals and an estimated time to first token. The kv_hints policy adds prefetch hints (kvidx.core.hints)
that replicas follow (`hint_compliance`, `hint_delay_ms`) by loading while the request is queued.

Engines publish into an in-process outbox (no sockets on the hot path); their payloads are exactly
what they would send on their ZMQ PUB socket.

In the code: run_fleet lays the fleet out (_FleetPlan: kinds, names, pools, hybrid groups), opens the
index side (_IndexSide: the sink, the lookup, the Kafka wait) and builds the replicas and their relays
(_Fleet, over a _Network); _replay_requests then takes each request through steps 1-4 with a _Router,
the ServingModel (kvidx/sim/serving.py: queues, tier loads, prefetches), the HintFollower
(kvidx/sim/advice.py) and the _Accounts
(agreement), and _stream_counters / _tier_counters report the rest.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from index_service.store import ShardStore
from kvidx import index as index_reads  # `index` names the simulator's index side here
from kvidx.client import KvidxClient, UnknownModel
from kvidx.config import DEFAULT_HINT_KINDS, Config, ModelConfig, PoolConfig
from kvidx.core.hashing import prompt_hashes
from kvidx.core.price import PriceConfig, total_s
from kvidx.core.shard import ModelShard
from kvidx.engines.contract import Frame
from kvidx.engines.sglang.relay import SglangPublisherRelay
from kvidx.engines.sglang.sim import SimSglangEngine
from kvidx.engines.trtllm.relay import TrtllmPollRelay
from kvidx.engines.trtllm.sim import SimTrtllmEngine
from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.engines.vllm.sim import SimVllmEngine, chain_digests, external_hash
from kvidx.engines.vllm.sim_hybrid import FleetHybridEngine
from kvidx.shadow import Agreement
from kvidx.sim.advice import HintFollower
from kvidx.sim.census import answer_key, census
from kvidx.sim.rolling import RollingRestart
from kvidx.sim.serving import ServingModel
from kvidx.sim.workloads import SimRequest
from relays.run import Relay
from schemas.answers import ReplicaAnswer
from schemas.events import EventBatch, ReplicaCleared

POLICIES = ("kv", "kv_hints", "random", "round_robin", "least_loaded")
DEFAULT_POLICIES = ("kv", "random", "round_robin", "least_loaded")
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
    below the last prompt token; they are loaded into GPU blocks and cached there again.

    With `disk_blocks`, a second level below the CPU (a tiered store, as LMCache's local disk backend
    under its CPU one): a block the CPU evicts moves to a disk LRU (placeholder medium "DISK"; the disk's
    evictions as BlockRemoved "DISK"), and the lookup's consecutive hits count blocks in either level,
    each loaded from the faster one holding it."""

    def __init__(self, name: str, num_blocks: int, block_size: int, cpu_blocks: int,
                 buffer_steps: int = 1000, disk_blocks: int = 0) -> None:
        super().__init__(name, num_blocks, block_size, buffer_steps)
        self.cpu_blocks = cpu_blocks
        self.cpu: OrderedDict[bytes, None] = OrderedDict()
        self.disk_blocks = disk_blocks
        self.disk: OrderedDict[bytes, None] = OrderedDict()
        self.offloaded = self.cpu_evicted = self.cpu_hit_blocks = 0
        self.disk_stored = self.disk_evicted = self.disk_hit_blocks = 0
        self.last_split: dict[str, int] = {}

    @staticmethod
    def _placeholder(d: bytes, medium: str) -> dict[str, Any]:
        return {"type": "BlockStored", "block_hashes": [external_hash(d)], "parent_block_hash": None,
                "token_ids": [], "block_size": 0, "lora_id": None, "medium": medium, "lora_name": None,
                "group_idx": 0}

    def _admit(self, level: OrderedDict[bytes, None], capacity: int, d: bytes, medium: str,
               events: list[dict[str, Any]], spill: Callable[[bytes], None]) -> bool:
        """Put block `d` in an LRU level (the connector's placeholder in `medium`); each block it evicts
        (BlockRemoved in `medium`) goes to `spill`. False if it was there already (now most recent)."""
        if d in level:
            level.move_to_end(d)
            return False
        while len(level) >= capacity:
            old, _ = level.popitem(last=False)
            events.append({"type": "BlockRemoved", "block_hashes": [external_hash(old)], "medium": medium,
                           "group_idx": 0})
            spill(old)
        level[d] = None
        events.append(self._placeholder(d, medium))
        return True

    def _evict(self, b: Any, events: list[dict[str, Any]]) -> None:
        d = b.digest
        super()._evict(b, events)
        if d is None:
            return

        def disk_spill(old: bytes) -> None:
            self.disk_evicted += 1

        def cpu_spill(old: bytes) -> None:
            self.cpu_evicted += 1
            if self.disk_blocks > 0:
                self.disk_stored += self._admit(self.disk, self.disk_blocks, old, "DISK", events, disk_spill)

        self.offloaded += self._admit(self.cpu, self.cpu_blocks, d, "CPU", events, cpu_spill)

    def advise(self, digests: list[bytes], drop: bool = False) -> int:
        """As SimVllmEngine.advise; `drop` also puts them first in the CPU and disk LRUs."""
        moved = super().advise(digests, drop)
        if drop:
            for level in (self.cpu, self.disk):
                for d in digests:
                    if d in level:
                        level.move_to_end(d, last=False)
                        moved += 1
        return moved

    def serve(self, prompt_token_ids: list[int], output_token_ids: list[int] | None = None) -> int:
        prompt = list(prompt_token_ids)
        B = self.block_size
        limit = (len(prompt) - 1) // B
        digests = chain_digests(prompt[:limit * B], B, self._root)
        g = 0
        while g < limit and digests[g] in self._cached:
            g += 1
        c = k = 0  # blocks loaded from the CPU, from the disk
        cpu, disk = self.cpu, self.disk
        while g + c + k < limit:
            d = digests[g + c + k]
            if d in cpu:
                cpu.move_to_end(d)  # touched by the lookup / load
                c += 1
            elif d in disk:
                disk.move_to_end(d)
                k += 1
            else:
                break
        self.cpu_hit_blocks += c
        self.disk_hit_blocks += k
        gpu = super().serve(prompt, output_token_ids)
        assert gpu == g * B
        self.last_split = {"GPU": g * B, "CPU": c * B}
        if self.disk_blocks > 0:
            self.last_split["DISK"] = k * B
        return (g + c + k) * B


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
    hybrid_group_blocks: int = 0  # the pool's blocks added for the second group (0: GPU blocks / 4 for
    # swa, / (2K) for mamba)
    hybrid_chunk_tokens: int = 2048  # scheduler chunk of the swa model (mamba: K engine blocks)
    hybrid_hashless_p: float = 0.05  # mamba: chunk announcements without a hash
    hybrid_report_full_p: float = 0.1  # hits re-announced (kv_cache_report_mode "full")
    cpu_offload_blocks: int = 0  # vLLM offloading connector: CPU blocks per vLLM replica (0: none)
    disk_offload_blocks: int = 0  # under the CPU tier: disk blocks per vLLM replica (0: none)
    # serving time (kvidx/sim/serving.py): load rates per tier in workload tokens/s (the service's
    # default price rates), KV bytes per workload token (Llama-3-8B: 32 layers x 8 KV heads x 128 x 2 x 2)
    load_tps: dict[str, float] = field(default_factory=lambda: dict(PriceConfig().load_tokens_per_s))
    kv_bytes_per_token: int = 131072
    # the kv_hints policy: the hint kinds the index issues, the share of hints engines follow, and how long
    # after the routing decision a hint reaches the engine
    hints: tuple[str, ...] = DEFAULT_HINT_KINDS  # the service's, once a model's hints are on
    placement_tps: float = 100_000.0  # a placement's copy between replicas, workload tokens/s (RDMA-class)
    hint_compliance: float = 1.0
    hint_delay_ms: float = 2.0
    # the router records each decision as /v1/routes does (pending credit, eviction foresight, the
    # service's pending_ttl_s); in process only (the HTTP service keeps wall-clock time, the run virtual)
    record_routes: bool = True
    replica_groups: int = 1  # through Kafka: each model's index as this many groups (kvidx.core.groups)
    # through Kafka: service instances each holding ~1/N of the groups, every lookup sent to one of them
    # (round-robin), which merges the others' answers as the service's fan-out does; 0: none
    service_instances: int = 0
    # through Kafka with service instances: restart every worker (2, real processes) and every instance
    # once during the run, one at a time (kvidx/sim/rolling.py)
    rolling_restart: bool = False


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
    """The router's client of the real lookup service (kvidx.client: POST /v1/lookup/binary, keep-alive)."""

    def __init__(self, store: ShardStore) -> None:
        from index_service.app import create_app
        from index_service.http_protocol import InProcessServer

        self.server = InProcessServer(create_app(store), name="simulate-http")
        self.client = KvidxClient(self.server.start(), timeout=10)

    def lookup(self, model: str, prompt: np.ndarray) -> list[ReplicaAnswer]:
        try:
            return self.client.lookup(model, token_ids=prompt.astype("<u4").tobytes()).replicas
        except UnknownModel:  # no event of this model seen yet: nothing cached anywhere
            return []

    def close(self) -> None:
        self.client.close()
        self.server.stop(0)


class _Clock:
    """The simulation's virtual time, one cell shared by the sinks, replay sources and relays that stamp
    what they do with it (the request loop and the network's deliveries move it)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass
class _FleetPlan:
    """Who is where, decided before anything runs: each replica's engine kind and name per model, the
    pools and their members, the hybrid groups and their sizes. Checks the configuration on the way."""

    kinds: list[str]  # engine kind of replica j (the same for every model)
    mixed: bool  # more than plain vLLM: replica names carry their kind, counters split by engine
    rep_names: dict[str, list[str]]
    pools: dict[str, PoolConfig]
    hgroups: list[tuple[str, int | None]]  # hybrid groups (empty: no hybrid replicas)
    hcap: int = 0  # blocks of the hybrid model's second group
    hchunk: int = 0  # the hybrid model's scheduler chunk, in tokens

    @classmethod
    def of(cls, cfg: FleetConfig) -> _FleetPlan:
        """Check `cfg` (ValueError: unknown engine or pool tier, a bad or unsupported hybrid spec) and lay
        its fleet out."""
        for k in cfg.engines:
            if k not in ENGINES:
                raise ValueError(f"unknown engine {k!r} (known: {', '.join(ENGINES)})")
        if cfg.pool_tier not in POOL_TIERS:
            raise ValueError(f"pool tier must be one of {', '.join(POOL_TIERS)}")
        hgroups, hk = hybrid_spec(cfg.hybrid) if cfg.hybrid else ([], 0)
        if hgroups and (cfg.pool_blocks > 0 or cfg.cpu_offload_blocks > 0):
            raise ValueError("hybrid replicas are simulated without pools or CPU offload")
        hcap = hchunk = 0
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
                    pools[f"{m}/pool{k // g}"] = PoolConfig(replicas=rep_names[m][k:k + g],
                                                            tier=cfg.pool_tier)
        return cls(kinds, mixed, rep_names, pools, hgroups, hcap, hchunk)

    def tier_names(self, cfg: FleetConfig) -> list[str]:
        """The tiers a run's reuse is split over: GPU, the CPU tier if an engine has one, the pools'."""
        kinds = self.kinds
        names = ["GPU"]
        offload = cfg.cpu_offload_blocks > 0 and "vllm" in kinds and not self.hgroups
        if (cfg.host_tier_blocks > 0 and "trtllm" in kinds) or offload:
            names.append("CPU")
        if offload and cfg.disk_offload_blocks > 0:
            names.append("DISK")
        if self.pools:
            names.append(cfg.pool_tier)
        return names


class _IndexSide:
    """The index as the fleet sees it: the sink the relays publish to (folded into the store in process,
    or through a Kafka broker and a follower) and the router's lookup (in process, or the real HTTP
    service). Whatever it starts goes on `stack`, to be stopped when the run ends."""

    def __init__(self, cfg: FleetConfig, store: ShardStore, clock: _Clock,
                 stack: list[Callable[[], Any]]) -> None:
        self.cfg = cfg
        self.store = store
        self.kafka_waits: list[float] = []  # wall-clock seconds each lookup waited for the follower
        self.kafka_timeouts = 0
        self.instances: list[ShardStore] = []  # partial service instances (cfg.service_instances)
        self.fanout_us: list[float] = []
        self.fanout_mismatches = 0
        self._next_instance = 0
        self.followers: dict[int, Any] = {}  # id(instance store) -> its KafkaFollower
        self.rolling: RollingRestart | None = None
        self.blind_lookups = 0  # answered by an instance not ready or not caught up
        self.credit_lost = 0  # credit on the chosen replica the full instance gave and the merge did not
        self._full_credit: dict[str, int] = {}
        # the last lookups of a run with instances, sent again to them as processes at its end (census)
        self.recent: deque[tuple[str, np.ndarray]] = deque(maxlen=400)
        self.split: Config | None = None  # the deployment's configuration the instances read
        if cfg.transport == "kafka":
            inner: Any = self._start_kafka(stack)
        else:
            inner = VirtualStoreSink(store, clock)
            store.ready = True
        self.sink = TrackingSink(inner)
        self.last_hashes: list[int] | None = None  # of the last prompt looked up in process
        self.http: _HttpLookup | None = None
        if cfg.lookup == "http":
            self.http = _HttpLookup(store)
            stack.append(self.http.close)

    def _start_kafka(self, stack: list[Callable[[], Any]]) -> Any:
        """A KafkaSink to the broker and a KafkaFollower folding its topic into the store, once ready."""
        from index_service.follower import KafkaFollower
        from relays.sinks import KafkaSink
        from schemas.events import topic_names
        cfg, store = self.cfg, self.store
        names = topic_names(cfg.topic_prefix)
        groups = cfg.replica_groups
        # the deployment's configuration as relays and instances read it: G groups per model
        split = self.split = Config(models={m: ModelConfig(replica_groups=groups) for m in cfg.models},
                                    pools=store.config.pools)
        inner = KafkaSink(cfg.bootstrap, names["events"], names["dead_letters"],
                          replica_group=split.replica_group)
        stack.append(inner.close)
        follower = KafkaFollower(store, cfg.bootstrap, names["events"], names["snapshots"]).start()
        stack.append(follower.stop)
        self._wait_ready(store, follower)
        n = cfg.service_instances

        def new_instance(held: frozenset[int] | None) -> tuple[ShardStore, Any]:
            part = ShardStore(cfg.index_block, config=split, groups=held)
            f = KafkaFollower(part, cfg.bootstrap, names["events"], names["snapshots"]).start()
            stack.append(f.stop)
            self.followers[id(part)] = f
            self._wait_ready(part, f)
            return part, f

        for i in range(n):
            self.instances.append(new_instance(frozenset(g for g in range(groups) if g % n == i))[0])
        if cfg.rolling_restart and n:
            self.rolling = RollingRestart(cfg.bootstrap, cfg.topic_prefix, 2, store.config.pending_ttl_s,
                                          new_instance, stack)
            self.rolling.schedule(n)
        return inner

    @staticmethod
    def _wait_ready(store: ShardStore, follower: Any, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not store.ready:
            if follower.error is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Kafka follower did not start: {follower.error}")
            time.sleep(0.01)

    def tick(self, i: int, n: int) -> None:
        """Before request i of n: the rolling restart's next step, if due."""
        if self.rolling is not None:
            due = self.rolling.due(i, n)
            if due is not None:
                self.rolling.restart(*due, self.instances, self.followers)

    def wait_until_applied(self, model: str) -> None:
        """Through Kafka, wait (up to kafka_wait_s) until the follower has applied everything the relays
        of `model` published: the lookup then sees what an in-process run would."""
        self.sink.flush(0)
        t0 = time.perf_counter()
        for store in [self.store, *self.instances]:
            want = [(k[1], v) for k, v in self.sink.last.items()
                    if k[0] == model and store.holds_replica(model, k[1])]
            while want:
                shard = store.shards.get(model)
                if shard is not None:
                    want = [(rep, v) for rep, v in want
                            if (st := index_reads.replica_of(shard, rep)) is None or (st.epoch, st.seq) < v]
                if not want:
                    break
                if time.perf_counter() - t0 > self.cfg.kafka_wait_s:
                    self.kafka_timeouts += 1
                    if store is not self.store:
                        self.blind_lookups += 1
                    break
                time.sleep(0.0003)
        self.kafka_waits.append(time.perf_counter() - t0)

    def lookup(self, model: str, prompt: np.ndarray, t: float) -> dict[str, ReplicaAnswer]:
        """The router's view of `prompt`: the index's answer per replica (DP rank 0), by replica name."""
        self.last_hashes = None
        if self.http is not None:
            answers = self.http.lookup(model, prompt)
        else:
            shard = self.store.shards.get(model)
            if shard is not None:
                self.last_hashes = self._hashes(shard, prompt)
            answers = index_reads.lookup(shard, self.last_hashes, len(prompt), t) if shard is not None else []
            if self.instances and self.last_hashes is not None:
                answers = self._fanout_lookup(model, self.last_hashes, len(prompt), t, answers)
                self.recent.append((model, prompt))
        return {a.replica: a for a in answers if a.dp_rank == 0}

    def _hashes(self, shard: ModelShard, prompt: np.ndarray) -> list[int]:
        """The prompt's index blocks, as the service hashes them for this shard."""
        tokens = prompt.astype("<u4").tobytes()
        return prompt_hashes(tokens, self.cfg.index_block, tails=bool(shard.tail_keys))

    def _fanout_lookup(self, model: str, hashes: list[int], n: int, t: float,
                       full: list[ReplicaAnswer]) -> list[ReplicaAnswer]:
        """The lookup as one partial instance answers it (round-robin): its own shard, then the other
        instances' (the groups it misses), merged as the service's fan-out merges; compared with the
        full instance's answer (`full`), every lookup."""
        i = self._next_instance = (self._next_instance + 1) % len(self.instances)
        if not all(s.ready for s in self.instances):
            self.blind_lookups += 1
        self._full_credit = {a.replica: a.resumable_tokens for a in full if a.dp_rank == 0}
        t0 = time.perf_counter()
        order = self.instances[i:] + self.instances[:i]  # its own first, then the others
        shards = [s for s in (st.shards.get(model) for st in order) if s is not None]
        parts = [index_reads.lookup(s, hashes, n, t) for s in shards]
        merged = index_reads.merge(parts)
        self.fanout_us.append((time.perf_counter() - t0) * 1e6)
        if answer_key(merged) != answer_key(full):
            self.fanout_mismatches += 1
        return merged

    def route(self, model: str, replica: str, n_tokens: int, credited: int, t: float) -> None:
        """Record the router's decision for the prompt last looked up, as POST /v1/routes does."""
        if not self.cfg.record_routes or self.last_hashes is None:
            return
        if self.store.shards.get(model) is None:
            return
        if self.instances:
            self.credit_lost += max(0, self._full_credit.get(replica, 0) - credited)
        expires = t + self.store.config.pending_ttl_s
        if self.rolling is not None:
            self.rolling.routed(t, (model, replica, 0, self.last_hashes, n_tokens, credited, expires))
        for store in [self.store, *self.instances]:  # as the routes topic reaches every instance
            if store.holds_replica(model, replica):
                with store.lock:  # its follower may be making the shard
                    shard = store.shard(model)
                shard.add_pending(replica, 0, self.last_hashes, n_tokens, credited, expires)

    def instance_counters(self, t_end: float) -> dict[str, Any]:
        """The partial service instances: groups, entries and index memory each; the fan-out lookups'
        time (in process: the shards' walks and the merge, no HTTP) and how many differed from the
        full instance's answer. Then the same instances as processes (kvidx.sim.census): their RSS, and
        the run's last lookups over HTTP through them, timed and compared (at `t_end`, past every
        route's pending credit)."""
        if not self.instances:
            return {}
        for model in self.cfg.models:  # the last events in every instance first
            self.wait_until_applied(model)
        instances, expected = [], []
        for s in self.instances:
            # the tier maps alone, as the census has always counted them
            entries, nbytes = index_reads.index_size(s.shards.values(), union_maps=False)
            instances.append({"groups": sorted(s.groups or ()), "entries": entries, "index_bytes": nbytes})
            expected.append({(m, gid): n for m, shard in s.shards.items()
                             for gid, n in index_reads.keys_by_group(shard) if n})

        def full(model: str, prompt: np.ndarray) -> list[ReplicaAnswer]:
            shard = self.store.shards[model]
            return index_reads.lookup(shard, self._hashes(shard, prompt), len(prompt), t_end)

        assert self.split is not None
        procs = census(self.cfg.bootstrap, self.cfg.topic_prefix, self.split, self.cfg.index_block,
                       [frozenset(s.groups or ()) for s in self.instances], expected, list(self.recent), full)
        for mine, theirs in zip(instances, procs.pop("instances"), strict=True):
            mine["rss_bytes"] = theirs["rss_bytes"]
        us = np.asarray(self.fanout_us or [0.0])
        out = {"instances": instances, "fanout_lookup_us": {"p50": round(float(np.percentile(us, 50)), 1),
                                                      "p99": round(float(np.percentile(us, 99)), 1)},
               "fanout_lookups": len(self.fanout_us), "fanout_mismatches": self.fanout_mismatches,
               "blind_lookups": self.blind_lookups, "credit_lost_tokens": self.credit_lost, **procs}
        if self.rolling is not None:
            out["rolling_restart"] = self.rolling.counters()
        return out

    def kafka_counters(self) -> dict[str, Any]:
        """How long lookups waited for the follower (wall clock), when events went through Kafka."""
        if not self.kafka_waits:
            return {}
        w = np.asarray(self.kafka_waits) * 1000
        return {"kafka_wait_ms_p50": round(float(np.percentile(w, 50)), 3),
                "kafka_wait_ms_p99": round(float(np.percentile(w, 99)), 3),
                "kafka_wait_timeouts": self.kafka_timeouts}


class _Fleet:
    """Every model's replicas (engines of their kinds) and pools, each wired to the relay its stream goes
    through; the network between them and the relays. Building it publishes the TensorRT-LLM engines'
    `created` polls and the pool members' relay starts, in replica order."""

    def __init__(self, cfg: FleetConfig, plan: _FleetPlan, sink: TrackingSink, net: _Network, clock: _Clock,
                 stack: list[Callable[[], Any]]) -> None:
        self.cfg = cfg
        self.plan = plan
        self.sink = sink
        self.net = net
        self.clock = clock
        self.stack = stack
        self.engines: dict[str, list[SimReplica]] = {}  # model -> its replicas, in replica order
        self.relays: dict[str, Any] = {}  # name -> Relay (ZMQ streams) or TrtllmPollRelay (polls)
        self.sources: list[EngineReplaySource] = []
        self.pool_engines: dict[str, SimPool] = {}
        for model in cfg.models:
            self.engines[model] = []
            self._add_pools(model)
            for j in range(cfg.replicas):
                self._add_replica(model, j)

    def replicas(self) -> list[SimReplica]:
        return [r for es in self.engines.values() for r in es]

    def _zmq_relay(self, e: Any, core: VllmPublisherRelay) -> None:
        src = EngineReplaySource(e, self.cfg.replay, self.clock)
        self.sources.append(src)
        self.relays[e.name] = Relay(core, self.sink, src)

    def _add_pools(self, model: str) -> None:
        cfg = self.cfg
        for pname, pc in self.plan.pools.items():
            if pname.startswith(model + "/pool"):
                pool = SimPool(pname, cfg.pool_blocks, cfg.engine_block, pc.tier, cfg.replay_buffer)
                self.pool_engines[pname] = pool
                self._zmq_relay(pool, VllmPublisherRelay(model, pname, cfg.index_block, epoch=0))

    def _add_replica(self, model: str, j: int) -> None:
        name, kind = self.plan.rep_names[model][j], self.plan.kinds[j]
        if kind == "vllm" and self.plan.hgroups:
            e = self._hybrid_vllm(model, name, j)
        elif kind == "vllm":
            e = self._vllm(model, name)
        elif kind == "sglang":
            e = self._sglang(model, name)
        else:
            e = self._trtllm(model, name)
        pool = next((self.pool_engines[p] for p, pc in self.plan.pools.items() if name in pc.replicas), None)
        self.engines[model].append(SimReplica(name, kind, model, e, pool))
        if pool is not None:
            self._announce(name)

    def _hybrid_vllm(self, model: str, name: str, j: int) -> FleetHybridEngine:
        cfg, plan, hgroups = self.cfg, self.plan, self.plan.hgroups
        e = FleetHybridEngine(name, hgroups, cfg.engine_block, cfg.num_blocks + plan.hcap, plan.hchunk,
                              seed=cfg.seed * 1009 + j, hashless_p=cfg.hybrid_hashless_p,
                              report_full_p=cfg.hybrid_report_full_p, buffer_steps=cfg.replay_buffer)
        # the relay is configured with the model's groups (as `kvidx relay` is from the model's
        # configuration); the events carry them too
        self._zmq_relay(e, VllmPublisherRelay(model, name, cfg.index_block, epoch=0,
                                              group_kinds=dict(enumerate(hgroups))))
        return e

    def _vllm(self, model: str, name: str) -> OutboxVllmEngine:
        cfg = self.cfg
        if cfg.cpu_offload_blocks > 0:
            e: OutboxVllmEngine = OffloadVllmEngine(name, cfg.num_blocks, cfg.engine_block,
                                                    cfg.cpu_offload_blocks, cfg.replay_buffer,
                                                    cfg.disk_offload_blocks)
        else:
            e = OutboxVllmEngine(name, cfg.num_blocks, cfg.engine_block, cfg.replay_buffer)
        self.stack.append(e.close)
        self._zmq_relay(e, VllmPublisherRelay(model, name, cfg.index_block, epoch=0))
        return e

    def _sglang(self, model: str, name: str) -> OutboxSglangEngine:
        cfg = self.cfg
        e = OutboxSglangEngine(name, cfg.num_blocks, cfg.engine_block, cfg.sglang_version, cfg.replay_buffer)
        self._zmq_relay(e, SglangPublisherRelay(model, name, cfg.index_block,
                                                engine_version=cfg.sglang_version, epoch=0))
        return e

    def _trtllm(self, model: str, name: str) -> PolledTrtllmEngine:
        cfg = self.cfg
        e = PolledTrtllmEngine(name, cfg.num_blocks, cfg.host_tier_blocks, cfg.engine_block)
        self.relays[name] = TrtllmPollRelay(model, name, cfg.index_block, block_size=cfg.engine_block,
                                            epoch=0)
        self.net.send(e, 0.0)  # the `created` event
        return e

    def _announce(self, name: str) -> None:
        """A starting relay announces its replica (as `kvidx relay` does): the index knows it, and credits
        it its pool's blocks, before its first own event."""
        r = self.relays[name]
        if isinstance(r, Relay):
            start = Frame(b"", -1, b"", 0, name, "relay")
            self.sink.publish(r.core._wrap([ReplicaCleared("relay_start")], -1, start, 0.0))
        else:
            for b in r.start_fresh(0):
                self.sink.publish(b)

    def deliver_until(self, t: float) -> None:
        """Hand every message due by `t` to its replica's relay, moving the clock to each delivery."""
        heap = self.net.heap
        relays, sink, clock = self.relays, self.sink, self.clock
        while heap and heap[0][0] <= t:
            at, _, name, seq, payload = heapq.heappop(heap)
            clock.t = at
            r = relays[name]
            if isinstance(r, TrtllmPollRelay):
                out = r.on_poll(payload, int(at * 1e9))
                for dl in out.dead:
                    sink.dead_letter(dl, r.model, r.replica)
                for b in out.batches:
                    sink.publish(b)
            else:
                r.handle(Frame(b"kv", seq, payload, int(at * 1e9), name, "pub"))

    def place(self, rep: SimReplica, prompt: np.ndarray, t: float) -> None:
        """A placement hint followed: `rep`'s engine caches `prompt` (copied from another replica; it
        publishes the blocks as a prefill would) at `t`."""
        eng = rep.engine
        eng.now = t
        eng.serve(prompt.tolist(), [])
        self.net.send(eng, t)

    def run_request(self, rep: SimReplica, req: SimRequest, t: float) -> tuple[int, dict[str, int]]:
        """Serve `req` on `rep` at `t` and put the engine's (and its pool's) messages on the network."""
        eng = rep.engine
        eng.now = t
        reused, split = serve(rep, req.prompt.tolist(), req.output.tolist(), self.cfg.pool_tier)
        self.net.send(eng, t)
        if rep.pool is not None:
            # stamped after the pool stored the prompt: its message carries the previous request's time
            rep.pool.now = t
            self.net.send(rep.pool, t)
        return reused, split


def _serving_model(cfg: FleetConfig, names: list[str], n_requests: int) -> ServingModel:
    """The run's queues and load channels, in simulated tokens (rates x `token_scale`)."""
    sc = cfg.token_scale
    return ServingModel(names, n_requests, cfg.prefill_tps * sc, {t: r * sc for t, r in cfg.load_tps.items()},
                        cfg.decode_ms_per_token / 1000.0 / sc, cfg.kv_bytes_per_token / sc)


class _Router:
    """One routing policy over a model's replicas. The KV-aware one sends a request where the service's
    router cost (kvidx.core.price.Pricer.cost_s) is lowest, its queue the replica's queued prefill
    weighed by `load_weight`; kv_hints prices the same but takes off the load a prefetch plan hides where
    the gate (kvidx.core.hints.PrefetchGate) would issue it (at the hints' compliance). Ties, and the
    random policy, draw from `rng` (one draw per replica per request for kv and least_loaded)."""

    def __init__(self, policy: str, cfg: FleetConfig, rng: random.Random, serving: ServingModel,
                 hints: HintFollower) -> None:
        self.policy = policy
        self.rng = rng
        self.serving = serving
        self.gate = hints.gate if hints.prefetch_on else None
        self.compliance = hints.compliance
        self.load_weight = cfg.load_weight
        self.rr = {m: 0 for m in cfg.models}

    def _price(self, name: str, n: int, ans: ReplicaAnswer | None, t: float) -> float:
        sv = self.serving
        queue_s = max(0.0, sv.busy_until[name] - t)
        if self.gate is None or ans is None or not ans.resumable_tokens:
            return sv.pricer.cost_s(ans, n, queue_s, self.load_weight)
        p = sv.pricer(ans, n)  # the load a plan the gate would issue hides, where the replica follows it
        hidden = self.compliance * self.gate.expected_s(p.load_s, queue_s, (name, 0), t)
        return total_s(p.prefill_s, p.load_s - hidden, queue_s, self.load_weight)

    def choose(self, model: str, reps: list[SimReplica], n: int, answers: dict[str, ReplicaAnswer],
               t: float) -> SimReplica:
        busy_until, inflight, rng = self.serving.busy_until, self.serving.inflight, self.rng
        if self.policy in ("kv", "kv_hints"):
            prices = [(self._price(e.name, n, answers.get(e.name), t), len(inflight[e.name]), rng.random(), k)
                      for k, e in enumerate(reps)]
            return reps[min(prices)[3]]
        if self.policy == "random":
            return reps[rng.randrange(len(reps))]
        if self.policy == "round_robin":
            chosen = reps[self.rr[model] % len(reps)]
            self.rr[model] += 1
            return chosen
        # least_loaded: fewest requests in flight, then the shortest prefill queue
        loads = [(len(inflight[e.name]), busy_until[e.name], rng.random(), k) for k, e in enumerate(reps)]
        return reps[min(loads)[3]]


class _Accounts:
    """Agreement between what the engines reused and what the index credited the chosen replica with:
    overall, per model, replica, time window and engine kind; per tier (the engine's reuse split by where
    it came from, the credit by the answer's tier runs) and, for hybrid replicas, per group kind."""

    def __init__(self, cfg: FleetConfig, plan: _FleetPlan, replicas: list[SimReplica]) -> None:
        self.window_s = cfg.window_s
        self.hgroups = plan.hgroups
        self.overall = Agreement()
        self.per_model: dict[str, Agreement] = {m: Agreement() for m in cfg.models}
        self.per_replica: dict[str, Agreement] = {e.name: Agreement() for e in replicas}
        self.windows: dict[int, Agreement] = {}
        self.kind_of = {e.name: e.kind for e in replicas}
        self.per_engine = {k: Agreement() for k in dict.fromkeys(plan.kinds)}
        self.tier_names = plan.tier_names(cfg)
        self.per_tier = {tn: Agreement() for tn in self.tier_names}
        # hybrid replicas: per group kind, the group's own hit (engine) vs the answer's groups[].hit_tokens
        self.per_group_kind = {k: Agreement() for k, _ in plan.hgroups}
        # the same credit without eviction foresight (the answer's evicting_tokens added back)
        self.without_foresight = Agreement()
        self.foresight_requests = 0  # requests whose chosen replica's credit foresight cut
        self.foresight_tokens = 0

    def add(self, i: int, t: float, n: int, rep: SimReplica, reused: int, reused_split: dict[str, int],
            credited: int, ans: ReplicaAnswer | None) -> None:
        """Count request `i` (n prompt tokens, at `t`) served on `rep`; `ans` is the index's answer for it."""
        win = int(t // self.window_s)
        for a in (self.overall, self.per_model[rep.model], self.per_replica[rep.name],
                  self.windows.get(win) or self.windows.setdefault(win, Agreement())):
            a.add(i, n, reused, credited)
        self.per_engine[rep.kind].add(i, n, reused, credited)
        cut = ans.evicting_tokens if ans is not None else 0
        self.without_foresight.add(i, n, reused, credited + cut)
        if cut:
            self.foresight_requests += 1
            self.foresight_tokens += cut
        eng = rep.engine
        if self.hgroups and isinstance(eng, FleetHybridEngine):
            idx_hits = {gr.group: gr.hit_tokens for gr in ans.groups} if ans else {}
            for g, (gkind, _) in enumerate(self.hgroups):
                self.per_group_kind[gkind].add(i, n, eng.last_group_hits.get(g, 0), idx_hits.get(g, 0))
        if len(self.tier_names) > 1:
            # the credit split by the fastest tier holding each block (the answer's tier runs)
            credited_split: dict[str, int] = {}
            left = credited
            for run in ans.tiers if credited and ans is not None else ():
                k = min(left, run.tokens)
                credited_split[run.tier] = credited_split.get(run.tier, 0) + k
                left -= k
            for tn in self.tier_names:
                self.per_tier[tn].add(i, n, reused_split.get(tn, 0), credited_split.get(tn, 0))
        else:
            self.per_tier["GPU"].add(i, n, reused, credited)


def _replay_requests(requests: list[SimRequest], cfg: FleetConfig, clock: _Clock, index: _IndexSide,
                     fleet: _Fleet, router: _Router, serving: ServingModel, hints: HintFollower,
                     accounts: _Accounts, progress: Callable[[int], None] | None) -> None:
    """The run itself, one request at a time in arrival order (the module docstring's steps 1-4), then
    every message still in flight delivered."""
    for i, req in enumerate(requests):
        t = req.t / cfg.speed
        fleet.deliver_until(t)
        clock.t = t
        model = req.model
        n = len(req.prompt)
        reps = fleet.engines[model]
        if cfg.transport == "kafka":
            index.tick(i, len(requests))
            index.wait_until_applied(model)
        # the router's view: resumable tokens per replica (from the index) and load
        by_rep = index.lookup(model, req.prompt, t)
        serving.expire([e.name for e in reps], t)
        chosen = router.choose(model, reps, n, by_rep, t)
        ans = by_rep.get(chosen.name)
        credited = ans.resumable_tokens if ans is not None else 0
        index.route(model, chosen.name, n, credited, t)
        hint, followed_at = hints.prefetch(ans, chosen.name, t)
        ready_at = hints.ready_at(model, index.last_hashes, chosen.name)
        reused, reused_split = fleet.run_request(chosen, req, t)
        hints.prefetched(serving.admit(i, chosen.name, t, n, reused, reused_split, len(req.output), hint,
                                       followed_at, ready_at))
        hints.routed(model, req.prompt, req.output, index.last_hashes, chosen.name, t, reused, reused_split)
        accounts.add(i, t, n, chosen, reused, reused_split, credited, ans)
        if progress is not None and (i & 63) == 63:
            progress(i + 1)
    fleet.deliver_until(float("inf"))
    index.sink.flush()
    if progress is not None:
        progress(len(requests))


def _stream_counters(fleet: _Fleet, net: _Network, index: _IndexSide) -> dict[str, Any]:
    """What the event streams went through: messages sent and lost, gaps seen and left unfilled, replay
    requests, dead letters, delays; engine blocks stored and evicted (per engine kind when mixed) and
    what the index holds at the end."""
    relays = fleet.relays
    zmq_relays = [r for r in relays.values() if isinstance(r, Relay)]
    polled = [r for r in relays.values() if isinstance(r, TrtllmPollRelay)]
    delays = np.asarray(net.delays) * 1000 if net.delays else np.zeros(1)
    evicted = {k: 0 for k in dict.fromkeys(fleet.plan.kinds)}
    stored = {k: 0 for k in dict.fromkeys(fleet.plan.kinds)}
    for r in fleet.replicas():
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
        "replay_requests": sum(s.requests for s in fleet.sources),
        "dead_letters": index.sink.dead,
        "delay_ms_p50": round(float(np.percentile(delays, 50)), 3),
        "delay_ms_p99": round(float(np.percentile(delays, 99)), 3),
        "engine_evicted_blocks": sum(evicted.values()),
        "engine_stored_blocks": sum(stored.values()),
        "indexed_blocks_end": sum(len(g.any) for s in index.store.shards.values() for g in s.groups.values()),
    }
    if fleet.plan.mixed:
        counters["engine_evicted_blocks_by_engine"] = evicted
    return counters


def _tier_counters(cfg: FleetConfig, fleet: _Fleet) -> dict[str, Any]:
    """The engines' own tiers and groups: TensorRT-LLM's reuse and host tier, the pools, the hybrid
    groups, vLLM's CPU offload (each key present only when the fleet has it)."""
    plan = fleet.plan
    out: dict[str, Any] = {}
    tr = [r.engine for r in fleet.replicas() if r.kind == "trtllm"]
    if tr:
        keys = ("partial_matches", "taken_over", "copied", "offloaded", "onboarded", "evicted")
        out["trtllm"] = {k: sum(e.stats[k] for e in tr) for k in keys}
        out["trtllm"].update(self_evicted_requests=sum(e.self_evicted for e in tr),
                             self_evicted_tokens=sum(e.self_evicted_tokens for e in tr))
    if fleet.pool_engines:
        pe = fleet.pool_engines.values()
        out["pools"] = {"pools": len(fleet.pool_engines),
                        "stored_blocks": sum(p.stored_blocks for p in pe),
                        "evicted_blocks": sum(p.removed_blocks for p in pe),
                        "hits": sum(p.hits for p in pe), "hit_tokens": sum(p.hit_tokens for p in pe)}
    vl = [r for r in fleet.replicas() if r.kind == "vllm"]
    hgroups = plan.hgroups
    if hgroups:
        he = [r.engine for r in vl]
        ms = [fleet.relays[r.name].core.mirror.stats for r in vl]
        out["hybrid"] = {
            "groups": [f"{k}" + (f":{w}" if w else "") for k, w in hgroups],
            "pool_blocks": cfg.num_blocks + plan.hcap, "chunk_tokens": plan.hchunk,
            "overdrawn_blocks": sum(e.overdrawn for e in he),
            "stored_blocks_by_group": [sum(e.stored[g] for e in he) for g in range(len(hgroups))],
            "evicted_blocks_by_group": [sum(e.removed[g] for e in he) for g in range(len(hgroups))],
            "hashless_announced": sum(e.hashless for e in he),
            **{f"relay_{k}": sum(m[k] for m in ms)
               for k in ("hashless_stored", "reannounced", "extra_copies", "remove_unknown")}}
    if cfg.cpu_offload_blocks > 0 and not hgroups:
        oe = [r.engine for r in vl]
        ms = [fleet.relays[r.name].core.mirror.stats for r in vl]
        out["cpu_offload"] = {
            "cpu_blocks": cfg.cpu_offload_blocks, "offloaded_blocks": sum(e.offloaded for e in oe),
            "cpu_evicted_blocks": sum(e.cpu_evicted for e in oe),
            "cpu_hit_blocks": sum(e.cpu_hit_blocks for e in oe),
            **({"disk_blocks": cfg.disk_offload_blocks, "disk_stored_blocks": sum(e.disk_stored for e in oe),
                "disk_evicted_blocks": sum(e.disk_evicted for e in oe),
                "disk_hit_blocks": sum(e.disk_hit_blocks for e in oe)} if cfg.disk_offload_blocks else {}),
            "relay_placeholder_stored": sum(m["placeholder_stored"] for m in ms),
            "relay_placeholder_unknown": sum(m["placeholder_unknown"] for m in ms)}
    return out


def _foresight_counters(accounts: _Accounts) -> dict[str, Any]:
    """What eviction foresight changed on the chosen replicas: requests and tokens it cut, and the
    agreement the same run would have had without it."""
    w = accounts.without_foresight.summary()
    return {"discounted_requests": accounts.foresight_requests,
            "discounted_tokens": accounts.foresight_tokens,
            "recall_without": w["recall"], "over_credit_without": w["over_credit"]}


def _stop_all(stack: list[Callable[[], Any]]) -> None:
    """Stop what the run started, last first; best effort: one failing stop does not keep the rest."""
    for stop in reversed(stack):
        try:
            stop()
        except Exception:
            pass


def _after_pending(requests: list[SimRequest], cfg: FleetConfig, store: ShardStore) -> float:
    """A time past the run's last request and every route's pending credit."""
    return max((r.t for r in requests), default=0.0) / cfg.speed + store.config.pending_ttl_s + 1.0


def run_fleet(requests: list[SimRequest], cfg: FleetConfig, policy: str,
              progress: Callable[[int], None] | None = None) -> RunResult:
    """Simulate the fleet on `requests` with one routing policy; see the module docstring."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r} (known: {', '.join(POLICIES)})")
    t_wall = time.perf_counter()
    rng = random.Random(cfg.seed)  # network: delays and drops
    route_rng = random.Random(cfg.seed + 1)  # random policy and ties
    plan = _FleetPlan.of(cfg)
    clock = _Clock()
    store = ShardStore(cfg.index_block, config=Config(pools=plan.pools))
    stack: list[Callable[[], Any]] = []
    try:
        index = _IndexSide(cfg, store, clock, stack)
        net = _Network(cfg, rng)
        fleet = _Fleet(cfg, plan, index.sink, net, clock, stack)
        serving = _serving_model(cfg, [r.name for r in fleet.replicas()], len(requests))
        hints = HintFollower(cfg, policy, serving, fleet)
        router = _Router(policy, cfg, route_rng, serving, hints)
        accounts = _Accounts(cfg, plan, fleet.replicas())
        _replay_requests(requests, cfg, clock, index, fleet, router, serving, hints, accounts, progress)
        counters = {**_stream_counters(fleet, net, index), **_tier_counters(cfg, fleet),
                    **index.kafka_counters(), **index.instance_counters(_after_pending(requests, cfg, store)),
                    "foresight": _foresight_counters(accounts), "serving": serving.report()}
        if policy == "kv_hints":
            counters["hints"] = hints.report()
        return RunResult(policy, accounts.overall, accounts.per_model, accounts.per_replica, accounts.windows,
                         serving.served, serving.ttft, counters, time.perf_counter() - t_wall,
                         accounts.per_engine, accounts.per_tier, accounts.kind_of, accounts.per_group_kind)
    finally:
        _stop_all(stack)
