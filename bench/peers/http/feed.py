"""Replays the common event file as vLLM KV-event wire traffic, one publisher per worker, into
(a) Dynamo's standalone indexer: one ZMQ XPUB socket per worker on tcp://127.0.0.1:<zmq_base+w>,
    registered with POST /register; the indexer's own ZMQ SUB listeners consume them;
(b) kvidx: the SAME payload bytes handed, as relay Frames (kvidx.engines.contract.Frame), to one
    kvidx relay per worker (relays.run.Relay(kvidx.engines.vllm.relay.VllmPublisherRelay) ->
    relays.sinks.KafkaSink: the code `kvidx relay` runs), publishing to Kafka, which `kvidx serve`
    follows. kvidx is imported from this repository's root, or from $KVIDX_ROOT.

Wire format (vLLM 0.32, vllm/distributed/kv_events.py): 3 ZMQ frames [topic b"", seq u64 BE,
payload]; payload = msgpack array [ts, [event], data_parallel_rank=0]; event = map tagged by "type":
{"type":"BlockStored","block_hashes":[..],"parent_block_hash":p|nil,"token_ids":[..],"block_size":B}
(defaults omitted: lora_id nil, medium "GPU") or {"type":"BlockRemoved","block_hashes":[..]}.
Engine block hashes = the file's canonical chained hashes (unique per prefix, like vLLM's).
Token ids: each block's hash_id repeated B times (the generator's convention); the seq->hash_id map
comes from the query records (every stored block was first queried).

After publishing it keeps the sockets open (like a live engine) until SIGTERM.
"""
import argparse
import json
import os
import signal
import sys
import time
import urllib.request

import msgspec
import zmq

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from evfile import load  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.abspath(os.environ.get("KVIDX_ROOT") or REPO))


def mp_uint(h: int) -> bytes:
    if h < 128:
        return bytes([h])
    if h < 256:
        return b"\xcc" + bytes([h])
    if h < 65536:
        return b"\xcd" + h.to_bytes(2, "big")
    return b"\xce" + h.to_bytes(4, "big")


def mp_array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    if n < 65536:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", required=True)
    ap.add_argument("--model", default="bench-model")
    ap.add_argument("--dyn-url", help="Dynamo indexer base URL (http://127.0.0.1:PORT); omit to skip")
    ap.add_argument("--zmq-base", type=int, default=0, help="first ZMQ port (one per worker)")
    ap.add_argument("--bootstrap", help="Kafka bootstrap for kvidx relays; omit to skip kvidx")
    ap.add_argument("--topic-prefix", default="")
    ap.add_argument("--index-block-size", type=int, default=512)
    ap.add_argument("--status", required=True, help="write a JSON status file here when done")
    a = ap.parse_args()

    t0 = time.time()
    nw, B, recs = load(a.events)
    id_of = {}
    for r in recs:
        if r[0] == "Q":
            for s, i in zip(r[1], r[3], strict=True):
                id_of[s] = i
    tok_cache = {}

    def block_tokens(i: int) -> bytes:
        b = tok_cache.get(i)
        if b is None:
            b = tok_cache[i] = mp_uint(i) * B
        return b

    print(f"[feed] loaded {len(recs)} records, {nw} workers, B={B} in {time.time()-t0:.1f}s", flush=True)

    endpoints = [f"tcp://127.0.0.1:{a.zmq_base + w}" for w in range(nw)]
    socks = None
    if a.dyn_url:
        ctx = zmq.Context()
        socks = []
        for ep in endpoints:
            s = ctx.socket(zmq.XPUB)
            s.setsockopt(zmq.SNDHWM, 0)  # never drop (a PUB drops at the HWM)
            s.setsockopt(zmq.LINGER, -1)
            s.bind(ep)
            socks.append(s)
        for w, ep in enumerate(endpoints):
            body = json.dumps({"instance_id": w + 1, "endpoint": ep, "model_name": a.model,
                               "block_size": B}).encode()
            req = urllib.request.Request(a.dyn_url + "/register", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert resp.status == 201, resp.status
        # wait until each indexer listener has subscribed (XPUB hands us the subscription)
        deadline = time.time() + 30
        for w, s in enumerate(socks):
            if not s.poll(max(1, int((deadline - time.time()) * 1000))):
                sys.exit(f"[feed] worker {w}: no subscriber within 30 s")
            s.recv()
        print(f"[feed] {nw} Dynamo listeners subscribed", flush=True)

    relays = None
    if a.bootstrap:
        from kvidx.engines.contract import Frame
        from kvidx.engines.vllm.relay import VllmPublisherRelay
        from kvidx.kafka.topics import ensure_topics
        from relays.run import Relay
        from relays.sinks import KafkaSink
        from schemas.events import topic_names
        t = topic_names(a.topic_prefix)
        ensure_topics(a.bootstrap, t)  # as `kvidx relay` does
        sink = KafkaSink(a.bootstrap, t["events"], t["dead_letters"])
        relays = []
        for ep in endpoints:  # replica name = the endpoint (as `kvidx relay` without --replica)
            r = Relay(VllmPublisherRelay(a.model, ep, a.index_block_size, 0, engine_version="0.32.0"), sink)
            r.start_fresh(replay_from_start=False)
            relays.append(r)

    enc = msgspec.msgpack.Encoder()
    seqs = [0] * nw
    n_frames = wire_bytes = 0
    ts = 1.7e9
    t1 = time.time()
    for r in recs:
        if r[0] == "Q":
            continue
        w = r[1]
        if r[0] == "S":
            seq = r[3]
            toks = mp_array_header(B * len(seq)) + b"".join(block_tokens(id_of[s]) for s in seq)
            ev = {"type": "BlockStored", "block_hashes": seq, "parent_block_hash": r[2],
                  "token_ids": msgspec.Raw(toks), "block_size": B}
        else:
            ev = {"type": "BlockRemoved", "block_hashes": r[2]}
        ts += 0.001
        payload = enc.encode([ts, [ev], 0])
        sq = seqs[w]
        seqs[w] = sq + 1
        if socks is not None:
            socks[w].send_multipart([b"", sq.to_bytes(8, "big"), payload], copy=False)
        if relays is not None:
            relays[w].handle(Frame(b"", sq, payload, time.time_ns(), endpoints[w], "pub"))
        n_frames += 1
        wire_bytes += len(payload)
    if relays is not None:
        sink.flush(60)
    dt = time.time() - t1
    st = {"frames": n_frames, "wire_bytes": wire_bytes, "publish_s": round(dt, 2),
          "workers": nw, "block_tokens": B}
    if relays is not None:
        st["kvidx_relay_counters"] = {k: sum(r.core.counters[k] for r in relays)
                                      for k in relays[0].core.counters}
        st["kvidx_sink_errors"] = sink.errors
    print(f"[feed] published {n_frames} frames ({wire_bytes/1e9:.2f} GB) in {dt:.1f}s: {st}", flush=True)
    with open(a.status, "w") as f:
        json.dump(st, f)
    if socks is None:
        return 0
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while not stop:  # stay up like a live engine: the indexer's SUB sockets stay connected
        for s in socks:
            while s.poll(0):
                s.recv()
        time.sleep(0.5)
    for s in socks:
        s.close(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
