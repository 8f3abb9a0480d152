"""Shared helpers of the benchmarks: the Mooncake-derived workload, the lookup shard builder, timing
statistics, machine info and the figure records run_all.py collects.

Nothing here asserts on timings: benchmarks measure and print, RESULTS.md judges against targets.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import sys
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # scripts run as `python bench/x.py`: make the project importable
    sys.path.insert(0, str(ROOT))

from kvidx import index  # noqa: E402
from kvidx.core.hashing import pack_tokens, prompt_hashes  # noqa: E402
from kvidx.core.shard import ModelShard  # noqa: E402
from schemas.events import SCHEMA_VERSION, BlocksRemoved, BlocksStored, EventBatch  # noqa: E402

# the public Mooncake conversation trace, shipped with the simulator (the benchmarks read its head)
TRACE = (Path(__file__).resolve().parent.parent / "kvidx" / "sim" / "data"
         / "mooncake_conversation_trace.jsonl")
TRACE_BLOCK = 512  # tokens per Mooncake hash_id
MODEL = "bench-model"
_M64 = (1 << 64) - 1


# ---- the broker -------------------------------------------------------------------------------
def start_broker(data_dir: str | Path):
    """(bootstrap, the LocalKafka started in `data_dir`, or None where $KAFKA_BOOTSTRAP_SERVERS names
    a broker to use)."""
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if bootstrap:
        log(f"broker: $KAFKA_BOOTSTRAP_SERVERS={bootstrap}")
        return bootstrap, None
    from kvidx.kafka.local import LocalKafka

    kafka = LocalKafka(log=lambda m: log(f"  [kafka] {m}"))
    log("starting LocalKafka ...")
    return kafka.start(str(data_dir)), kafka


def stop_broker(kafka) -> None:
    if kafka is not None:
        log("stopping LocalKafka ...")
        kafka.stop()


# ---- output ----------------------------------------------------------------------------------
def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass
class Figure:
    bench: str
    figure: str
    measured: float | None
    unit: str
    target: str = ""  # e.g. ">= 250000"; empty: informational
    note: str = ""

    @property
    def verdict(self) -> str:
        if not self.target or self.measured is None:
            return "info" if self.measured is not None else "n/a"
        op, val = self.target.split()
        v = float(val)
        ok = self.measured >= v if op == ">=" else self.measured <= v
        return "pass" if ok else "FAIL"


@dataclass
class ScalePoint:
    """One point of a scaling series: `metric` measured at `factor` x the base load (`load` says
    what that load is, e.g. "256 replicas x 128 blocks/batch")."""
    bench: str
    metric: str
    factor: float
    load: str
    value: float | None
    unit: str
    target: str = ""


def parse_scale(text: str | None) -> list[float]:
    """--scale "1,2,4" -> [1.0, 2.0, 4.0]; "" or None -> [] (no scaling series)."""
    if not text:
        return []
    out = sorted({float(x) for x in text.split(",") if x.strip()})
    if any(f <= 0 for f in out):
        raise SystemExit(f"--scale factors must be > 0: {text!r}")
    return out


class Figures:
    def __init__(self, bench: str):
        self.bench = bench
        self.items: list[Figure] = []
        self.scaling: list[ScalePoint] = []

    def scale(self, metric: str, factor: float, load: str, value: float | None, unit: str,
              target: str = "") -> None:
        self.scaling.append(ScalePoint(self.bench, metric, factor, load, value, unit, target))
        val = "n/a" if value is None else fmt(value)
        print(f"  SCALE {metric} @{factor:g}x ({load}): {val} {unit}", flush=True)

    def add(self, figure: str, measured: float | None, unit: str, target: str = "", note: str = "") -> None:
        f = Figure(self.bench, figure, measured, unit, target, note)
        self.items.append(f)
        val = "n/a" if measured is None else fmt(measured)
        tgt = f"  (target {target} {unit}: {f.verdict})" if target else ""
        print(f"  FIGURE {figure}: {val} {unit}{tgt}{'  # ' + note if note else ''}", flush=True)

    def write(self, path: str | None, extra: dict | None = None) -> None:
        if not path:
            return
        Path(path).write_text(json.dumps({"bench": self.bench, "figures": [asdict(f) for f in self.items],
                                          "scaling": [asdict(x) for x in self.scaling],
                                          "extra": extra or {}}, indent=1))


def fmt(x: float) -> str:
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def pct(samples, *qs: float) -> list[float]:
    a = np.asarray(samples, dtype=float)
    if a.size == 0:
        return [float("nan")] * len(qs)
    return [float(np.percentile(a, q)) for q in qs]


def machine_info() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = next(int(x.split()[1]) // 1024 for x in Path("/proc/meminfo").read_text().splitlines()
                   if x.startswith("MemTotal"))
    except (OSError, StopIteration):
        mem = None
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_mb": mem, "python": platform.python_version(),
            "platform": platform.platform(), "loadavg": [round(x, 2) for x in os.getloadavg()]}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---- workload --------------------------------------------------------------------------------
def load_trace(limit: int | None = None) -> list[tuple[int, list[int]]]:
    """(input_length, hash_ids) of the first `limit` Mooncake requests (hash_ids: 512-token blocks,
    equal ids = equal prefixes)."""
    out = []
    with open(TRACE) as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            d = json.loads(line)
            out.append((int(d["input_length"]), d["hash_ids"]))
    return out


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: distinct u64 ints in, well-spread u64 hashes out (vectorized)."""
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def request_blocks(input_length: int, hash_ids: list[int], block_size: int, salt: int) -> list[int]:
    """Stand-in canonical hashes of a trace request's full `block_size` blocks: each 512-token trace
    block splits into 512/block_size sub-blocks; `salt` makes a pass over the trace a new tenant."""
    per = TRACE_BLOCK // block_size
    n = min(len(hash_ids) * per, input_length // block_size)
    ids = np.asarray(hash_ids, dtype=np.uint64)
    keys = (ids[:, None] * np.uint64(per) + np.arange(per, dtype=np.uint64)).ravel()[:n]
    keys = keys + np.uint64((salt & 0xFFFF) << 40)
    return mix64(keys).tolist()


class ReplicaLRU:
    """An engine's prefix cache at block granularity: a request hits its cached leading blocks,
    stores the rest, and the least recently used blocks are evicted beyond `capacity`."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.cache: OrderedDict[int, None] = OrderedDict()

    def serve(self, hashes: list[int]) -> tuple[int, list[int], list[int]]:
        """-> (hit blocks, stored hashes, evicted hashes)."""
        c = self.cache
        hit = 0
        for h in hashes:
            if h not in c:
                break
            hit += 1
        for h in hashes[:hit]:
            c.move_to_end(h)
        stored = [h for h in hashes[hit:] if h not in c]
        for h in hashes[hit:]:
            c[h] = None
            c.move_to_end(h)
        evicted = []
        while len(c) > self.capacity:
            evicted.append(c.popitem(last=False)[0])
        return hit, stored, evicted


def event_stream(replicas: int, capacity: int, block_size: int, seed: int = 1,
                 trace_limit: int | None = None, affine: bool = False
                 ) -> Iterator[tuple[int, list[int], list[int], int]]:
    """Endless (replica, stored, evicted, depth of first stored) per trace request, requests routed
    at random over `replicas` LRU caches (`affine`: by their first blocks, as a prefix-aware router
    keeps a conversation where its prefix is); the trace is replayed with a new salt on each pass."""
    trace = load_trace(trace_limit)
    rng = np.random.default_rng(seed)
    caches = [ReplicaLRU(capacity) for _ in range(replicas)]
    salt = 0
    while True:
        route = rng.integers(0, replicas, len(trace))
        if affine:  # by the first 4 trace blocks: a conversation's turns share them, and a system
            # prompt alone (the first block of most requests) does not send everything to one replica
            head = [hash((salt, *ids[:4])) & _M64 for _, ids in trace]
            route = (mix64(np.asarray(head, dtype=np.uint64)) % np.uint64(replicas)).astype(np.int64)
        for (n_in, ids), r in zip(trace, route.tolist(), strict=True):
            hashes = request_blocks(n_in, ids, block_size, salt)
            if not hashes:
                continue
            hit, stored, evicted = caches[r].serve(hashes)
            yield r, stored, evicted, hit
        salt += 1


def batches_from_stream(replicas: int, capacity: int, block_size: int, per_batch: int, n_events: int,
                        warm_fill: float = 0.9, seed: int = 1, affine: bool = False
                        ) -> tuple[list[EventBatch], list[EventBatch]]:
    """EventBatches of at most `per_batch` block events (removes then stores) per replica, as
    (warm-up batches until the caches are `warm_fill` full, timed batches of ~n_events events)."""
    seqs = [0] * replicas
    warm: list[EventBatch] = []
    timed: list[EventBatch] = []
    live = 0
    target_live = int(warm_fill * replicas * capacity)
    timed_events = 0
    t_engine = 1.7e9
    for r, stored, evicted, depth in event_stream(replicas, capacity, block_size, seed, affine=affine):
        live += len(stored) - len(evicted)
        out = warm if live < target_live and not timed else timed
        # chunk: removes first (the engine evicts before it caches), then the stored chain
        items: list[tuple[str, list[int], int]] = []
        for i in range(0, len(evicted), per_batch):
            items.append(("r", evicted[i:i + per_batch], 0))
        for i in range(0, len(stored), per_batch):
            items.append(("s", stored[i:i + per_batch], depth + i))
        cur: list = []
        n_cur = 0
        for kind, hs, d in items:
            while hs:
                room = per_batch - n_cur
                part, hs = hs[:room], hs[room:]
                if kind == "r":
                    cur.append(BlocksRemoved("GPU", 0, part))
                else:
                    cur.append(BlocksStored("GPU", 0, part, None, d))
                    d += len(part)
                n_cur += len(part)
                if n_cur >= per_batch:
                    out.append(_batch(r, seqs, cur, t_engine))
                    cur, n_cur = [], 0
        if cur:
            out.append(_batch(r, seqs, cur, t_engine))
        if out is timed:
            timed_events += len(stored) + len(evicted)
            if timed_events >= n_events:
                break
        t_engine += 0.001
    return warm, timed


def _batch(r: int, seqs: list[int], events: list, ts: float) -> EventBatch:
    b = EventBatch(SCHEMA_VERSION, MODEL, f"replica-{r:03d}", 0, 1, seqs[r], ts, ts, 16, events)
    seqs[r] += 1
    return b


def block_events(batch: EventBatch) -> int:
    return sum(len(getattr(e, "hashes", ())) for e in batch.events)


# ---- the lookup shard ------------------------------------------------------------------------
@dataclass
class LookupShard:
    shard: ModelShard
    prompts: list[bytes]  # packed little-endian uint32 token ids, 32k tokens each
    prompt_hashes: list[list[int]]
    build_s: float


def build_lookup_shard(n_blocks: int, replicas: int = 64, block_size: int = 64, n_prompts: int = 16,
                       prompt_tokens: int = 32768, seed: int = 7, progress: bool = True) -> LookupShard:
    """A shard of ~n_blocks distinct blocks over `replicas` replicas (one tier, one group):
    - `n_prompts` 32k-token query prompts sharing a 4k-token system prefix; each replica holds, for
      each prompt, with probability 0.6 a random-length prefix of it (partial hits on many replicas);
    - the rest: the Mooncake trace replayed (new salt per pass) with requests routed at random, so
      block sharing across replicas follows the trace's prefix reuse."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    shard = ModelShard(MODEL, block_size)
    seqs = [0] * replicas
    system = rng.integers(0, 150_000, 4096, dtype=np.uint32)
    prompts, phashes = [], []
    for _ in range(n_prompts):
        own = rng.integers(0, 150_000, prompt_tokens - system.size, dtype=np.uint32)
        toks = np.concatenate([system, own])
        packed = pack_tokens(toks)
        prompts.append(packed)
        phashes.append(prompt_hashes(packed, block_size))
    ts = time.time()
    for r in range(replicas):
        events = []
        for hs in phashes:
            if rng.random() < 0.6:
                k = int(rng.integers(1, len(hs) + 1))
                events.append(BlocksStored("GPU", 0, hs[:k], None, 0))
        events = events or [BlocksStored("GPU", 0, phashes[0][:1], None, 0)]
        shard.apply(_batch(r, seqs, events, ts), ts)
    g = shard.groups[0]
    trace = load_trace()
    salt = 1
    last = time.perf_counter()
    while len(g.any) < n_blocks:
        route = rng.integers(0, replicas, len(trace)).tolist()
        for (n_in, ids), r in zip(trace, route, strict=True):
            hs = request_blocks(n_in, ids, block_size, salt)
            if not hs:
                continue
            hs = hs[:n_blocks - len(g.any)] if len(g.any) + len(hs) > n_blocks else hs
            shard.apply(_batch(r, seqs, [BlocksStored("GPU", 0, hs, None, 0)], ts), ts)
            if len(g.any) >= n_blocks:
                break
            if progress and time.perf_counter() - last > 2:
                last = time.perf_counter()
                log(f"  building shard: {len(g.any):,} / {n_blocks:,} blocks")
        salt += 1
    for st in index.replicas(shard):
        st.block_size = 16
    return LookupShard(shard, prompts, phashes, time.perf_counter() - t0)


def shard_entries(shard: ModelShard) -> tuple[int, int]:
    """(distinct blocks, (block, replica, tier) entries) over all groups."""
    blocks = entries = 0
    for g in shard.groups.values():
        blocks += len(g.any)
        for d in g.tiers.values():
            entries += sum(m.bit_count() for m in d.values())
    return blocks, entries


def shard_bytes(shard: ModelShard) -> int:
    """Bytes held by the shard's maps: dict tables + key and mask int objects, each object counted
    once (small ints and the shard's shared single-slot masks are shared objects). A separate "any
    tier" map shares its keys with the tier maps: only its table and masks are counted."""
    seen: set[int] = set()

    def ints(xs) -> int:
        n = 0
        for x in xs:
            if -5 <= x <= 256 or id(x) in seen:
                continue
            seen.add(id(x))
            n += sys.getsizeof(x)
        return n

    total = 0
    for g in shard.groups.values():
        for d in g.tiers.values():
            total += sys.getsizeof(d) + ints(d.keys()) + ints(d.values())
        if all(g.any is not d for d in g.tiers.values()):
            total += sys.getsizeof(g.any) + ints(g.any.values())
    return total


def collect() -> None:
    gc.collect()
