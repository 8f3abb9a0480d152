"""The compiled answer writer (kvidx.core.walk.lookup_json) against the typed answer it stands in for:
on random shards of the kind it takes (one full-attention group, one tier; engine block sizes,
token-granular replicas, recompute tails, pending routes with prefill in flight, names needing JSON
escapes), QueryPipeline.answer_json's bytes must decode to exactly QueryPipeline.answer's answer,
for lookups, ranked lookups and top_k; and shards it does not take fall back to the typed answer."""

import json
import os
import random

import msgspec
import pytest

import index_service.query as query_mod
from index_service.query import QueryPipeline
from index_service.store import ShardStore
from kvidx import index
from kvidx.core import maskmap, walk
from schemas.events import SCHEMA_VERSION, BlocksRemoved, BlocksStored, EventBatch

NATIVE = maskmap.lookup_json is not None
if not NATIVE and os.environ.get("KVIDX_REQUIRE_NATIVE") == "1" and os.environ.get("KVIDX_NATIVE") != "0":
    raise ImportError("KVIDX_REQUIRE_NATIVE=1 but kvidx_native has no lookup_json")
NOW = 1_700_000_100.25


def _store(r: random.Random, tier: str = "GPU") -> tuple[ShardStore, list[list[int]]]:
    store = ShardStore(16)
    roots = [[r.getrandbits(64) for _ in range(r.randint(1, 10))] for _ in range(4)]
    chains = [root + [r.getrandbits(64) for _ in range(r.randint(0, 10))] for root in roots for _ in range(3)]
    names = ['r"0', "r\\1", "rép-2", "r\n3"] + [f"tcp://10.0.0.{i}:5557" for i in range(r.randint(1, 70))]
    seqs: dict[str, int] = {}
    for _ in range(300):
        rep = r.choice(names)
        c = r.choice(chains)
        ev = (BlocksStored(tier, 0, c[:r.randint(1, len(c))], None, 0,
                           block_size=r.choice([0, 0, 0, 1]))  # 1: token-granular partial reuse
              if r.random() < 0.75 else BlocksRemoved(tier, 0, r.sample(c, r.randint(1, len(c)))))
        seq = seqs.get(rep, -1) + 1
        seqs[rep] = seq
        ets = NOW - r.uniform(0, 30)
        store.apply(EventBatch(SCHEMA_VERSION, "m", rep, 0, 1, seq, ets, ets, r.choice([16, 32, 64]), [ev],
                               recompute_tokens=r.choice([1, 1, 2])), now=ets + r.uniform(0, 0.01))
    shard = store.shards["m"]
    for _ in range(r.randint(0, 3)):  # routed prompts still pending, with prefill in flight
        c = r.choice(chains)
        st = r.choice([s for s in shard.by_slot if s is not None])
        shard.add_pending(st.replica, st.dp_rank, c, 16 * len(c) + r.randint(0, 15), r.randint(0, 64),
                          NOW + 60)
    return store, chains + [[r.getrandbits(64)]]


def _both(pipe: QueryPipeline, shard, hashes, n, rank, top_k, monkeypatch):
    monkeypatch.setattr(query_mod.time, "time", lambda: NOW)
    body, best, count, below = pipe.answer_json(shard, hashes, n, rank, top_k)
    answer = pipe.answer(shard, hashes, n, rank, top_k)
    assert below == index.below_gpu(answer.replicas)  # the tokens below GPU memory: the typed answer's
    return json.loads(body), best, count, msgspec.to_builtins(answer)


@pytest.mark.skipif(not NATIVE, reason="kvidx_native is not built here")
@pytest.mark.parametrize("seed", range(8))
def test_compiled_answers_are_the_typed_answers(seed, monkeypatch):
    r = random.Random(seed)
    store, prompts = _store(r, tier=r.choice(["GPU", "CPU"]))
    pipe = QueryPipeline(store)
    shard = store.shards["m"]
    if seed % 2:  # the replicas' fields by attribute lookup (no ReplicaFields): the same answers
        shard.replica_fields = None
    credited = 0
    for hashes in prompts:
        n = 16 * len(hashes) + r.randint(0, 20)
        for rank, top_k in [(False, None), (True, None), (False, 3), (True, 2)]:
            got, best, count, want = _both(pipe, shard, hashes, n, rank, top_k, monkeypatch)
            assert got == want
            assert count == len(want["replicas"])
            assert best == (want["replicas"][0]["resumable_tokens"] if want["replicas"] else 0)
            credited += sum(a["resumable_tokens"] for a in want["replicas"])
    assert credited > 0  # the shards hold the prompts: not a comparison of empty answers


def test_shards_it_does_not_take_fall_back_to_the_typed_answer(monkeypatch):
    r = random.Random(1)
    store, prompts = _store(r)
    shard = store.shards["m"]
    store.apply(EventBatch(SCHEMA_VERSION, "m", "x", 0, 1, 0, NOW, NOW, 16,
                           [BlocksStored("CPU", 0, prompts[0][:2], None, 0)]))  # a second tier
    assert walk.lookup_json(shard, prompts[0], 100, NOW, 1e-4, {}) is None
    pipe = QueryPipeline(store)
    got, best, count, want = _both(pipe, shard, prompts[0], 16 * len(prompts[0]), False, None, monkeypatch)
    assert got == want and count == len(want["replicas"])


@pytest.mark.skipif(not NATIVE, reason="kvidx_native is not built here")
def test_partial_blocks_in_the_compiled_answer(monkeypatch):
    """Replicas with partial-block keys (SGLang page 1 through its relay): the compiled answer counts
    the partial block's tokens as the typed one does, for prompts hashed with their tokens."""
    from kvidx.core.hashing import prompt_hashes
    from kvidx.engines.contract import zmq_replay
    from kvidx.engines.sglang.relay import SglangPublisherRelay
    from kvidx.engines.sglang.sim import SimSglangEngine, record, stepping_clock
    from kvidx.sim.prompts import chat_requests

    store = ShardStore(16)
    for rep in range(3):
        eng = SimSglangEngine(num_pages=3000, page_size=1, endpoint=None, clock=stepping_clock())
        frames, _ = record(eng, chat_requests(rep, 60), endpoint=f"tcp://r{rep}:1")
        def relay(ep):
            return SglangPublisherRelay("m", ep, 16, engine_version="0.5.23", epoch=0)

        for t, batches in zmq_replay(frames, relay):
            for b in batches():
                store.apply(b, now=NOW - 1 + t / 1e12)
    shard = store.shards["m"]
    assert shard.tail_keys > 0
    pipe = QueryPipeline(store)
    partial = 0
    for p, o in chat_requests(1, 60):
        toks = p + o + [5, 6]
        hashes = prompt_hashes(toks, 16, tails=True)
        for rank, top_k in [(False, None), (True, None), (False, 2)]:
            got, best, count, want = _both(pipe, shard, hashes, len(toks), rank, top_k, monkeypatch)
            assert got == want
        partial += sum(a["cached_tokens"] % 16 != 0 for a in want["replicas"])
    assert partial > 0  # partial blocks were counted, not only whole ones
