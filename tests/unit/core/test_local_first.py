"""EventBatch.external_after_local: vLLM's scheduler takes the prefix its GPU holds, then one
contiguous load from its KV connector's tier (vllm/v1/core/sched/scheduler.py: the local hit, then
connector.get_num_new_matched_tokens from there). A block only the GPU holds, after one the engine
must load, is not reused; TensorRT-LLM onboards block by block and reuses it."""

from __future__ import annotations

import pytest

from kvidx.core import walk
from kvidx.core.hashing import prompt_hashes
from kvidx.core.shard import ModelShard
from schemas.events import SCHEMA_VERSION, BlocksRemoved, BlocksStored, EventBatch

B = 16
TOKENS = list(range(100, 100 + 6 * B + 3))
HASHES = prompt_hashes(TOKENS, B)


def _batch(seq: int, events: list, local_first: int, replica: str = "r") -> EventBatch:
    return EventBatch(SCHEMA_VERSION, "m", replica, 0, 1, seq, 0.0, 0.0, B, events,
                      external_after_local=local_first)


def _shard(local_first: int) -> ModelShard:
    """Blocks 0-2 on the CPU only, 3 on both, 4-5 on the GPU only."""
    sh = ModelShard("m", B)
    sh.apply(_batch(0, [BlocksStored("GPU", 0, HASHES[:6], None, 0)], local_first), 1.0)
    sh.apply(_batch(1, [BlocksStored("CPU", 0, HASHES[:4], None, 0)], local_first), 1.0)
    sh.apply(_batch(2, [BlocksRemoved("GPU", 0, HASHES[:3])], local_first), 1.0)
    return sh


@pytest.mark.parametrize("local_first, credited", [(1, 4 * B), (0, 6 * B)])
def test_a_gpu_block_after_a_load_counts_only_where_the_engine_onboards_block_by_block(local_first, credited):
    sh = _shard(local_first)
    assert walk.credited(sh, HASHES, len(TOKENS), now=1.0) == credited
    (ans,) = walk.lookup(sh, HASHES, len(TOKENS), 1.0)
    assert ans.resumable_tokens == credited and ans.cached_tokens == 6 * B  # still cached, in two tiers
    assert [(t.tier, t.tokens) for t in ans.tiers] == [("CPU", 3 * B), ("GPU", 3 * B)]


def test_a_gpu_prefix_then_a_load_is_whole_and_the_trait_is_sticky():
    sh = _shard(1)
    # the GPU gets blocks 0-2 back: GPU 0-5, nothing to load
    sh.apply(_batch(3, [BlocksStored("GPU", 0, HASHES[:3], None, 0)], 0), 1.0)  # a batch without it
    assert sh.replicas[("r", 0)].external_after_local == 1
    assert walk.credited(sh, HASHES, len(TOKENS), now=1.0) == 6 * B
    # GPU 0-1, CPU 0-3, GPU 4-5: the local hit is 2 blocks, the load 2 more, then a GPU-only block
    sh.apply(_batch(4, [BlocksRemoved("GPU", 0, HASHES[2:4])], 1), 1.0)
    assert walk.credited(sh, HASHES, len(TOKENS), now=1.0) == 4 * B


def test_only_the_replicas_whose_engine_says_so_are_cut():
    sh = _shard(1)
    sh.apply(_batch(0, [BlocksStored("GPU", 0, HASHES[:6], None, 0)], 0, "trt"), 1.0)
    sh.apply(_batch(1, [BlocksStored("CPU", 0, HASHES[:4], None, 0)], 0, "trt"), 1.0)
    sh.apply(_batch(2, [BlocksRemoved("GPU", 0, HASHES[:3])], 0, "trt"), 1.0)
    assert walk.credited(sh, HASHES, len(TOKENS), "r", now=1.0) == 4 * B
    assert walk.credited(sh, HASHES, len(TOKENS), "trt", now=1.0) == 6 * B
