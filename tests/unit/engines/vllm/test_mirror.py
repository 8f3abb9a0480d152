"""The relay's mirror of a vLLM engine cache (kvidx/engines/vllm/mirror.py): engine events ->
canonical events."""

from __future__ import annotations

import random

from kvidx.core.hashing import prompt_hashes
from kvidx.engines.common import normalize_tier
from kvidx.engines.recording import read_frames
from kvidx.engines.vllm.mirror import VllmMirror
from kvidx.engines.vllm.wire import AllBlocksCleared, BlockRemoved, BlockStored, decode_payload
from schemas.events import BlocksRemoved, BlocksStored, ReplicaCleared
from tests.helpers import GEMMA

rng = random.Random(7)
T = [rng.randrange(1024) for _ in range(256)]  # a prompt
H16 = prompt_hashes(T, 16)
H32 = prompt_hashes(T, 32)
BIG = 2**64 - 3


def S(hashes, parent, tokens, bs=16, **kw) -> BlockStored:
    return BlockStored(list(hashes), parent, list(tokens), bs, **kw)


def R(hashes, **kw) -> BlockRemoved:
    return BlockRemoved(list(hashes), **kw)


def stored(out) -> list[int]:
    return [h for e in out if isinstance(e, BlocksStored) for h in e.hashes]


def removed(out) -> list[int]:
    return [h for e in out if isinstance(e, BlocksRemoved) for h in e.hashes]


def test_store_emits_canonical_chain():
    m = VllmMirror(16)
    out = m.apply([S([11, BIG, 13], None, T[:48])])
    assert len(out) == 1
    e = out[0]
    assert isinstance(e, BlocksStored)
    assert (e.tier, e.group, e.hashes, e.parent, e.depth) == ("GPU", 0, H16[:3], None, 0)
    assert e.engine_hashes == [11, BIG, 13]
    assert e.group_kind == "full_attention"
    assert m.live_blocks() == 3


def test_remove_emits_canonical_removal():
    m = VllmMirror(16)
    m.apply([S([1, 2, 3], None, T[:48])])
    out = m.apply([R([2])])
    assert len(out) == 1 and isinstance(out[0], BlocksRemoved)
    assert (out[0].tier, out[0].group, out[0].hashes, out[0].engine_hashes) == ("GPU", 0, [H16[1]], [2])
    assert m.live_blocks() == 2


def test_chain_continues_through_parent_engine_hash():
    m = VllmMirror(16)
    m.apply([S([1, 2], None, T[:32])])
    out = m.apply([S([3, 4], 2, T[32:64])])
    (e,) = out
    assert e.hashes == H16[2:4] and e.parent == H16[1] and e.depth == 2
    # and from a parent in the middle of a stored chain: a branch
    other = T[:16] + [(x + 1) % 1024 for x in T[16:48]]
    (b,) = m.apply([S([5, 6], 1, other[16:48])])
    assert b.hashes == prompt_hashes(other, 16)[1:3] and b.parent == H16[0] and b.depth == 1


def test_chain_through_a_parent_that_was_evicted():
    m = VllmMirror(16)
    m.apply([S([1, 2], None, T[:32]), R([2])])
    (e,) = m.apply([S([3], 2, T[32:48])])  # the memo outlives the live copy
    assert e.hashes == [H16[2]] and e.parent == H16[1] and e.depth == 2


def test_unknown_parent_is_counted_as_orphan():
    m = VllmMirror(16)
    assert m.apply([S([3, 4], 999, T[32:64])]) == []
    assert m.stats["orphan_blocks"] == 2 and m.live_blocks() == 0


def test_independent_eviction_child_outlives_parent():
    m = VllmMirror(16)
    m.apply([S([1, 2, 3], None, T[:48])])
    assert removed(m.apply([R([1])])) == [H16[0]]
    assert m.live_blocks() == 2
    assert removed(m.apply([R([3])])) == [H16[2]]
    assert removed(m.apply([R([2])])) == [H16[1]]
    assert m.live_blocks() == 0


def test_parent_returns_after_eviction():
    m = VllmMirror(16)
    m.apply([S([1, 2], None, T[:32]), R([1])])
    out = m.apply([S([1], None, T[:16])])
    assert stored(out) == [H16[0]]
    assert m.live_blocks() == 2


