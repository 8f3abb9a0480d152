"""kvidx answers Dynamo's POST /query exactly as the real Dynamo indexer does: the recording of a real
vLLM 0.32 engine (tests/fixtures/vllm-0.32/llama_c4) replayed as live ZMQ traffic into kvidx, which
follows it through Dynamo's POST /register, and each request's prompt asked once the frames the engine
had published by its send time are folded; the answers must equal those the real indexer gave on the
same traffic, for POST /query and for POST /query_by_hash with the prompt's Dynamo block hashes
(tests/fixtures/dynamo-1.6.1, captured by bench/peers/http/dynamo_compat.py with
dynamo-kv-router 1.6.1's own service code)."""

from __future__ import annotations

import json
from contextlib import contextmanager

import httpx
import zmq

from index_service.app import create_app
from index_service.dynamo_api import DynamoRegistry, dump_blocks
from index_service.store import ShardStore
from kvidx.core.hashing import dynamo_local_hashes, pack_tokens
from kvidx.engines.recording import read_frames, request_steps
from relays.managed import vllm_relay_starter
from relays.sinks import StoreSink
from tests.helpers import FIXTURES, ServerThread, wait_for

FIXTURE = FIXTURES / "dynamo-1.6.1" / "llama_c4_query.json"


@contextmanager
def kvidx_following(fx: dict, empty_dump: bool = False):
    """kvidx's service (index block 16; the engine's blocks are 32) with an engine publisher registered
    through its POST /register as the fixture's worker, once its relay subscribed: (store, client,
    publisher, endpoint)."""
    store = ShardStore(16)
    store.ready = True
    registry = DynamoRegistry(vllm_relay_starter(StoreSink(store), lambda model: 16))
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    endpoint = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    app = create_app(store, dynamo=registry)
    try:
        with ServerThread(app) as url, httpx.Client(base_url=url, timeout=10) as c:
            if empty_dump:
                assert c.get("/dump").json() == {}  # nothing registered: an empty (valid) recovery
            r = c.post("/register", json={"instance_id": fx["instance_id"], "endpoint": endpoint,
                                          "model_name": fx["model_name"], "block_size": fx["block_size"]})
            assert r.status_code == 201
            assert pub.poll(15_000), "kvidx's relay never subscribed"
            pub.recv()
            yield store, c, pub, endpoint
    finally:
        registry.stop_all()
        pub.close(0)
        ctx.term()


def test_query_answers_equal_the_real_dynamo_indexers():
    fx = json.loads(FIXTURE.read_text())
    recording = FIXTURES.parent.parent / fx["recording"]
    requests = [json.loads(x) for x in (recording / "requests.jsonl").read_text().splitlines() if x]
    want = {q["i"]: q["answer"] for q in fx["queries"]}
    by_hash = {q["i"]: q["answer_by_hash"] for q in fx["queries"]}
    matched = 0
    with kvidx_following(fx) as (store, c, pub, endpoint):
        for frames, req in request_steps(read_frames(recording / "frames.jsonl"), requests):
            for f in frames:
                pub.send_multipart([f.topic, f.seq.to_bytes(8, "big"), f.payload])
            if frames:
                last = frames[-1].seq
                wait_for(lambda last=last: (st := store.shards.get(fx["model_name"])) is not None
                         and st.replicas.get((endpoint, 0)) is not None
                         and st.replicas[(endpoint, 0)].seq >= last, what=f"frame {last} folded")
            got = c.post("/query", json={"token_ids": req["prompt_token_ids"],
                                         "model_name": fx["model_name"]}).json()
            assert got == want[req["i"]], req["i"]
            local = dynamo_local_hashes(pack_tokens(req["prompt_token_ids"]), fx["block_size"])
            hashes = [h - (1 << 64) if h >= 1 << 63 else h for h in local]  # Dynamo takes i64
            got = c.post("/query_by_hash", json={"block_hashes": hashes,
                                                 "model_name": fx["model_name"]}).json()
            assert got == by_hash[req["i"]], req["i"]
            matched += bool(got["scores"])
    assert matched == sum(bool(a["scores"]) for a in want.values()) > 150


DUMP = FIXTURES / "dynamo-1.6.1" / "llama_c4_dump.json"


def test_dump_holds_the_blocks_the_real_dynamo_indexer_dumps():
    """GET /dump after the whole recording: the same blocks (worker, rank, tier, engine hash, Dynamo
    tokens_hash, parent) as the real indexer's /dump on the same traffic, in the shape its --peers
    recovery reads (bench/peers/http/dynamo_compat.py --dump also starts a real indexer with --peers
    on kvidx and checks its /query answers)."""
    fx = json.loads(DUMP.read_text())
    recording = FIXTURES.parent.parent / fx["recording"]
    requests = [json.loads(x) for x in (recording / "requests.jsonl").read_text().splitlines() if x]
    # what the compat run sent: the frames published by the last request's send time
    frames = [f for fs, _ in request_steps(read_frames(recording / "frames.jsonl"), requests) for f in fs]
    with kvidx_following(fx, empty_dump=True) as (store, c, pub, endpoint):
        for f in frames:
            pub.send_multipart([f.topic, f.seq.to_bytes(8, "big"), f.payload])
        wait_for(lambda: (st := store.shards.get(fx["model_name"])) is not None
                 and (rs := st.replicas.get((endpoint, 0))) is not None and rs.seq >= frames[-1].seq,
                 what="the recording folded")
        r = c.get("/dump")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    key = f"{fx['model_name']}:default"
    assert list(body) == [key] and body[key]["block_size"] == fx["block_size"]
    ev = body[key]["events"][0]
    assert ev["residency_domain"] == "worker" and ev["storage_tier"] == "device"
    assert set(ev["event"]["data"]["stored"]) == {"parent_hash", "start_position", "blocks"}
    got = dump_blocks(body)
    assert got == fx["dump_blocks"] and len(got[key]) > 20
