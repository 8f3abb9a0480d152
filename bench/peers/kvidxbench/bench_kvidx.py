"""Drives kvidx's pure core (kvidx/core/shard.py ModelShard.apply = the fold; prefix_blocks = the
lookup AND-walk; kvidx/core/hashing.py prompt_hashes = canonical hashing) from the common event
file, in process, as bench/bench_fold.py ("apply alone") and bench/bench_lookup.py ("(b')
shard.prefix_blocks") do. Passes: ingest (events only), mixed (trace order; every query timed),
tracemalloc (index bytes, untimed), hashing (tokens -> canonical hashes). Prints one JSON object.

One EventBatch per Stored/Removed record (one BlocksStored or BlocksRemoved event each), pre-built
before timing in the form the service folds them, its decoder's (schemas.events.decode_batch: each
event's hashes packed, no Python int per hash); the wire decode itself is excluded, as the peers get
pre-built Rust/Go structs. Queries likewise come in the service's form: the prompt's hashes as
index_service/query.py makes them from a request's tokens (prompt_hashes(array=True): packed u64s, as
the peers' queries are a Vec of u64), checked equal to the file's hashes; not the lists of Python ints
the loader decodes (cold objects a full pass apart, a cost no request has: at 64 workers the lookup
p50 was ~30 % and p99 ~20 % higher with them).

kvidx is imported from this repository's root (bench/peers/kvidxbench/../../..), or from $KVIDX_ROOT
(run.sh --rev exports a commit there). Usage: bench_kvidx.py EVENTS_FILE (env HASH_EVERY, PROFILE,
PROFILE_OUT, INGEST_TURNS=1: the ingest pass in turns with the other indexers, bench/peers/turns.py).
"""
import gc
import json
import os
import struct
import sys
import time
import tracemalloc

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
KVIDX = os.path.abspath(os.environ.get("KVIDX_ROOT") or REPO)
sys.path.insert(0, KVIDX)
from kvidx import index  # noqa: E402
from kvidx.core.hashing import prompt_hashes  # noqa: E402
from kvidx.core.shard import ModelShard  # noqa: E402
from schemas.events import (  # noqa: E402
    SCHEMA_VERSION,
    BlocksRemoved,
    BlocksStored,
    EventBatch,
    decode_batch,
    encode_batch,
)

try:  # the compiled mask map, where the core has one: say which implementation ran
    from kvidx.core.maskmap import IMPLEMENTATION as MASKMAP_IMPLEMENTATION
except ImportError:
    MASKMAP_IMPLEMENTATION = None


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def load(path):
    data = open(path, "rb").read()
    assert data[:8] == b"KVEVTS01"
    nw, bt, n = struct.unpack_from("<IIQ", data, 8)
    p = 24
    recs = []
    u64 = np.dtype("<u8")
    for _ in range(n):
        t = data[p]
        p += 1
        if t == 0:
            (k,) = struct.unpack_from("<I", data, p)
            p += 4
            seq = np.frombuffer(data, u64, k, p).tolist()
            p += 8 * k
            p += 8 * k  # Dynamo local hashes: unused by kvidx
            ids = np.frombuffer(data, u64, k, p).copy()
            p += 8 * k
            recs.append((0, seq, ids))
        elif t == 1:
            w, hp, par, k = struct.unpack_from("<IBQI", data, p)
            p += 17
            seq = np.frombuffer(data, u64, k, p).tolist()
            p += 16 * k
            recs.append((1, w, par if hp else None, seq))
        elif t == 2:
            w, k = struct.unpack_from("<II", data, p)
            p += 8
            seq = np.frombuffer(data, u64, k, p).tolist()
            p += 8 * k
            recs.append((2, w, seq))
        else:
            raise ValueError(t)
    return nw, bt, recs


def build_batches(recs, bt):
    """rec index -> EventBatch for Stored/Removed records (per-replica seq numbers), as decoded."""
    seqs = {}
    out = [None] * len(recs)
    ts = 1.7e9
    for i, r in enumerate(recs):
        if r[0] == 0:
            continue
        w = r[1]
        s = seqs.get(w, 0)
        seqs[w] = s + 1
        if r[0] == 1:
            # depth is informational for kvidx's fold (the AND-walk does not use it)
            ev = BlocksStored(tier="GPU", group=0, hashes=r[3], parent=r[2], depth=0)
        else:
            ev = BlocksRemoved(tier="GPU", group=0, hashes=r[2])
        out[i] = decode_batch(encode_batch(EventBatch(
            v=SCHEMA_VERSION, model="bench-model", replica=f"worker-{w:03d}", dp_rank=0, epoch=1, seq=s,
            engine_ts=ts, relay_ts=ts, block_size=bt, events=[ev])))
    return out


