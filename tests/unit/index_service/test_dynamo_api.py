"""Dynamo's indexer API on kvidx (index_service/dynamo_api.py), over real HTTP and real ZMQ: simulated
vLLM engines publish, `POST /register` makes kvidx follow them with its own relays, and `POST /query`
answers in Dynamo's ScoreResponse shape what the engines really hold (their own cache, whole blocks
of the registered size, no last-token rule); the registry's checks and messages are Dynamo's
(services/indexer/registry.rs, services/common/zmq.rs); `POST /unregister` retracts the replica.
The same answers as a real Dynamo indexer on a real engine's recording: test_dynamo_fixture.py."""

from __future__ import annotations

import httpx
import pytest

from index_service.app import create_app
from index_service.dynamo_api import DynamoRegistry, zmq_endpoint_error
from index_service.store import ShardStore
from kvidx.core.hashing import dynamo_local_hashes, pack_tokens
from kvidx.engines.vllm.sim import SimVllmEngine
from kvidx.sim.prompts import workload_requests
from relays.managed import vllm_relay_starter
from relays.sinks import StoreSink
from tests.helpers import ServerThread, wait_for

B = 32  # the engines' block size: the one registered with Dynamo's API; kvidx indexes at 16


def i64_local_hashes(prompt: list[int]) -> list[int]:
    """What a Dynamo router sends to /query_by_hash: its per-block hashes, as i64."""
    return [h - (1 << 64) if h >= 1 << 63 else h for h in dynamo_local_hashes(pack_tokens(prompt), B)]


def expected_tokens(engine: SimVllmEngine, prompt: list[int]) -> int:
    """What Dynamo counts: the prompt's leading full blocks the engine holds, in tokens."""
    cached, n = engine.cached_hashes(), 0
    for h in engine.engine_hashes(prompt):
        if h not in cached:
            break
        n += 1
    return n * B


@pytest.fixture
def fleet():
    store = ShardStore(16)
    store.ready = True
    registry = DynamoRegistry(vllm_relay_starter(StoreSink(store), lambda model: 16))
    engines = [SimVllmEngine(num_blocks=40, block_size=B, endpoint="tcp://127.0.0.1:*",
                             replay_endpoint="tcp://127.0.0.1:*") for _ in range(2)]
    try:
        with ServerThread(create_app(store, dynamo=registry)) as url:
            yield url, store, engines
    finally:
        registry.stop_all()
        for e in engines:
            e.close()


def _register(c: httpx.Client, iid: int, engine: SimVllmEngine, **kw) -> httpx.Response:
    body = {"instance_id": iid, "endpoint": engine.endpoint, "replay_endpoint": engine.replay_endpoint,
            "model_name": "m", "block_size": B, **kw}
    return c.post("/register", json=body)


def test_register_follow_query_unregister(fleet):
    url, store, engines = fleet
    work = workload_requests(4, 60, systems=2, sys_len=(40, 100))
    with httpx.Client(base_url=url, timeout=10) as c:
        assert c.post("/query", json={"token_ids": [1] * 64, "model_name": "m"}).json() == {
            "error": "no indexer for model=m routing_group=default"}
        for iid, e in enumerate(engines, 1):
            r = _register(c, iid, e)
            assert (r.status_code, r.json()) == (201, {"status": "ok"})
        wait_for(lambda: len(store.shards.get("m").replicas) == 2 if "m" in store.shards else False,
                 what="both relays' start batches")
        for i, (prompt, output) in enumerate(work):
            engines[i % 2].serve(prompt, output)
        last = [e.next_seq - 1 for e in engines]
        wait_for(lambda: all(store.shards["m"].replicas[(e.endpoint, 0)].seq == s
                             for e, s in zip(engines, last, strict=True)), what="every batch folded")
        hits = 0
        for prompt, _ in work:
            got = c.post("/query", json={"token_ids": prompt, "model_name": "m"}).json()
            want_scores, want_instances = {}, {}
            for iid, e in enumerate(engines, 1):
                t = expected_tokens(e, prompt)
                if t:
                    want_scores[str(iid)] = {"0": t}
                    want_instances[str(iid)] = {"cpu": t, "disk": t, "dp": {"0": t}, "gpu": t,
                                                "longest_matched": t}
            assert got == {"frequencies": [], "instances": want_instances, "scores": want_scores}, prompt[:8]
            by_hash = c.post("/query_by_hash", json={"block_hashes": i64_local_hashes(prompt),
                                                     "model_name": "m"}).json()
            assert by_hash == got
            hits += bool(want_scores)
        assert hits > 20
        workers = c.get("/workers").json()
        assert sorted(w["instance_id"] for w in workers) == [1, 2]
        w1 = next(w for w in workers if w["instance_id"] == 1)
        assert w1 == {"instance_id": 1, "source": "zmq", "status": "active", "model_name": "m",
                      "routing_group": "default", "block_size": B, "endpoints": {"0": engines[0].endpoint},
                      "listeners": {"0": {"endpoint": engines[0].endpoint, "status": "active"}}}
        assert c.get("/workers", params={"model_name": "other"}).json() == []
        # unregister: the relay stops and the replica's blocks leave the index
        assert c.post("/unregister", json={"instance_id": 1, "model_name": "m"}).json() == {"status": "ok"}
        wait_for(lambda: store.shards["m"].replicas[(engines[0].endpoint, 0)].blocks == 0, what="retraction")
        for prompt, _ in work[:10]:
            assert "1" not in c.post("/query", json={"token_ids": prompt, "model_name": "m"}).json()["scores"]
        assert c.get("/health").status_code == 200 and c.get("/health").content == b""


