"""The relay's frame logic (kvidx/engines/contract.py) and the shadow audit (kvidx/shadow.py): what the
index credits vs what the engine reused, on a real vLLM recording and on the simulated engine."""

from __future__ import annotations

import itertools
import random

import msgspec
import pytest

from kvidx.core import walk
from kvidx.core.hashing import prompt_hashes
from kvidx.core.shard import ModelShard
from kvidx.engines.contract import Frame
from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.engines.vllm.sim import SimVllmEngine
from kvidx.shadow import InProcessIndex, run_shadow
from kvidx.sim.prompts import workload_requests
from schemas.events import BlocksStored
from tests.helpers import LLAMA

enc = msgspec.msgpack.encode
rng = random.Random(11)
T = [rng.randrange(1024) for _ in range(128)]
H = prompt_hashes(T, 16)
_ns = itertools.count(1_000_000_000)


def stored_ev(hashes, parent, tokens, bs=16):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": bs, "lora_id": None, "medium": "GPU", "lora_name": None,
            "extra_keys": [None] * len(hashes), "group_idx": 0, "kv_cache_spec_kind": "full_attention"}


def frame(seq, events, rank=0, src="pub", payload=None) -> Frame:
    if payload is None:
        payload = enc([1.7e9 + seq, events, rank] if rank is not None else [1.7e9 + seq, events])
    return Frame(b"kv", seq, payload, next(_ns), "tcp://e:1", src)


def block_frame(seq, i, rank=0, src="pub"):
    """Frame `seq` storing block i of T (engine hash i + 1)."""
    return frame(seq, [stored_ev([i + 1], i or None, T[16 * i:16 * (i + 1)])], rank, src)


def kinds(out):
    return [[type(e).__name__ for e in b.events] for b in out.batches]


def fold(shard: ModelShard, out) -> None:
    for b in out.batches:
        shard.apply(b, 0.0)


# ---- relay ---------------------------------------------------------------------------------------
def test_relay_wraps_canonical_events():
    r = VllmPublisherRelay("m", "rep", 16, epoch=7)
    out = r.on_frame(frame(0, [stored_ev([1, 2], None, T[:32])], rank=2))
    (b,) = out.batches
    assert (b.model, b.replica, b.dp_rank, b.epoch, b.seq, b.block_size) == ("m", "rep", 2, 7, 0, 16)
    assert b.engine_ts == 1.7e9
    (e,) = b.events
    assert isinstance(e, BlocksStored) and e.hashes == H[:2]


def test_relay_rank_defaults_to_configured_dp_rank():
    r = VllmPublisherRelay("m", "rep", 16, dp_rank=3, epoch=0)
    assert r.on_frame(frame(0, [], rank=None)).batches[0].dp_rank == 3


def test_relay_drops_duplicate_seq():
    r = VllmPublisherRelay("m", "rep", 16, epoch=0)
    assert len(r.on_frame(block_frame(0, 0)).batches) == 1
    assert len(r.on_frame(block_frame(1, 1)).batches) == 1
    for dup in (block_frame(1, 1), block_frame(0, 0, src="replay"), block_frame(1, 1, src="replay")):
        out = r.on_frame(dup)
        assert out.batches == [] and out.dead == [] and out.gap is None
    assert r.counters["duplicates"] == 3
    assert r.mirror.stats["extra_copies"] == 0 and r.mirror.live_blocks() == 2


def test_relay_reports_gap_then_accepts_replayed_frames():
    r = VllmPublisherRelay("m", "rep", 16, epoch=0)
    r.on_frame(block_frame(0, 0))
    out = r.on_frame(block_frame(3, 3))
    assert out.gap == (1, 3) and out.batches == [] and r.counters["gaps"] == 1
    # the caller replays 1..3
    got = [r.on_frame(block_frame(s, s, src="replay")) for s in (1, 2, 3)]
    assert [len(o.batches) for o in got] == [1, 1, 1]
    assert [o.batches[0].seq for o in got] == [1, 2, 3]
    assert got[2].batches[0].events[0].hashes == [H[3]]
    assert r.on_frame(block_frame(3, 3)).batches == []  # the live copy of 3 arrives late: a duplicate


def test_relay_gap_unfilled_clears_and_continues():
    shard = ModelShard("m", 16)
    r = VllmPublisherRelay("m", "rep", 16, epoch=5)
    fold(shard, r.on_frame(frame(0, [stored_ev([1, 2], None, T[:32])])))
    assert walk.credited(shard, H, 128) == 32
    f = frame(4, [stored_ev([9], None, T[64:80])])
    assert r.on_frame(f).gap == (1, 4)
    out = r.gap_unfilled(f)
    assert kinds(out) == [["ReplicaCleared"], ["BlocksStored"]]
    assert out.batches[0].events[0].reason == "gap_unfilled"
    assert [(b.epoch, b.seq) for b in out.batches] == [(6, -1), (6, 4)]
    assert r.mirror.live_blocks() == 1
    fold(shard, out)
    assert walk.credited(shard, H, 128) == 0
    assert walk.credited(shard, prompt_hashes(T[64:], 16), 64) == 16
    assert len(r.on_frame(frame(5, [])).batches) == 1  # and carries on


