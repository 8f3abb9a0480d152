"""In-process lookup latency, shard memory, snapshot size and restore time.

The shard (see _common.build_lookup_shard): --blocks distinct 64-token index blocks over --replicas
replicas, one tier; 16 query prompts of 32k tokens (512 blocks) of which each replica holds a
random-length prefix with probability 0.6 (partial hits on ~38 replicas per prompt), the rest of
the blocks from the Mooncake trace replayed with random routing.

Measured per lookup (prompts rotated, --iters of each):
  (a) prompt_hashes(packed tokens)  (b) index.lookup(shard, hashes)  (b') index.prefix_walk(shard)(hashes)
  (c) prompt_hashes + index.lookup  (what the service does per request, minus HTTP and JSON)
Targets (DESIGN.md): in-process p99 <= 300 us; <= 64 bytes per (block, replica, tier) entry;
rebuild of a 1M-block shard <= 10 s.
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc

import _common as c

from kvidx import index
from kvidx.core.hashing import prompt_hashes
from kvidx.core.snapshot import decode_snapshot, encode_snapshot


def timed(fn, iters: int, n_prompts: int) -> list[float]:
    out = []
    clock = time.perf_counter_ns
    for i in range(iters):
        j = i % n_prompts
        t = clock()
        fn(j)
        out.append((clock() - t) / 1e3)
    return out


def measure_latency(ls: c.LookupShard, args, figs: c.Figures, now: float) -> None:
    shard, hs, n = ls.shard, ls.prompt_hashes, len(ls.prompts)
    walk = index.prefix_walk(shard)
    n_tok = len(ls.prompts[0]) // 4
    ops = {
        "a_hash": lambda j: prompt_hashes(ls.prompts[j], args.block_size),
        "b_lookup": lambda j: index.lookup(shard, hs[j], n_tok, now),
        "b_prefix_blocks": lambda j: walk(hs[j]),
        "c_hash_lookup": lambda j: index.lookup(shard, prompt_hashes(ls.prompts[j], args.block_size), n_tok,
                                                now),
    }
    labels = {"a_hash": "(a) prompt_hashes 32k tokens", "b_lookup": "(b) index.lookup 512 blocks",
              "b_prefix_blocks": "(b') index.prefix_walk 512 blocks",
              "c_hash_lookup": "(c) prompt_hashes + index.lookup"}
    for key, fn in ops.items():
        timed(fn, min(200, args.iters), n)  # warm-up
        lat = timed(fn, args.iters, n)
        p50, p99, mx = c.pct(lat, 50, 99, 100)
        c.log(f"  {labels[key]}: p50 {p50:.1f} us, p99 {p99:.1f} us, max {mx:.0f} us ({args.iters} lookups)")
        figs.add(f"{labels[key]} p50", p50, "us")
        figs.add(f"{labels[key]} p99", p99, "us", "<= 300" if key == "c_hash_lookup" else "")


def _hash_lookup_pct(ls: c.LookupShard, block_size: int, iters: int) -> list[float]:
    """(p50, p99) in us of prompt_hashes + shard.lookup over the shard's query prompts."""
    shard, now, n_tok = ls.shard, time.time(), len(ls.prompts[0]) // 4

    def op(j: int) -> None:
        index.lookup(shard, prompt_hashes(ls.prompts[j], block_size), n_tok, now)

    timed(op, 200, len(ls.prompts))
    return c.pct(timed(op, iters, len(ls.prompts)), 50, 99)