def test_registry_checks_and_messages_are_dynamos(fleet):
    url, _store, engines = fleet
    e = engines[0]
    with httpx.Client(base_url=url, timeout=10) as c:
        assert _register(c, 7, e).status_code == 201
        r = _register(c, 7, e)
        assert (r.status_code, r.json()) == (409, {"error": "instance 7 dp_rank 0 already registered"})
        r = _register(c, 7, e, model_name="x")
        assert r.json() == {"error": "instance 7 is already registered for model=m routing_group=default"}
        r = _register(c, 8, engines[1], block_size=16)
        assert (r.status_code, r.json()["error"]) == (
            409, "block_size mismatch for model=m routing_group=default: existing=32, requested=16")
        r = _register(c, 8, engines[1], endpoint="tcp://host")
        assert r.status_code == 400
        assert r.json() == {"error": "invalid ZMQ endpoint `tcp://host`: missing TCP port"}
        r = _register(c, 8, engines[1], replay_endpoint="udp://x:1")
        assert r.json()["error"] == ("invalid replay endpoint `udp://x:1`: invalid ZMQ endpoint `udp://x:1`: "
                                     "unsupported scheme `udp`")
        for body, status, err in [
                ({"instance_id": 9, "model_name": "m"}, 404, "instance 9 not found"),
                ({"instance_id": 7, "model_name": "x"}, 404, "instance 7 is registered for model=m "
                                                             "routing_group=default"),
                ({"instance_id": 7, "model_name": "m", "routing_group": "default", "dp_rank": 3}, 404,
                 "instance 7 dp_rank 3 not found")]:
            r = c.post("/unregister", json=body)
            assert (r.status_code, r.json()) == (status, {"error": err})
        # malformed bodies: axum's statuses and texts
        r = c.post("/query", content=b"{}", headers={"content-type": "text/plain"})
        assert (r.status_code, r.text) == (415, "Expected request with `Content-Type: application/json`")
        r = c.post("/query", content=b"{", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.text.startswith("Failed to parse the request body as JSON: ")
        r = c.post("/query", json={"model_name": "m"})
        assert r.status_code == 422 and r.text.startswith(
            "Failed to deserialize the JSON body into the target type: ") and "token_ids" in r.text
        r = c.post("/query", json={"token_ids": [-1], "model_name": "m"})
        assert r.status_code == 422
        r = c.post("/query_by_hash", json={"block_hashes": [1], "model_name": "m", "cache_salt": ""})
        assert r.status_code == 400 and r.json()["error"] == (
            "cache_salt is not accepted by /query_by_hash; block_hashes must already include the intended "
            "cache salt")
        r = c.post("/query_by_hash", json={"block_hashes": [1 << 63], "model_name": "m"})
        assert r.status_code == 422  # Dynamo takes i64: a u64 above 2^63 - 1 goes as its negative


@pytest.mark.parametrize("endpoint,error", [
    ("tcp://127.0.0.1:5557", None), ("ipc:///tmp/x", None), ("tcp://[::1]:5", None),
    ("nope", "missing scheme"), ("tcp://", "missing address"), ("tcp://:5", "missing TCP host"),
    ("tcp://[::1:5", "missing closing `]`"), ("tcp://a:b:5", "missing TCP port"),
    ("tcp://h:x", "invalid TCP port: invalid digit found in string"),
    ("tcp://h:70000", "invalid TCP port: number too large to fit in target type"),
    ("tcp://h:", "invalid TCP port: cannot parse integer from empty string"),
    ("udp://h:1", "unsupported scheme `udp`")])
def test_endpoint_checks(endpoint, error):
    got = zmq_endpoint_error(endpoint)
    assert got == (None if error is None else f"invalid ZMQ endpoint `{endpoint}`: {error}")
