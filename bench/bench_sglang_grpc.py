"""SGLang's external-indexer API on kvidx over real gRPC: the router's MatchExternalKvPrefix per second
and the server's CPU per query, in a closed loop.

The server (a child process: `--serve PORT`) is kvidx's SglangIndexer over an in-process store; this
process feeds it as SGLang's bridges do (ApplyExternalKvBatch, the workers' page hash chains) and then
queries it as sgl-router does, from `--connections` threads for `--seconds`. Prompts are SGLang page
chains (kvidx.engines.sglang.hashing) of `--pages` pages; each worker holds a random prefix of each.
Nothing is asserted: it prints one JSON line (bench/RESULTS.md keeps the figures).

    .venv/bin/python bench/bench_sglang_grpc.py [--workers 8] [--prompts 200] [--pages 64]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from index_service.sglang_indexer import SERVICE, SglangIndexer, start_server  # noqa: E402
from index_service.sglang_pb import kv_indexer_pb2 as pb  # noqa: E402
from index_service.store import ShardStore  # noqa: E402
from kvidx.engines.sglang.hashing import sglang_page_hashes  # noqa: E402

PAGE = 16


def serve(port: int, empty: bool) -> None:
    store = ShardStore(PAGE)
    store.ready = True
    indexer = SglangIndexer(store, "bench", store.apply)
    if empty:  # grpcio's own cost per call: the same server, answering without looking anything up
        indexer.match_prefix = lambda req: pb.MatchExternalKvPrefixResponse()
    server, _ = start_server(indexer, f"127.0.0.1:{port}")
    print("ready", flush=True)
    server.wait_for_termination()


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rpc(channel, method: str, reply):
    return channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=reply.FromString)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--pages", type=int, default=64, help="pages of 16 tokens per prompt")
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--empty", action="store_true",
                    help="the server answers every query empty: grpcio's floor per call, for comparison")
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.empty)
        return 0
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve_args = ["--serve", str(port), *(["--empty"] if args.empty else [])]
    child = subprocess.Popen([sys.executable, __file__, *serve_args], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        rng = random.Random(1)
        prompts = [[rng.randrange(32000) for _ in range(args.pages * PAGE)] for _ in range(args.prompts)]
        chains = [[str(h) for h in sglang_page_hashes(p, PAGE)] for p in prompts]
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        apply = rpc(channel, "ApplyExternalKvBatch", pb.ApplyExternalKvBatchResponse)
        held = 0
        for w in range(args.workers):
            for seq, chain in enumerate(chains):
                n = rng.randrange(len(chain) + 1)
                held += n
                if n:
                    apply(pb.ApplyExternalKvBatchRequest(
                        worker_id=f"w{w}", seq=seq, worker_address=f"http://10.0.0.{w}:30000",
                        actions=[pb.ExternalKvAction(type=pb.ACTION_REPORT, tier=pb.TIER_HBM,
                                                     hashes=chain[:n])]))
        reqs = [pb.MatchExternalKvPrefixRequest(hashes=c) for c in chains]
        done = [0] * args.connections
        stop = time.monotonic() + args.seconds

        def run(k: int) -> None:
            ch = grpc.insecure_channel(f"127.0.0.1:{port}")
            query = rpc(ch, "MatchExternalKvPrefix", pb.MatchExternalKvPrefixResponse)
            i = k
            while time.monotonic() < stop:
                query(reqs[i % len(reqs)], timeout=10)
                done[k] += 1
                i += args.connections
            ch.close()

        c0, t0 = cpu_s(child.pid), time.monotonic()
        threads = [threading.Thread(target=run, args=(k,)) for k in range(args.connections)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        n, wall, cpu = sum(done), time.monotonic() - t0, cpu_s(child.pid) - c0
        name = "sglang_grpc_prefix" + ("_empty" if args.empty else "")
        print(json.dumps({"bench": name, "workers": args.workers, "prompts": args.prompts,
                          "pages_per_prompt": args.pages, "pages_held": held, "connections": args.connections,
                          "queries": n, "queries_per_s": round(n / wall),
                          "server_cpu_us_per_query": round(cpu / n * 1e6, 1)}))
        channel.close()
    finally:
        child.terminate()
        child.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
