"""SGLang's block hashes (kvidx.engines.sglang.hashing) against SGLang's published vectors, and the
simulated SGLang engine's events against them."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from kvidx.engines.sglang.hashing import hash_str_to_int64, page_hash_hex, sglang_page_hashes
from kvidx.engines.sglang.sim import SimSglangEngine

# sgl-router kv_events::hash cross-language tests (the engine's own hashing, pinned there)
GOLDENS = [
    (([1, 2, 3, 4], 4), [-3488128144981237669]),
    (([10, 20, 30, 40, 50, 60, 70, 80], 2),
     [978178666101069530, -895308556211281782, -8033692805846017938, 835415944263129316]),
    (([1, 2, 3], 4), []),  # only full pages are hashed
]


@pytest.mark.parametrize("args, want", GOLDENS)
def test_sglangs_published_vectors(args, want):
    assert sglang_page_hashes(*args) == want


def test_digest_to_int64_and_the_hex_chain_agree():
    assert hash_str_to_int64(hashlib.sha256(b"").hexdigest()) == -2039914840885289964
    prior = None
    ints = []
    for page in ([10, 20], [30, 40], [50, 60], [70, 80]):
        prior = page_hash_hex(page, prior)
        ints.append(hash_str_to_int64(prior))
    assert ints == GOLDENS[1][1]
    with pytest.raises(ValueError):
        sglang_page_hashes([1, 2], 0)


def test_the_simulated_engine_publishes_these_hashes():
    eng = SimSglangEngine(num_pages=64, page_size=4, version="0.5.23", endpoint=None, clock=lambda: 1.0)
    prompt = list(range(100, 137))
    eng.serve(prompt, [7, 8])
    stored = []
    for _seq, _ts, payload in eng.published:
        for ev in msgspec.msgpack.decode(payload)[1]:
            if isinstance(ev, dict) and ev.get("type") == "BlockStored":
                stored += ev["block_hashes"]
    assert stored[:9] == sglang_page_hashes(prompt, 4)
