"""Dynamo's indexer API, proven against the real one: replays a recording of a real vLLM engine as live
ZMQ traffic into Dynamo's standalone indexer (this folder's dynserver: dynamo-kv-router 1.6.1's own
service code, unmodified), registered through its POST /register like any worker, then asks POST
/query for every request's prompt and writes the answers as a fixture. tests/unit/index_service/
test_dynamo_fixture.py replays the same frames into kvidx (registered the same way) and requires
identical answers, so CI checks compatibility without building Rust. Each request's prompt is asked
once every frame the engine had published by the request's send time was sent (the engine's state
as a router saw it), so the answers cover the cache as it grew and was evicted.

    cargo build --release --manifest-path bench/peers/http/dynserver/Cargo.toml   # once (~10 min)
    .venv/bin/python bench/peers/http/dynamo_compat.py \\
        --dynserver bench/peers/http/dynserver/target/release/dynserver \\
        --recording tests/fixtures/vllm-0.32/llama_c4 --block-size 32 \\
        --out tests/fixtures/dynamo-1.6.1/llama_c4_query.json
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


def steps(recording: Path):
    frames = read_frames(recording / "frames.jsonl")
    requests = [json.loads(line) for line in (recording / "requests.jsonl").read_text().splitlines() if line]
    return request_steps(frames, requests)


def query(base_url: str, prompt: list[int]):
    return post(f"{base_url}/query", {"token_ids": prompt, "model_name": MODEL})[1]


def settled(base_url: str, prompt: list[int], timeout_s: float = 10.0):
    """The answer once it is the same three times 50 ms apart (the indexer applies events
    asynchronously, with no sequence number to wait for)."""
    deadline = time.monotonic() + timeout_s
    seen = [query(base_url, prompt)]
    while time.monotonic() < deadline:
        time.sleep(0.05)
        seen.append(query(base_url, prompt))
        if len(seen) >= 3 and seen[-1] == seen[-2] == seen[-3]:
            return seen[-1]
    raise SystemExit("answers did not settle")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--dynserver", required=True, help="the dynserver binary (this folder's crate, built)")
    ap.add_argument("--recording", required=True, type=Path,
                    help="a folder with frames.jsonl and requests.jsonl")
    ap.add_argument("--block-size", type=int, required=True, help="the engine's block size (registered)")
    ap.add_argument("--threads", type=int, default=4,
                    help="dynserver --threads (default: 4, its production one)")
    ap.add_argument("--out", required=True, type=Path, help="the fixture to write")
    args = ap.parse_args()
    port = free_port()
    proc = subprocess.Popen([args.dynserver, "--port", str(port), "--threads", str(args.threads)],
                            stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
    base = f"http://127.0.0.1:{port}"
    ctx = zmq.Context()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{base}/health", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("dynserver did not start") from None
                time.sleep(0.1)
        pub = connect_publisher(base, args.block_size, ctx)
        queries = []
        for frames, r in steps(args.recording):
            for f in frames:
                pub.send_multipart([f.topic, f.seq.to_bytes(8, "big"), f.payload])
            queries.append({"i": r.get("i"), "answer": settled(base, r["prompt_token_ids"]) if frames
                            else query(base, r["prompt_token_ids"])})
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
