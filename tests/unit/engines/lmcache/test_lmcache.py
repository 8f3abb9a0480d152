"""LMCache (kvidx/engines/lmcache/chunks.py, kvidx/engines/lmcache/controller.py): stores
re-published through vLLM placed by
tokens (never by their parent), upper-bound tier with TTL and capacity, the controller's admit/evict
messages, bad input, and the generated conformance stream of tests/fixtures/lmcache-0.5.6/."""

from __future__ import annotations

import json
import random
import sys

import pytest

from kvidx.core import walk
from kvidx.core.hashing import prompt_hashes
from kvidx.core.shard import ModelShard
from kvidx.engines.contract import Frame
from kvidx.engines.lmcache.chunks import LmcacheConfig, location_tier, mark_upper_bound
from kvidx.engines.lmcache.controller import LmcacheControllerRelay, decode_controller, parse_key
from kvidx.engines.recording import read_frames
from kvidx.engines.vllm.mirror import VllmMirror
from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.engines.vllm.wire import decode_payload, is_lmcache_store
from schemas.answers import Freshness, ReplicaAnswer, Tier
from schemas.events import BlocksRemoved, BlocksStored
from tests.helpers import FIXTURES

LM = FIXTURES / "lmcache-0.5.6"
sys.path.insert(0, str(FIXTURES / "vllm-variants"))
sys.path.insert(0, str(LM))
import engine_wire as ew  # noqa: E402
import make_lmcache as make_lm  # noqa: E402

rng = random.Random(5)
T = [rng.randrange(1024) for _ in range(512)]
H = prompt_hashes(T, 16)


def dec(events):
    return decode_payload(ew.payload(events)).events


def stored(out, tier="CPU"):
    return [h for e in out if isinstance(e, BlocksStored) and e.tier == tier for h in e.hashes]


def removed(out, tier="CPU"):
    return [h for e in out if isinstance(e, BlocksRemoved) and e.tier == tier for h in e.hashes]


def test_lmcache_events_are_recognised():
    (e,) = dec(ew.lmcache_store_call(T[:64], 64, 0, ew.lmcache_hash))
    assert is_lmcache_store(e) and e.medium == "cpu" and e.group_idx is None
    (g,) = dec([ew.BlockStored([1], None, T[:32], 32, None, "CPU", None, [None], 0, "full_attention")])
    assert not is_lmcache_store(g)


def test_store_call_from_the_start_and_extra_token():
    m = VllmMirror(16)
    evs = dec(ew.lmcache_store_call(T[:200], 64, 0, ew.lmcache_hash))
    assert [len(e.token_ids) for e in evs] == [65, 65, 65, 8]  # non-last chunks carry one extra id
    out = m.apply(evs, now=0.0)
    assert stored(out) == H[:12] and m.lmcache.stats["lmcache_orphans"] == 0


def test_parent_zero_chunk_placed_by_what_came_before_not_its_parent():
    m = VllmMirror(16)
    m.apply(dec(ew.lmcache_store_call(T[:200], 64, 0, ew.lmcache_hash)), now=0.0)
    call2 = dec(ew.lmcache_store_call(T[:320], 64, 3, ew.lmcache_hash))
    assert call2[0].parent_block_hash == 0  # prev_key starts at 0 in every call (cache_engine.py)
    out = m.apply(call2, now=1.0)
    assert stored(out) == H[12:20]


def test_chunk_after_a_last_chunk_is_placed_through_vllm_chains():
    # the previous call ended on a full chunk (no extra id): the GPU chain of the same tokens places it
    m = VllmMirror(16)
    m.apply(dec(ew.lmcache_store_call(T[:128], 64, 0, ew.lmcache_hash)), now=0.0)
    g = [ew.external(d) for d in ew.vllm_digests(T[:256], 32, "sha256", "vllm-none-hash")]
    m.apply(dec([ew.BlockStored(g, None, T[:256], 32, None, "GPU", None, [None] * 8, 0, "full_attention")]))
    out = m.apply(dec(ew.lmcache_store_call(T[:256], 64, 2, ew.lmcache_hash)), now=1.0)
    assert stored(out) == H[8:16]


