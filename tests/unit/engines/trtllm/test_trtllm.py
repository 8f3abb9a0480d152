"""TensorRT-LLM adapter: pull-API decoding, the mirror's rules, the poll relay, conformance fixtures
and the shadow audit against the simulated KV cache manager (kvidx/engines/trtllm/sim.py).

Regenerate the conformance fixtures (the engine's recording, its own final state, and the mirror
counters' regression snapshot) with `KVIDX_REGEN_FIXTURES=1 pytest tests/unit/engines/trtllm/test_trtllm.py`
and review the diff; a missing file fails.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from kvidx.core import walk
from kvidx.core.hashing import prompt_hashes
from kvidx.core.shard import ModelShard
from kvidx.engines import RelayOptions
from kvidx.engines.trtllm.mirror import TrtllmMirror
from kvidx.engines.trtllm.relay import TrtllmPollRelay, read_polls
from kvidx.engines.trtllm.sim import SimTrtllmEngine, block_key_hash, record
from kvidx.engines.trtllm.wire import (
    Removed,
    Stored,
    UnsupportedVersion,
    Updated,
    check_version,
    decode_event,
    split_poll,
)
from kvidx.shadow import run_shadow_engine
from schemas.answers import Tier
from schemas.events import BlocksRemoved, BlocksStored, ReplicaCleared
from tests.helpers import FIXTURES, ListSink

FIX = FIXTURES / "trtllm-1.2"
B = 32


def run_shadow(events, requests, index_block_size=16, engine_block=None):
    """`kvidx shadow --engine trtllm` as a call: (agreement, shard, the relay)."""
    res, shard = run_shadow_engine("trtllm", events, requests, index_block_size=index_block_size,
                                   options=RelayOptions(engine_block_size=engine_block))
    return res.agreement, shard, res.relays["trtllm"]


def chat(seed: int, n_conv: int = 12, turns: int = 5) -> list[tuple[list[int], list[int]]]:
    """Multi-turn chat: each turn extends the conversation's history (prompt + output) by new tokens."""
    rnd = random.Random(seed)
    hist = [[rnd.randrange(1000) for _ in range(rnd.randrange(20, 90))] for _ in range(n_conv)]
    reqs = []
    for _ in range(turns):
        for c in rnd.sample(range(n_conv), n_conv):
            prompt = hist[c] + [rnd.randrange(1000) for _ in range(rnd.randrange(3, 40))]
            out = [rnd.randrange(1000) for _ in range(rnd.randrange(1, 40))]
            reqs.append((prompt, out))
            hist[c] = prompt + out
    return reqs


def stored(parent, blocks, eid=1, window=4096, rank=None, level=0, priority=35):
    ev = {"event_id": eid, "data": {"type": "stored", "parent_hash": parent, "blocks": [
        {"type": "stored_block", "block_hash": h,
         "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in toks],
         "cache_level": level, "priority": priority} for h, toks in blocks]}, "window_size": window}
    if rank is not None:
        ev["attention_dp_rank"] = rank
    return ev


def removed(hashes, eid=1, window=4096):
    return {"event_id": eid, "data": {"type": "removed", "block_hashes": hashes}, "window_size": window}


def updated(h, old, new, eid=1, priority=None):
    return {"event_id": eid, "data": {"type": "updated", "block_hash": h,
                                      "cache_level": {"type": "event_diff", "new_value": new,
                                                      "old_value": old},
                                      "priority": priority}, "window_size": 4096}


BIG = (1 << 64) - 12345  # hashes are unsigned 64-bit, often >= 2^63


# ---- decoding -----------------------------------------------------------------------------------
def test_decode_serializer_shapes_u64_and_null_priority():
    body = json.dumps([stored(None, [(BIG, list(range(32)))], eid=7, rank=2),
                       updated(BIG, 0, 1, eid=8), removed([BIG, 5], eid=9)]).encode()
    evs = [decode_event(r) for r in split_poll(body)]
    assert isinstance(evs[0].data, Stored) and evs[0].data.blocks[0].block_hash == BIG
    assert evs[0].attention_dp_rank == 2 and evs[1].attention_dp_rank is None
    assert isinstance(evs[1].data, Updated) and evs[1].data.priority is None  # fixed releases: null
    assert evs[1].data.cache_level.new_value == 1
    assert isinstance(evs[2].data, Removed) and evs[2].data.block_hashes == [BIG, 5]


