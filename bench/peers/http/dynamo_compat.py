"""Dynamo's indexer API, proven against the real one: replays a recording of a real vLLM engine as live
ZMQ traffic into Dynamo's standalone indexer (this folder's dynserver: dynamo-kv-router 1.6.1's own
service code, unmodified), registered through its POST /register like any worker, then asks POST
/query for every request's prompt and writes the answers as a fixture. tests/unit/index_service/
test_dynamo_fixture.py replays the same frames into kvidx (registered the same way) and requires
identical answers, to POST /query and to POST /query_by_hash with the prompts' Dynamo block hashes,
so CI checks compatibility without building Rust. Each request's prompt is asked
once every frame the engine had published by the request's send time was sent (the engine's state
as a router saw it), so the answers cover the cache as it grew and was evicted.

    cargo build --release --manifest-path bench/peers/http/dynserver/Cargo.toml   # once (~10 min)
    .venv/bin/python bench/peers/http/dynamo_compat.py \\
        --dynserver bench/peers/http/dynserver/target/release/dynserver \\
        --recording tests/fixtures/vllm-0.32/llama_c4 --block-size 32 \\
        --out tests/fixtures/dynamo-1.6.1/llama_c4_query.json
    .venv/bin/python bench/peers/http/dynamo_compat.py --dump \\
        --dynserver bench/peers/http/dynserver/target/release/dynserver \\
        --recording tests/fixtures/vllm-0.32/llama_c4 --block-size 32 \\
        --out tests/fixtures/dynamo-1.6.1/llama_c4_dump.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import zmq

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from index_service.dynamo_api import dump_blocks  # noqa: E402
from kvidx.core.hashing import dynamo_local_hashes, pack_tokens  # noqa: E402
from kvidx.engines.recording import read_frames, request_steps  # noqa: E402

MODEL = "llama"
INSTANCE = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> tuple[int, dict | str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def connect_publisher(base_url: str, block_size: int, ctx: zmq.Context) -> zmq.Socket:
    """An XPUB socket registered at `base_url` as a worker (POST /register), once the indexer's
    listener subscribed: frames sent on it from then on all reach the indexer."""
    pub = ctx.socket(zmq.XPUB)
    pub.linger = 2000
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    status, body = post(f"{base_url}/register", {"instance_id": INSTANCE, "endpoint": f"tcp://127.0.0.1:{port}",
                                                  "model_name": MODEL, "block_size": block_size})
    if status != 201:
        raise SystemExit(f"register failed: {status} {body}")
    if not pub.poll(15_000):
        raise SystemExit("the indexer never subscribed to the publisher")
    pub.recv()  # the subscription message
    return pub


CONDUCTOR_PROFILE = {"strategy": "vllm_v1", "algorithm": "sha256_cbor", "python_hash_seed": "0",
                     "index_projection": "low64_be"}


def connect_conductor_publisher(base_url: str, block_size: int, ctx: zmq.Context) -> zmq.Socket:
    """As connect_publisher, registered through Mooncake conductor's msgpack POST /register instead."""
    import msgspec
    pub = ctx.socket(zmq.XPUB)
    pub.linger = 2000
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    body = {"endpoint": f"tcp://127.0.0.1:{port}", "type": "vLLM", "modelname": MODEL,
            "instance_id": "engine-a", "block_size": block_size, "dp_rank": 0,
            "hash_profile": CONDUCTOR_PROFILE}
    req = urllib.request.Request(f"{base_url}/register", data=msgspec.msgpack.encode(body),
                                 headers={"Content-Type": "application/msgpack"})
    with urllib.request.urlopen(req, timeout=10) as r:
        if r.status != 200:
            raise SystemExit(f"conductor register failed: {r.status}")
    if not pub.poll(15_000):
        raise SystemExit("the conductor's relay never subscribed to the publisher")
    pub.recv()
    return pub


def conductor_bodies(prompts: list[list[int]], block_size: int) -> list[bytes]:
    """Mooncake conductor's POST /query bodies (msgpack; token ids as a bin of int32 LE, as it sends them)."""
    import msgspec
    import numpy as np
    return [msgspec.msgpack.encode({"model": MODEL, "block_size": block_size,
                                    "token_ids": np.asarray(p, dtype="<i4").tobytes()}) for p in prompts]