def test_unplaceable_chunk_is_counted_and_skipped():
    m = VllmMirror(16)
    evs = dec(ew.lmcache_store_call(T[:256], 64, 2, ew.lmcache_hash))
    # the first chunk says parent 0, the second its real parent: neither is placed by its parent
    assert m.apply(evs, now=0.0) == [] and m.lmcache.stats["lmcache_orphans"] == 2


def test_ttl_and_capacity_age_chunks_out():
    m = VllmMirror(16, lmcache=LmcacheConfig(ttl_s=10.0))
    m.apply(dec(ew.lmcache_store_call(T[:128], 64, 0, ew.lmcache_hash)), now=100.0)
    assert m.apply([], now=105.0) == []
    m.apply(dec(ew.lmcache_store_call(T[:64], 64, 0, ew.lmcache_hash)), now=105.0)  # stored again: refreshed
    out = m.apply([], now=111.0)
    assert removed(out) == H[4:8] and m.lmcache.stats["lmcache_aged_out"] == 1
    assert removed(m.apply([], now=116.0)) == H[:4]
    c = VllmMirror(16, lmcache=LmcacheConfig(ttl_s=None, capacity_blocks=8))
    out = c.apply(dec(ew.lmcache_store_call(T[:192], 64, 0, ew.lmcache_hash)), now=0.0)
    assert stored(out) == H[:12] and removed(out) == H[:4]
    assert c.lmcache.stats["lmcache_capacity_evicted"] == 1


def test_gpu_and_lmcache_copies_are_separate_tiers():
    m = VllmMirror(16)
    g = [ew.external(d) for d in ew.vllm_digests(T[:64], 32, "sha256", "vllm-none-hash")]
    m.apply(dec([ew.BlockStored(g, None, T[:64], 32, None, "GPU", None)]))
    out = m.apply(dec(ew.lmcache_store_call(T[:64], 64, 0, ew.lmcache_hash)), now=0.0)
    assert stored(out) == H[:4]
    assert removed(m.apply(dec([ew.BlockRemoved([g[1]], "GPU")])), "GPU") == H[2:4]
    assert m.lmcache.live  # the LMCache copy stays


def test_bad_lmcache_events_are_set_aside_and_the_relay_goes_on():
    r = VllmPublisherRelay("m", "r", 16, engine_version="0.32.0")
    hashes_mode = ew.BlockStored([5], None, [2**40 + i for i in range(65)], 64, None, "cpu", None)
    too_many = ew.BlockStored([5], None, T[:70], 64, None, "cpu", None)
    two = ew.BlockStored([5, 6], None, T[:65], 64, None, "cpu", None)
    reasons = []
    for i, ev in enumerate([hashes_mode, too_many, two]):
        out = r.on_frame(Frame(b"kv", i, ew.payload([ev]), i, "e"))
        assert not out.dead and out.batches  # each bad event is set aside alone, its batch goes out
        reasons += [d.reason for d in out.set_aside]
    # hash-mode token ids beyond uint32 fail the wire's token-id check already; below it, the mirror's
    assert reasons == ["undecodable_event", "lmcache_token_count", "lmcache_hash_count"]
    m = VllmMirror(16)
    with pytest.raises(Exception) as ei:
        m.lmcache.stored([5], None, [-1] + T[:64], 64, None, [], 0.0)
    assert ei.value.reason == "lmcache_hash_token_ids"
    good = ew.payload(ew.lmcache_store_call(T[:64], 64, 0, ew.lmcache_hash))
    ok = r.on_frame(Frame(b"kv", 3, good, 3, "e"))
    assert ok.batches and not ok.dead


