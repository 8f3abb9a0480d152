"""LMCache's controller lookup (POST /lookup) on kvidx's service over real HTTP: LMCache's request and
answer shapes, every replica holding a prefix of the prompt longest first with its LMCache instance id
and the backend holding the end of its prefix, the same tokens as kvidx's own lookup; malformed
bodies get a 422 that says what is wrong."""

from __future__ import annotations

import httpx
import pytest

from index_service.app import create_app
from kvidx.config import HintsConfig, ModelConfig
from tests.helpers import SEEDED_BS, SEEDED_MODEL, ServerThread, seeded_store

PROMPT = list(range(1000, 1000 + 40 * SEEDED_BS))


@pytest.fixture()
def client():
    store = seeded_store(prompt=PROMPT)  # replica r holds 10 (r + 1) blocks: half on GPU, half on CPU
    store.config.models[SEEDED_MODEL] = ModelConfig(hints=HintsConfig(lmcache_instances={
        "tcp://10.0.0.3:5557": "lmcache-instance-3"}))
    app = create_app(store, lmcache_lookup=SEEDED_MODEL)
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=10) as c:
        yield c


def test_layout_info_longest_first_with_instances_and_backends(client):
    r = client.post("/lookup", json={"tokens": PROMPT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["event_id"].startswith("Lookup") and len(body["event_id"]) == len("Lookup") + 36
    assert list(body["layout_info"].items()) == [
        ("lmcache-instance-3", ["LocalCPUBackend", 640]), ("tcp://10.0.0.2:5557", ["LocalCPUBackend", 480]),
        ("tcp://10.0.0.1:5557", ["LocalCPUBackend", 320]), ("tcp://10.0.0.0:5557", ["LocalCPUBackend", 160])]
    # a prompt that leaves the prefix inside the GPU part of every replica
    short = PROMPT[:3 * SEEDED_BS + 5]
    info = client.post("/lookup", json={"tokens": short}).json()["layout_info"]
    assert [tuple(v) for v in info.values()] == [("GPU", 48)] * 4
    # kvidx's own lookup credits the same tokens
    mine = client.post("/v1/lookup", json={"model": SEEDED_MODEL, "token_ids": PROMPT}).json()
    assert sorted(r["cached_tokens"] for r in mine["replicas"]) == [160, 320, 480, 640]
    assert client.post("/lookup", json={"tokens": list(range(7, 100))}).json()["layout_info"] == {}


@pytest.mark.parametrize("body, status, text", [
    (b'{"tokens": []}', 422, "tokens is empty"),
    (b'{"tokens": [1, "2"]}', 422, "Expected `int`, got `str` - at `$.tokens[1]`"),
    (b'{"token_ids": [1]}', 422, "Object missing required field `tokens`"),
    (b'{"tokens": [4294967296]}', 422, "a token id outside 0..2^32-1"),
    (b'not json', 422, 'a lookup is {\\"tokens\\": [token ids]}'),
])
def test_malformed_bodies_say_what_is_wrong(client, body, status, text):
    r = client.post("/lookup", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status and text in r.text, r.text


def test_a_model_without_events_answers_empty_like_lmcaches_empty_registry():
    with ServerThread(create_app(seeded_store(), lmcache_lookup="not-yet")) as url:
        r = httpx.post(f"{url}/lookup", json={"tokens": PROMPT}, timeout=10)
    assert r.status_code == 200 and r.json()["layout_info"] == {}
