"""Known answers for kvidx's canonical block hash (kvidx/core/hashing.py), in whichever build runs
(compiled core or KVIDX_NATIVE=0).

Each case is checked twice: against `_ref`, written here from the rule hashing.py documents (xxh3-64
over the block's tokens packed as little-endian uint32, seeded with the parent's hash; a block's
extra keys, msgpack-encoded by hand below, hashed with the parent as seed into that block's seed;
the root seed 0x6B7669647831, a LoRA adapter's xxh3(b"lora\\0" + name, seed=root)), and against
the literal numbers committed here, so a change of the rule, of xxhash, or of both sides at once
fails. Nothing here calls kvidx's own chain to make an expected value."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash

from kvidx.core import hashing, maskmap
from kvidx.core.hashing import chain, extra_seed, namespace_seed, prompt_hashes, tail_key
from kvidx.core.maskmap import py_chain

X = xxhash.xxh3_64_intdigest
ROOT = 0x6B7669647831  # "kvidx1"
T = [(i * 7919 + 13) % 50257 for i in range(40)]  # 2 full 16-token blocks and an 8-token tail
SALT_S1 = b"\x91\xa2s1"  # msgpack ["s1"]: the cache salt as block 0's extra keys
MM_IMG = b"\x91\x93\xa2mm\xa3img\x03"  # msgpack [["mm", "img", 3]]


def _packed(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def _ref(tokens: list[int], bs: int, seed: int, extras: dict[int, bytes] | None = None) -> list[int]:
    extras = extras or {}
    out, h = [], seed
    for i in range(len(tokens) // bs):
        s = X(extras[i], seed=h) if i in extras else h
        h = X(_packed(tokens[i * bs:(i + 1) * bs]), seed=s)
        out.append(h)
    return out


LORA_A = 13646322398051267904  # namespace seed of adapter "adapter-a"
PLAIN = [6015790963889481576, 17656239798150870357]
PLAIN_BS1 = [9769915717626943830, 14784639730502826301, 703177369249746448]  # T[:3], 1-token blocks
LORA = [7962960957348718365, 18241371901337513006]
SALT = [6311807621863067191, 12401997195094968115]
LORA_SALT = [13640158621388670997, 8461023620347190818]
EXTRA_ON_BLOCK_1 = [6015790963889481576, 12713469263307362462]
TAILS_AFTER_2 = [1500078380725721586, 7534720926376807734, 16205397943926913473, 10538347348991293723,
                 14678453008953976034, 3119685123048785300, 6802107387478425879, 1582694989002291442]
TAILS_AT_ROOT_SALTED = [5095658370798513582, 11605719650647710051, 18416801827456116050]


def test_reference_matches_the_committed_numbers():
    """The test's own reference reproduces the committed numbers (so they are the rule's, not a
    snapshot of kvidx)."""
    assert X(b"lora\x00adapter-a", seed=ROOT) == LORA_A
    assert _ref(T, 16, ROOT) == PLAIN
    assert _ref(T[:3], 1, ROOT) == PLAIN_BS1
    assert _ref(T, 16, LORA_A) == LORA
    assert _ref(T, 16, ROOT, {0: SALT_S1}) == SALT
    assert _ref(T, 16, LORA_A, {0: SALT_S1}) == LORA_SALT
    assert _ref(T, 16, ROOT, {1: MM_IMG}) == EXTRA_ON_BLOCK_1


def test_plain_chain():
    assert hashing.ROOT_SEED == ROOT
    assert prompt_hashes(T, 16) == PLAIN
    assert list(prompt_hashes(T, 16, array=True)) == PLAIN
    assert prompt_hashes(T[:3], 1) == PLAIN_BS1
    assert chain(_packed(T), 16, ROOT) == PLAIN
    assert py_chain(_packed(T), 16, ROOT) == PLAIN
    assert maskmap.chain(_packed(T), 16, ROOT) == PLAIN


def test_lora_namespace():
    assert namespace_seed("adapter-a") == LORA_A
    assert prompt_hashes(T, 16, lora_name="adapter-a") == LORA
    assert list(prompt_hashes(T, 16, lora_name="adapter-a", array=True)) == LORA


def test_cache_salt_is_block_0s_extra_key():
    assert extra_seed(ROOT, ["s1"]) == X(SALT_S1, seed=ROOT)
    assert prompt_hashes(T, 16, cache_salt="s1") == SALT
    assert prompt_hashes(T, 16, lora_name="adapter-a", cache_salt="s1") == LORA_SALT


def test_extra_keys_chain_from_the_parent():
    """Extra keys of a later block are hashed with that block's parent as the seed: a rule that
    dropped the parent there would give the second number another value."""
    assert chain(_packed(T), 16, ROOT, [None, [["mm", "img", 3]]]) == EXTRA_ON_BLOCK_1
    assert hashing.mm_start_extras(2, 16, [("img", 19)]) == [None, [["mm", "img", 3]]]
    assert prompt_hashes(T, 16, mm=[("img", 19)]) == EXTRA_ON_BLOCK_1
    assert extra_seed(PLAIN[0], [["mm", "img", 3]]) == X(MM_IMG, seed=PLAIN[0])


def test_partial_keys():
    """A partial block's key: its first l tokens hashed from its parent (from the namespace seed
    with the first block's extra keys at the root)."""
    ph = prompt_hashes(T, 16, tails=True)
    assert list(ph) == PLAIN
    assert ph.tail_keys(2) == TAILS_AFTER_2
    assert [X(_packed(T[32:32 + k]), seed=PLAIN[1]) for k in range(1, 9)] == TAILS_AFTER_2
    assert tail_key(PLAIN[1], _packed(T[32:35])) == TAILS_AFTER_2[2]
    salted = prompt_hashes(T[:3], 16, cache_salt="s1", tails=True)
    assert list(salted) == [] and salted.tail_keys(0) == TAILS_AT_ROOT_SALTED
    s0 = X(SALT_S1, seed=ROOT)
    assert [X(_packed(T[:k]), seed=s0) for k in range(1, 4)] == TAILS_AT_ROOT_SALTED


# ---- long inputs: the pure-Python reference loop, not the compiled chain, is the oracle ----------
# 20,000 tokens: 80 KB, past the 64 KiB from which the compiled chain hashes without the GIL
LONG = [(i * 2654435761) % 200003 for i in range(20000)]
LONG_LAST = {1: 2858419832548994380, 16: 18114394181044922348, 1000: 11369990791656167312}


def _loop(tokens: list[int], bs: int, seed: int) -> list[int]:
    """The chain written out with xxhash and struct, one block at a time (no kvidx code)."""
    return _ref(tokens, bs, seed)


@pytest.mark.parametrize("bs", [1, 16, 1000])
def test_long_chain_against_the_python_loop(bs):
    packed = _packed(LONG)
    want = _loop(LONG, bs, 11)
    assert len(want) == len(LONG) // bs and want[-1] == LONG_LAST[bs]
    assert py_chain(packed, bs, 11) == want
    assert maskmap.chain(packed, bs, 11) == want  # the compiled chain where built
    assert list(maskmap.chain_array(packed, bs, 11)) == want
    assert hashing.chain(packed, bs, 11) == want
    native = maskmap.native_module()
    if native is not None:
        assert native.chain(packed, bs, 11) == want
        assert native.chain(np.asarray(LONG, dtype="<u4"), bs, 11) == want
