"""One model split in replica groups (docs/scaling.md), measured with real processes on a real broker.

Broker: $KAFKA_BOOTSTRAP_SERVERS if set (fresh topics on it), else a LocalKafka in a temp dir.
The workload: the fold benchmark's event stream (Mooncake-trace requests over --replicas LRU caches of
--capacity blocks, batches of <= 64 block events), G = 4 groups (replica_groups = 4 in a config file,
the relays' KafkaSink keys and partitions), 4 partitions.

1. Ingest scaling: `kvidx worker` processes (1, then 2, each run on fresh topics), started first and
   left to form their consumer group; then the stream is published as fast as a producer process can;
   block events/s = block events / (first folded -> last folded), from the workers' own
   kvidx_worker_block_events_total.
2. Memory: `kvidx serve` processes on the 2-worker run's topics: one holding every group, one holding
   groups 0,1 and one 2,3 (each rebuilt from the snapshots and the events), and one on empty topics
   (the process without an index); RSS from /proc once /healthz says ready.
3. Identity: every lookup of --prompts trace prompts asked of the instance holding groups 0,1 (which
   asks the one holding 2,3: fan-out) and of the full one, answers compared (freshness aside).
4. Fan-out latency: an open loop of JSON lookups (block hashes) at --rate/s for --seconds against the
   full instance and against the partial one (its answer waits for the other's), over loopback.
Nothing is asserted: figures are printed and written with --json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as c
import bench_http as h
import httpx
import msgspec

from kvidx.config import Config, ModelConfig
from kvidx.core.groups import shard_key
from kvidx.kafka.topics import ensure_topics, group_partition
from schemas.events import encode_batch, topic_names

G = 4
PARTITIONS = 4
PLACEMENT: dict[str, int] = {}  # --placement even: replica i in group i % G (else a hash of the name)
CONFIG = Config(models={c.MODEL: ModelConfig(replica_groups=G, replica_placement=PLACEMENT)})


def messages(replicas: int, capacity: int, n_events: int, affine: bool
             ) -> tuple[list[tuple[bytes, int, bytes]], int]:
    """The stream as Kafka messages (key, partition, value) with their replica groups, and its block
    events."""
    warm, timed = c.batches_from_stream(replicas, capacity, 16, 64, n_events, affine=affine)
    out, blocks = [], 0
    for b in warm + timed:
        b.replica_group = CONFIG.replica_group(b.model, b.replica)
        out.append((shard_key(b.model, b.replica_group).encode(),
                    group_partition(b.model, b.replica_group, PARTITIONS), encode_batch(b)))
        blocks += c.block_events(b)
    return out, blocks


def publish(bootstrap: str, topic: str, msgs: list[tuple[bytes, int, bytes]]) -> None:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 5,
                  "batch.num.messages": 10000, "queue.buffering.max.messages": 1_000_000})
    for key, part, value in msgs:
        while True:
            try:
                p.produce(topic, value=value, key=key, partition=part)
                break
            except BufferError:
                p.poll(0.01)
    p.flush(120)


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvidx.cli", *cmd], cwd=c.ROOT, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(c.ROOT)),
                            start_new_session=True)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def metric(port: int, name: str) -> float:
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def members_assigned(bootstrap: str, group: str) -> int:
    from confluent_kafka.admin import AdminClient

    try:
        admin = AdminClient({"bootstrap.servers": bootstrap})
        desc = admin.describe_consumer_groups([group])[group].result(10)
    except Exception:  # noqa: BLE001 - the group does not exist yet
        return 0
    if str(desc.state).split(".")[-1] != "STABLE":
        return 0
    return sum(1 for m in desc.members if m.assignment and m.assignment.topic_partitions)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ingest(bootstrap: str, prefix: str, workers: int, msgs, blocks: int, tmp: Path, ctx
           ) -> tuple[float, list[float], list[subprocess.Popen]]:
    """Block events/s folded by `workers` workers, and the CPU seconds each spent meanwhile; returns
    them and the (running) workers."""
    names = topic_names(prefix)
    ensure_topics(bootstrap, names, partitions=PARTITIONS)
    ports = [h.free_port() for _ in range(workers)]
    procs = [start(["worker", "--bootstrap", bootstrap, "--topic-prefix", prefix, "--data-dir",
                    str(tmp / f"{prefix}w{i}"), "--metrics-port", str(port), "--web-port", "0",
                    "--no-supervise", "--snapshot-interval", "2"],
                   tmp / f"{prefix}w{i}.log") for i, port in enumerate(ports)]
    deadline = time.monotonic() + 180
    while members_assigned(bootstrap, prefix + "kvidx-worker") < workers:
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            stop(procs)
            raise RuntimeError(f"the {workers} workers did not form their group; see {tmp}")
        time.sleep(0.5)
    time.sleep(3.0)  # a settled group: no rebalance while the stream arrives
    cpu0 = [cpu_seconds(p.pid) for p in procs]
    pub = ctx.Process(target=publish, args=(bootstrap, names["events"], msgs))
    pub.start()
    first = last = None
    done = 0.0
    deadline = time.monotonic() + 900
    while done < blocks and time.monotonic() < deadline:
        done = sum(metric(p, "kvidx_worker_block_events_total") for p in ports)
        now = time.perf_counter()
        if done and first is None:
            first = now
        last = now
        time.sleep(0.05)
    cpu = [cpu_seconds(p.pid) - c0 for p, c0 in zip(procs, cpu0, strict=True)]
    pub.join()
    if done < blocks:
        c.log(f"  only {done:,.0f} of {blocks:,} block events folded in time")
    return (done / (last - first) if first and last > first else 0.0), cpu, procs


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        m = re.search(r"VmRSS:\s+(\d+) kB", f.read())
    return int(m.group(1)) * 1024 if m else 0


def serve(bootstrap: str, prefix: str, config: Path, groups: str | None, tmp: Path, tag: str
          ) -> tuple[subprocess.Popen, str]:
    port = h.free_port()
    cmd = ["serve", "--bootstrap", bootstrap, "--topic-prefix", prefix, "--port", str(port), "--config",
           str(config), "--instance-name", tag, "--fanout-timeout-ms", "1000"]
    cmd += ["--groups", groups] if groups else []
    proc = start(cmd, tmp / f"serve-{tag}.log")
    h.wait_ready(port, proc, timeout=300)
    return proc, f"http://127.0.0.1:{port}"


def canon(raw: bytes) -> list:
    d = msgspec.json.decode(raw)
    assert not d.get("partial"), d.get("missing_groups")
    reps = d["replicas"]
    for r in reps:
        r.pop("freshness", None)
    return sorted(reps, key=lambda r: (-r["resumable_tokens"], r["replica"], r["dp_rank"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CI-size run")
    p.add_argument("--replicas", type=int, default=64)
    p.add_argument("--capacity", type=int, default=8192, help="blocks per replica's cache")
    p.add_argument("--events", type=int, default=1_500_000, help="block events after the warm-up")
    p.add_argument("--placement", choices=("even", "hashed"), default="even",
                   help="replicas' groups: even (an explicit replica_placement, replica i in group i %% 4) "
                        "or hashed (a stable hash of the name: uneven for few replicas)")
    p.add_argument("--routing", choices=("random", "affine"), default="affine",
                   help="how the stream's requests were routed: affine (by their first block, as a "
                        "prefix-aware router keeps a conversation on a replica) or random (every prefix "
                        "spread over every replica: the worst case for splitting by replica)")
    p.add_argument("--prompts", type=int, default=1000)
    p.add_argument("--rate", type=float, default=1000.0, help="lookups/s of the latency runs")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--procs", type=int, default=1, help="load-generator processes")
    p.add_argument("--threads", type=int, default=8, help="connections per load generator")
    p.add_argument("--json", help="write the figures to this JSON file")
    p.add_argument("--scale", default="", help="(accepted for run_all.py; no series here)")
    args = p.parse_args(argv)
    if args.quick:
        args.replicas, args.capacity, args.events, args.prompts, args.seconds = 16, 1024, 50_000, 100, 3.0
    figs = c.Figures("groups")
    ctx = mp.get_context("spawn")
    tmp = Path(tempfile.mkdtemp(prefix="kvidx-bench-groups-"))
    if args.placement == "even":
        PLACEMENT.update({f"replica-{r:03d}": r % G for r in range(args.replicas)})
    config = tmp / "kvidx.toml"
    placement = ", ".join(f'"{k}" = {v}' for k, v in PLACEMENT.items())
    config.write_text(f'[models."{c.MODEL}"]\nreplica_groups = {G}\nreplica_placement = {{{placement}}}\n')
    bootstrap, kafka = c.start_broker(tmp / "kafka")
    run = f"groups{os.getpid()}t{int(time.time())}"
    procs: list[subprocess.Popen] = []
    try:
        c.log(f"building the stream: {args.replicas} replicas x {args.capacity} blocks, "
              f"{args.events:,} block events after the warm-up, G = {G} ...")
        msgs, blocks = messages(args.replicas, args.capacity, args.events, args.routing == "affine")
        c.log(f"  {len(msgs):,} batches, {blocks:,} block events")
        rates, cpus = {}, {}
        for w in (1, 2):
            c.log(f"ingest: {w} worker(s) ...")
            rate, cpus[w], ws = ingest(bootstrap, f"{run}.w{w}.", w, msgs, blocks, tmp, ctx)
            rates[w] = rate
            shown = ", ".join(f"{x:.1f}" for x in cpus[w])
            c.log(f"  {rate:,.0f} block events/s; worker CPU seconds {shown}")
            if w == 2:
                procs += ws  # their snapshots feed the service instances below
            else:
                stop(ws)
        figs.add("ingest through 1 worker (G = 4), block events/s", rates[1], "blocks/s", ">= 250000",
                 f"{blocks:,} block events; the broker and the producer share the 2 cores")
        figs.add("ingest through 2 workers (G = 4), block events/s", rates[2], "blocks/s", "",
                 f"x{rates[2] / rates[1]:.2f} of 1 worker" if rates[1] else "")
        for w in (1, 2):  # what the workers could fold with a core each: the busiest one's CPU bounds it
            shown = ", ".join(f"{x:.1f}" for x in cpus[w])
            figs.add(f"ingest capacity with a core per worker, {w} worker(s), block events/s",
                     blocks / max(cpus[w]), "blocks/s", "",
                     f"block events / the busiest worker's CPU seconds ({shown})")

        prefix = f"{run}.w2."
        c.log("service instances: empty, full, groups 0,1 and 2,3 ...")
        empty, _ = serve(bootstrap, f"{run}.empty.", config, None, tmp, "empty")
        procs.append(empty)
        full, full_url = serve(bootstrap, prefix, config, None, tmp, "full")
        procs.append(full)
        # the partial instances must not ask the full one: it would answer for every group
        a, a_url = serve(bootstrap, prefix, config, "0,1", tmp, "a")
        b, b_url = serve(bootstrap, prefix, config, "2,3", tmp, "b")
        procs += [a, b]
        base = rss(empty.pid)
        sizes = {"full": rss(full.pid), "a": rss(a.pid), "b": rss(b.pid)}
        urls = (("full", full_url), ("a", a_url), ("b", b_url))
        blocks_held = {k: metric(int(u.rsplit(":", 1)[1]), "kvidx_index_blocks") for k, u in urls}
        index_bytes = {k: metric(int(u.rsplit(":", 1)[1]), "kvidx_index_bytes") for k, u in urls}
        c.log(f"  distinct blocks indexed: full {blocks_held['full']:,.0f}, groups 0,1 "
              f"{blocks_held['a']:,.0f}, groups 2,3 {blocks_held['b']:,.0f}; index bytes "
              + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in index_bytes.items()))
        c.log(f"  RSS: empty {base / 2**20:.0f} MiB, full {sizes['full'] / 2**20:.0f} MiB, groups 0,1 "
              f"{sizes['a'] / 2**20:.0f} MiB, groups 2,3 {sizes['b'] / 2**20:.0f} MiB")
        figs.add("service RSS, every group", sizes["full"] / 2**20, "MiB", "",
                 f"an empty instance: {base / 2**20:.0f}")
        figs.add("index memory (mask maps), every group", index_bytes["full"] / 2**20, "MiB", "",
                 f"{blocks_held['full']:,.0f} distinct blocks")
        for k, label in (("a", "0,1"), ("b", "2,3")):
            figs.add(f"index memory (mask maps), groups {label}", index_bytes[k] / 2**20, "MiB", "",
                     f"x{index_bytes[k] / max(1, index_bytes['full']):.2f} of the full one's; "
                     f"{blocks_held[k]:,.0f} distinct blocks")
            figs.add(f"service RSS, groups {label}", sizes[k] / 2**20, "MiB", "",
                     f"index part x{(sizes[k] - base) / max(1, sizes['full'] - base):.2f} of the full one's; "
                     f"distinct blocks x{blocks_held[k] / max(1, blocks_held['full']):.2f}; "
                     f"{args.routing} routing")

        c.log(f"identity: {args.prompts} lookups, partial (fan-out) vs full ...")
        trace = c.load_trace(args.prompts)
        bodies = [msgspec.json.encode({"model": c.MODEL, "block_hashes": hs,
                                       "prompt_tokens": len(hs) * 16 + 1})
                  for n_in, ids in trace if (hs := c.request_blocks(n_in, ids, 16, 0))]
        with httpx.Client(timeout=10, headers={"content-type": "application/json"}) as cl:
            # the partial instances find each other on the instances topic within a few seconds
            deadline = time.monotonic() + 60
            while "partial" in cl.post(f"{a_url}/v1/lookup", content=bodies[0]).text:
                if time.monotonic() > deadline:
                    raise RuntimeError("the partial instances did not find each other")
                time.sleep(0.5)
            same = hits = 0
            for body in bodies:
                x, y = canon(cl.post(f"{a_url}/v1/lookup", content=body).content), canon(
                    cl.post(f"{full_url}/v1/lookup", content=body).content)
                same += x == y
                hits += any(r["resumable_tokens"] for r in y)
        c.log(f"  {same} of {len(bodies)} identical ({hits} with a hit)")
        figs.add("fan-out answers identical to the full instance", same, "lookups", f">= {len(bodies)}",
                 f"of {len(bodies)} trace prompts, {hits} with a hit somewhere")

        port_of = {u: int(u.rsplit(":", 1)[1]) for u in (full_url, a_url)}
        tags = (("full instance", full_url), ("fan-out (groups 0,1 + 2,3 asked)", a_url))
        with httpx.Client(timeout=10, headers={"content-type": "application/json"}) as cl:
            for tag, url in tags:  # one at a time: what a lookup costs without queueing
                lat = []
                for body in bodies[:300]:
                    t = time.perf_counter()
                    cl.post(f"{url}/v1/lookup", content=body)
                    lat.append((time.perf_counter() - t) * 1e3)
                p50, p99 = c.pct(lat, 50, 99)
                figs.add(f"lookup unloaded p50, {tag}", p50, "ms", "", f"p99 {p99:.2f} ms, one at a time")
        for rate in sorted({args.rate / 4, args.rate / 2, args.rate}):
            for tag, url in tags:
                r = h.open_loop(ctx, port_of[url], bodies, rate, args.seconds, args, path="/v1/lookup")
                figs.add(f"lookup p50 @{rate:,.0f}/s, {tag}", r["p50"], "ms")
                target = "<= 2" if rate == args.rate else ""
                figs.add(f"lookup p99 @{rate:,.0f}/s, {tag}", r["p99"], "ms", target,
                         f"{r['ok']:,} ok, {r['errors']} errors, achieved {r['achieved']:,.0f}/s")
    finally:
        stop(procs)
        c.stop_broker(kafka)
        shutil.rmtree(tmp, ignore_errors=True)
    figs.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