def bench_scaling(args, figs: c.Figures) -> None:
    """At f x the base load: f x --blocks blocks over f x --replicas replicas (the query prompts hit
    on ~0.6 of them): (c) p99, bytes per entry, snapshot restore time."""
    for f in args.scale:
        n_blocks, replicas = round(args.blocks * f), round(args.replicas * f)
        ls = c.build_lookup_shard(n_blocks, replicas, args.block_size, progress=False)
        blocks, entries = c.shard_entries(ls.shard)
        p50, p99 = _hash_lookup_pct(ls, args.block_size, args.scale_iters)
        per_entry = c.shard_bytes(ls.shard) / entries
        snap = encode_snapshot(ls.shard)
        del ls
        c.collect()
        t = time.perf_counter()
        restored = decode_snapshot(snap)
        t_restore = time.perf_counter() - t
        del restored, snap
        c.collect()
        load = f"{blocks / 1e6:g}M blocks, {replicas} replicas, {entries / 1e6:.2f}M entries"
        c.log(f"  scale {f:g}x: {load}: (c) p50 {p50:.0f} us p99 {p99:.0f} us; {per_entry:.1f} B/entry; "
              f"restore {t_restore:.2f}s")
        figs.scale("lookup (c) prompt_hashes + shard.lookup p50", f, load, p50, "us")
        figs.scale("lookup (c) prompt_hashes + shard.lookup p99", f, load, p99, "us", "<= 300")
        figs.scale("memory per (block, replica, tier) entry", f, load, per_entry, "bytes", "<= 64")
        figs.scale("restore (rebuild) from a snapshot, in process", f, load, t_restore, "s", "<= 10")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CI-size run (a few seconds)")
    p.add_argument("--blocks", type=int, default=1_000_000, help="distinct blocks in the shard")
    p.add_argument("--replicas", type=int, default=64)
    # --index-block-size as everywhere else; --block-size is its old spelling, still accepted
    p.add_argument("--index-block-size", "--block-size", dest="block_size", type=int, default=64,
                   help="index block size (tokens)")
    p.add_argument("--iters", type=int, default=20000, help="timed lookups per measured operation")
    p.add_argument("--scale", default="", help="comma-separated load factors for the scaling series "
                   "(e.g. 1,2,4: x blocks and x replicas); empty: none")
    p.add_argument("--scale-iters", type=int, default=3000, help="timed lookups per scaling factor")
    p.add_argument("--json", help="write the figures to this JSON file")
    args = p.parse_args(argv)
    if args.quick:
        args.blocks, args.iters, args.scale_iters = 100_000, 500, 300
    args.scale = c.parse_scale(args.scale)
    figs = c.Figures("lookup")

    c.log(f"building a shard of {args.blocks:,} blocks over {args.replicas} replicas "
          f"({args.block_size}-token blocks) ...")
    c.collect()
    rss0 = c.rss_bytes()
    ls = c.build_lookup_shard(args.blocks, args.replicas, args.block_size)
    c.collect()
    rss1 = c.rss_bytes()
    shard = ls.shard
    blocks, entries = c.shard_entries(shard)
    c.log(f"  built in {ls.build_s:.1f}s: {blocks:,} blocks, {entries:,} (block, replica, tier) entries "
          f"({entries / blocks:.2f} replicas per block)")

    now = time.time()
    hs = ls.prompt_hashes
    n = len(ls.prompts)
    n_tok = len(ls.prompts[0]) // 4
    walk = index.prefix_walk(shard)
    hits = [walk(h) for h in hs]
    c.log(f"  query prompts: {n} x {n_tok:,} tokens = {len(hs[0])} blocks; hit on "
          f"{sum(map(len, hits)) / n:.1f} replicas on average, mean hit "
          f"{sum(sum(x.values()) / max(1, len(x)) for x in hits) / n:.0f} blocks")

    measure_latency(ls, args, figs, now)

    nbytes = c.shard_bytes(shard)
    figs.add("memory per (block, replica, tier) entry (dict tables + int objects)", nbytes / entries,
             "bytes", "<= 64", f"{nbytes / blocks:.0f} B per distinct block, {entries / blocks:.2f} "
             f"entries per block")
    figs.add("memory per entry (RSS delta of the build)", (rss1 - rss0) / entries, "bytes", "",
             f"RSS +{(rss1 - rss0) / 2**20:.0f} MiB, includes allocator slack and the query prompts")

    c.log("snapshot ...")
    t = time.perf_counter()
    snap = encode_snapshot(shard)
    t_snap = time.perf_counter() - t
    figs.add("snapshot size", len(snap) / 2**20, "MiB", "", f"{len(snap) / blocks:.1f} B per block")
    figs.add("snapshot time", t_snap, "s")
    del shard, ls, hits
    c.collect()
    rt = []
    for _ in range(2):
        t = time.perf_counter()
        restored = decode_snapshot(snap)
        rt.append(time.perf_counter() - t)
        del restored
        c.collect()
    c.log(f"  restore: {', '.join(f'{x:.2f}s' for x in rt)}")
    figs.add(f"restore (rebuild) of {blocks:,} blocks from a snapshot", min(rt), "s", "<= 10",
             "in process: decode + dict rebuild (no Kafka read)")
    tracemalloc.start()
    restored = decode_snapshot(snap)
    c.collect()
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    figs.add("memory per entry of a restored shard (tracemalloc)", used / entries, "bytes", "")
    del restored
    if args.scale:
        c.log(f"lookup scaling: x{', x'.join(f'{f:g}' for f in args.scale)} of {args.blocks:,} blocks and "
              f"{args.replicas} replicas ...")
        bench_scaling(args, figs)
    figs.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
