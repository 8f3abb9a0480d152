"""Lookups per host as cores grow: one `kvidx serve` deployment unit (one process, one copy of the
index) answering Dynamo's POST /query closed-loop on 1 core, then on 2 (more with --cores), pinned
with sched_setaffinity, the same state and queries each time. Two fronts of the same process: its
--lookup-port (index_service/lookup_front.py: compiled threads reading the maps without the GIL) and
its --port (the Python service, one core by the GIL), for contrast.

The state: the head of the public Mooncake conversation trace as real token ids (each 512-token trace
block is 512 pseudo-random tokens seeded by its hash id, so equal ids are equal prefixes), the first
--requests routed over --replicas replicas by their first blocks and stored on the GPU (every third
also in host memory on the next replica); the queries are the next requests' prompts, capped at
--max-tokens, as Dynamo routers send them (token ids). The load is bench/loadgen (Rust, std only,
~2 us of CPU a request: built here with cargo), so the client, not Python, is cheap; on a host with
no core to spare (2 cores, measuring 2) it runs on the server's cores and takes some of their time:
the figure is then a floor. With --dynserver, Dynamo's standalone indexer (dynamo-kv-router 1.6.1, its
4 threads) is measured the same way beside kvidx, both fed by simulated vLLM engines' real KV-event frames
(their answers compared first). Prints a table and ends with one JSON line:
{"cores": {"1": LOOKUPS_PER_S, "2": ...}, "rss_mb": {"1": X, "2": Y}, "port": {...}, "dynamo": {...}, ...}.

    .venv/bin/python bench/bench_cores.py --json
    .venv/bin/python bench/bench_cores.py --json \\
        --dynserver bench/peers/http/dynserver/target/release/dynserver
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import _common
import numpy as np
from _common import load_trace, log

ROOT = _common.ROOT
sys.path.insert(0, str(ROOT / "bench" / "peers" / "http"))
from dynamo_compat import free_port, post  # noqa: E402  (the peers' harness: the same requests)

LOADGEN = ROOT / "bench" / "loadgen"
MODEL = "bench-model"
BLOCK = 16


def trace_prompts(n: int, max_tokens: int) -> Iterator[np.ndarray]:
    """The trace's first `n` requests as token ids (module docstring), one at a time."""
    for length, ids in load_trace(n):
        blocks = [np.random.default_rng(h).integers(0, 32_000, 512, dtype=np.uint32) for h in ids]
        yield np.concatenate(blocks)[: min(length, max_tokens)] if blocks else np.zeros(0, np.uint32)


def replica(i: int) -> str:
    return f"tcp://10.0.{i // 200}.1:{5000 + i % 200}"


def serve(args) -> int:
    """--serve: the deployment unit (a store, Dynamo's registry, the lookup front and the Python
    service), the state folded in, then serving until killed."""
    from index_service.dynamo_api import DynamoRegistry, RegisterRequest
    from index_service.store import ShardStore
    from kvidx.core.hashing import prompt_hashes
    from schemas.events import SCHEMA_VERSION, BlocksStored, EventBatch

    store = ShardStore(BLOCK)
    store.ready = True
    if args.engines:  # the engines are the bench's (--dynserver): their relays start on /register
        from relays.managed import vllm_relay_starter
        from relays.sinks import StoreSink

        dynamo = DynamoRegistry(vllm_relay_starter(StoreSink(store), lambda model: BLOCK))
        return _serve(args, store, dynamo)
    dynamo = DynamoRegistry(None)
    for i in range(args.replicas):
        status, body = dynamo.register(RegisterRequest(instance_id=i + 1, endpoint=replica(i),
                                                       model_name=MODEL, block_size=BLOCK))
        assert status == 201, body
    seq = [0] * args.replicas
    stored = islice(trace_prompts(args.requests, args.max_tokens), args.requests - args.queries)
    for k, p in enumerate(stored):
        r = zlib.crc32(p[:4 * 512].tobytes()) % args.replicas  # by the first 4 trace blocks
        hashes = prompt_hashes(p, BLOCK)
        for tier, rr in (("GPU", r), *((("CPU", (r + 1) % args.replicas),) if k % 3 == 0 else ())):
            seq[rr] += 1
            store.apply(EventBatch(SCHEMA_VERSION, MODEL, replica(rr), 0, 1, seq[rr], 0.0, 0.0, BLOCK,
                                   [BlocksStored(tier, 0, hashes, None, 0)]))
    return _serve(args, store, dynamo)