# ---- the controller's admit / evict -------------------------------------------------------------------
def test_controller_message_forms():
    k = ew.lmcache_hash(T[:64])
    new = ew.controller(ew.KVAdmitMsg("inst", 0, k, "LocalDiskBackend", 3))
    old = ew.controller(ew.KVEvictMsgOld("inst", 0, f"vllm@llama@1@0@{k}", "LocalCPUBackend"))
    ops = [ew.KVOpEvent("admit", k, 7), ew.KVOpEvent("evict", k, 8)]
    batched = ew.controller(ew.BatchedKVOperationMsg("inst", 1, "LocalCPUBackend", ops))
    (a,) = decode_controller(new)
    assert (a.admit, a.key, a.location, a.seq_num) == (True, k, "LocalDiskBackend", 3)
    (e,) = decode_controller(old)
    assert (e.admit, e.key) == (False, k)
    assert [(o.admit, o.seq_num) for o in decode_controller(batched)] == [(True, 7), (False, 8)]
    assert parse_key("fmt@m@1@0@ff") == 255
    assert location_tier("LocalCPUBackend") == "CPU" and location_tier("LocalDiskBackend") == "DISK"
    assert location_tier("RemoteBackend") == "POOL"


def test_controller_admit_evict_move_blocks_between_tiers():
    core = VllmPublisherRelay("m", "r", 16, engine_version="0.32.0",
                              lmcache=LmcacheConfig(evictions_reported=True))
    core.on_frame(Frame(b"kv", 0, ew.payload(ew.lmcache_store_call(T[:128], 64, 0, ew.lmcache_hash)), 0, "e"))
    ctl = LmcacheControllerRelay(core)
    k0, k1 = ew.lmcache_hash(T[:64]), ew.lmcache_hash(T[:128])
    out = ctl.on_message(ew.controller(ew.KVAdmitMsg("inst", 0, k1, "LocalDiskBackend", 1)), 10)
    (b,) = out.batches
    assert b.part == 1 and b.seq == 0 and stored(b.events, "DISK") == H[4:8]
    out = ctl.on_message(ew.controller(ew.KVEvictMsg("inst", 0, k1, "LocalCPUBackend", 2)), 11)
    assert removed(out.batches[0].events) == H[4:8]
    out = ctl.on_message(ew.controller(ew.KVEvictMsg("inst", 0, k1, "LocalCPUBackend", 2)), 12)
    assert [d.reason for d in out.dead] == ["out_of_order"] and not out.batches
    out = ctl.on_message(ew.controller(ew.KVAdmitMsg("inst", 0, 12345, "LocalCPUBackend", 3)), 13)
    assert not out.batches and core.mirror.lmcache.stats["lmcache_unknown_key"] == 1
    assert core.mirror.lmcache.unreported_tiers == frozenset()
    for bad, reason in [(b"\x81", "malformed_payload"), (b"x" * (2 << 20), "oversized"),
                        (ew.controller(ew.KVAdmitMsg("i", 0, k0, "")), "missing_field"),
                        (ew._enc.encode({"type": "Nope"}), "unknown_type"),
                        (ew._enc.encode({"type": "KVAdmitMsg", "key": 1.5, "location": "x"}),
                         "malformed_payload")]:
        assert [d.reason for d in ctl.on_message(bad).dead] == [reason]
    assert ctl.on_message(ew._enc.encode({"type": "RegisterMsg", "instance_id": "i"})).batches == []