def test_remove_unknown_is_counted_not_raised():
    m = VllmMirror(16)
    assert m.apply([R([42])]) == []
    m.apply([S([1], None, T[:16])])
    out = m.apply([R([1, 42])])
    assert removed(out) == [H16[0]]
    assert m.stats["remove_unknown"] == 2
    assert m.apply([R([1])]) == [] and m.stats["remove_unknown"] == 3


def test_duplicate_physical_copy_needs_two_removals():
    m = VllmMirror(16)
    m.apply([S([1, 2], None, T[:32])])
    # the recomputed last block of a fully cached prompt: stored again with its parent (nothing new
    # to index; published as a copy, which takes room in the engine's cache: eviction foresight)
    (copy,) = m.apply([S([2], 1, T[16:32])])
    assert copy.copy and copy.hashes == [H16[1]]
    assert m.stats["extra_copies"] == 1
    assert m.apply([R([2])]) == [] and m.copies_removed == {0: [H16[1]]}
    assert removed(m.apply([R([2])])) == [H16[1]] and m.copies_removed == {}
    assert m.apply([R([2])]) == [] and m.stats["remove_unknown"] == 1


def test_a_chain_restored_from_the_root_is_a_second_copy_single_group():
    """vLLM 0.34 with a KV connector: two requests load one prefix from the CPU tier in one step,
    each into GPU blocks of its own, and each caches its chain from the root when its load is done
    (tests/fixtures/vllm-0.34/simple_offload_lazy, seq 72): two physical copies."""
    m = VllmMirror(16)
    m.apply([S([1, 2, 3], None, T[:48])])
    (copy,) = m.apply([S([1, 2], None, T[:32])])
    assert copy.copy and copy.hashes == H16[:2] and m.stats["extra_copies"] == 2
    assert m.apply([R([1])]) == []  # one copy left
    assert removed(m.apply([R([1])])) == [H16[0]]


def test_reannounced_chain_from_root_is_not_a_copy_single_group():
    m = VllmMirror(16, full_reports=True)
    m.apply([S([1, 2, 3], None, T[:48])])
    # kv_cache_report_mode "full": the reused blocks re-announced with parent null
    assert m.apply([S([1, 2], None, T[:32])]) == []
    assert m.stats["restored_live"] == 2 and m.stats["extra_copies"] == 0
    assert removed(m.apply([R([1])])) == [H16[0]]
    assert removed(m.apply([R([2])])) == [H16[1]]


def test_hybrid_parent_null_restore_is_a_copy():
    m = VllmMirror(16)
    m.apply([S([1, 2], None, T[:32], group_idx=0, kv_cache_spec_kind="sliding_window",
               kv_cache_spec_sliding_window=32)])
    m.apply([S([1, 2], None, T[:32], group_idx=1, kv_cache_spec_kind="full_attention")])
    assert m.hybrid
    # the full-attention group stores the same chain again while it is cached: copies, not new blocks
    (copy,) = m.apply([S([1, 2], None, T[:32], group_idx=1, kv_cache_spec_kind="full_attention")])
    assert copy.copy and copy.group == 1 and copy.hashes == H16[:2]
    assert m.stats["extra_copies"] == 2
    assert m.apply([R([1], group_idx=1)]) == []
    assert removed(m.apply([R([1], group_idx=1)])) == [H16[0]]
    # groups are independent: the sliding-window group still holds block 1
    out = m.apply([R([1], group_idx=0)])
    assert len(out) == 1 and out[0].group == 0 and out[0].hashes == [H16[0]]


def test_hybrid_events_carry_group_kind_and_window():
    m = VllmMirror(16)
    (e,) = m.apply([S([1], None, T[:16], group_idx=0, kv_cache_spec_kind="sliding_window",
                      kv_cache_spec_sliding_window=32)])
    assert (e.group, e.group_kind, e.sliding_window) == (0, "sliding_window", 32)


