"""End-to-end ingest through a real Kafka broker: KafkaSink -> broker -> Consumer -> decode -> fold.

Broker: $KAFKA_BOOTSTRAP_SERVERS if set (a fresh topic is created on it), else a LocalKafka
(kvidx.kafka.local) in a temp dir, stopped and deleted afterwards.

1. Throughput: a producer process builds --batches EventBatches (<= 64 block events each, stores and
   removes over 64 replicas, Mooncake-trace patterns; see _common.batches_from_stream) and publishes
   them as fast as it can with relays.sinks.KafkaSink (idempotent, linger.ms=2); this process
   consumes them concurrently with a confluent_kafka Consumer, decode_batch + ModelShard.apply (the
   fold of streams.worker.ShardWorker, minus its Prometheus counters). End-to-end blocks/s = block
   events / (first publish -> last applied).
2. Freshness: the producer publishes at a fixed --fresh-rate batches/s, stamping engine_ts just
   before KafkaSink.publish; the consumer records applied - engine_ts (same host clock).
3. Rebuild: a --rebuild-blocks shard (the lookup bench's) is written to a compacted snapshot topic
   with streams.snapshots (a first snapshot: base pieces + manifest), then rebuilt with read_snapshots.
Targets (DESIGN.md): ingest >= 250k block events/s; freshness p99 <= 50 ms at nominal load;
rebuild of a 1M-block shard from the compacted topic <= 10 s.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time

import _common as c
import numpy as np

from kvidx.core.shard import ModelShard
from schemas.events import decode_batch


def consume(bootstrap: str, topic: str, n_batches: int, timeout: float, fresh: bool) -> dict:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    cons = Consumer({"bootstrap.servers": bootstrap, "group.id": f"kvidx-bench-{time.time_ns()}",
                     "enable.auto.commit": False, "auto.offset.reset": "earliest",
                     "fetch.wait.max.ms": 10, "fetch.max.bytes": 64 << 20})
    cons.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    shard = ModelShard(c.MODEL, 16)
    lags: list[float] = []
    n = blocks = 0
    t_first = t_last = None
    deadline = time.time() + timeout
    last_log = time.time()
    try:
        while n < n_batches and time.time() < deadline:
            # block for the first message only, then take what is already there: consume(n, t)
            # alone would wait up to t for n messages, i.e. add up to t to every batch's freshness
            first = cons.poll(0.05)
            if first is None:
                continue
            for msg in [first, *cons.consume(999, 0)]:
                if msg.error():
                    continue
                if t_first is None:
                    t_first = time.time()
                b = decode_batch(msg.value())
                now = time.time()
                shard.apply(b, now)
                n += 1
                blocks += c.block_events(b)
                if fresh:
                    lags.append(now - b.engine_ts)
            t_last = time.time()
            if t_last - last_log > 2:
                last_log = t_last
                c.log(f"  consumed {n:,} / {n_batches:,} batches")
    finally:
        cons.close()
    return {"n": n, "blocks": blocks, "t_first": t_first, "t_last": t_last, "lags": lags,
            "entries": c.shard_entries(shard)[1]}


def run(bootstrap: str, topic: str, n_batches: int, rate: float | None, ctx) -> tuple[dict, tuple]:
    from kvidx.kafka.topics import create_topics

    create_topics(bootstrap, [topic, topic + ".warmup"], partitions=1)
    q, go = ctx.Queue(), ctx.Queue()
    prod = ctx.Process(target=producer, args=(bootstrap, topic, n_batches, rate, q, go))
    prod.start()
    ready = q.get(timeout=120)  # the producer has built its batches
    start_at = time.time() + 0.5
    go.put(start_at)
    n = ready[1]
    time.sleep(0.05)
    res = consume(bootstrap, topic, n, timeout=(n / rate if rate else 0) + 120, fresh=rate is not None)
    done = q.get(timeout=120)
    prod.join(30)
    res["ready"], res["done"], res["start_at"] = ready, done, start_at
    return res, done


def producer(bootstrap: str, topic: str, n_batches: int, rate: float | None, q, go) -> None:
    """Build the batches, report ready, then publish them from the wall time received on `go`
    (paced at `rate`/s if given)."""
    from relays.sinks import KafkaSink

    _, batches = c.batches_from_stream(64, 4096, 16, 64, n_batches * 64, warm_fill=0.0)
    batches = batches[:n_batches]
    sink = KafkaSink(bootstrap, events_topic=topic)
    # warm up: idempotent producer id and metadata, so the timed part measures steady state
    sink.producer.produce(topic + ".warmup", b"x")
    sink.flush(30)
    sink.producer.list_topics(topic, timeout=10)
    q.put(("ready", len(batches), sum(map(c.block_events, batches))))
    start_at = go.get(timeout=120)
    while time.time() < start_at:
        time.sleep(0.001)
    t0 = time.time()
    for i, b in enumerate(batches):
        if rate:
            d = start_at + i / rate - time.time()
            if d > 0:
                time.sleep(d)
        b.engine_ts = b.relay_ts = time.time()
        sink.publish(b)
    t_pub = time.time()
    left = sink.flush(60)
    q.put(("done", t0, t_pub, time.time(), left, sink.errors))


def rebuild(bootstrap: str, topic: str, n_blocks: int, figs: c.Figures | None) -> float:
    """Write a shard's snapshot to a compacted topic (streams.snapshots) and time read_snapshots."""
    from kvidx.kafka.snapshots import read_snapshots
    from kvidx.kafka.topics import create_topics
    from streams.snapshots import SnapshotLog, SnapshotTopic

    create_topics(bootstrap, [], partitions=1, compacted=[topic])
    shard = c.build_lookup_shard(n_blocks, progress=False).shard
    shard.track_changes()
    t = time.perf_counter()
    snap = SnapshotLog(c.MODEL).plan(shard)  # a first snapshot: the whole base, as a worker writes it
    SnapshotTopic(bootstrap, topic).publish(snap.items, 0)
    t_pub = time.perf_counter() - t
    n_bytes = sum(snap.nbytes.values())
    del shard
    c.collect()
    t = time.perf_counter()
    shards = read_snapshots(bootstrap, topic)
    dt = time.perf_counter() - t
    got = len(shards[c.MODEL].groups[0].any) if c.MODEL in shards else 0
    c.log(f"  snapshot {n_bytes / 2**20:.1f} MiB published in {t_pub:.2f}s; read_snapshots rebuilt "
          f"{got:,} blocks in {dt:.2f}s")
    if figs is not None:
        figs.add(f"rebuild of {got:,} blocks from the compacted topic (read_snapshots)", dt, "s", "<= 10",
                 f"snapshot {n_bytes / 2**20:.1f} MiB in {len(snap.items)} messages")
    return dt