def request_tokens(ids, bt) -> bytes:
    """A query's synthesized prompt: each block's hash_id repeated bt times, as packed uint32 tokens."""
    return np.repeat(ids.astype("<u4"), bt).tobytes()


def service_queries(recs, bt):
    """Query records with their hashes as the lookup service computes them from the request's tokens
    (hash_id repeated bt times as uint32, as the hashing pass): (records, mismatches against the file)."""
    out, mism = [], 0
    for r in recs:
        if r[0] == 0:
            h = prompt_hashes(request_tokens(r[2], bt), bt, array=True)
            mism += h != r[1]
            r = (0, h, r[2])
        out.append(r)
    return out, mism


def fold_seconds(shard, batches) -> float:
    """Seconds folding every batch into `shard` (apply alone, as bench_fold "apply alone")."""
    apply = shard.apply
    t = time.perf_counter()
    for b in batches:
        apply(b, 1.0)
    return time.perf_counter() - t


def ingest_once(batches, bt) -> float:
    """Seconds folding every batch into a fresh shard; the shard is freed before it returns."""
    spent = fold_seconds(ModelShard("bench-model", bt), batches)
    gc.collect()
    return spent


def take_turns(ingest) -> list[float]:
    """The turns protocol of bench/peers/turns.py, once every other pass is done: "turn: ready" on
    stderr, then for each line on stdin, "ingest": one timed pass, answered "turn: ingest SECONDS"
    once its memory is freed (so the next indexer's pass runs alone); "warmup": the same, answered
    "turn: warmup SECONDS", not counted; "go": the end. The "ingest" passes' seconds."""
    out = []
    print("turn: ready", file=sys.stderr, flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "go":
            break
        seconds = ingest()
        if cmd == "ingest":
            out.append(seconds)
        print(f"turn: {cmd} {seconds:.6f}", file=sys.stderr, flush=True)
    return out


def middle(xs: list[float]) -> float:
    """The median of `xs`, the lower middle one for an even count (as dynbench's)."""
    return sorted(xs)[(len(xs) - 1) // 2]


def pct(a, q):
    return float(np.percentile(np.asarray(a), q, method="nearest"))


def main():
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return
    path = sys.argv[1]
    if MASKMAP_IMPLEMENTATION is not None:
        print(f"kvidx.core.maskmap: {MASKMAP_IMPLEMENTATION}", file=sys.stderr)
    hash_every = int(os.environ.get("HASH_EVERY", "1"))
    profile = os.environ.get("PROFILE")  # "ingest" | "lookup": cProfile that pass, write to $PROFILE_OUT
    t0 = time.perf_counter()
    nw, bt, recs = load(path)
    batches = build_batches(recs, bt)
    recs, query_mismatches = service_queries(recs, bt)
    load_s = time.perf_counter() - t0
    ev_batches = [b for b in batches if b is not None]
    block_events = sum(len(r[3]) if r[0] == 1 else len(r[2]) for r in recs if r[0] != 0)
    # an event record's hashes now live in its batch (decoded: packed), so its list of Python ints is
    # only a copy: dropped, as the peers drop the input they parsed (kept, its ~9M ints stay in memory
    # through the passes, and the ingest pass ran ~25 % slower at 2,048 workers: 3 runs each)
    recs = [r if r[0] == 0 else r[:1] for r in recs]
    gc.collect()
    # the pre-built input (the peers get plain structs) out of the collector's scans, as the service
    # freezes what it keeps (index_service/http_protocol.py): without it, at 2,048 workers a fifth of
    # the ingest pass was full collections walking the harness's 385k batches, not the index
    gc.freeze()
    rss0 = rss()

    # ---- ingest pass (apply alone, as bench_fold "apply alone") ----
    shard = ModelShard("bench-model", bt)
    prof = None
    if profile == "ingest":
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    ingest_s = fold_seconds(shard, ev_batches)
    if prof:
        prof.disable()
        prof.dump_stats(os.environ["PROFILE_OUT"])
    gc.collect()
    rss1 = rss()
    entries = sum(st.blocks for st in shard.replicas.values())  # live (block, tier, group, replica)
    del shard
    gc.collect()

    # ---- mixed pass: trace order, every query timed (index.prefix_walk = the AND-walk) ----
    shard = ModelShard("bench-model", bt)
    apply, walk = shard.apply, index.prefix_walk(shard)
    clock = time.perf_counter_ns
    lat = []
    ev_ns = 0
    checksum = 0
    hit_q = 0
    q_blocks = 0
    if profile == "lookup":
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    tw = time.perf_counter()
    for r, b in zip(recs, batches, strict=True):
        if r[0] == 0:
            hs = r[1]
            q_blocks += len(hs)
            t = clock()
            res = walk(hs)
            lat.append(clock() - t)
            s = sum(res.values())
            checksum += s
            hit_q += s > 0
        else:
            t = clock()
            apply(b, 1.0)
            ev_ns += clock() - t
    mixed_wall = time.perf_counter() - tw
    if prof:
        prof.disable()
        prof.dump_stats(os.environ["PROFILE_OUT"])
    lat_us = np.asarray(lat, dtype=float) / 1e3
    final_shard = shard
    del apply, walk

    # ---- hashing pass: tokens (hash_id repeated 512x as uint32) -> canonical hashes ----
    hl = []
    hb = 0
    qi = 0
    mism = 0
    for r in recs:
        if r[0] != 0:
            continue
        qi += 1
        if (qi - 1) % hash_every:
            continue
        packed = request_tokens(r[2], bt)
        t = clock()
        h = prompt_hashes(packed, bt, array=True)  # the lookup service's form (index_service/query.py)
        hl.append(clock() - t)
        hb += len(h)
        mism += h != r[1]  # (r[1] is the service form already checked against the file: a repeat check)
    hl_us = np.asarray(hl, dtype=float) / 1e3

    # ---- index bytes, untimed: tracemalloc over a rebuild of the final state ----
    del final_shard, shard
    gc.collect()
    tracemalloc.start()
    m0 = tracemalloc.get_traced_memory()[0]
    shard = ModelShard("bench-model", bt)
    for b in ev_batches:
        shard.apply(b, 1.0)
    gc.collect()
    heap_index = tracemalloc.get_traced_memory()[0] - m0
    tracemalloc.stop()
    maps = {}
    if MASKMAP_IMPLEMENTATION == "native":  # the compiled maps' heap is not Python's: they count it
        maps = {id(d): d for g in shard.groups.values() for d in [g.any, *g.tiers.values()]}
        # (only maps that are native: a core whose shard still uses dicts has none)
        heap_index += sum(d.memory_bytes() for d in maps.values() if hasattr(d, "memory_bytes"))

    # ---- ingest in turns, after every other pass (run.sh --turns: bench/peers/turns.py alternates
    # the indexers' ingest passes once all of them are done with the rest) ----
    del shard, maps
    gc.collect()
    turns = take_turns(lambda: ingest_once(ev_batches, bt)) if os.environ.get("INGEST_TURNS") == "1" else []

    out = {
        "indexer": "kvidx ModelShard (CPython, 1 thread)", "python": sys.version.split()[0],
        "kvidx_root": KVIDX, "maskmap_implementation": MASKMAP_IMPLEMENTATION,
        "load_s": round(load_s, 3), "event_msgs": len(ev_batches), "block_events": block_events,
        # with turns, the figure is their median (the single pass above is kept for reference)
        "ingest_turns_s": turns, "ingest_single_s": ingest_s,
        "ingest_s": middle(turns) if turns else ingest_s,
        "ingest_blocks_per_s": block_events / (middle(turns) if turns else ingest_s),
        "mixed_event_s": ev_ns / 1e9, "mixed_ingest_blocks_per_s": block_events / (ev_ns / 1e9),
        "mixed_wall_s": mixed_wall, "queries": len(lat), "query_blocks": q_blocks,
        "lookup_p50_us": pct(lat_us, 50), "lookup_p99_us": pct(lat_us, 99),
        "lookup_p999_us": pct(lat_us, 99.9),
        "lookup_mean_us": float(lat_us.mean()), "lookups_per_s": len(lat) / (lat_us.sum() / 1e6),
        "checksum": checksum, "hit_queries": hit_q, "entries": entries, "index_heap_bytes": heap_index,
        "rss_base_bytes": rss0, "rss_after_ingest_bytes": rss1,
        "hash_queries": len(hl), "hash_blocks": hb, "hash_p50_us": pct(hl_us, 50),
        "hash_p99_us": pct(hl_us, 99),
        "hash_blocks_per_s": hb / (hl_us.sum() / 1e6), "hash_mismatches": int(mism + query_mismatches),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