def test_version_check():
    assert check_version("1.2.0rc2") == "1.2"
    assert check_version("1.0.0") == "1.0"
    for bad in ("0.9.0", "2.0.0", "", "dev"):
        with pytest.raises(UnsupportedVersion, match="not a version this relay was checked against"):
            check_version(bad)


def test_sim_hash_and_serialization_match_the_engine_rules():
    eng = SimTrtllmEngine(num_blocks=8, block_size=4)
    first = eng.poll()
    assert first == [{"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [8, 0]},
                      "window_size": 1 << 20}]
    eng.generate([1, 2, 3, 4, 5, 6], [7])
    evs = eng.poll()
    # context: one full block of n-1 = 5 tokens; release: the partial block [5, 6] (7 tokens - 1)
    assert [list(e) for e in evs] == [["event_id", "data", "window_size"]] * 2
    assert evs[0]["data"]["parent_hash"] is None
    h0 = block_key_hash((1, 2, 3, 4), 0)
    assert evs[0]["data"]["blocks"][0]["block_hash"] == h0
    assert list(evs[0]["data"]["blocks"][0]) == ["type", "block_hash", "tokens", "cache_level", "priority"]
    assert evs[1]["data"]["parent_hash"] == h0
    assert [t["token_id"] for t in evs[1]["data"]["blocks"][0]["tokens"]] == [5, 6]


# ---- mirror rules -------------------------------------------------------------------------------
def apply(mirror, *events):
    return mirror.apply([decode_event(e).data for e in events])


def test_removal_cascades_to_the_subtree():
    m = TrtllmMirror(16, block_size=32)
    apply(m, stored(None, [(11, range(32)), (12, range(32, 64))]), stored(11, [(13, range(100, 132))]))
    assert m.live_blocks() == 3
    out = apply(m, removed([11]))  # even if descendants are not listed, they go with it
    assert m.live_blocks() == 0 and m.stats["cascaded"] == 2
    assert sum(len(e.hashes) for e in out if isinstance(e, BlocksRemoved)) == 6


def test_cache_level_move_is_never_a_loss():
    shard = ModelShard("m", 16)
    relay = TrtllmPollRelay("m", "r", 16, 32, epoch=0)
    toks = list(range(64))
    polls = [[stored(None, [(BIG, toks[:32]), (BIG - 1, toks[32:])], eid=0)],
             [updated(BIG - 1, 0, 1, eid=1)], [updated(BIG - 1, 1, 0, eid=2)]]
    for i, p in enumerate(polls):
        out = relay.on_poll(p, i)
        for b in out.batches:
            shard.apply(b, 0)
            if i == 1:  # stored in CPU before removed from GPU, in one batch
                kinds = [(type(e).__name__, e.tier) for e in b.events]
                assert kinds == [("BlocksStored", "CPU"), ("BlocksRemoved", "GPU")]
        hashes = prompt_hashes(toks + [999], 16)
        assert walk.credited(shard, hashes, 65, "r") == 64
        if i == 1:
            ans = walk.lookup(shard, hashes, 65, 0)[0]
            assert ans.tiers == [Tier("GPU", 32), Tier("CPU", 32)]
    assert relay.ranks[0].mirror.stats["moved"] == 2


def test_partial_block_and_token_granular_credit():
    """The partial last block is indexed: its full index blocks as blocks, the tokens past them as
    partial keys, so the shard credits to the token (unit 1) below the last prompt token at any index
    block size; a router's block hashes (no tokens) credit whole index blocks."""
    for ibs in (1, 4, 16):
        relay = TrtllmPollRelay("m", "r", ibs, 32, epoch=0)
        shard = ModelShard("m", ibs)
        toks = list(range(45))
        for b in relay.on_poll([stored(None, [(1, toks[:32]), (2, toks[32:])], eid=0)], 0).batches:
            assert all(e.block_size == 1 for e in b.events if not e.tail)  # "resumes at any token"
            assert sum(len(e.hashes) for e in b.events if e.tail) == 45 % ibs  # the tail's prefixes
            shard.apply(b, 0)
        prompt = toks + [500, 501]  # the engine matches 45 of its 46 usable tokens
        assert walk.credited(shard, prompt_hashes(prompt, ibs, tails=True), len(prompt), "r") == 45
        assert walk.credited(shard, prompt_hashes(prompt, ibs), len(prompt), "r") == 45 // ibs * ibs
        # a prompt ending inside the cached partial block: at most n - 1 tokens
        assert walk.credited(shard, prompt_hashes(toks[:40], ibs, tails=True), 40, "r") == 39
        # leaving the partial block after 3 of its tokens: those 3 count where they are in its tail
        # (past its last full index block); inside a full index block nothing else shares, the block
        # boundary before them
        other = toks[:35] + [900] * 10
        want = 35 if 35 >= 45 // ibs * ibs else 35 // ibs * ibs
        assert walk.credited(shard, prompt_hashes(other, ibs, tails=True), len(other), "r") == want
        # the full block alone (no other path shares it): a prompt leaving it inside an index block
        # is credited to the index block before (the engine reuses up to the token: the safe side)
        inside = toks[:20] + [900] * 30
        assert walk.credited(shard, prompt_hashes(inside, ibs, tails=True), len(inside), "r") \
            == 20 // ibs * ibs