def _serve(args, store, dynamo) -> int:
    from index_service.app import create_app
    from index_service.http_protocol import serve as serve_http
    from index_service.lookup_front import LookupFront

    front = LookupFront("127.0.0.1", args.front_port, store, dynamo)
    print(json.dumps({"ready": True, "front": front.port}), flush=True)
    serve_http(create_app(store, dynamo=dynamo), "127.0.0.1", args.port, log_level="warning",
               access_log=False)
    return 0


def wait_up(url: str, what: str) -> None:
    import urllib.request

    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"{what} did not start") from None
            time.sleep(0.2)


def feed_engines(args, bases: list[str]) -> list:
    """--dynserver: the replicas as simulated vLLM engines (real KV-event frames over ZMQ, with replay),
    each registered at every server in `bases` through Dynamo's POST /register, then serving the stored
    trace requests; the engines (to close at the end)."""
    from kvidx.engines.vllm.sim import SimVllmEngine

    engines = [SimVllmEngine(num_blocks=args.engine_blocks, block_size=BLOCK, endpoint="tcp://127.0.0.1:*",
                             replay_endpoint="tcp://127.0.0.1:*") for _ in range(args.replicas)]
    for i, e in enumerate(engines):
        for base in bases:
            reg = {"instance_id": i + 1, "endpoint": e.endpoint, "replay_endpoint": e.replay_endpoint,
                   "model_name": MODEL, "block_size": BLOCK}
            status, body = post(f"{base}/register", reg)
            while status == 429:  # kvidx's admin routes are rate-limited per client: wait as told
                time.sleep(0.06)
                status, body = post(f"{base}/register", reg)
            if status != 201:
                raise SystemExit(f"{base}/register: {status} {body}")
    time.sleep(2.0)  # the listeners subscribe (a batch they miss is replayed all the same)
    stored = islice(trace_prompts(args.requests, args.max_tokens), args.requests - args.queries)
    for p in stored:
        engines[zlib.crc32(p[:4 * 512].tobytes()) % args.replicas].serve(p.tolist())
    return engines


def query(base: str, prompt: list[int]):
    return post(f"{base}/query", {"token_ids": prompt, "model_name": MODEL})