def test_all_blocks_cleared():
    m = VllmMirror(16)
    m.apply([S([1, 2], None, T[:32])])
    out = m.apply([AllBlocksCleared()])
    assert len(out) == 1 and isinstance(out[0], ReplicaCleared)
    assert m.live_blocks() == 0 and m.stats["cleared"] == 1
    # forgotten: removals of old blocks are unknown, a new store is new again
    assert m.apply([R([1])]) == [] and m.stats["remove_unknown"] == 1
    assert stored(m.apply([S([2], 1, T[16:32])])) == [H16[1]]  # the memo still chains it


def test_block_size_not_multiple_is_set_aside():
    m = VllmMirror(16)
    assert m.apply([S([1], None, T[:24], bs=24), S([2], None, T[:16])]) != []  # the other store is placed
    assert [(a.position, a.event, a.reason) for a in m.set_aside] == [(0, "stored", "block_size_mismatch")]
    m32 = VllmMirror(32)
    assert m32.apply([S([1], None, T[:16], bs=16)]) == []
    assert [a.reason for a in m32.set_aside] == ["block_size_mismatch"]


def test_short_token_ids_is_set_aside():
    m = VllmMirror(16)
    assert m.apply([S([1, 2], None, T[:31])]) == []
    assert [a.reason for a in m.set_aside] == ["short_token_ids"]
    assert m.live_blocks() == 0


def test_sliding_window_hashes_are_the_last_blocks():
    m = VllmMirror(16)
    # 4 blocks of tokens, only the last 2 listed (the first 2 left the window); parent null mid-chain
    (e,) = m.apply([S([3, 4], None, T[:64], group_idx=0, kv_cache_spec_kind="sliding_window",
                      kv_cache_spec_sliding_window=32)])
    assert e.hashes == H16[2:4] and e.depth == 2 and e.parent == H16[1]
    assert removed(m.apply([R([3])])) == [H16[2]]


def test_sliding_window_skip_with_engine_block_32_index_16():
    m = VllmMirror(16)
    (e,) = m.apply([S([9], None, T[:96], bs=32, group_idx=0, kv_cache_spec_kind="sliding_window")])
    assert e.hashes == H16[4:6] and e.depth == 4


def test_sliding_window_block_before_the_replay_boundary_is_placed_by_its_hash():
    # vLLM 0.32 (prefix_cache_retention_interval 0) caches in a sliding-window group only the block
    # before the replay boundary (n - 1 rounded down): for a 128-token prompt, block 2 of 0-3 (engine
    # hash 3), not the last one; the full-attention store of the same step lists every block
    m = VllmMirror(16)
    swa = dict(group_idx=0, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=32)
    fa = dict(group_idx=1, kv_cache_spec_kind="full_attention")
    out = m.apply([S([3], None, T[:128], bs=32, **swa), S([1, 2, 3, 4], None, T[:128], bs=32, **fa)])
    (e,) = [e for e in out if e.group == 0]
    assert e.hashes == H16[4:6] and e.depth == 4 and m.stats["placed_inner"] == 1
    assert removed(m.apply([R([3], group_idx=0)])) == H16[4:6]
    # later stores find the block through the memo (engine hashes are content hashes)
    (e,) = m.apply([S([3], None, T[:128], bs=32, **swa)])
    assert e.hashes == H16[4:6]
    # unknown hashes: the last blocks, as before (the blocks that left the window lead)
    (e,) = m.apply([S([9], None, T[:64], bs=32, **swa)])
    assert e.hashes == H16[2:4] and m.stats["placed_inner"] == 2


def test_engine_block_32_index_16():
    m = VllmMirror(16)
    (e,) = m.apply([S([1, 2], None, T[:64], bs=32)])
    assert e.hashes == H16[:4] and e.depth == 0 and m.block_size == 32
    (f,) = m.apply([S([3], 2, T[64:96], bs=32)])
    assert f.hashes == H16[4:6] and f.parent == H16[3] and f.depth == 4
    assert removed(m.apply([R([2])])) == H16[2:4]


