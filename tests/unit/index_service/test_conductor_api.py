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
from kvidx.core import walk
from kvidx.core.hashing import prompt_hashes
from kvidx.engines.recording import read_frames, request_steps
from relays.managed import vllm_relay_starter
from relays.sinks import StoreSink
from tests.helpers import FIXTURES, LLAMA, ServerThread, wait_for

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
        held = walk.prefix_blocks(shard, prompt_hashes(tokens[:n * 32], 16)).get(slot, 0) // 2 * 32
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


def test_a_mooncake_store_master_registered_as_the_contexts_shared_pool():
    """A Mooncake Store master registered with type "Mooncake" beside the context's vLLM engines: kvidx
    follows the master (its relay placing the tokenless objects through the engines' own streams, which
    it subscribes to as key feeds) and the pool counts for every engine of the context. Replayed live
    over ZMQ, frame by frame, from the Mooncake Store conformance recording (tests/fixtures/mooncake-
    store: pool-a read by node-a/b/c); before each request to node-b (which holds nothing itself), the
    conductor's /query and kvidx's own /v1/lookup credit node-b exactly what it would reuse."""
    from prometheus_client import REGISTRY

    from relays.managed import mooncake_relay_starter

    moon = FIXTURES / "mooncake-store"
    store = ShardStore(16)
    store.ready = True
    sink = StoreSink(store)
    conductor = ConductorRegistry(vllm_relay_starter(sink, lambda model: 16),
                                  start_pool_relay=mooncake_relay_starter(sink, lambda model: 16),
                                  set_pool=store.set_registered_pool)
    ctx = zmq.Context()
    pubs, endpoints = {}, {}
    for name in ("tcp://mooncake-master:5557", "tcp://node-a:5557", "tcp://node-b:5557", "tcp://node-c:5557"):
        pubs[name] = ctx.socket(zmq.XPUB)
        pubs[name].setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not the first only
        endpoints[name] = f"tcp://127.0.0.1:{pubs[name].bind_to_random_port('tcp://127.0.0.1')}"
    master = endpoints["tcp://mooncake-master:5557"]

    def handled(replica: str) -> float:
        return REGISTRY.get_sample_value("kvidx_relay_frames_total", {"replica": replica}) or 0.0

    app = create_app(store, conductor=conductor)
    try:
        with ServerThread(app) as url, httpx.Client(base_url=url, timeout=10) as c:
            for node in ("a", "b", "c"):
                ep = endpoints[f"tcp://node-{node}:5557"]
                reg = registration(ep, instance_id=f"node-{node}", block_size=16)
                assert post(c, "/register", reg)[0] == 200
            assert post(c, "/register", registration(master, type="Mooncake", instance_id="pool-a",
                                                     block_size=16))[0] == 200
            # the engines' relays, the master's relay and its key feeds on node-a/b/c have subscribed
            for name, pub in pubs.items():
                for _ in range(1 if name == "tcp://mooncake-master:5557" else 2):
                    assert pub.poll(15_000), f"no subscriber on {name}"
                    pub.recv()
            svcs = msgspec.msgpack.decode(c.get("/services").content)["services"]
            assert sorted((s["InstanceID"], s["Type"]) for s in svcs) == [
                ("node-a", "vLLM"), ("node-b", "vLLM"), ("node-c", "vLLM"), ("pool-a", "Mooncake")]
            requests = [json.loads(x) for x in (moon / "requests.jsonl").read_text().splitlines() if x]
            credited = 0
            for frames, req in request_steps(read_frames(moon / "frames.jsonl"), requests):
                for f in frames:  # one at a time: the pool relay reads the master and the key feeds in order
                    before = handled(master)
                    seq = f.seq.to_bytes(8, "big", signed=True)
                    pubs[f.endpoint].send_multipart([f.topic, seq, f.payload])
                    wait_for(lambda before=before: handled(master) > before, what="the pool relay took it")
                toks = req["prompt_token_ids"]
                want = req["cached_tokens"]
                code, body = post(c, "/query", {"model": "llama", "block_size": 16, "token_ids": toks})
                b = body["instances"]["node-b"]
                assert code == 200 and b["gpu"] == 0, body
                assert min(b["longest_matched"], (len(toks) - 1) // 16 * 16) == want, (req["i"], b, want)
                mine = c.post("/v1/lookup", json={"model": "llama", "token_ids": toks}).json()["replicas"]
                node_b = [r for r in mine if r["replica"] == endpoints["tcp://node-b:5557"]]
                assert (node_b[0]["resumable_tokens"] if node_b else 0) == want, (req["i"], node_b, want)
                credited += want > 0
            assert credited >= 5
            # an engine of another tenant does not read pool-a: none of its blocks counts there
            other = ctx.socket(zmq.XPUB)
            pubs["other"] = other
            ep_x = f"tcp://127.0.0.1:{other.bind_to_random_port('tcp://127.0.0.1')}"
            reg = registration(ep_x, instance_id="node-x", block_size=16, tenant_id="tenant-b")
            assert post(c, "/register", reg)[0] == 200
            assert other.poll(15_000)
            toks = requests[-1]["prompt_token_ids"]
            wait_for(lambda: (store.shards["llama"].replicas.get((ep_x, 0)) is not None), what="node-x known")
            q = {"model": "llama", "block_size": 16, "token_ids": toks}
            x = post(c, "/query", {**q, "tenant_id": "tenant-b"})[1]["instances"]["node-x"]
            assert x["longest_matched"] == 0, x
            assert post(c, "/query", q)[1]["instances"]["node-b"]["longest_matched"] > 0
            # unregistering the master detaches the pool: node-b is credited nothing any more
            assert post(c, "/unregister", {"instance_id": "pool-a", "dp_rank": 0})[0] == 200
            mine = c.post("/v1/lookup", json={"model": "llama", "token_ids": toks}).json()["replicas"]
            assert all(r["replica"] != master for r in mine)  # never an engine a router could pick
            assert post(c, "/query", {"model": "llama", "block_size": 16, "token_ids": toks}
                        )[1]["instances"]["node-b"]["longest_matched"] == 0
    finally:
        conductor.stop_all()
        for pub in pubs.values():
            pub.close(0)
        ctx.term()
