"""Hybrid models end to end: generated vLLM 0.32 event streams (wire format, through the relay and the
shard) for full attention + sliding window and for full attention + state space (mamba), checked
against a straightforward reference of vLLM's resume rule on thousands of random cases.

The generated engine lives in kvidx/engines/vllm/sim_hybrid.py (the fleet simulator's `--hybrid` replicas
are built on it). It keeps the engine's own view (per group: engine hash -> live physical copies) and emits
what vLLM 0.32's block pool emits for it (vllm/v1/core/block_pool.py cache_full_blocks,
cache_partial_block; ENGINES.md vLLM observations 5, 6, 9):
- full attention: the chunk's full blocks, parent = the block before the chunk (null at 0);
- sliding window: the same token range, but hashes only for the blocks a later hit can need (the
  ceil((w-1)/B) blocks before the chunk's end); the others are skipped (token_ids longer than
  hashes x block_size);
- mamba: one checkpoint per scheduled chunk, at its last block boundary: one hash, token_ids from 0
  to that boundary, parent null; a chunk without a new boundary gives an announcement without hash.
Evictions are one BlockRemoved per hash per group, each group on its own.
"""

from __future__ import annotations

import random

import msgspec

from kvidx.core import walk
from kvidx.core.hashing import prompt_hashes
from kvidx.core.shard import ModelShard
from kvidx.core.snapshot import decode_snapshot, encode_snapshot
from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.engines.vllm.sim_hybrid import HybridEngine, WBatch, WRemoved, WStored, _enc
from schemas.answers import Group