def test_shared_sub_block_is_refcounted():
    # two 32-token engine blocks with the same first 16 tokens share their first index block
    a = T[:32]
    b = T[:16] + [(x + 3) % 1024 for x in T[16:32]]
    ha, hb = prompt_hashes(a, 16), prompt_hashes(b, 16)
    assert ha[0] == hb[0] and ha[1] != hb[1]
    m = VllmMirror(16)
    assert stored(m.apply([S([1], None, a, bs=32)])) == ha
    out = m.apply([S([2], None, b, bs=32)])
    assert stored(out) == [hb[1]] and out[0].depth == 1 and out[0].parent == ha[0]
    assert removed(m.apply([R([1])])) == [ha[1]]  # the shared sub-block stays
    assert removed(m.apply([R([2])])) == [hb[0], hb[1]]


def test_store_runs_split_around_live_blocks():
    # a child outlived its evicted parent; the chain is stored again past it: two runs of new blocks,
    # and the engine recomputed the live one into a second physical copy (its prefix hit stopped at
    # the parent)
    m = VllmMirror(16)
    m.apply([S([1, 2], None, T[:64], bs=32), R([1])])
    out = m.apply([S([1, 2, 3], None, T[:96], bs=32)])
    assert [(e.hashes, e.parent, e.depth, e.copy) for e in out] == [
        (H16[0:2], None, 0, False), (H16[4:6], H16[3], 4, False), (H16[2:4], None, 0, True)]
    assert out[0].engine_hashes and out[0].engine_hashes + out[1].engine_hashes == [1, 3]
    assert m.live_blocks() == 3
    # with full reports the live block is a re-announced one: no copy
    m = VllmMirror(16, full_reports=True)
    m.apply([S([1, 2], None, T[:64], bs=32), R([1])])
    assert [e.copy for e in m.apply([S([1, 2, 3], None, T[:96], bs=32)])] == [False, False]


def test_tiers_are_separate_and_normalized():
    m = VllmMirror(16)
    m.apply([S([1], None, T[:16])])
    # (a lowercase "cpu" is LMCache's, re-published through vLLM: tests/unit/engines/lmcache/test_lmcache.py)
    (e,) = m.apply([S([1], None, T[:16], medium="CPU")])
    assert e.tier == "CPU" and e.hashes == [H16[0]]
    (r,) = m.apply([R([1], medium="CPU_PINNED")])
    assert r.tier == "CPU"
    assert normalize_tier(None) == "GPU" and normalize_tier("local_disk") == "DISK"


def test_bytes_engine_hashes():
    m = VllmMirror(16)
    d1, d2 = b"\x01" * 32, b"\x02" * 24 + (7).to_bytes(8, "big")
    (e,) = m.apply([S([d1], None, T[:16])])
    assert e.engine_hashes == [int.from_bytes(d1[-8:], "big")]
    (f,) = m.apply([S([d2], d1, T[16:32])])
    assert f.hashes == [H16[1]] and f.engine_hashes == [7]
    assert removed(m.apply([R([d2])])) == [H16[1]]


def test_memo_limit_bounds_memo_and_keeps_live_entries():
    m = VllmMirror(16, memo_limit=64)
    for i in range(300):
        m.apply([S([i], None, [i % 1024] * 16)])
        m.apply([R([i])])
    assert len(m.memo) <= 64
    m.apply([S([1000], None, T[:16])])
    for i in range(300, 600):
        m.apply([S([i], None, [i % 1024] * 16)])
        m.apply([R([i])])
    (e,) = m.apply([S([1001], 1000, T[16:32])])  # the live block's memo entry survived
    assert e.hashes == [H16[1]]


def test_memo_limit_holds_when_oldest_entries_are_live():
    m = VllmMirror(16, memo_limit=64)
    m.apply([S(range(1000, 1008), None, T[:128])])  # 8 long-lived blocks (a system prompt), first in
    for i in range(300):
        m.apply([S([i], None, [i % 1024] * 16)])
        m.apply([R([i])])
    assert len(m.memo) <= 64


def test_gemma_recording_copies_and_live_blocks():
    # decode.txt of the fixture: 15 stores of an already-present hash, no removal of an absent hash,
    # 4 blocks live at the end
    m = VllmMirror(16)
    for f in read_frames(GEMMA / "frames.jsonl"):
        m.apply(decode_payload(f.payload).events)
    assert m.stats["extra_copies"] == 15
    assert m.stats["remove_unknown"] == 0 and m.stats["orphan_blocks"] == 0
    assert m.live_blocks() == 4
