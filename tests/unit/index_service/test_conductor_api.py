"""Mooncake conductor's msgpack API on kvidx's service over real HTTP: /register starts a relay for a
real vLLM engine's recorded traffic (llama_c4, replayed over ZMQ), /query answers per instance and rank
from the index, /services and /global_view describe the registrations; malformed requests get the
conductor's error bodies; Dynamo's JSON API on the same paths is untouched."""

from __future__ import annotations

import json

import httpx
import msgspec
import numpy as np
import pytest
import zmq

from index_service.app import create_app
from index_service.conductor_api import ConductorRegistry
from index_service.dynamo_api import DynamoRegistry
from index_service.store import ShardStore
from kvidx.core.hashing import prompt_hashes
from kvidx.engines.recording import read_frames, request_steps
from relays.managed import vllm_relay_starter
from relays.sinks import StoreSink
from tests.helpers import LLAMA, ServerThread, wait_for

MP = {"Content-Type": "application/msgpack"}
PROFILE = {"strategy": "vllm_v1", "algorithm": "sha256_cbor", "python_hash_seed": "0",
           "index_projection": "low64_be"}
CBOR_ROOT_0 = "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"  # sha256(cbor("0"))


def post(c: httpx.Client, path: str, body) -> tuple[int, dict]:
    r = c.post(path, content=msgspec.msgpack.encode(body), headers=MP)
    assert r.headers["content-type"] == "application/msgpack"
    return r.status_code, msgspec.msgpack.decode(r.content)


def registration(endpoint: str, **kw) -> dict:
    return {"endpoint": endpoint, "type": "vLLM", "modelname": "llama", "instance_id": "engine-a",
            "block_size": 32, "dp_rank": 0, "hash_profile": dict(PROFILE), **kw}


@pytest.fixture()
def service():
    store = ShardStore(16)
    store.ready = True
    starter = vllm_relay_starter(StoreSink(store), lambda model: 16)
    conductor = ConductorRegistry(starter)
    dynamo = DynamoRegistry(starter)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    endpoint = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    app = create_app(store, dynamo=dynamo, conductor=conductor)
    try:
        with ServerThread(app) as url, httpx.Client(base_url=url, timeout=10) as c:
            yield store, c, pub, endpoint
    finally:
        conductor.stop_all()
        dynamo.stop_all()
        pub.close(0)
        ctx.term()


def test_register_query_views_and_unregister_over_a_real_engines_traffic(service):
    store, c, pub, endpoint = service
    assert post(c, "/register", registration(endpoint)) == (
        200, {"status": "registered successfully", "instance_id": "engine-a"})
    assert post(c, "/register", registration(endpoint)) == (  # the same registration again: a no-op
        200, {"status": "registered successfully", "instance_id": "engine-a"})
    # registered, no event of the model yet: the instance is listed with nothing matched
    q = {"model": "llama", "block_size": 32, "token_ids": list(range(64))}
    code, body = post(c, "/query", q)
    assert code == 200 and body["instances"]["engine-a"]["longest_matched"] == 0, body
    assert pub.poll(15_000), "kvidx's relay never subscribed"
    pub.recv()
    requests = [json.loads(x) for x in (LLAMA / "requests.jsonl").read_text().splitlines() if x]
    frames = [f for fs, _ in request_steps(read_frames(LLAMA / "frames.jsonl"), requests) for f in fs]
    for f in frames:
        pub.send_multipart([f.topic, f.seq.to_bytes(8, "big"), f.payload])
    wait_for(lambda: (st := store.shards.get("llama")) is not None
             and (rs := st.replicas.get((endpoint, 0))) is not None and rs.seq >= frames[-1].seq,
             what="the recording folded")
    shard = store.shards["llama"]
    slot = shard.replicas[(endpoint, 0)].slot
    hits = 0
    for r in requests:
        tokens = r["prompt_token_ids"]
        n = len(tokens) // 32
        held = shard.prefix_blocks(prompt_hashes(tokens[:n * 32], 16)).get(slot, 0) // 2 * 32
        as_bin = np.asarray(tokens, dtype="<i4").tobytes()
        status, got = post(c, "/query", {"model": "llama", "block_size": 32, "token_ids": as_bin})
        assert status == 200
        assert got == {"instances": {"engine-a": {
            "longest_matched": held, "dp": {"0": held}, "rank_matches": {"0": {"gpu": held, "cpu": held,
                                                                                "disk": held}},
            "gpu": held, "cpu": held, "disk": held}}}, r["i"]
        assert list(got["instances"]["engine-a"]) == ["longest_matched", "dp", "rank_matches", "gpu", "cpu",
                                                      "disk"]  # the conductor's pack order
        hits += held > 0
    assert hits > 150
    last = requests[-1]["prompt_token_ids"]
    as_list = post(c, "/query", {"model": "llama", "block_size": 32, "token_ids": last})
    assert as_list == post(c, "/query", {"model": "llama", "block_size": 32,
                                         "token_ids": np.asarray(last, "<i4").tobytes()})
    # another context (block size, tenant, LoRA) or an unknown instance: nothing, and no error
    for other in ({"block_size": 16}, {"tenant_id": "t2"}, {"lora_name": "x"}, {"instance_id": "nope"}):
        body = {"model": "llama", "block_size": 32, "token_ids": [1, 2, 3], **other}
        assert post(c, "/query", body) == (200, {"instances": {}})
    svcs = msgspec.msgpack.decode(c.get("/services").content)
    assert svcs == {"count": 1, "services": [{
        "Endpoint": endpoint, "ReplayEndpoint": "", "Type": "vLLM", "ModelName": "llama", "LoraName": "",
        "TenantID": "default", "InstanceID": "engine-a", "BlockSize": 32, "DPRank": 0, "CacheGroup": None,
        "HashProfile": {**PROFILE, "root_digest": CBOR_ROOT_0}}]}
    view = msgspec.msgpack.decode(c.get("/global_view").content)
    assert view["context_count"] == 1 and view["contexts"][0]["instances"] == {"engine-a": [0]}
    assert view["contexts"][0]["prefix_count"] > 0
    assert post(c, "/unregister", {"instance_id": "engine-a", "dp_rank": 0}) == (
        200, {"status": "unregistered successfully", "removed_instances": ["engine-a|default|0"]})
    assert post(c, "/unregister", {"instance_id": "engine-a", "dp_rank": 0}) == (
        404, {"error": "service not found: engine-a|default|0"})
    assert shard.replicas[(endpoint, 0)].blocks == 0  # retracted
    # Dynamo's JSON API on the same paths is still Dynamo's (no Dynamo worker registered: its 404)
    r = c.post("/query", json={"token_ids": [1, 2], "model_name": "llama"})
    assert r.headers["content-type"] == "application/json" and "error" in r.json()