def steps(recording: Path):
    frames = read_frames(recording / "frames.jsonl")
    requests = [json.loads(line) for line in (recording / "requests.jsonl").read_text().splitlines() if line]
    return request_steps(frames, requests)


def query(base_url: str, prompt: list[int]):
    return post(f"{base_url}/query", {"token_ids": prompt, "model_name": MODEL})[1]


def query_by_hash(base_url: str, prompt: list[int], block_size: int):
    """POST /query_by_hash with the prompt's Dynamo per-block hashes, as a Dynamo router sends them (i64)."""
    hashes = [h - (1 << 64) if h >= 1 << 63 else h
              for h in dynamo_local_hashes(pack_tokens(prompt), block_size)]
    return post(f"{base_url}/query_by_hash", {"block_hashes": hashes, "model_name": MODEL})[1]


def conductor_query(base_url: str, prompt: list[int], block_size: int) -> bytes:
    """Mooncake conductor's POST /query answer (msgpack, raw)."""
    req = urllib.request.Request(f"{base_url}/query", data=conductor_bodies([prompt], block_size)[0],
                                 headers={"Content-Type": "application/msgpack"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read()


def settled(base_url: str, prompt: list[int], timeout_s: float = 10.0, ask=None):
    """The answer once it is the same three times 50 ms apart (the indexer applies events
    asynchronously, with no sequence number to wait for); `ask(base_url, prompt)`: Dynamo's /query."""
    ask = ask or query
    deadline = time.monotonic() + timeout_s
    seen = [ask(base_url, prompt)]
    while time.monotonic() < deadline:
        time.sleep(0.05)
        seen.append(ask(base_url, prompt))
        if len(seen) >= 3 and seen[-1] == seen[-2] == seen[-3]:
            return seen[-1]
    raise SystemExit("answers did not settle")


KVIDX_SERVER = """
import sys
from index_service.app import create_app
from index_service.http_protocol import serve
from index_service.dynamo_api import DynamoRegistry
from index_service.store import ShardStore
from relays.managed import vllm_relay_starter
from relays.sinks import StoreSink
from index_service.conductor_api import ConductorRegistry
store = ShardStore(16)
store.ready = True
starter = vllm_relay_starter(StoreSink(store), lambda m: 16)
dynamo, conductor = DynamoRegistry(starter), ConductorRegistry(starter)
app = create_app(store, dynamo=dynamo, conductor=conductor, lmcache_lookup="llama")
if len(sys.argv) > 2:  # --lookup-port: the queries from the compiled threads too
    from index_service.conductor_api import ConductorPaths
    from index_service.lookup_front import LookupFront
    front = LookupFront("127.0.0.1", int(sys.argv[2]), store, dynamo,
                        conductor=ConductorPaths(None, store, conductor))
serve(app, "127.0.0.1", int(sys.argv[1]), log_level="warning", access_log=False)  # as `kvidx serve` does
"""


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bodies_of(route: str, prompts: list[list[int]], block_size: int) -> list[bytes]:
    """The routers' request bodies of `route` (/query: token ids; /query_by_hash: Dynamo's block hashes)."""
    if route == "/query":
        return [json.dumps({"token_ids": p, "model_name": MODEL}).encode() for p in prompts]
    return [json.dumps({"block_hashes": [h - (1 << 64) if h >= 1 << 63 else h
                                         for h in dynamo_local_hashes(pack_tokens(p), block_size)],
                        "model_name": MODEL}).encode() for p in prompts]


def load(base_url: str, bodies: list[bytes], pid: int, seconds: float, connections: int,
         route: str = "/query", content_type: str = "application/json") -> dict:
    """Closed loop: `connections` threads, each sending the bodies to `route` in turn for `seconds`;
    lookups/s and the server's CPU per lookup."""
    import http.client
    import threading

    host, port = base_url.removeprefix("http://").split(":")
    done = [0] * connections
    stop = time.monotonic() + seconds

    def run(k: int) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        i = k
        while time.monotonic() < stop:
            conn.request("POST", route, body=bodies[i % len(bodies)], headers={"Content-Type": content_type})
            r = conn.getresponse()
            r.read()
            assert r.status == 200
            done[k] += 1
            i += connections
        conn.close()

    c0, t0 = cpu_s(pid), time.monotonic()
    threads = [threading.Thread(target=run, args=(k,)) for k in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    n, wall, cpu = sum(done), time.monotonic() - t0, cpu_s(pid) - c0
    return {"lookups": n, "lookups_per_s": round(n / wall),
            "server_cpu_us_per_lookup": round(cpu / n * 1e6, 1)}


def bench(args) -> int:
    """Both servers fed the same traffic, then the same closed-loop load on /query, one after the other."""
    ctx = zmq.Context()
    front_port, conductor_front_port = free_port(), free_port()
    servers = {"dynamo": [args.dynserver, "--port", "{port}", "--threads", str(args.threads)],
               "kvidx": [sys.executable, "-c", KVIDX_SERVER, "{port}", str(front_port)],
               # the same traffic registered through Mooncake conductor's API, for its msgpack /query
               "kvidx_conductor": [sys.executable, "-c", KVIDX_SERVER, "{port}", str(conductor_front_port)]}
    procs = []
    try:
        bases = {}
        for name, cmd in servers.items():
            port = free_port()
            p = subprocess.Popen([c.format(port=port) for c in cmd], stderr=subprocess.DEVNULL,
                                 env={**os.environ, "RUST_LOG": "warn", "PYTHONPATH": str(ROOT)})
            procs.append(p)
            bases[name] = (f"http://127.0.0.1:{port}", p.pid)
            wait_up(bases[name][0])
        # the same process's --lookup-port (its CPU is the process's: loads run one at a time)
        front = ("kvidx_front", (f"http://127.0.0.1:{front_port}", bases["kvidx"][1]))
        pubs = {name: (connect_conductor_publisher if name == "kvidx_conductor" else connect_publisher)(
            base, args.block_size, ctx) for name, (base, _) in bases.items()}
        prompts = []
        for frames, r in steps(args.recording):
            for f in frames:
                for pub in pubs.values():
                    pub.send_multipart([f.topic, f.seq.to_bytes(8, "big"), f.payload])
            prompts.append(r["prompt_token_ids"])
        for name, (base, _) in bases.items():
            if name != "kvidx_conductor":
                settled(base, prompts[-1])
        conductor = bases.pop("kvidx_conductor")
        conductor_front = (f"http://127.0.0.1:{conductor_front_port}", conductor[1])
        bases[front[0]] = front[1]
        settled(conductor[0], prompts[-1], ask=lambda base, p: conductor_query(base, p, args.block_size))
        bs = args.block_size
        conductor_mismatches = sum(conductor_query(conductor[0], p, bs)
                                   != conductor_query(conductor_front[0], p, bs) for p in prompts)
        print(f"conductor /query: --lookup-port answers that differ from --port's: {conductor_mismatches}",
              file=sys.stderr)
        ask = {"/query": lambda base, p: query(base, p),
               "/query_by_hash": lambda base, p: query_by_hash(base, p, args.block_size)}
        mismatches = {route: sum(f(bases["dynamo"][0], p) != f(bases["kvidx"][0], p) for p in prompts)
                      for route, f in ask.items()}
        front_mismatches = {route: sum(f(bases["dynamo"][0], p) != f(bases["kvidx_front"][0], p)
                                       for p in prompts) for route, f in ask.items()}
        print(f"--lookup-port answers that differ: {front_mismatches}", file=sys.stderr)
        print(f"answers that differ on the final state, of {len(prompts)}: {mismatches}", file=sys.stderr)
        results: dict = {}
        for rnd in range(args.rounds):
            for route in ask:
                bodies = bodies_of(route, prompts, args.block_size)
                for conns in (1, 4):
                    for name, (base, pid) in bases.items():
                        res = load(base, bodies, pid, args.seconds, conns, route)
                        results.setdefault(route, {}).setdefault(f"{name} x{conns}", []).append(res)
                        print(f"round {rnd + 1} {route} {name} {conns} connection(s): {res}", file=sys.stderr)

            bodies = conductor_bodies(prompts, args.block_size)
            for name, (base, pid) in (("kvidx", conductor), ("kvidx_front", conductor_front)):
                res = load(base, bodies, pid, args.seconds, 4, "/query", "application/msgpack")
                results.setdefault("conductor /query", {}).setdefault(f"{name} x4", []).append(res)
                print(f"round {rnd + 1} conductor /query (msgpack) {name} 4 connection(s): {res}",
                      file=sys.stderr)
            # LMCache's controller lookup (--lmcache-lookup: kvidx's whole lookup, in LMCache's terms)
            bodies = [json.dumps({"tokens": p}).encode() for p in prompts]
            res = load(bases["kvidx"][0], bodies, bases["kvidx"][1], args.seconds, 4, "/lookup")
            results.setdefault("lmcache /lookup", {}).setdefault("kvidx x4", []).append(res)
            print(f"round {rnd + 1} lmcache /lookup kvidx 4 connection(s): {res}", file=sys.stderr)

        def median_cpu(route: str, name: str) -> float:
            runs = sorted(r["server_cpu_us_per_lookup"] for r in results[route][f"{name} x4"])
            return runs[len(runs) // 2]

        # kvidx_cpu_us: `kvidx serve --lookup-port`, the compiled threads (what a Dynamo router is pointed
        # at); kvidx_port_cpu_us: the same queries on --port (the Python service)
        routes = {route: {"kvidx_cpu_us": median_cpu(route, "kvidx_front"),
                          "peer_cpu_us": median_cpu(route, "dynamo"),
                          "mismatches": mismatches[route] + front_mismatches[route],
                          "kvidx_port_cpu_us": median_cpu(route, "kvidx")}
                  for route in ask}
        # no conductor to run here (Mooncake's is C++ in a branch): its /query beside Dynamo's /query
        other = {api: {"kvidx_cpu_us": median_cpu(api, "kvidx"),
                       "dynamo_query_cpu_us": median_cpu("/query", "dynamo")}
                 for api in ("conductor /query", "lmcache /lookup")}
        other["conductor /query"]["kvidx_lookup_port_cpu_us"] = median_cpu("conductor /query", "kvidx_front")
        other["conductor /query"]["lookup_port_mismatches"] = conductor_mismatches
        print(json.dumps({"queries": len(prompts), "rounds": args.rounds, "connections": 4, "routes": routes,
                          "other_apis": other, "results": results}))
        return 0
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        ctx.destroy(linger=0)


def get(url: str):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def dump_check(args) -> int:
    """Dynamo's indexer and kvidx fed the same traffic; both GET /dump compared block by block (Dynamo's
    written as a fixture with --out); then a second Dynamo indexer started with --peers <kvidx> (its own
    P2P recovery from kvidx's /dump) must answer /query like the one fed live, on every prompt."""
    ctx = zmq.Context()
    procs = []

    def start(cmd: list[str]) -> str:
        port = free_port()
        p = subprocess.Popen([c.format(port=port) for c in cmd], stderr=subprocess.DEVNULL,
                             env={**os.environ, "RUST_LOG": "warn", "PYTHONPATH": str(ROOT)})
        procs.append(p)
        base = f"http://127.0.0.1:{port}"
        wait_up(base)
        return base

    try:
        dyn = start([args.dynserver, "--port", "{port}", "--threads", str(args.threads)])
        kv = start([sys.executable, "-c", KVIDX_SERVER, "{port}"])
        pubs = [connect_publisher(b, args.block_size, ctx) for b in (dyn, kv)]
        prompts = []
        for frames, r in steps(args.recording):
            for f in frames:
                for pub in pubs:
                    pub.send_multipart([f.topic, f.seq.to_bytes(8, "big"), f.payload])
            prompts.append(r["prompt_token_ids"])
        for b in (dyn, kv):
            settled(b, prompts[-1])
        want, got = dump_blocks(get(f"{dyn}/dump")), dump_blocks(get(f"{kv}/dump"))
        key = f"{MODEL}:default"
        same_dump = want == got
        print(f"dump: Dynamo {len(want.get(key, []))} blocks, kvidx {len(got.get(key, []))}, identical: "
              f"{same_dump}", file=sys.stderr)
        recovered = start([args.dynserver, "--port", "{port}", "--threads", str(args.threads), "--peers", kv])
        live = [query(dyn, p) for p in prompts]
        same = sum(a == query(recovered, p) for a, p in zip(live, prompts, strict=True))
        matched = sum(bool(a["scores"]) for a in live)
        print(f"Dynamo recovered from kvidx's /dump answers /query like the one fed live: {same} of "
              f"{len(prompts)} ({matched} with a GPU match)", file=sys.stderr)
        if args.out is not None:
            args.out.write_text(json.dumps({
                "peer": "dynamo-kv-router 1.6.1 standalone indexer (bench/peers/http/dynserver)",
                "recording": str(args.recording), "model_name": MODEL, "instance_id": INSTANCE,
                "block_size": args.block_size, "dump_blocks": want}) + "\n")
        print(json.dumps({"dump_identical": same_dump, "dump_blocks": len(want.get(key, [])),
                          "recovered_identical": same, "with_match": matched, "queries": len(prompts)}))
        return 0 if same_dump and same == len(prompts) else 1
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        ctx.destroy(linger=0)


def wait_up(base: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{base}/health", timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"{base} did not start") from None
            time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--dynserver", required=True, help="the dynserver binary (this folder's crate, built)")
    ap.add_argument("--recording", required=True, type=Path,
                    help="a folder with frames.jsonl and requests.jsonl")
    ap.add_argument("--block-size", type=int, required=True, help="the engine's block size (registered)")
    ap.add_argument("--threads", type=int, default=4,
                    help="dynserver --threads (default: 4, its production one)")
    ap.add_argument("--out", type=Path, help="the fixture to write")
    ap.add_argument("--bench", "--json", action="store_true",
                    help="instead: feed Dynamo's indexer and kvidx the same traffic and compare /query and "
                         "/query_by_hash lookups/s and server CPU per lookup (closed loop, 1 and 4 "
                         "connections); the last line is JSON: {\"routes\": {ROUTE: {\"kvidx_cpu_us\", "
                         "\"peer_cpu_us\", \"mismatches\"}}} (medians over rounds, 4 connections)")
    ap.add_argument("--dump", action="store_true",
                    help="instead: compare Dynamo's and kvidx's GET /dump on the same traffic (writes "
                         "Dynamo's, block by block, to --out), and check that a Dynamo indexer started "
                         "with --peers <kvidx> answers /query like the one fed live")
    ap.add_argument("--seconds", type=float, default=5.0, help="--bench: seconds per load run (default: 5)")
    ap.add_argument("--rounds", type=int, default=3, help="--bench: interleaved rounds (default: 3)")
    args = ap.parse_args()
    if args.bench:
        return bench(args)
    if args.dump:
        return dump_check(args)
    if args.out is None:
        ap.error("--out is needed (or --bench)")
    port = free_port()
    proc = subprocess.Popen([args.dynserver, "--port", str(port), "--threads", str(args.threads)],
                            stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
    base = f"http://127.0.0.1:{port}"
    ctx = zmq.Context()
    try:
        wait_up(base)
        pub = connect_publisher(base, args.block_size, ctx)
        queries = []
        for frames, r in steps(args.recording):
            for f in frames:
                pub.send_multipart([f.topic, f.seq.to_bytes(8, "big"), f.payload])
            prompt = r["prompt_token_ids"]
            answer = settled(base, prompt) if frames else query(base, prompt)
            queries.append({"i": r.get("i"), "answer": answer,
                            "answer_by_hash": query_by_hash(base, prompt, args.block_size)})
        manifest = str(Path(__file__).parent / "dynserver" / "Cargo.toml")
        version = subprocess.run(["cargo", "pkgid", "--manifest-path", manifest, "dynamo-kv-router"],
                                 capture_output=True, text=True).stdout.strip()
        fixture = {"peer": "dynamo-kv-router 1.6.1 standalone indexer (bench/peers/http/dynserver)",
                   "peer_pkgid": version, "threads": args.threads,
                   "recording": str(args.recording.relative_to(ROOT)) if args.recording.is_absolute() else
                   str(args.recording),
                   "model_name": MODEL, "instance_id": INSTANCE, "block_size": args.block_size,
                   "queries": queries}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(fixture) + "\n")
        hits = sum(bool(q["answer"]["scores"]) for q in queries)
        print(f"wrote {args.out}: {len(queries)} answers, {hits} with a GPU match", file=sys.stderr)
        return 0
    finally:
        proc.terminate()
        proc.wait(10)
        ctx.destroy(linger=0)


if __name__ == "__main__":
    sys.exit(main())