def freshness(bootstrap: str, topic: str, rate: float, seconds: float, ctx) -> tuple[list[float], float]:
    """(p50, p99, max) in ms of engine_ts -> applied at `rate` batches/s, and block events/s."""
    res, _ = run(bootstrap, topic, int(rate * seconds), rate, ctx)
    lags = np.asarray(res["lags"]) * 1e3
    p50, p99, mx = c.pct(lags, 50, 99, 100)
    c.log(f"  {res['n']:,} batches; engine_ts -> applied p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
          f"max {mx:.1f} ms")
    return [p50, p99, mx], res["blocks"] / seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CI-size run (a few seconds)")
    p.add_argument("--batches", type=int, default=100_000, help="batches for the throughput run")
    p.add_argument("--fresh-rate", type=float, default=1000, help="batches/s of the freshness run")
    p.add_argument("--fresh-seconds", type=float, default=8.0)
    p.add_argument("--rebuild-blocks", type=int, default=1_000_000, help="shard size for the rebuild")
    p.add_argument("--scale", default="", help="comma-separated load factors for the scaling series "
                   "(e.g. 1,2,4: x the freshness event rate, x the rebuilt shard's blocks); empty: none")
    p.add_argument("--scale-seconds", type=float, default=3.0, help="seconds per freshness scaling rate")
    p.add_argument("--json", help="write the figures to this JSON file")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.fresh_seconds, args.rebuild_blocks = 3000, 2.0, 100_000
        args.scale_seconds = 1.5
    args.scale = c.parse_scale(args.scale)
    figs = c.Figures("kafka")
    ctx = mp.get_context("spawn")

    data_dir = tempfile.mkdtemp(prefix="kvidx-bench-kafka-")
    bootstrap, kafka = c.start_broker(data_dir)
    prefix = f"kvidx-bench-{os.getpid()}-{int(time.time())}"
    try:
        c.log(f"throughput: {args.batches:,} batches, producer as fast as it can, consumer folding ...")
        res, done = run(bootstrap, f"{prefix}.tput", args.batches, None, ctx)
        _, t0, t_pub, t_flushed, left, errors = done
        blocks = res["blocks"]
        e2e = blocks / (res["t_last"] - t0) if res["t_last"] else 0.0
        prod_rate = res["ready"][2] / (t_flushed - t0)
        fold_span = res["t_last"] - res["t_first"] if res["t_first"] else float("nan")
        c.log(f"  produced {res['ready'][2]:,} block events in {res['ready'][1]:,} batches: publish "
              f"{t_pub - t0:.2f}s, +flush {t_flushed - t_pub:.2f}s ({left} unflushed, {errors} errors); "
              f"consumed+folded {res['n']:,} batches / {blocks:,} block events, last applied "
              f"{res['t_last'] - t_flushed:+.2f}s after the flush")
        bound = ("consumer-bound (it finished after the producer)"
                 if res["t_last"] - t_flushed > 0.1 * fold_span else "producer-bound (it kept up)")
        figs.add("Kafka end-to-end ingest (publish -> fold), block events/s", e2e, "blocks/s", ">= 250000",
                 f"{blocks:,} block events in {res['n']:,} batches of <= 64; 1 partition, 1 consumer")
        figs.add("Kafka producer (KafkaSink encode+produce+flush), block events/s", prod_rate, "blocks/s")
        figs.add("Kafka consumer (consume+decode+apply, first->last message), block events/s",
                 blocks / fold_span, "blocks/s", "", bound)

        n_fresh = int(args.fresh_rate * args.fresh_seconds)
        c.log(f"freshness: {n_fresh:,} batches at {args.fresh_rate:,.0f} batches/s "
              f"(~{args.fresh_rate * 64:,.0f} block events/s) ...")
        (p50, p99, mx), rate_blocks = freshness(bootstrap, f"{prefix}.fresh", args.fresh_rate,
                                                args.fresh_seconds, ctx)
        figs.add(f"freshness engine_ts -> applied p50 @{rate_blocks:,.0f} blocks/s", p50, "ms")
        figs.add(f"freshness engine_ts -> applied p99 @{rate_blocks:,.0f} blocks/s", p99, "ms", "<= 50",
                 "KafkaSink linger.ms=2, consumer fetch.wait.max.ms=10")
        figs.add("freshness max", mx, "ms")

        c.log(f"rebuild: a {args.rebuild_blocks:,}-block shard through the compacted snapshot topic ...")
        rebuild(bootstrap, f"{prefix}.shards", args.rebuild_blocks, figs)

        if args.scale:
            c.log(f"scaling: freshness at x{', x'.join(f'{f:g}' for f in args.scale)} of "
                  f"{args.fresh_rate:,.0f} batches/s ({args.scale_seconds:g}s each), rebuild at the same "
                  f"factors of {args.rebuild_blocks:,} blocks ...")
        for f in args.scale:
            rate = args.fresh_rate * f
            if f == 1:
                lat, blocks_s = (p50, p99, mx), rate_blocks
            else:
                lat, blocks_s = freshness(bootstrap, f"{prefix}.fresh{f:g}", rate, args.scale_seconds, ctx)
            figs.scale("freshness engine_ts -> applied p99", f,
                       f"{rate:,.0f} batches/s, {blocks_s:,.0f} block events/s", lat[1], "ms", "<= 50")
        for f in args.scale:
            n = round(args.rebuild_blocks * f)
            dt = (rebuild(bootstrap, f"{prefix}.shards{f:g}", n, None) if f != 1
                  else next(x.measured for x in figs.items if x.figure.startswith("rebuild of")))
            figs.scale("rebuild from the compacted topic (read_snapshots)", f, f"{n / 1e6:g}M blocks",
                       dt, "s", "<= 10")
    finally:
        c.stop_broker(kafka)
        shutil.rmtree(data_dir, ignore_errors=True)
    figs.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