@pytest.mark.parametrize("body, error", [
    (b"\xc1", {"error": "Invalid msgpack object", "reason": "invalid_msgpack"}),
    ([1, 2], {"error": "request body must be a msgpack map", "reason": "invalid_msgpack"}),
    ({"endpoint": "tcp://x:1", "color": 1},
     {"error": "unsupported request field: color", "reason": "unknown_field", "field": "color"}),
    ({"type": "vLLM"}, {"error": "endpoint is required", "reason": "missing", "field": "endpoint"}),
    ({"endpoint": ""},
     {"error": "endpoint must not be empty", "reason": "invalid_value", "field": "endpoint"}),
])
def test_register_errors_are_the_conductors(service, body, error):
    _, c, _, _ = service
    raw = body if isinstance(body, bytes) else msgspec.msgpack.encode(body)
    r = c.post("/register", content=raw, headers=MP)
    assert r.status_code == 400 and msgspec.msgpack.decode(r.content) == error


@pytest.mark.parametrize("profile, error", [
    ({"algorithm": "xxhash"}, ("unsupported hash algorithm: xxhash", "algorithm")),
    ({"strategy": "v2"}, ("unsupported hash strategy: v2", "strategy")),
    ({"index_projection": "low64_le"}, ("unsupported index projection: low64_le", "index_projection")),
    ({"python_hash_seed": "seven"},
     ('python_hash_seed must be "random" or ASCII decimal text in 0..4294967295', "python_hash_seed")),
    ({"python_hash_seed": "4294967296"},
     ("python_hash_seed must be in range 0..4294967295", "python_hash_seed")),
])
def test_hash_profiles_are_checked_as_the_conductor_does(service, profile, error):
    _, c, _, endpoint = service
    status, body = post(c, "/register", registration(endpoint, hash_profile={**PROFILE, **profile}))
    assert status == 400 and body == {"error": error[0], "reason": "invalid_value", "field": error[1]}


def test_conflicts_and_query_errors(service):
    _, c, _, endpoint = service
    assert post(c, "/register", registration(endpoint))[0] == 200
    status, body = post(c, "/register", registration(endpoint, block_size=16))
    assert status == 400 and body == {"error": "conflicting registration for service key: engine-a|default|0",
                                      "reason": "invalid_registration"}
    status, body = post(c, "/register", registration(endpoint, instance_id="engine-b"))
    assert status == 400 and body["error"] == f"conflicting active registration for endpoint: {endpoint}"
    status, body = post(c, "/query", {"model": "llama", "block_size": 32, "token_ids": [1, 2**31]})
    assert status == 400 and body == {"error": "token_ids element is outside the int32 range",
                                      "reason": "out_of_range", "field": "token_ids", "index": 1}
    status, body = post(c, "/query", {"model": "llama", "token_ids": b"\x00\x00\x00"})
    assert status == 400 and body["error"] == "token_ids bin size must be a multiple of 4"
    status, body = post(c, "/query", {"model": "llama", "token_ids": []})
    assert status == 400 and body == {"error": "block_size is required", "reason": "missing",
                                      "field": "block_size"}
    r = c.post("/services")
    assert r.status_code == 405 and msgspec.msgpack.decode(r.content) == {"error": "Method not allowed"}
