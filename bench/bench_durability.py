"""Durability proportional to change, at 100M (block, replica, tier) entries in one model.

A real ShardWorker (streams.worker: its fold, its snapshots to a compacted topic of a real broker and
to its RocksDB) holds a synthesized shard: 64 replicas, each caching a window of --entries / 64
blocks of one long sequence, neighbours' windows overlapping by a third (about 1.5 replicas per
block). Steady churn: every window slides (one block removed, the next one stored) at --churn block
events/s in total, folded as encoded event batches through ShardWorker.fold, with a snapshot every
--interval s. Then a fresh process (a new service instance) rebuilds the shard from the compacted
topic alone, and its content is checked against the worker's, byte for byte.

Figures (the issue's bars): snapshot bytes/s during the churn against the changed entries' size
(changed entries/s x 16 B: the block hash and its replica-mask word, what a snapshot stores of an
entry), at most 2x; RSS of the worker and of the rebuilt process per entry, at most 46 B; the rebuild,
at most 120 s; lookup (the AND-walk) p99 at --entries against the same walks at --small entries.

Broker: $KAFKA_BOOTSTRAP_SERVERS if set, else a LocalKafka (kvidx.kafka.local) in a temp dir.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import _common as c
import numpy as np
import xxhash

from kvidx import index
from kvidx.core.shard import ModelShard
from kvidx.core.snapshot import SEGMENTS, encode_segments
from schemas.events import SCHEMA_VERSION, BlocksRemoved, BlocksStored, EventBatch, encode_batch

MODEL = "bench-100m"
REPLICAS = 64
ENTRY_BYTES = 16


class Windows:
    """Replica r caches blocks [start[r], start[r] + width) of the sequence key(i) = mix64(i)."""

    def __init__(self, entries: int, replicas: int = REPLICAS):
        self.width = entries // replicas
        self.start = [r * self.width * 2 // 3 for r in range(replicas)]
        self.seq = [0] * replicas

    @staticmethod
    def keys(lo: int, hi: int) -> list[int]:
        return c.mix64(np.arange(lo, hi, dtype=np.uint64)).tolist()

    def batch(self, r: int, events: list) -> EventBatch:
        self.seq[r] += 1
        now = time.time()
        return EventBatch(SCHEMA_VERSION, MODEL, f"r{r}", 0, 1, self.seq[r], now, now, 16, events)

    def fill(self, shard: ModelShard, step: int = 1 << 20) -> None:
        for r, s in enumerate(self.start):
            for lo in range(s, s + self.width, step):
                hs = self.keys(lo, min(lo + step, s + self.width))
                shard.apply(self.batch(r, [BlocksStored("GPU", 0, hs, None, 0)]), time.time())

    def slide(self, r: int, n: int) -> EventBatch:
        """Replica r drops its oldest n blocks and stores the next n: 2n block events."""
        s = self.start[r]
        self.start[r] = s + n
        return self.batch(r, [BlocksRemoved("GPU", 0, self.keys(s, s + n)),
                              BlocksStored("GPU", 0, self.keys(s + self.width, s + self.width + n), None, 0)])

    def prompts(self, n: int, length: int, seed: int = 5) -> list[list[int]]:
        """Prefixes held by a replica (and partly its neighbours): each walk runs `length` blocks."""
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            r = rng.randrange(len(self.start))
            lo = self.start[r] + rng.randrange(self.width - length)
            out.append(self.keys(lo, lo + length))
        return out


def walk_p99(shard: ModelShard, prompts: list[list[int]]) -> tuple[float, float]:
    walk, clock = index.prefix_walk(shard), time.perf_counter_ns
    for p in prompts[:2000]:
        walk(p)
    lat = []
    for p in prompts:
        t = clock()
        walk(p)
        lat.append(clock() - t)
    p50, p99 = c.pct(np.asarray(lat, dtype=float) / 1e3, 50, 99)
    return p50, p99


def digest(shard: ModelShard) -> str:
    """The masks of every (group, tier), in segment order: equal iff the two shards hold the same."""
    h = xxhash.xxh3_64()
    for first in range(0, SEGMENTS, 64):
        h.update(encode_segments(shard, first, first + 64).split(b"groups", 1)[1])
    return h.hexdigest()


def rebuild_main(bootstrap: str, topic: str) -> int:
    """The fresh process: rebuild from the compacted topic alone; print its figures as JSON."""
    from kvidx.kafka.snapshots import read_snapshots

    gc.collect()
    rss0 = c.rss_bytes()  # the interpreter and its modules: what every process has before a shard
    t = time.perf_counter()
    shard = read_snapshots(bootstrap, topic)[MODEL]
    dt = time.perf_counter() - t
    gc.collect()
    entries = sum(st.blocks for st in shard.replicas.values())
    print(json.dumps({"seconds": dt, "rss": c.rss_bytes() - rss0, "rss_total": c.rss_bytes(),
                      "entries": entries, "digest": digest(shard),
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entries", type=float, default=100e6, help="(block, replica, tier) entries")
    p.add_argument("--small", type=float, default=1e6, help="entries of the lookup baseline shard")
    p.add_argument("--churn", type=float, default=100_000, help="block events/s of steady churn")
    p.add_argument("--seconds", type=float, help="seconds of churn (default 60; --quick: 10)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between snapshots")
    p.add_argument("--lookups", type=int, default=50_000, help="timed walks per shard")
    p.add_argument("--quick", action="store_true", help="a small run (2M entries, 10 s)")
    p.add_argument("--json", help="write the figures to this JSON file")
    p.add_argument("--rebuild-from", nargs=2, metavar=("BOOTSTRAP", "TOPIC"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rebuild_from:
        return rebuild_main(*args.rebuild_from)
    if args.quick:
        args.entries, args.lookups = 2e6, 20_000
    args.seconds = args.seconds or (10 if args.quick else 60)
    from kvidx.kafka.topics import create_topics
    from streams.worker import SNAP_BYTES, ShardWorker

    figs = c.Figures("durability")
    tmp = tempfile.mkdtemp(prefix="kvidx-bench-durability-")
    bootstrap, kafka = c.start_broker(os.path.join(tmp, "kafka"))
    topic = f"kvidx-bench-durability-{os.getpid()}.shards"
    try:
        create_topics(bootstrap, [topic + ".dlq"], partitions=1, compacted=[topic])
        # the lookup baseline first, on its own
        small = Windows(int(args.small))
        base_shard = ModelShard(MODEL, 16)
        small.fill(base_shard)
        small_p50, small_p99 = walk_p99(base_shard, small.prompts(args.lookups, 32))
        del base_shard
        gc.collect()

        rss0 = c.rss_bytes()
        w = Windows(int(args.entries))
        worker = ShardWorker(bootstrap, os.path.join(tmp, "worker"), topic, topic + ".dlq")
        shard = worker.shard(MODEL, 0)
        shard.journal = None  # the fill stands for a restored shard: its first snapshot is a whole base
        t = time.perf_counter()
        w.fill(shard)
        entries = sum(st.blocks for st in shard.replicas.values())
        c.log(f"filled {entries:,} entries ({len(shard.groups[0].any):,} blocks) in "
              f"{time.perf_counter() - t:.1f}s; RSS {c.rss_bytes() / 2**30:.2f} GiB")
        shard.track_changes()
        worker.dirty.add(MODEL)

        def written() -> dict[str, float]:
            parts = ("delta", "base", "manifest")
            return {part: SNAP_BYTES.labels(MODEL, part)._value.get() for part in parts}

        t = time.perf_counter()
        worker.snapshot_dirty()
        first_s = time.perf_counter() - t
        first = written()
        c.log(f"first snapshot (a whole base): {first['base'] / 2**20:,.0f} MiB in {first_s:.1f}s "
              f"({first['base'] / entries:.1f} B/entry)")

        # steady churn, paced; a snapshot every interval
        per_batch = 8  # slides per batch: 16 block events
        offset = events = snaps = 0
        snap_s: list[float] = []
        t0 = time.perf_counter()
        next_snap = t0 + args.interval
        rng = random.Random(1)
        while (now := time.perf_counter()) - t0 < args.seconds:
            due = int((now - t0) * args.churn) - events
            while due > 0:
                raw = encode_batch(w.slide(rng.randrange(REPLICAS), per_batch))
                worker.fold(raw, 0, offset)
                offset += 1
                events += 2 * per_batch
                due -= 2 * per_batch
            if now >= next_snap:
                ts = time.perf_counter()
                worker.snapshot_dirty()
                snap_s.append(time.perf_counter() - ts)
                snaps += 1
                next_snap += args.interval
            time.sleep(0.001)
        churn_s = time.perf_counter() - t0
        worker.snapshot_dirty()
        after = written()
        churn_bytes = sum(after.values()) - sum(first.values())
        gc.collect()
        worker_rss = c.rss_bytes() - rss0
        entries = sum(st.blocks for st in shard.replicas.values())
        rate = events / churn_s
        bps = churn_bytes / churn_s
        ratio = bps / (rate * ENTRY_BYTES)
        per_s = {k: (after[k] - first[k]) / churn_s / 2**20 for k in after}
        c.log(f"churn: {events:,} block events in {churn_s:.1f}s ({rate:,.0f}/s), {snaps} snapshots "
              f"(p50 {np.median(snap_s) * 1e3:.0f} ms, max {max(snap_s) * 1e3:.0f} ms); snapshot bytes "
              f"{bps / 2**20:.2f} MiB/s (delta {per_s['delta']:.2f}, base {per_s['base']:.2f}, manifest "
              f"{per_s['manifest']:.3f})")
        big_p50, big_p99 = walk_p99(shard, w.prompts(args.lookups, 32))
        want = digest(shard)

        # a fresh process rebuilds from the compacted topic alone
        c.log("rebuilding in a fresh process from the compacted topic ...")
        out = subprocess.run([sys.executable, __file__, "--rebuild-from", bootstrap, topic],
                             capture_output=True, text=True, env=dict(os.environ))
        if out.returncode != 0:
            raise SystemExit(f"rebuild failed:\n{out.stderr[-3000:]}")
        rb = json.loads(out.stdout.strip().splitlines()[-1])
        exact = rb["digest"] == want and rb["entries"] == entries
        c.log(f"rebuilt {rb['entries']:,} entries in {rb['seconds']:.1f}s, RSS {rb['rss'] / 2**30:.2f} GiB "
              f"(peak {rb['peak_rss'] / 2**30:.2f}); identical to the worker's: {exact}")

        figs.add(f"snapshot bytes/s over changed entries' size (x {ENTRY_BYTES} B) at {rate:,.0f} block "
                 f"events/s on {entries / 1e6:.0f}M entries", ratio, "x", "<= 2",
                 f"{bps / 2**20:.2f} MiB/s (bases {per_s['base']:.2f}); first (whole) base "
                 f"{first['base'] / 2**20:,.0f} MiB in {first_s:.0f}s")
        figs.add("worker RSS per entry (over the process before the shard)", worker_rss / entries, "B",
                 "<= 46")
        figs.add("rebuilt service RSS per entry (over the process before the rebuild)", rb["rss"] / entries,
                 "B", "<= 46", f"whole process {rb['rss_total'] / entries:.1f} B/entry, peak while"
                 f" rebuilding {rb['peak_rss'] / entries:.1f}")
        figs.add(f"rebuild of {entries / 1e6:.0f}M entries from the compacted topic (fresh process)",
                 rb["seconds"], "s", "<= 120", "identical content" if exact else "CONTENT DIFFERS")
        figs.add(f"lookup (walk) p99 at {entries / 1e6:.0f}M entries", big_p99, "us", "",
                 f"p50 {big_p50:.2f} us")
        figs.add(f"lookup (walk) p99 at {args.small / 1e6:g}M entries", small_p99, "us", "",
                 f"p50 {small_p50:.2f} us")
        figs.add("lookup p99 ratio (large / small)", big_p99 / small_p99, "x", "",
                 "the same walks; a large table misses the CPU caches on every block")
        figs.write(args.json, {"machine": c.machine_info(), "snapshots": snaps, "snapshot_s": snap_s})
        worker.close()
        return 0 if exact else 1
    finally:
        c.stop_broker(kafka)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
