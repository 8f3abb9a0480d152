"""vLLM 0.33's lookahead block hashing (EAGLE, EAGLE3, MTP with prefix caching): a block's hash covers
the L tokens after it and its BlockStored carries them (`lookahead_token_ids`), so the engine reuses
block k only where the prompt goes on with those L tokens, and at most (n - L) // B blocks of n
tokens. The mirror keys index blocks with their lookahead tokens and prompts are hashed the same way,
so a prompt that diverges right after a block boundary is not credited that block; a relay pinned to
a release without lookahead refuses such events instead of over-crediting them."""

from __future__ import annotations

import random

import pytest

from kvidx.core import walk
from kvidx.core.hashing import prompt_hashes
from kvidx.core.shard import ModelShard
from kvidx.core.snapshot import decode_parts, decode_snapshot, encode_delta, encode_segments, encode_snapshot
from kvidx.engines.vllm.mirror import VllmMirror
from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.engines.vllm.wire import BlockStored, check_engine_version
from schemas.events import SCHEMA_VERSION, EventBatch

B = 16


def engine_hit(cached_prompt: list[int], prompt: list[int], la: int) -> int:
    """vLLM 0.33's hit for `prompt` once `cached_prompt`'s blocks are cached: block k needs its tokens
    and the la after it to match, hashed only if those exist, and at most n - 1 tokens."""
    n = len(prompt)
    hit = 0
    for k in range(min((n - la) // B, (len(cached_prompt) - la) // B)):
        end = (k + 1) * B + la
        if prompt[:end] != cached_prompt[:end]:
            break
        hit = k + 1
    return min(hit * B, (n - 1) // B * B)


def store_events(prompt: list[int], la: int) -> list[BlockStored]:
    nb = (len(prompt) - la) // B  # the blocks whose lookahead tokens exist
    return [BlockStored(list(range(1000, 1000 + nb)), None, prompt[:nb * B], B, medium="GPU",
                        lookahead_token_ids=[prompt[(k + 1) * B:(k + 1) * B + la] for k in range(nb)]
                        if la else None)]


def shard_for(prompt: list[int], la: int, ibs: int = B) -> ModelShard:
    mirror = VllmMirror(ibs)
    events = mirror.apply(store_events(prompt, la))
    shard = ModelShard("m", ibs)
    shard.apply(EventBatch(SCHEMA_VERSION, "m", "r0", 0, 1, 0, 1.0, 1.0, B, events,
                           lookahead_tokens=mirror.lookahead_tokens), 1.0)
    return shard


@pytest.mark.parametrize("ibs", [B, 4], ids=["index16", "index4"])
@pytest.mark.parametrize("la", [1, 3])
def test_divergence_at_every_position_near_block_boundaries_is_credited_exactly(la, ibs):
    r = random.Random(la)
    cached = [r.randrange(1000) for _ in range(5 * B + 7)]
    shard = shard_for(cached, la, ibs)
    assert shard.lookahead == la
    checked = 0
    for cut in range(1, len(cached) + 1):  # the prompt shares `cut` tokens, then differs
        prompt = cached[:cut] + [1000 + (cached[cut] if cut < len(cached) else 0)] * 9
        for p in (prompt, cached[:cut]):
            hashes = prompt_hashes(p, ibs, lookahead=shard.lookahead)
            assert walk.credited(shard, hashes, len(p)) == engine_hit(cached, p, la), (cut, len(p))
            checked += 1
    assert checked > 150
    # without the lookahead in the keys, a prompt diverging right after a boundary would be credited
    p = cached[:2 * B] + [999_999 % 1000 + 1]
    assert engine_hit(cached, p, la) \
        == B and walk.credited(shard, prompt_hashes(p, ibs, lookahead=la), len(p)) == B


def test_no_lookahead_is_the_plain_hashing():
    r = random.Random(0)
    cached = [r.randrange(1000) for _ in range(3 * B)]
    shard = shard_for(cached, 0)
    assert shard.lookahead == 0
    assert prompt_hashes(cached, B, lookahead=0) == prompt_hashes(cached, B)
    assert walk.credited(shard, prompt_hashes(cached, B), len(cached)) == 2 * B  # (n - 1) // B blocks


def test_a_relay_pinned_before_033_refuses_lookahead_and_033_is_accepted():
    assert check_engine_version("0.33.0").lookahead and not check_engine_version("0.32.0").lookahead
    prompt = list(range(3 * B + 1))
    old = VllmPublisherRelay("m", "r", B, engine_version="0.32.0")
    assert old.mirror.apply(store_events(prompt, 1)) == []  # each such store is set aside
    (e,) = old.mirror.set_aside
    assert e.reason == "wrong_engine" and "--engine-version 0.33.0" in e.detail
    new = VllmPublisherRelay("m", "r", B, engine_version="0.33.0")
    assert new.mirror.apply(store_events(prompt, 1)) and new.mirror.lookahead_tokens == 1
    # the same engine cannot change L without a restart
    changed = BlockStored([7], None, prompt[:B], B, lookahead_token_ids=[prompt[B:B + 2]])
    assert new.mirror.apply([changed]) == []
    assert [a.reason for a in new.mirror.set_aside] == ["lookahead_changed"]


def test_the_models_lookahead_survives_snapshots():
    shard = shard_for(list(range(3 * B + 2)), 3)
    assert decode_snapshot(encode_snapshot(shard)).lookahead == 3
    shard.track_changes()
    assert decode_parts([encode_segments(shard, 0, 4096), encode_delta(shard)]).lookahead == 3