def test_a_batched_controller_message_sets_a_bad_operation_aside_alone():
    """One operation of a BatchedKVOperationMsg that cannot be read costs that operation only: the
    others are applied; an unreadable admit is skipped, an evict of another kind with a readable key
    evicts it, one whose key cannot be read evicts every chunk of its location (never credits more)."""
    core = VllmPublisherRelay("m", "r", 16, engine_version="0.32.0",
                              lmcache=LmcacheConfig(evictions_reported=True))
    core.on_frame(Frame(b"kv", 0, ew.payload(ew.lmcache_store_call(T[:128], 64, 0, ew.lmcache_hash)), 0, "e"))
    ctl = LmcacheControllerRelay(core)
    k0, k1 = ew.lmcache_hash(T[:64]), ew.lmcache_hash(T[:128])

    def batched(ops: list) -> bytes:
        return ew._enc.encode({"type": "BatchedKVOperationMsg", "instance_id": "inst", "worker_id": 1,
                               "location": "LocalDiskBackend", "operations": ops})

    out = ctl.on_message(batched([{"op_type": "admit", "key": k0, "seq_num": 1},
                                  {"op_type": "admit", "key": "??", "seq_num": 2},
                                  {"op_type": "admit", "key": k1, "seq_num": 3}]), 10)
    assert not out.dead and [(d.reason, d.event, d.position) for d in out.set_aside] == [
        ("undecodable_event", "stored", 1)]
    assert stored(out.batches[0].events, "DISK") == H[:8]  # both good admits applied
    out = ctl.on_message(batched([{"op_type": "teleport", "key": k1, "seq_num": 4}]), 11)
    assert [(d.reason, d.event) for d in out.set_aside] == [("unknown_op", "other")]
    assert removed(out.batches[0].events, "DISK") == H[4:8]  # it may have moved k1 away: dropped
    out = ctl.on_message(batched([{"op_type": "evict", "key": [1], "seq_num": 5}]), 12)
    assert removed(out.batches[0].events, "DISK") == H[:4]  # which chunk? every chunk of the location
    assert core.set_aside[("undecodable_event", "removed")] == 1


def test_mark_upper_bound():
    def answer(resumable: int) -> ReplicaAnswer:
        return ReplicaAnswer("r", 0, 96, [Tier("GPU", 64), Tier("CPU", 32)], resumable, 96, [], 0, 0,
                             False, [], Freshness(None, None, 0, 0, 0))

    assert mark_upper_bound(answer(96), {"CPU"}).upper_bound_tiers == ["CPU"]
    assert mark_upper_bound(answer(64), {"CPU"}).upper_bound is False


# ---- generated conformance stream -------------------------------------------------------------
def test_lmcache_fixture_is_what_the_engine_rules_generate():
    lines = [json.loads(x) for x in (LM / "frames.jsonl").read_text().splitlines()]
    assert lines == make_lm.frames()
    assert json.loads((LM / "expected.json").read_text()) == make_lm.expected()


def test_lmcache_fixture_lookups():
    exp = make_lm.expected()
    shard = ModelShard("m", 16)
    relay = VllmPublisherRelay("m", "node6", 16, engine_version="0.32.0")
    prompt = make_lm.TURN2 + [1]
    h = prompt_hashes(prompt, 16)
    answers = []
    for f in read_frames(LM / "frames.jsonl"):
        out = relay.on_frame(f)
        assert not out.dead
        for b in out.batches:
            shard.apply(b, 0.0)
        (a,) = walk.lookup(shard, h, len(prompt), 0.0)
        answers.append(mark_upper_bound(a, relay.mirror.lmcache.unreported_tiers))
    for a, key in [(answers[1], "after_turn2"), (answers[2], "after_gpu_evictions")]:
        assert a.cached_tokens == exp[key]["turn2_prompt_cached"]
        assert [[t.tier, t.tokens] for t in a.tiers] == exp[key]["tiers"]
    assert answers[2].upper_bound_tiers == exp["after_gpu_evictions"]["upper_bound_tiers"]
    assert answers[1].upper_bound_tiers is None
    assert answers[3].cached_tokens == exp["after_ttl"]["turn2_prompt_cached"]
    st = relay.mirror.lmcache.stats
    assert {k: st[k] for k in exp["mirror"]} == exp["mirror"]
