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


def test_a_partial_instance_answers_like_a_full_one():
    """A model split in two replica groups: an instance holding one asks the other's holder and
    answers LMCache's lookup as an instance holding both."""
    import time

    from index_service.fanout import Fanout, PeerDirectory
    from index_service.store import ShardStore
    from kvidx.config import Config
    from kvidx.core.groups import hashed_group
    from kvidx.core.hashing import prompt_hashes
    from schemas.events import BlocksStored, EventBatch

    config = Config(models={"m": ModelConfig(replica_groups=2)})
    stores = {k: ShardStore(16, config=config, groups=g)
              for k, g in (("full", None), ("a", frozenset({0})), ("b", frozenset({1})))}
    hashes = prompt_hashes(PROMPT, 16)
    names = [f"tcp://10.0.1.{r}:5557" for r in range(8)]
    assert {hashed_group(n, 2) for n in names} == {0, 1}
    now = time.time()
    for r, name in enumerate(names):
        n = 5 * (r + 1)
        batch = EventBatch(1, "m", name, 0, 1, 0, now, now, 16, [BlocksStored("GPU", 0, hashes[:n], None, 0)],
                           replica_group=hashed_group(name, 2))
        for s in stores.values():
            s.apply(batch)
    for s in stores.values():
        s.ready = True
    directory = PeerDirectory("a")
    with ServerThread(create_app(stores["full"], lmcache_lookup="m")) as full, \
            ServerThread(create_app(stores["b"], lmcache_lookup="m")) as b:
        directory.add_static(b, frozenset({1}))
        app = create_app(stores["a"], lmcache_lookup="m", fanout=Fanout(directory, timeout_s=5.0))
        with ServerThread(app) as a, httpx.Client(timeout=10) as c:
            want = c.post(f"{full}/lookup", json={"tokens": PROMPT}).json()["layout_info"]
            got = c.post(f"{a}/lookup", json={"tokens": PROMPT}).json()["layout_info"]
            assert len(want) == 8 and list(got.items()) == list(want.items())
            assert len(c.post(f"{b}/lookup", json={"tokens": PROMPT}).json()["layout_info"]) < 8