# ---- vLLM 0.32's wire structs (kvidx/engines/vllm/sim_hybrid.py) -------------------------------------
def test_wire_structs_encode_like_vllm_032():
    """Key order and omitted defaults as in the real recording (fixtures/vllm-0.32/gemma2_swa)."""
    ev = WStored([5], None, [1, 2], 2, None, "GPU", None, [None], 0, "sliding_window", 32)
    raw = msgspec.msgpack.decode(_enc.encode(WBatch(1.5, [ev], 0)))
    assert list(raw[1][0]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                               "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                               "kv_cache_spec_kind", "kv_cache_spec_sliding_window"]
    rm = msgspec.msgpack.decode(_enc.encode(WRemoved([5], "GPU", 1)))
    assert rm == {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU", "group_idx": 1}


# ---- the generated engine: kvidx.engines.vllm.sim_hybrid.HybridEngine --------------------------------
def _prompts(rng: random.Random, n: int, lengths: tuple[int, int]) -> list[list[int]]:
    """Prompts sharing system prefixes (some shorter, some longer than a 1024-token window)."""
    systems = [[rng.randrange(32000) for _ in range(rng.randint(50, 1500))] for _ in range(4)]
    out = []
    for _ in range(n):
        base = rng.choice(systems)
        if rng.random() < 0.3:
            base = base[:rng.randint(0, len(base))]
        out.append(base + [rng.randrange(32000) for _ in range(rng.randint(*lengths))])
    return out


def _run(groups, block_size, n_streams, steps, seed, ibs=16, chunks=(1, 8), hashless_p=0.0,
         unreported=(), silent_p=0.0, check=None, report_full_p=0.2):
    """Random streams: prefill, evict per group, query; returns (cases, nonzero, mismatches)."""
    cases = nonzero = 0
    bad = []
    for s in range(n_streams):
        rng = random.Random(seed * 1000 + s)
        eng = HybridEngine(groups, block_size)
        relay = VllmPublisherRelay("m", "r", ibs, epoch=1)
        shard = ModelShard("m", ibs, unreported_eviction_kinds=unreported)
        prompts = _prompts(rng, 12, (1, 1200))
        chunk_blocks = rng.randint(*chunks)  # checkpoints every `chunk_blocks` blocks (mamba)
        for step in range(steps):
            tokens = rng.choice(prompts)
            eng.prefill(tokens, chunk_blocks * block_size, rng, hashless_p, report_full_p)
            for g in range(len(groups)):  # each group evicts on its own
                live = list(eng.live[g])
                for h in rng.sample(live, min(len(live), rng.randint(0, 1 + len(live) // 6))):
                    eng.evict(g, h, silent=rng.random() < silent_p)
            for b in relay.on_frame(eng.flush()).batches:
                shard.apply(b, 0.0)
            for q in rng.sample(prompts, 4):
                qh = prompt_hashes(q, ibs)
                got = walk.credited(shard, qh, len(q), "r")
                want = eng.reference(q)
                cases += 1
                nonzero += want > 0
                if check is not None:
                    check(shard, eng, q, qh, got, want)
                elif got != want:
                    bad.append((s, step, len(q), got, want))
    return cases, nonzero, bad, eng


def test_full_attention_plus_sliding_window_1024_matches_reference():
    groups = [("sliding_window", 1024), ("full_attention", None)]
    cases, nonzero, bad, _ = _run(groups, 16, n_streams=12, steps=60, seed=1, chunks=(4, 96))
    assert not bad, bad[:5]
    assert cases >= 2500 and nonzero >= cases // 4, (cases, nonzero)


def test_full_attention_plus_mamba_matches_reference():
    """Block size raised to 96 by the engine (index block 16), checkpoints every N blocks, state and
    attention evicted separately, announcements without hash ignored."""
    groups = [("full_attention", None), ("mamba", None)]
    cases, nonzero, bad, eng = _run(groups, 96, n_streams=12, steps=60, seed=2, chunks=(1, 4),
                                    hashless_p=0.1)
    assert not bad, bad[:5]
    assert cases >= 2500 and nonzero >= cases // 5, (cases, nonzero)
    assert eng.hashless > 0


def test_three_groups_full_window_mamba_matches_reference():
    """vLLM's fixed point over several groups = the largest p valid for every group."""
    groups = [("full_attention", None), ("sliding_window", 200), ("mamba", None)]
    cases, _, bad, _ = _run(groups, 32, n_streams=6, steps=40, seed=3, chunks=(1, 6), hashless_p=0.05)
    assert not bad, bad[:5]
    assert cases >= 900


def test_unreported_state_evictions_are_flagged_as_upper_bound():
    """Where the engine drops state copies without an event, the index credits at least what the
    engine can resume (an upper bound) and says so in every answer that relies on it."""
    groups = [("full_attention", None), ("mamba", None)]
    seen = {"over": 0, "flagged": 0}

    def check(shard, eng, q, qh, got, want):
        assert got >= want
        seen["over"] += got > want
        for a in walk.lookup(shard, qh, len(q), 0.0):
            assert a.upper_bound == (a.resumable_tokens > 0)
            if a.upper_bound:
                assert a.upper_bound_groups == [1]
                seen["flagged"] += 1

    _run(groups, 96, n_streams=4, steps=40, seed=4, chunks=(1, 3), unreported=("mamba",), silent_p=0.5,
         check=check)
    assert seen["over"] > 0 and seen["flagged"] > 0, seen


def test_lookup_explains_why_the_hit_is_shorter():
    """A 2000-token prompt: full attention holds it all, the mamba group only checkpoints at 960 and
    1920, then the 1920 state is evicted: resumable 960 of a 1920-token full-attention hit."""
    eng = HybridEngine([("full_attention", None), ("mamba", None)], 96)
    rng = random.Random(5)
    tokens = [rng.randrange(32000) for _ in range(2000)]
    eng.prefill(tokens, 960, rng)
    relay = VllmPublisherRelay("m", "r", 16, epoch=1)
    shard = ModelShard("m", 16)
    hs = eng.block_hashes(tokens)
    eng.evict(1, hs[19])
    for b in relay.on_frame(eng.flush()).batches:
        shard.apply(b, 0.0)
    (a,) = walk.lookup(shard, prompt_hashes(tokens, 16), len(tokens), 0.0)
    assert a.cached_tokens == 1920 and a.full_attention_hit_tokens == 1920
    assert a.resumable_tokens == 960 == eng.reference(tokens)
    assert a.upper_bound is False and a.upper_bound_groups == []
    fa, mamba = a.groups
    assert fa == Group(0, "full_attention", hit_tokens=1920, blocks=120, prompt_blocks=120)
    # a checkpoint is one index block: the state after exactly p tokens
    assert mamba == Group(1, "mamba", hit_tokens=960, blocks=1, prompt_blocks=1)
    assert relay.mirror.stats["hashless_stored"] == 1  # the last chunk (80 tokens) had no boundary


def test_counts_fold_and_snapshot_keep_group_state():
    groups = [("sliding_window", 64), ("full_attention", None)]
    _, _, bad, _ = _run(groups, 16, n_streams=1, steps=5, seed=6)
    assert not bad
    shard = ModelShard("m", 16, unreported_eviction_kinds={"mamba"})
    eng = HybridEngine(groups, 16)
    rng = random.Random(6)
    tokens = [rng.randrange(32000) for _ in range(300)]
    eng.prefill(tokens, 160, rng)
    relay = VllmPublisherRelay("m", "r", 16, epoch=1)
    for b in relay.on_frame(eng.flush()).batches:
        shard.apply(b, 0.0)
    st = shard.replicas[("r", 0)]
    assert st.group_blocks == {g: len(eng.live[g]) for g in (0, 1)}
    back = decode_snapshot(encode_snapshot(shard))
    assert back.replicas[("r", 0)].group_blocks == st.group_blocks
    assert back.unreported_eviction_kinds == {"mamba"}
    qh = prompt_hashes(tokens, 16)
    assert walk.lookup(back, qh, 300, 0.0) == walk.lookup(shard, qh, 300, 0.0)


def test_window_and_matches_naive():
    from kvidx.core.walk import _window_and

    rng = random.Random(7)
    for _ in range(300):
        masks = [rng.getrandbits(6) | (rng.random() < 0.7) for _ in range(rng.randint(1, 60))]
        w = rng.randint(1, 20)
        fn = _window_and(masks, w)
        for e in range(1, len(masks) + 1):
            want = -1
            for m in masks[max(0, e - w):e]:
                want &= m
            assert fn(e) == want, (masks, w, e)