def settle(bases: list[str], prompts: list[list[int]], timeout_s: float = 300.0) -> None:
    """Until every server answers the sample prompts alike, three times 0.5 s apart."""
    deadline, same = time.monotonic() + timeout_s, 0
    while same < 3:
        answers = [[query(b, p) for p in prompts] for b in bases]
        same = same + 1 if all(a == answers[0] for a in answers) else 0
        if time.monotonic() > deadline:
            raise SystemExit("the servers' answers did not settle alike")
        time.sleep(0.5)


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` on `cpus` (threads it makes later inherit their maker's)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # a thread that ended


def loadgen() -> Path:
    exe = LOADGEN / "target" / "release" / "kvidx-loadgen"
    log("building bench/loadgen (cargo, seconds) ...")
    subprocess.run(["cargo", "build", "--release", "-q", "--manifest-path", str(LOADGEN / "Cargo.toml")],
                   check=True)
    return exe


def run(exe: Path, port: int, bodies: Path, pid: int, cpus: set[int], client_cpus: set[int],
        connections: int, seconds: float, depth: int) -> dict:
    pin(pid, cpus)
    c0, k0 = cpu_s(pid), _children_cpu_s()
    p = subprocess.run(["taskset", "-c", ",".join(map(str, sorted(client_cpus))), str(exe),
                        f"127.0.0.1:{port}", "/query", str(bodies), str(connections), str(seconds),
                        str(depth)],
                       capture_output=True, text=True, check=True)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    cpu, client_cpu = cpu_s(pid) - c0, _children_cpu_s() - k0
    if out["errors"]:
        raise SystemExit(f"{out['errors']} requests failed on port {port}")
    return {"lookups_per_s": round(out["lookups"] / out["seconds"]),
            "server_cores": round(cpu / out["seconds"], 2),
            "server_cpu_us": round(cpu / max(1, out["lookups"]) * 1e6, 1), "rss_mb": round(rss_mb(pid), 1),
            "client_cores": round(client_cpu / out["seconds"], 2)}


def _children_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)  # the load generators that ended
    return r.ru_utime + r.ru_stime


def print_table(counts: list[int], med, cols: list[str]) -> None:
    """Lookups/s per core count and server (x its 1-core figure), and kvidx's lookup port's cost."""
    names = {"front": "--lookup-port", "port": "--port", "dynamo": "Dynamo"}
    head = [f"{'cores':>5}"]
    for n in cols:
        head += [f"{names[n] + ' lookups/s':>24}", f"{'x 1 core':>8}"]
    print("\n" + " | ".join([*head, "kvidx cores", "us CPU/lookup", "RSS MB"]))
    for k in counts:
        row = [f"{k:>5}"]
        for n in cols:
            v = med(n, k, "lookups_per_s")
            row += [f"{v:>24,.0f}", f"{v / med(n, counts[0], 'lookups_per_s'):>8.2f}"]
        row += [f"{med('front', k, 'server_cores'):>11.2f}", f"{med('front', k, 'server_cpu_us'):>13.1f}",
                 f"{med('front', k, 'rss_mb'):>6.0f}"]
        print(" | ".join(row))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cores", default=None, help="core counts to measure, e.g. 1,2,4 (default: 1 and "
                    "every doubling up to the host's, and the host's)")
    ap.add_argument("--replicas", type=int, default=64)
    ap.add_argument("--requests", type=int, default=3000, help="trace requests: stored, then queried")
    ap.add_argument("--queries", type=int, default=1000, help="of --requests, the last ones are the queries")
    ap.add_argument("--max-tokens", type=int, default=8192, help="prompt length cap (tokens)")
    ap.add_argument("--seconds", type=float, default=5.0, help="per run")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    ap.add_argument("--connections-per-core", type=int, default=8,
                    help="closed-loop connections per core measured (enough to keep the cores busy)")
    ap.add_argument("--depth", type=int, default=1, help="requests in flight per connection (1: closed loop)")
    ap.add_argument("--json", action="store_true", help="end with the JSON line (always printed)")
    ap.add_argument("--dynserver", metavar="BIN",
                    help="also measure Dynamo's standalone indexer (bench/peers/http/dynserver, built) on "
                         "the same cores: the replicas are then simulated vLLM engines publishing real "
                         "KV-event frames to both, registered through /register (GPU tier only)")
    ap.add_argument("--dynserver-threads", type=int, default=4, help="dynserver --threads (its default: 4)")
    ap.add_argument("--engine-blocks", type=int, default=20_000, help="--dynserver: each engine's blocks")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engines", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--front-port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args)
    host = sorted(os.sched_getaffinity(0))
    if args.cores:
        counts = sorted({int(c) for c in args.cores.split(",")})
    else:
        counts = sorted({1, *(2 ** k for k in range(1, 10) if 2 ** k <= len(host)), len(host)})
    if counts[-1] > len(host):
        ap.error(f"--cores {counts[-1]}: this host has {len(host)}")
    exe = loadgen()
    port = free_port()
    log(f"building the state: {args.requests - args.queries} trace requests, {args.replicas} replicas ...")
    t0 = time.monotonic()
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--port", str(port),
                               "--replicas", str(args.replicas), "--requests", str(args.requests),
                               "--queries", str(args.queries), "--max-tokens", str(args.max_tokens),
                               *(["--engines"] if args.dynserver else [])],
                              stdout=subprocess.PIPE, text=True)
    peer, engines = None, []
    try:
        front = json.loads(server.stdout.readline())["front"]
        wait_up(f"http://127.0.0.1:{port}/healthz", "the Python service")
        servers = {"front": (front, server.pid), "port": (port, server.pid)}
        mismatches = None
        if args.dynserver:
            dport = free_port()
            cmd = [args.dynserver, "--port", str(dport), "--threads", str(args.dynserver_threads)]
            peer = subprocess.Popen(cmd,
                                    stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
            wait_up(f"http://127.0.0.1:{dport}/health", "dynserver")
            servers["dynamo"] = (dport, peer.pid)
            log(f"feeding {args.replicas} simulated vLLM engines' frames to kvidx and Dynamo ...")
            engines = feed_engines(args, [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{dport}"])
        queries = [p.tolist() for p in islice(trace_prompts(args.requests, args.max_tokens),
                                              args.requests - args.queries, None)]
        if args.dynserver:
            bases = [f"http://127.0.0.1:{front}", f"http://127.0.0.1:{dport}"]
            settle(bases, queries[:: max(1, len(queries) // 20)])
            mismatches = sum(query(bases[0], p) != query(bases[1], p) for p in queries)
            log(f"  answers that differ from Dynamo's, of {len(queries)}: {mismatches}")
        log(f"  state built in {time.monotonic() - t0:.1f} s, rss {rss_mb(server.pid):.0f} MB")
        bodies = Path(f"/tmp/kvidx-bench-cores-{os.getpid()}.jsonl")
        with open(bodies, "w") as f:
            for p in queries:
                f.write(json.dumps({"token_ids": p, "model_name": MODEL}) + "\n")
        res: dict[str, dict[int, list[dict]]] = {name: {} for name in servers}
        for rnd in range(args.rounds):
            for k in counts:
                cpus = set(host[:k])
                client = set(host[k:]) or set(host)  # no core to spare: shares the server's
                for name, (p, pid) in servers.items():
                    conns = args.connections_per_core * k
                    r = run(exe, p, bodies, pid, cpus, client, conns, args.seconds, args.depth)
                    res[name].setdefault(k, []).append(r)
                    log(f"round {rnd + 1} {name:5s} {k} core(s), {conns} connections: {r}")
        bodies.unlink()

        def med(name: str, k: int, key: str) -> float:
            xs = sorted(r[key] for r in res[name][k])
            return xs[len(xs) // 2]

        print_table(counts, med, [n for n in ("front", "port", "dynamo") if n in res])
        spare = len(host) > counts[-1]
        out = {
            "cores": {str(k): med("front", k, "lookups_per_s") for k in counts},
            "rss_mb": {str(k): med("front", k, "rss_mb") for k in counts},
            "server_cores": {str(k): med("front", k, "server_cores") for k in counts},
            "cpu_us_per_lookup": {str(k): med("front", k, "server_cpu_us") for k in counts},
            "port": {str(k): med("port", k, "lookups_per_s") for k in counts},
            "client_on_server_cores": not spare, "replicas": args.replicas, "queries": args.queries}
        if "dynamo" in res:
            out["dynamo"] = {n: {str(k): med("dynamo", k, n) for k in counts}
                             for n in ("lookups_per_s", "server_cpu_us", "rss_mb")}
            out["dynamo"]["threads"], out["dynamo"]["mismatches"] = args.dynserver_threads, mismatches
        print(json.dumps({**out, "machine": _common.machine_info()}))
        return 0
    finally:
        for e in engines:
            e.close()
        for p in (server, peer):
            if p is not None:
                p.terminate()
                p.wait(10)


if __name__ == "__main__":
    sys.exit(main())
