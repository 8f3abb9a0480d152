"""Fetch hints (kvidx.core.fetch, issue #41 item 5): the engine-hash table, the plan, and Dynamo's KvHint
form held to texts Dynamo's own types made (tests/fixtures/dynamo-1.6.1/kv_hints.jsonl, written by
bench/peers/http/kv_hint_check.py from dynamo-kv-router 1.6.1's KvHint::new + KvHintAction::fetch)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from kvidx.config import PriceConfig
from kvidx.core.fetch import EngineHashes, FetchPlan, dynamo_kv_hint, fetch_plan, source_endpoint
from kvidx.core.price import Pricer
from schemas.answers import Freshness, ReplicaAnswer, Tier
from schemas.events import SCHEMA_VERSION, BlocksStored, EventBatch

FIXTURE = Path(__file__).parents[2] / "fixtures/dynamo-1.6.1/kv_hints.jsonl"


def batch(*events, replica: str = "r", part: int = 0) -> EventBatch:
    return EventBatch(SCHEMA_VERSION, "m", replica, 0, 1, 0, 0.0, 0.0, 16, list(events), part=part)


def test_kvidx_writes_the_bytes_dynamos_own_types_write():
    cases = [json.loads(x) for x in FIXTURE.read_text().splitlines()]
    assert len(cases) >= 6 and any(max(c["engine_hashes"]) == 2**64 - 1 for c in cases)
    for c in cases:
        plan = FetchPlan("src", 0, c["endpoint"], c["engine_hashes"], 16, 0, 1.0, 0.0)
        assert msgspec.json.encode(dynamo_kv_hint(c["message_id"], plan)).decode() == c["dynamo"]


def test_the_table_maps_gpu_stores_and_names_the_leading_chain():
    t = EngineHashes()
    t.observe(batch(BlocksStored("GPU", 0, [1, 2, 3], None, 0, engine_hashes=[101, 102, 103]),
                    BlocksStored("CPU", 0, [4], 3, 3, engine_hashes=[999]),  # not GPU: not kept
                    BlocksStored("GPU", 1, [5], None, 0, engine_hashes=[998]),  # another group
                    BlocksStored("GPU", 0, [6], None, 0, engine_hashes=[997], tail=True)))
    assert len(t) == 3 and t.per_engine_block == 1
    assert t.chain([1, 2, 3, 4]) == [101, 102, 103]  # up to the first it does not hold
    assert t.chain([2, 1]) == [102, 101] and t.chain([4, 1]) == []
    t.observe(batch(BlocksStored("GPU", 0, [7], None, 0, engine_hashes=[107]), part=1))  # a replay part
    assert t.chain([7]) == []


def test_engine_pages_of_several_index_blocks_map_their_last():
    """SGLang's pages of 64 at the index's 16: one engine hash per 4 index blocks."""
    t = EngineHashes()
    t.observe(batch(BlocksStored("GPU", 0, list(range(1, 9)), None, 0, engine_hashes=[501, 502])))
    assert t.per_engine_block == 4
    assert t.chain(list(range(1, 9))) == [501, 502]
    assert t.chain(list(range(1, 8))) == [501]  # the second page is not whole in the prompt
    # engine blocks finer than the index's name no index block: nothing kept
    t2 = EngineHashes()
    t2.observe(batch(BlocksStored("GPU", 0, [1], None, 0, engine_hashes=[7, 8])))
    assert len(t2) == 0 and t2.chain([1]) == []


def test_engines_that_hash_apart_are_seen_and_the_table_stays_bounded():
    t = EngineHashes()
    t.observe(batch(BlocksStored("GPU", 0, [1, 2], None, 0, engine_hashes=[11, 12])))
    t.observe(batch(BlocksStored("GPU", 0, [1, 2], None, 0, engine_hashes=[11, 12]), replica="s"))
    assert t.consistent  # the same engine hashes from another replica: one hash seed
    t.observe(batch(BlocksStored("GPU", 0, [1, 2], None, 0, engine_hashes=[11, 99]), replica="s"))
    assert t.conflicts == 1 and not t.consistent
    small = EngineHashes(capacity=4)
    for i in range(0, 100, 2):
        small.observe(batch(BlocksStored("GPU", 0, [i, i + 1], None, 0, engine_hashes=[i + 1000, i + 1001])))
    assert len(small) <= 4 and small.chain([98, 99]) == [1098, 1099]


def answer(replica: str, gpu: int, resumable: int | None = None) -> ReplicaAnswer:
    r = gpu if resumable is None else resumable
    tiers = [Tier("GPU", gpu)] + ([Tier("CPU", r - gpu)] if r > gpu else [])
    return ReplicaAnswer(replica, 0, r, tiers, r, r, [], 0, 0, False, [], Freshness(None, None, 0, 0, 0))


def test_the_plan_fetches_the_longest_gpu_prefix_a_source_with_an_endpoint_holds():
    t = EngineHashes()
    h = list(range(1, 9))
    t.observe(batch(BlocksStored("GPU", 0, h, None, 0, engine_hashes=[100 + x for x in h])))
    pricer = Pricer(PriceConfig())
    ends = {"a": "tcp://a:1", "b": "tcp://b:1"}
    answers = [answer("c", 128), answer("a", 96, 128), answer("b", 80), answer("me", 32)]
    p = fetch_plan(answers, "me", 0, ends, t, h, 16, pricer, 100_000.0)
    # "c" holds most but has no endpoint; "a" holds 96 on GPU (the rest on CPU: not fetched)
    assert (p.source, p.endpoint, p.tokens, p.held_tokens) == ("a", "tcp://a:1", 96, 32)
    assert p.engine_hashes == [101, 102, 103, 104, 105, 106]
    assert p.gain_s == 64 * pricer.per_token and p.copy_s == 64 / 100_000.0 and p.net_s > 0
    # chosen "a" (128 resumable): "c" holds as much but has no endpoint, "b" less
    assert fetch_plan(answers, "a", 0, ends, t, h, 16, pricer, 100_000.0) is None
    # nobody with an endpoint holds more than the chosen one
    assert fetch_plan([answer("a", 32), answer("me", 32)], "me", 0, ends, t, h, 16, pricer, 1e5) is None
    # the table lacks the source's blocks past the chosen one's: nothing to name
    assert fetch_plan(answers, "me", 0, ends, t, h[:1] + [77] * 7, 16, pricer, 1e5) is None
    # engines hashing apart: no hint
    t.conflicts = 1
    assert fetch_plan(answers, "me", 0, ends, t, h, 16, pricer, 1e5) is None


def test_a_dp_ranks_endpoint_is_its_own():
    ends = {"a": "tcp://a:1", "b#1": "tcp://b1:1"}
    assert source_endpoint(ends, "a", 0) == "tcp://a:1"
    assert source_endpoint(ends, "a", 1) is None  # another rank's cache: not rank 0's endpoint
    assert source_endpoint(ends, "b", 1) == "tcp://b1:1" and source_endpoint(ends, "b", 0) is None
