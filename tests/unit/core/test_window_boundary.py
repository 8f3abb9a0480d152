"""Sliding-window boundaries, by hand (kvidx/core/walk.py window_blocks and the lookup walk): resuming
at token p with a window of w tokens needs the w - 1 tokens before p, i.e. the ceil((w - 1) / B)
engine blocks right before p. Each case below sits on one side of that boundary."""

from __future__ import annotations

import pytest

from kvidx.core import walk
from kvidx.core.shard import ModelShard
from kvidx.core.walk import window_blocks
from schemas.events import SCHEMA_VERSION, BlocksStored, EventBatch

H = list(range(5000, 5010))  # ten 16-token blocks of one prompt


@pytest.mark.parametrize("window,bs,per,want", [
    (1, 16, 1, 0),  # attends to itself only: nothing before
    (2, 16, 1, 1),  # one token before: one block
    (16, 16, 1, 1),  # 15 tokens before: still one block
    (17, 16, 1, 1),  # 16 tokens before: exactly one block
    (18, 16, 1, 2),  # 17 tokens before: a second block
    (32, 16, 1, 2),
    (33, 16, 1, 2),  # 32 tokens: two blocks exactly
    (34, 16, 1, 3),
    (4096, 16, 1, 256),  # 4095 tokens: 255 blocks and one token
    (4097, 16, 1, 256),
    (33, 32, 2, 2),  # 32-token engine blocks: one engine block of 2 index blocks
    (34, 32, 2, 4),  # 33 tokens: two engine blocks
])
def test_window_blocks(window, bs, per, want):
    assert window_blocks(window, bs, per) == want


def _shard(window: int, swa_held: list[int]) -> ModelShard:
    """One replica holding the whole prompt in full attention (group 0) and `swa_held` in a
    sliding-window group (group 1) of `window` tokens; 16-token engine and index blocks."""
    s = ModelShard("m", 16)
    fa = BlocksStored("GPU", 0, H, None, 0, group_kind="full_attention")
    swa = [BlocksStored("GPU", 1, [H[i]], H[i - 1] if i else None, i, group_kind="sliding_window",
                        sliding_window=window) for i in swa_held]
    s.apply(EventBatch(SCHEMA_VERSION, "m", "r", 0, 1, 0, 0.0, 0.0, 16, [fa, *swa]), 0.0)
    return s


def _resumable(s: ModelShard, n: int = 161) -> int:
    (a,) = walk.lookup(s, H, n, 0.0)
    return a.resumable_tokens


@pytest.mark.parametrize("window,held,want", [
    # 161 tokens: resume at 160 at best, needing the window before it
    (33, [8, 9], 160),  # 32 tokens before 160: blocks 8 and 9, held
    (34, [8, 9], 0),  # 33 tokens: block 7 too, missing (and no other point has its window)
    (34, [0, 1], 32),  # at 32 the window reaches past the prompt's start: blocks 0 and 1 are all it needs
    (34, [7, 8, 9], 160),
    (17, [9], 160),  # 16 tokens: block 9 alone
    (18, [9], 0),  # 17 tokens: block 8 too; no earlier point has its window either
    (18, [2, 3], 64),  # resume at 64: blocks 2 and 3 before it
    (1, [], 160),  # a window of 1 token needs no block
])
def test_resume_point_at_the_window_boundary(window, held, want):
    assert _resumable(_shard(window, held)) == want