def test_relay_engine_restart():
    shard = ModelShard("m", 16)
    r = VllmPublisherRelay("m", "rep", 16, epoch=0)
    for s in range(3):
        fold(shard, r.on_frame(block_frame(s, s)))
    assert walk.credited(shard, H, 128) == 48
    out = r.on_frame(frame(0, [stored_ev([50], None, T[64:80])]))
    assert kinds(out) == [["ReplicaCleared"], ["BlocksStored"]]
    assert out.batches[0].events[0].reason == "engine_restart"
    assert [(b.epoch, b.seq) for b in out.batches] == [(1, -1), (1, 0)]
    assert r.counters["restarts"] == 1
    fold(shard, out)
    assert walk.credited(shard, H, 128) == 0
    assert len(r.on_frame(frame(1, [])).batches) == 1  # the new epoch's seq 1 is next
    assert r.on_frame(frame(1, [])).batches == []


def test_relay_replayed_seq_0_is_not_a_restart():
    r = VllmPublisherRelay("m", "rep", 16, epoch=0)
    r.on_frame(block_frame(0, 0))
    r.on_frame(block_frame(1, 1))
    assert r.on_frame(block_frame(0, 0, src="replay")).batches == []
    assert r.counters["restarts"] == 0 and r.mirror.live_blocks() == 2


@pytest.mark.parametrize("bad", [b"\xc1garbage", enc([1.0, "nope", 0]), enc({"x": 1})])
def test_relay_malformed_payload_dead_letter_then_next_frame_applies(bad):
    r = VllmPublisherRelay("m", "rep", 16, epoch=0)
    r.on_frame(block_frame(0, 0))
    out = r.on_frame(frame(1, None, payload=bad))
    assert out.batches == [] and out.gap is None
    (d,) = out.dead
    assert d.reason == "malformed_payload" and d.frame.seq == 1
    out = r.on_frame(block_frame(2, 1))
    assert out.gap is None and out.dead == []
    assert out.batches[0].seq == 2 and out.batches[0].events[0].hashes == [H[1]]


def test_relay_mirror_error_sets_the_event_aside():
    r = VllmPublisherRelay("m", "rep", 16, epoch=0)
    out = r.on_frame(frame(0, [stored_ev([1], None, T[:24], bs=24)]))
    assert out.dead == [] and [(d.reason, d.position, d.event) for d in out.set_aside] == [
        ("block_size_mismatch", 0, "stored")]
    assert [b.events for b in out.batches] == [[]] and r.set_aside == {("block_size_mismatch", "stored"): 1}
    out = r.on_frame(frame(1, [stored_ev([1], None, T[:16], bs=16)]))
    assert out.dead == [] and out.gap is None and len(out.batches) == 1


def test_relay_restart_with_malformed_first_frame_keeps_following_frames():
    r = VllmPublisherRelay("m", "rep", 16, epoch=0)
    for s in range(5):
        r.on_frame(block_frame(s, s))
    out = r.on_frame(frame(0, None, payload=b"\xc1"))  # restart; its first batch is bad
    assert kinds(out) == [["ReplicaCleared"]] and out.dead[0].reason == "malformed_payload"
    out = r.on_frame(block_frame(1, 0))
    assert len(out.batches) == 1 and out.batches[0].events[0].hashes == [H[0]]


def test_relay_clear_targets_the_publishers_dp_rank():
    shard = ModelShard("m", 16)
    r = VllmPublisherRelay("m", "rep", 16, epoch=0)  # rank taken from the batches
    fold(shard, r.on_frame(frame(0, [stored_ev([1, 2], None, T[:32])], rank=1)))
    assert walk.credited(shard, H, 128, "rep", 1) == 32
    f = frame(3, [], rank=1)
    r.on_frame(f)
    out = r.gap_unfilled(f)
    assert [b.dp_rank for b in out.batches] == [1, 1]
    fold(shard, out)
    assert walk.credited(shard, H, 128, "rep", 1) == 0


# ---- shadow audit --------------------------------------------------------------------------------
@pytest.mark.parametrize("index_block_size", [16, 32])
def test_shadow_llama_recording(index_block_size):
    agreement, index = run_shadow(str(LLAMA / "frames.jsonl"), str(LLAMA / "requests.jsonl"),
                                  index_block_size=index_block_size)
    s = agreement.summary()
    assert s["requests"] == 201 and s["reused_tokens"] == 24608
    assert s["recall"] >= 0.995 and s["over_credit"] <= 0.005
    assert s["exact_requests"] >= 199
    assert index.dead_letters == 0
    (relay,) = index.relays.values()
    assert relay.counters["gaps"] == 0 and relay.counters["duplicates"] == 0
    assert relay.mirror.stats["remove_unknown"] == 0


