"""Eviction foresight through the service over real HTTP: a route to a full replica makes the next
lookup discount the blocks its prefill will evict, in every lookup form, visible in the answer
(evicting_tokens) and in /metrics; the route record carries the router's evicting_tokens."""

from __future__ import annotations

import time

import httpx
import numpy as np

from index_service.app import create_app
from index_service.store import ShardStore
from kvidx.core.hashing import prompt_hashes
from schemas.events import SCHEMA_VERSION, BlocksRemoved, BlocksStored, EventBatch
from tests.helpers import ServerThread

MODEL = "m"


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, n).tolist()


P, Q, Z, W = tokens(1, 65), tokens(2, 64), tokens(3, 16), tokens(4, 97)  # 4, 4, 1 and 6 blocks


def hashes(t: list[int]) -> list[int]:
    return list(prompt_hashes(np.asarray(t, dtype="<u4").tobytes(), 16))


def batch(seq: int, events) -> EventBatch:
    now = time.time()
    return EventBatch(SCHEMA_VERSION, MODEL, "r", 0, 1, seq, now, now, 16, events)


def test_a_route_to_a_full_replica_discounts_what_its_prefill_evicts():
    store = ShardStore(16)
    hp, hq = hashes(P), hashes(Q)
    with ServerThread(create_app(store)) as base, httpx.Client(base_url=base) as c:
        # foresight starts with the model's first route (P's, before the engine reports it)
        store.apply(batch(0, [BlocksStored("GPU", 0, [], None, 0)]))
        assert c.post("/v1/routes", json={"request_id": "p", "model": MODEL, "replica": "r", "token_ids": P,
                                          "ttl_s": 0.05}).status_code == 202
        store.apply(batch(1, [BlocksStored("GPU", 0, hp, None, 0)]))
        store.apply(batch(2, [BlocksStored("GPU", 0, hq, None, 0)]))
        # full at 8 blocks: Q's last block evicted for Z
        store.apply(batch(3, [BlocksRemoved("GPU", 0, [hq[3]]), BlocksStored("GPU", 0, hashes(Z), None, 0)]))
        time.sleep(0.1)  # P's route expired
        before = c.post("/v1/lookup", json={"model": MODEL, "token_ids": P}).json()["replicas"][0]
        assert before["resumable_tokens"] == 64 and "evicting_tokens" not in before
        r = c.post("/v1/routes", json={"request_id": "w", "model": MODEL, "replica": "r", "token_ids": W,
                                       "credited_tokens": 0, "evicting_tokens": 0})
        assert r.status_code == 202
        a = c.post("/v1/lookup", json={"model": MODEL, "token_ids": P}).json()["replicas"][0]
        assert (a["resumable_tokens"], a["cached_tokens"], a["evicting_tokens"]) == (0, 0, 64)
        packed = np.asarray(P, dtype="<u4").tobytes()
        b = c.post(f"/v1/lookup/binary?model={MODEL}", content=packed).json()["replicas"][0]
        assert (b["resumable_tokens"], b["evicting_tokens"]) == (0, 64)
        k = c.post("/v1/rank", json={"model": MODEL, "token_ids": P}).json()["replicas"][0]
        assert k["evicting_tokens"] == 64 and k["price"]["prefill_tokens"] == len(P)
        metrics = c.get("/metrics").text
        assert 'kvidx_foresight_evicting_blocks{model="m"} 6.0' in metrics
        assert 'kvidx_foresight_discounted_lookups_total{model="m"}' in metrics
        bad = c.post("/v1/routes", json={"request_id": "x", "model": MODEL, "replica": "r", "token_ids": P,
                                         "evicting_tokens": -1})
        assert bad.status_code == 422 and "evicting_tokens" in bad.json()["error"]
