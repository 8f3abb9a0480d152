"""Canonical block hashing (kvidx/core/hashing.py): determinism, chaining, namespaces, block sizes."""

from __future__ import annotations

import random

import numpy as np

from kvidx.core.hashing import ROOT_SEED, chain, namespace_seed, pack_tokens, prompt_hashes
from kvidx.engines.vllm.mirror import VllmMirror
from kvidx.engines.vllm.wire import BlockStored
from schemas.events import BlocksStored


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1024) for _ in range(n)]


def _mirror_hashes(tokens: list[int], engine_bs: int, index_bs: int, **kw) -> list[int]:
    m = VllmMirror(index_bs)
    nb = len(tokens) // engine_bs
    out = m.apply([BlockStored(list(range(1, nb + 1)), None, tokens, engine_bs, **kw)])
    assert len(out) == 1 and isinstance(out[0], BlocksStored)
    return out[0].hashes


def test_chain_is_deterministic_and_drops_partial_block():
    t = _tokens(70)
    a = prompt_hashes(t, 16)
    assert a == prompt_hashes(list(t), 16)
    assert len(a) == 4  # 70 // 16, the trailing partial block is not hashed
    assert len(set(a)) == 4
    assert all(0 <= h < 2**64 for h in a)
    assert prompt_hashes(t[:15], 16) == []


def test_token_change_changes_that_block_and_every_later_one():
    t = _tokens(128)
    base = prompt_hashes(t, 16)
    for pos in (0, 17, 63, 127):
        u = list(t)
        u[pos] = (u[pos] + 1) % 1024
        h = prompt_hashes(u, 16)
        i = pos // 16
        assert h[:i] == base[:i], pos
        assert all(h[j] != base[j] for j in range(i, len(base))), pos


def test_chain_covers_order_not_only_content():
    a, b = _tokens(16, 1), _tokens(16, 2)
    assert prompt_hashes(a + b, 16)[1] != prompt_hashes(b + a, 16)[0]
    assert prompt_hashes(a + b, 16)[1] != prompt_hashes(b, 16)[0]


def test_cache_salt_and_lora_namespaces_separate_chains():
    t = _tokens(64)
    plain = prompt_hashes(t, 16)
    salted = prompt_hashes(t, 16, cache_salt="s1")
    other_salt = prompt_hashes(t, 16, cache_salt="s2")
    lora = prompt_hashes(t, 16, lora_name="adapter-a")
    lora_b = prompt_hashes(t, 16, lora_name="adapter-b")
    chains = [plain, salted, other_salt, lora, lora_b]
    for i in range(len(chains)):
        for j in range(i + 1, len(chains)):
            assert not set(chains[i]) & set(chains[j]), (i, j)
    assert prompt_hashes(t, 16, cache_salt="s1") == salted
    assert prompt_hashes(t, 16, lora_name="") == plain  # no adapter = base model
    assert namespace_seed(None) == ROOT_SEED != namespace_seed("adapter-a")


def test_bytes_input_equals_list_input():
    t = _tokens(96)
    assert prompt_hashes(pack_tokens(t), 16) == prompt_hashes(t, 16)
    assert prompt_hashes(np.asarray(t, dtype=np.int64), 16) == prompt_hashes(t, 16)
    assert prompt_hashes(memoryview(pack_tokens(t)), 32) == prompt_hashes(t, 32)
    assert pack_tokens([1, 2**32 - 1]) == b"\x01\x00\x00\x00\xff\xff\xff\xff"


def test_extras_none_equals_no_extras():
    p = pack_tokens(_tokens(64))
    assert chain(p, 16, ROOT_SEED) == chain(p, 16, ROOT_SEED, [None, None, None, None])
    assert chain(p, 16, ROOT_SEED, [None, ["x"]])[0] == chain(p, 16, ROOT_SEED)[0]
    assert chain(p, 16, ROOT_SEED, [None, ["x"]])[1] != chain(p, 16, ROOT_SEED)[1]


def test_index_block_16_matches_mirror_of_engine_block_32():
    t = _tokens(64)
    h16 = prompt_hashes(t, 16)
    assert len(h16) == 4
    assert _mirror_hashes(t, 32, 16) == h16
    assert _mirror_hashes(t, 16, 16) == h16
    assert _mirror_hashes(t, 32, 32) == prompt_hashes(t, 32)
    assert prompt_hashes(t, 32) != h16[1::2]  # a different granularity is a different chain


def test_router_hashes_match_mirror_with_salt_and_lora():
    t = _tokens(64)
    # vLLM puts the cache salt in the extra keys of the chain's first block only
    salted = _mirror_hashes(t, 32, 16, extra_keys=[["s1"], None])
    assert salted == prompt_hashes(t, 16, cache_salt="s1")
    # LoRA: every block carries the adapter name in extra_keys; the name namespaces the chain
    lora = _mirror_hashes(t, 32, 16, lora_name="ad", extra_keys=[["ad"], ["ad"]])
    assert lora == prompt_hashes(t, 16, lora_name="ad")
    both = _mirror_hashes(t, 32, 16, lora_name="ad", extra_keys=[["ad", "s1"], ["ad"]])
    assert both == prompt_hashes(t, 16, lora_name="ad", cache_salt="s1")


def test_dynamo_local_hashes_are_dynamos_golden_vectors():
    """dynamo-kv-router 1.6.1's compute_block_hash_for_seq (block size 4), printed by a tool linked
    against the crate: plain, LoRA-seeded, salt-seeded, empty strings as absent."""
    from kvidx.core.hashing import dynamo_local_hashes, dynamo_seed

    assert dynamo_local_hashes(pack_tokens(list(range(1, 13))), 4) == [
        14643705804678351452, 16777012769546811212, 483935686894639516]
    assert dynamo_local_hashes(pack_tokens([1, 2, 3, 4, 5]), 4) == [14643705804678351452]  # partial dropped
    assert dynamo_local_hashes(pack_tokens([1, 2, 3, 4]), 4, dynamo_seed("lora-a")) == [16997879858665117404]
    assert dynamo_local_hashes(pack_tokens([1, 2, 3, 4]), 4, dynamo_seed(None, "s")) == [5728354201622468629]
    assert dynamo_seed("", "") == dynamo_seed()
