"""--prefix-match-unit partial blocks (ENGINES.md vLLM observation 6) and the real hybrid recordings."""

from __future__ import annotations

import random

import pytest

from kvidx.core import walk
from kvidx.core.hashing import prompt_hashes
from kvidx.core.shard import ModelShard
from kvidx.engines.vllm.mirror import VllmMirror
from kvidx.engines.vllm.wire import BlockStored
from kvidx.shadow import run_shadow
from schemas.events import SCHEMA_VERSION, BlocksStored, EventBatch
from tests.helpers import FIXTURES

rng = random.Random(9)
T = [rng.randrange(32000) for _ in range(128)]
H16 = prompt_hashes(T, 16)


def S(hashes, parent, tokens, bs, group, kind):
    return BlockStored(list(hashes), parent, list(tokens), bs, group_idx=group, kv_cache_spec_kind=kind)


def _fold(shard: ModelShard, events, seq: int, block_size: int = 32) -> None:
    shard.apply(EventBatch(SCHEMA_VERSION, "m", "r", 0, 1, seq, 0.0, 0.0, block_size, events), 0.0)


def test_partial_block_is_placed_at_its_unit_and_carries_it():
    """vLLM 0.32 (block_pool.cache_partial_block): one hash, the unit's tokens only, parent = the
    unit chain's hash before it (here a block boundary, which the mirror knows)."""
    m = VllmMirror(16)
    m.apply([S([101, 102], None, T[:64], 32, 1, "full_attention")])
    (e,) = m.apply([S([103], 102, T[64:80], 16, 1, "full_attention")])
    assert isinstance(e, BlocksStored)
    assert (e.hashes, e.depth, e.block_size) == ([H16[4]], 4, 16)
    assert m.block_size == 32 and m.stats["partial_blocks"] == 1


def test_partial_finer_than_the_index_block_is_skipped_not_dead_lettered():
    m = VllmMirror(32)
    m.apply([S([101], None, T[:32], 32, 0, "full_attention")])
    assert m.apply([S([103], 101, T[32:48], 16, 0, "full_attention")]) == []
    assert m.stats["partial_unaligned"] == 1


def _shard_with(groups_events) -> ModelShard:
    shard = ModelShard("m", 16)
    m = VllmMirror(16)
    for seq, evs in enumerate(groups_events):
        _fold(shard, m.apply(evs), seq, m.block_size)
    return shard


def test_partial_blocks_without_mamba_credit_engine_blocks_only():
    """Sliding window + full attention with a 16-token unit and 32-token blocks: vLLM's hits stay
    aligned to the 32-token scheduler block (partial_hash_hits_enabled needs a mamba group)."""
    shard = _shard_with([
        [S([201, 202], None, T[:64], 32, 0, "sliding_window"), S([101, 102], None, T[:64], 32, 1,
                                                                 "full_attention")],
        [S([103], 102, T[64:80], 16, 1, "full_attention")],
    ])
    shard.groups[0].window = 32
    (a,) = walk.lookup(shard, H16[:5], 90, 0.0)
    assert a.cached_tokens == 80  # the partial block is cached ...
    assert a.resumable_tokens == 64  # ... but the engine resumes at block boundaries


def test_partial_blocks_with_mamba_credit_the_finer_unit():
    """Full attention + mamba ("align") with a unit finer than the block: vLLM resumes inside a block
    where full attention has a partial entry and mamba a checkpoint at exactly that unit."""
    fa, mb = (1, "full_attention"), (0, "mamba")
    shard = _shard_with([
        [S([101, 102], None, T[:64], 32, *fa), S([102], None, T[:64], 32, *mb)],
        [S([103], 102, T[64:80], 16, *fa), S([103], 102, T[64:80], 16, *mb)],
    ])
    (a,) = walk.lookup(shard, H16[:5], 90, 0.0)
    assert (a.full_attention_hit_tokens, a.resumable_tokens) == (80, 80)
    # the last prompt token is never reused: an 81-token prompt resumes at 80, an 80-token one at 64
    assert walk.credited(shard, H16[:5], 81) == 80
    assert walk.credited(shard, H16[:5], 80) == 64


@pytest.mark.parametrize("name", ["gemma2_swa_c1", "qwen3next_c1", "qwen3next_c1_evict"])
def test_real_hybrid_recordings_at_concurrency_1(name):
    d = FIXTURES / "vllm-0.32" / name
    agreement, index = run_shadow(d / "frames.jsonl", d / "requests.jsonl")
    s = agreement.summary()
    assert s["requests"] == 60 and s["recall"] >= 0.99 and s["over_credit"] <= 0.01, s
    if name == "gemma2_swa_c1":  # the window group's blocks placed by their hashes: exact
        assert s["over_credit"] == 0.0 and s["exact_requests"] == 60, s
    if name == "qwen3next_c1_evict":  # 16 blocks: state and attention copies evicted separately
        (relay,) = index.relays.values()
        assert relay.mirror.stats["removed"] > 40 and s["exact_requests"] == 60
    if name == "qwen3next_c1":
        kinds = {g.kind for g in index.shard.groups.values()}
        assert kinds == {"mamba", "full_attention"}
        (relay,) = index.relays.values()
        assert relay.mirror.stats["hashless_stored"] == 4 and relay.mirror.block_size == 96