def test_taken_over_leaf_is_retracted_when_its_successor_is_stored():
    m = TrtllmMirror(1, block_size=32)
    base = list(range(32))
    apply(m, stored(None, [(1, base), (2, [7] * 20)]))  # a partial leaf of 20 tokens
    # a later request matched 12 of its tokens, took the leaf over privately (no event) and stored its own
    apply(m, stored(1, [(3, [7] * 12 + [8] * 20)]))
    assert 2 not in m.nodes and m.stats["taken_over"] == 1 and 3 in m.nodes
    # a sibling sharing nothing is left alone; a non-leaf best match is copied, not taken over
    apply(m, stored(1, [(4, [9] * 32)]), stored(3, [(5, [1] * 32)]))
    apply(m, stored(1, [(6, [7] * 12 + [8] * 5 + [2] * 15)]))
    assert {3, 4, 5, 6} <= set(m.nodes)


def test_relay_gap_restart_windows_and_dp_ranks():
    relay = TrtllmPollRelay("m", "r", 16, 32, epoch=0)
    created = {"event_id": 0, "data": {"type": "created", "num_blocks_per_cache_level": [8, 0]},
               "window_size": 4096}
    small = {**created, "window_size": 512, "event_id": 1}
    out = relay.on_poll([created, small, stored(None, [(1, range(32))], eid=2),
                         stored(None, [(9, range(32))], eid=3, window=512)], 1)
    assert relay.counters["other_window"] == 1 and relay.ranks[0].mirror.live_blocks() == 1
    out = relay.on_poll([stored(None, [(2, range(50, 82))], eid=6)], 2)  # ids 4, 5 lost
    assert relay.counters["gaps"] == 1
    assert any(isinstance(e, ReplicaCleared) and e.reason == "gap_unfilled"
               for b in out.batches for e in b.events)
    assert set(relay.ranks[0].mirror.nodes) == {2}
    out = relay.on_poll([created], 3)  # ids back to 0: a restarted engine
    assert relay.counters["restarts"] == 1 and relay.ranks[0].mirror.live_blocks() == 0
    out = relay.on_poll([stored(None, [(1, range(32))], eid=0, rank=1), b'{"event_id": "x"}'], 4)
    assert {b.dp_rank for b in out.batches} == {1} and out.dead[0].reason == "malformed_event"
    out = relay.poll_failed("http_500", 5)  # 1.2.0rc2: a failed poll's events are lost: cleared now
    assert {b.dp_rank for b in out.batches} == {0, 1}


# ---- conformance fixtures -------------------------------------------------------------------------
FIXTURE_README = """# TensorRT-LLM 1.2 conformance fixture (generated)

Generated by tests/unit/engines/trtllm/test_trtllm.py (`KVIDX_REGEN_FIXTURES=1`) from
kvidx/engines/trtllm/sim.py, which emits events by TensorRT-LLM's own serialization rules:
tensorrt_llm/_utils.py KVCacheEventSerializer
(keys `event_id`, `data`, `window_size`, `attention_dp_rank` only when set; data `created` /
`stored` {parent_hash, blocks [{type: stored_block, block_hash, tokens [{type: unique_token,
token_id, token_extra_id}], cache_level, priority}]} / `removed` {block_hashes} / `updated`
{block_hash, cache_level and priority as {type: event_diff, new_value, old_value} or null}),
kvCacheEventManager.cpp (ids +1 per event, consecutive removals merged), kvCacheManager.cpp
(BlockKeyHasher u64 hashes, partial last block stored, partial reuse, subtree eviction, host offload
with priority >= 30 as `updated` 0 -> 1 and onboarding as 1 -> 0), as of TensorRT-LLM 1.2
(`"priority": null` on level moves, as after PR #11576).

- events.jsonl / requests.jsonl: the pull-API recording format (../../../../shared/fixtures/README.md),
  one poll after each request, requests one at a time; `gpu` without a host tier, `host` with one.
  Each request's `cached_tokens` is the simulated engine's own answer.
- engine.json: the simulated engine's own final state, from its radix tree (not from kvidx's relay):
  its counters and every block it holds, engine hash -> cache level. The test's expected answers
  come from these two files: the relay's mirror must hold exactly the engine's blocks at their
  levels, and the index must credit every request exactly the engine's cached_tokens.
- snapshot.json: a regression snapshot of the relay mirror's own counters (written by the code under
  test, so it proves nothing by itself: it shows a change). A missing snapshot fails the test;
  it is rewritten only with `KVIDX_REGEN_FIXTURES=1`, and its diff reviewed.
"""