def _sim_frames(engine: SimVllmEngine, start: int) -> list[Frame]:
    # every payload the sim publishes is kept in its replay buffer: read it there, no socket needed
    return [Frame(engine.topic, s, p, next(_ns), "sim", "pub") for s, p in engine._buffer if s >= start]


@pytest.mark.parametrize("engine_bs,index_bs", [(32, 16), (32, 32), (16, 16)])
def test_shadow_sim_engine_concurrency_1_is_exact(engine_bs, index_bs):
    engine = SimVllmEngine(num_blocks=1024 // engine_bs * 2, block_size=engine_bs,
                           endpoint=f"inproc://sim-{engine_bs}-{index_bs}")
    try:
        index = InProcessIndex("m", index_bs)
        fed = 0
        results = []
        reqs = workload_requests(seed=engine_bs + index_bs, n_requests=160, max_prompt=400)
        # every 8th: the previous prompt cut to whole blocks, served again: its last block is
        # recomputed (never served from cache) and stored a second time (two physical copies)
        for j in range(len(reqs) - 1, 0, -8):
            p = reqs[j - 1][0]
            reqs.insert(j, (p[:len(p) // engine_bs * engine_bs], []))
        for i, (prompt, output) in enumerate(reqs):
            if i == 100:
                engine.reset()  # AllBlocksCleared, published at once
            for f in _sim_frames(engine, fed):
                index.feed(f)
                fed = f.seq + 1
            credited = walk.credited(index.shard, prompt_hashes(prompt, index_bs), len(prompt))
            cached = engine.serve(prompt, output)
            results.append((i, len(prompt), credited, cached))
        for f in _sim_frames(engine, fed):
            index.feed(f)
        st = engine.stats
        engine_hashes = engine.cached_hashes()
    finally:
        engine.close()
    assert [r for r in results if r[2] != r[3]] == []
    assert sum(r[3] for r in results) > 0.4 * sum(r[1] for r in results)  # plenty of reuse
    assert st["removed_blocks"] > 100  # and eviction
    assert index.dead_letters == 0
    (relay,) = index.relays.values()
    assert relay.mirror.stats["remove_unknown"] == 0 and relay.mirror.stats["cleared"] == 1
    assert relay.mirror.stats["extra_copies"] > 0  # recomputed last blocks: second physical copies
    # the mirror ends with the engine's cache: its hashes, and its physical copies
    assert {eh for (eh, _, _) in relay.mirror.live} == engine_hashes
    assert sum(entry[0] for entry in relay.mirror.live.values()) == st["cached_blocks_now"]


@pytest.mark.parametrize("engine, folder, stream", [
    ("trtllm", "trtllm-1.2/host", "events.jsonl"),  # partial reuse: partial-block keys on top
    ("vllm", "vllm-0.34/plain", "frames.jsonl"),  # whole blocks only: the two counts agree
])
def test_shadow_reports_the_index_size_beside_what_whole_blocks_alone_take(engine, folder, stream):
    from kvidx.shadow import run_shadow_engine
    from tests.helpers import FIXTURES

    d = FIXTURES / folder
    res, shard = run_shadow_engine(engine, d / stream, d / "requests.jsonl")
    x = res.extra
    assert x["index_entries"] == sum(len(m) for g in shard.groups.values() for m in g.tiers.values()) > 0
    assert x["index_bytes"] >= x["index_bytes_whole_blocks"] > 0
    assert x["index_entries"] >= x["index_entries_whole_blocks"] > 0
    if engine == "vllm":
        assert x["index_bytes"] == x["index_bytes_whole_blocks"]
    else:
        assert x["index_entries"] > x["index_entries_whole_blocks"]


@pytest.mark.parametrize("bad", ["[1]", '"x"', "[1, -2]", "[1.5, 0]", '{"seq": 1}'])
def test_a_malformed_lookup_at_is_named_with_its_line(tmp_path, bad):
    from kvidx.shadow import load_requests

    p = tmp_path / "requests.jsonl"
    p.write_text('{"prompt_token_ids": [1], "t_send": 1.0, "cached_tokens": 0, "lookup_at": [0, 0]}\n'
                 f'{{"prompt_token_ids": [1], "t_send": 2.0, "cached_tokens": 0, "lookup_at": {bad}}}\n')
    with pytest.raises(ValueError, match=r"requests.jsonl:2: lookup_at must be \[seq, events\]"):
        load_requests(p)
