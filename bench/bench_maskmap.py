"""Micro-benchmark of the mask map (kvidx/core/maskmap.py): the native MaskMap (native/, Rust) against
the pure-Python reference PyMaskMap, op by op, in ns per block, plus memory per entry.

The map: --entries distinct random 64-bit block hashes over --replicas slots, stored the way the fold
does (BlocksStored events of --batch hashes, one slot each); a fifth of the blocks are held by a
second slot too. Then:
  store    the initial stores (ns per stored block)
  remove   BlocksRemoved of half the blocks, tier-less (ns per removed block)
  walk     the AND-walk over --prompt-blocks hashes fully held by one slot (ns per block walked)
  masks    bulk get of the same prompt (ns per block)
  chain    canonical hashing of a --prompt-blocks * 16-token prompt (ns per block)
  bytes/entry  native: MaskMap.memory_bytes(); Python: tracemalloc of the dict built the shard's way,
               its key ints and mask ints included

--events FILE (bench/peers' common event file, e.g. bench/peers/.build/results/A/events.bin): also
replays its map calls alone, as the shard makes them with one tier (one MaskMap, slot = worker;
store(hashes, slot) per stored record, remove(hashes, slot) per removed one), --replay-reps times in
process CPU time (the machine may be shared), printing ns per block event of each repetition and
bytes per entry after the replay; then a mixed pass in trace order times each query's walk (wall
clock per call: most walks stop within a few blocks, and most return ~one entry per replica).
Nothing here asserts on timings: it measures and prints.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import tracemalloc
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # no BLAS here: no idle BLAS threads in process time

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python bench/bench_maskmap.py`
    sys.path.insert(0, str(ROOT))

from kvidx.core.hashing import chain as ref_chain  # noqa: E402
from kvidx.core.maskmap import PyMaskMap, py_chain  # noqa: E402

try:
    import kvidx_native
except ImportError:
    kvidx_native = None


def best(fn, repeat: int) -> float:
    """The fastest of `repeat` runs, in ns."""
    out = []
    for _ in range(repeat):
        t = time.thread_time_ns()
        fn()
        out.append(time.thread_time_ns() - t)
    return min(out)


def workload(args) -> tuple[np.ndarray, list[tuple[list[int], int]], list[tuple[list[int], int]]]:
    rng = np.random.default_rng(args.seed)
    keys = rng.integers(0, 2**64 - 1, size=args.entries, dtype=np.uint64, endpoint=True)
    slot_of = rng.integers(0, args.replicas, size=args.entries)
    stores = []
    for i in range(0, args.entries, args.batch):
        chunk = keys[i:i + args.batch].tolist()
        stores.append((chunk, int(slot_of[i])))
    second = rng.random(len(stores)) < 0.2
    for j in np.flatnonzero(second).tolist():  # a fifth of the events: a second replica holds them too
        chunk, s = stores[j]
        stores.append((chunk, (s + 1 + int(rng.integers(0, max(1, args.replicas - 1)))) % args.replicas))
    removes = stores[:len(stores) // 2]
    return keys, stores, removes


def measure(impl, label: str, args, keys, stores, removes, packed: bytes, chain_fn) -> dict[str, float]:
    gc.collect()
    out: dict[str, float] = {}
    n_stored = sum(len(h) for h, _ in stores)
    d = impl()
    t = time.thread_time_ns()
    for h, s in stores:
        d.store(h, s)
    out["store"] = (time.thread_time_ns() - t) / n_stored
    if impl is PyMaskMap:  # built again under tracemalloc (which slows what it traces)
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        m = impl()
        # the key ints as the fold gets them (decoded from events), kept alive only by the dict
        for h, s in stores:
            m.store(np.asarray(h, dtype=np.uint64).tolist(), s)
        gc.collect()
        out["bytes/entry"] = (tracemalloc.get_traced_memory()[0] - base) / len(m)
        tracemalloc.stop()
        del m
    else:
        out["bytes/entry"] = d.memory_bytes() / len(d)
    entries = len(d)
    prompt = keys[:args.prompt_blocks].tolist()
    d.store(prompt, args.replicas - 1)  # one slot holds the whole prompt
    out["walk"] = best(lambda: d.walk(prompt), args.repeat) / len(prompt)
    out["masks"] = best(lambda: d.masks(prompt), args.repeat) / len(prompt)
    n_blocks = len(packed) // 64
    out["chain"] = best(lambda: chain_fn(packed, 16, 7), args.repeat) / n_blocks
    victim = d.copy()
    n_removed = sum(len(h) for h, _ in removes)
    t = time.thread_time_ns()
    for h, s in removes:
        victim.remove(h, s)
    out["remove"] = (time.thread_time_ns() - t) / n_removed
    print(f"{label:>7}: {entries:,} entries  store {out['store']:7.1f}  remove {out['remove']:7.1f}  "
          f"walk {out['walk']:6.1f}  masks {out['masks']:6.1f}  chain {out['chain']:6.1f} ns/block   "
          f"{out['bytes/entry']:6.1f} bytes/entry", flush=True)
    return out


def load_events(path: str) -> tuple[list[tuple], int]:
    """The records of bench/peers' event file, as its kvidx driver reads them (kvidxbench/bench_kvidx.py
    `load`): (0, query hashes), (1, worker, stored hashes), (2, worker, removed hashes); and the
    number of workers."""
    sys.path.insert(0, str(Path(__file__).parent / "peers" / "kvidxbench"))
    from bench_kvidx import load

    nw, _bt, recs = load(path)
    return [(0, r[1]) if r[0] == 0 else (1, r[1], r[3]) if r[0] == 1 else r for r in recs], nw


def replay(impl, label: str, recs: list[tuple], reps: int) -> None:
    """The event file's map calls alone (ns per block event, process CPU time), then trace order
    with every query's walk timed (ns per query block)."""
    events = [(r[0] == 1, r[1], r[2]) for r in recs if r[0] != 0]
    n_blocks = sum(len(h) for _, _, h in events)
    ns = []
    d = None
    for _ in range(reps):
        del d
        gc.collect()
        d = impl()
        store, remove = d.store, d.remove
        t = time.process_time_ns()
        for stored, w, h in events:
            if stored:
                store(h, w)
            else:
                remove(h, w)
        ns.append((time.process_time_ns() - t) / n_blocks)
    mem = d.memory_bytes() / max(1, len(d)) if impl is not PyMaskMap else float("nan")
    d = impl()
    store, remove, walk = d.store, d.remove, d.walk
    clock = time.perf_counter_ns
    q_ns = q_blocks = queries = 0
    for r in recs:
        if r[0] == 0:
            t = clock()
            walk(r[1])
            q_ns += clock() - t
            q_blocks += len(r[1])
            queries += 1
        elif r[0] == 1:
            store(r[2], r[1])
        else:
            remove(r[2], r[1])
    print(f"{label:>7} replay: {n_blocks:,} block events  store/remove " + " ".join(f"{x:.1f}" for x in ns)
          + f" ns/block (min {min(ns):.1f})  {len(d):,} entries  {mem:.1f} bytes/entry   "
          f"mixed walk {q_ns / max(1, q_blocks):.1f} ns/query block "
          f"({q_ns / max(1, queries) / 1e3:.2f} us/query)", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=1_000_000, help="distinct block hashes (default 1M)")
    ap.add_argument("--replicas", type=int, default=16,
                    help="slots the blocks are spread over (> 64: wide masks; default 16)")
    ap.add_argument("--batch", type=int, default=32, help="hashes per store/remove event (default 32)")
    ap.add_argument("--prompt-blocks", type=int, default=2048,
                    help="blocks of the walked and hashed prompt (default 2048: 32k tokens of 16)")
    ap.add_argument("--repeat", type=int, default=20, help="runs of walk/masks/chain, the best kept")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--python-only", action="store_true", help="skip the native map even if built")
    ap.add_argument("--native-only", action="store_true", help="skip the Python reference")
    ap.add_argument("--events", help="also replay this bench/peers event file's map calls")
    ap.add_argument("--replay-reps", type=int, default=3, help="repetitions of the replay (default 3)")
    ap.add_argument("--replay-only", action="store_true", help="only the replay of --events")
    args = ap.parse_args(argv)
    if args.events:
        recs, nw = load_events(args.events)
        print(f"replay of {args.events}: {len(recs):,} records, {nw} workers (ns per block; lower is better)")
        if not args.native_only:
            replay(PyMaskMap, "python", recs, args.replay_reps)
        if kvidx_native is not None and not args.python_only:
            replay(kvidx_native.MaskMap, "native", recs, args.replay_reps)
        if args.replay_only:
            return 0
    keys, stores, removes = workload(args)
    packed = np.random.default_rng(args.seed).integers(0, 2**17, size=args.prompt_blocks * 16,
                                                       dtype="<u4").tobytes()
    assert py_chain(packed, 16, 7) == ref_chain(packed, 16, 7)
    print(f"mask map: {args.entries:,} blocks over {args.replicas} slots, events of {args.batch} hashes; "
          f"prompt {args.prompt_blocks} blocks (ns per block; lower is better)")
    res = {}
    if not args.native_only:
        res["python"] = measure(PyMaskMap, "python", args, keys, stores, removes, packed, py_chain)
    if kvidx_native is not None and not args.python_only:
        res["native"] = measure(kvidx_native.MaskMap, "native", args, keys, stores, removes, packed,
                                kvidx_native.chain)
        p, n = res.get("python"), res["native"]
        if p is not None:
            print("speed-up: " + "  ".join(f"{k} x{p[k] / n[k]:.1f}" for k in ("store", "remove", "walk",
                                                                                "masks", "chain"))
                  + f"   memory x{p['bytes/entry'] / n['bytes/entry']:.1f} less")
    elif not args.python_only:
        print("native: kvidx_native is not built (scripts/setup.sh builds it where cargo exists)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