def _generate(case: str, host: int) -> None:
    """Record the case from the simulated engine: events, requests, the engine's own final state,
    and the mirror counters' regression snapshot."""
    d = FIX / case
    d.mkdir(parents=True, exist_ok=True)
    eng = SimTrtllmEngine(num_blocks=48, host_blocks=host, block_size=B, window_size=4096, version="1.2.0")
    record(eng, chat(7, n_conv=10, turns=5), str(d / "events.jsonl"), str(d / "requests.jsonl"), t0=1.75e9)
    blocks = {str(b.hash): b.level for b in eng.blocks if b.key and b.prev is not None}  # in its tree
    (d / "engine.json").write_text(json.dumps({"stats": eng.stats, "blocks": blocks}, indent=1) + "\n")
    snapshot = {"mirror_stats": _full_replay(d).ranks[0].mirror.stats}
    (d / "snapshot.json").write_text(json.dumps(snapshot, indent=1) + "\n")


def _full_replay(d: Path) -> TrtllmPollRelay:
    """Every poll of the recording through a relay (the shadow stops at the last request's send)."""
    relay = TrtllmPollRelay("model", "trtllm", 1, B, epoch=0)
    for ns, events, _ in read_polls(d / "events.jsonl"):
        relay.on_poll(events, ns)
    return relay


def _credits(d: Path) -> list[dict]:
    reqs = [json.loads(x) for x in (d / "requests.jsonl").read_text().splitlines()]
    polls = list(read_polls(d / "events.jsonl"))
    relay = TrtllmPollRelay("model", "trtllm", 1, B, epoch=0)
    shard = ModelShard("model", 1)
    out, k = [], 0
    for r in reqs:
        while k < len(polls) and polls[k][0] <= r["t_send"] * 1e9:
            for b in relay.on_poll(polls[k][1], polls[k][0]).batches:
                shard.apply(b, 0)
            k += 1
        toks = r["prompt_token_ids"]
        out.append({"i": r["i"], "cached_tokens": r["cached_tokens"],
                    "credited": walk.credited(shard, prompt_hashes(toks, 1), len(toks), "trtllm")})
    return out


@pytest.mark.parametrize("case,host", [("gpu", 0), ("host", 160)])
def test_conformance_fixture(case, host):
    d = FIX / case
    if os.environ.get("KVIDX_REGEN_FIXTURES"):
        _generate(case, host)
        (FIX / "README.md").write_text(FIXTURE_README)
    for name in ("events.jsonl", "requests.jsonl", "engine.json", "snapshot.json"):
        if not (d / name).exists():
            pytest.fail(f"{d / name} is missing: regenerate with KVIDX_REGEN_FIXTURES=1 and review the diff")
    engine = json.loads((d / "engine.json").read_text())
    reqs = [json.loads(x) for x in (d / "requests.jsonl").read_text().splitlines()]
    # the engine's answers: its blocks (hash -> level) and each request's cached tokens
    mirror = _full_replay(d).ranks[0].mirror
    assert {str(h): (0 if n.tier == "GPU" else 1) for h, n in mirror.nodes.items()} == engine["blocks"]
    assert _credits(d) == [{"i": r["i"], "cached_tokens": r["cached_tokens"], "credited": r["cached_tokens"]}
                           for r in reqs]
    ag, _, _ = run_shadow(d / "events.jsonl", d / "requests.jsonl", index_block_size=1, engine_block=B)
    prompt = sum(len(r["prompt_token_ids"]) for r in reqs)
    reused = sum(r["cached_tokens"] for r in reqs)
    assert ag.summary() == {"requests": len(reqs), "prompt_tokens": prompt, "reused_tokens": reused,
                            "credited_tokens": reused, "reuse_rate": round(reused / prompt, 6), "recall": 1.0,
                            "over_credit": 0.0, "exact_requests": len(reqs)}
    # the regression snapshot of the mirror's counters (written by the code under test)
    assert mirror.stats == json.loads((d / "snapshot.json").read_text())["mirror_stats"]
    # the recording exercises partial-block reuse, and the host tier where there is one
    st = engine["stats"]
    assert st["partial_matches"] > 0 and st["taken_over"] > 0 and st["requests"] == len(reqs)
    if host:
        assert st["offloaded"] > 0 and st["onboarded"] > 0 and mirror.stats["moved"] > 0
        assert set(engine["blocks"].values()) == {0, 1}


# ---- shadow ---------------------------------------------------------------------------------------
def test_shadow_exact_with_partial_reuse_at_any_index_block_size(tmp_path):
    eng = SimTrtllmEngine(num_blocks=40, block_size=B)
    ev, rq = tmp_path / "events.jsonl", tmp_path / "requests.jsonl"
    record(eng, chat(3, n_conv=14, turns=6), str(ev), str(rq))
    assert eng.stats["partial_matches"] > 10 and eng.stats["evicted"] > 0
    ag1, shard1, _ = run_shadow(ev, rq, index_block_size=1)
    assert ag1.exact == ag1.requests  # token-exact, including the partially reused blocks
    # with the default index block, partial keys make it token-exact too, at a fraction of the entries
    ag16, shard16, _ = run_shadow(ev, rq, index_block_size=16)
    assert ag16.exact == ag16.requests and ag16.over_tokens == 0
    entries = [sum(len(d) for g in s.groups.values() for d in g.tiers.values()) for s in (shard1, shard16)]
    assert 0 < shard16.tail_keys and entries[1] * 4 < entries[0]


def test_shadow_host_tier_self_eviction_and_rc2_serializer_bug(tmp_path, monkeypatch):
    """With a small host pool, onboarding a host block can offload a GPU block into the host slot of
    the same prompt's next block, which the engine then frees (subtree eviction during admission).
    The index keeps the host queue as the engine does (HostLoads) and credits such a hit only as far
    as the engine's walk gets: exact; without that queue it over-credits them. With 1.2.0rc2 the polls
    that carry level moves fail: the relay clears the replica and never over-credits."""
    for version, host in (("1.2.0", 24), ("1.2.0rc2", 24)):
        eng = SimTrtllmEngine(num_blocks=48, host_blocks=host, block_size=B, version=version)
        ev, rq = tmp_path / f"{version}.events.jsonl", tmp_path / f"{version}.requests.jsonl"
        reqs = chat(1, n_conv=12, turns=5)
        record(eng, reqs, str(ev), str(rq))
        ag, shard, relay = run_shadow(ev, rq, index_block_size=1)
        s = ag.summary()
        if version == "1.2.0":
            assert s["recall"] == 1.0 and s["over_credit"] == 0.0 and shard.host_orders, s
            with monkeypatch.context() as m:  # the same stream without the host queue
                m.setattr(ModelShard, "_host_tier", lambda self, st, blocks: None)
                ag0, _, _ = run_shadow(ev, rq, index_block_size=1)
            assert ag0.summary()["recall"] == 1.0 and 0 < ag0.summary()["over_credit"] < 0.1
        else:
            assert relay.counters["poll_errors"] > 0 and s["over_credit"] == 0.0


def test_play_recording_through_a_sink(tmp_path):
    eng = SimTrtllmEngine(num_blocks=64, block_size=8)
    ev, rq = tmp_path / "e.jsonl", tmp_path / "r.jsonl"
    record(eng, chat(5, n_conv=4, turns=3), str(ev), str(rq))

    sink = ListSink()
    from kvidx import engines
    from relays import poller

    n = poller.play(engines.get("trtllm"), ev, "m", sink, 8, None, engines.RelayOptions(engine_block_size=8))
    assert n == len(list(read_polls(ev))) and not sink.dead
    assert any(isinstance(e, BlocksStored) and e.block_size == 1 for b in sink.batches for e in b.events)
