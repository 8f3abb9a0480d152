"""vLLM's own block hashes (kvidx.engines.vllm.hashing, the Mooncake conductor's `vllm_v1` profiles):
the canonical CBOR agrees with cbor2 (canonical=True), the oracle vLLM itself uses; `sha256` (pickle 5)
reproduces every block hash a real vLLM 0.32 engine published in the recordings; the chain, extras
and projection follow vLLM's hash_block_tokens."""

import hashlib
import json
import pickle

import cbor2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvidx.engines.recording import read_frames
from kvidx.engines.vllm.hashing import block_digests, block_keys, cbor, root_digest
from kvidx.engines.vllm.wire import BlockStored, decode_payload
from tests.helpers import GEMMA, LLAMA

scalars = st.none() | st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=300) | st.text(max_size=300)
values = st.recursive(scalars, lambda inner: st.tuples(inner, inner) | st.lists(inner, max_size=30),
                      max_leaves=40)


@given(values)
def test_canonical_cbor_is_cbor2s(v):
    assert cbor(v) == cbor2.dumps(v, canonical=True)


def test_the_chain_extras_and_projection():
    algo, seed = "sha256_cbor", "0"
    root = root_digest(algo, seed)
    assert root == hashlib.sha256(b"\x61\x30").digest()  # the text "0"
    assert root != root_digest(algo, "00")
    toks = list(range(1, 10))  # two full blocks of 4 and a partial one (no hash)
    d = block_digests(toks, 4, algo, seed, lora_name="a", cache_salt="s")
    first = hashlib.sha256(cbor2.dumps((root, (1, 2, 3, 4), ("a", "s")), canonical=True)).digest()
    second = hashlib.sha256(cbor2.dumps((first, (5, 6, 7, 8), ("a",)), canonical=True)).digest()
    assert d == [first, second]  # the full digest chains, LoRA on every block, the salt on the first
    assert block_keys(toks, 4, algo, seed, "a", "s") == [int.from_bytes(x[-8:], "big") for x in d]
    plain = block_digests(toks, 4, "sha256", seed)[0]
    assert plain == hashlib.sha256(pickle.dumps(
        (hashlib.sha256(pickle.dumps("0", protocol=5)).digest(), (1, 2, 3, 4), None), protocol=5)).digest()
    with pytest.raises(ValueError, match="unknown vLLM hash algorithm"):
        block_keys(toks, 4, "xxhash")


@pytest.mark.parametrize("recording", [LLAMA, GEMMA])
def test_sha256_reproduces_a_real_engines_block_hashes(recording):
    """The recordings' engine ran --prefix-caching-hash-algo sha256 without PYTHONHASHSEED (vLLM 0.32's
    NONE_HASH seed "vllm-none-hash"), blocks of 32: each stored block hash is the key of some request's
    prompt (+ output) chain."""
    known = set()
    for line in (recording / "requests.jsonl").read_text().splitlines():
        r = json.loads(line)
        known.update(block_keys(r["prompt_token_ids"] + (r.get("output_token_ids") or []), 32, "sha256",
                                "vllm-none-hash"))
    stored = [h for f in read_frames(recording / "frames.jsonl") for ev in decode_payload(f.payload).events
              if isinstance(ev, BlockStored) for h in ev.block_hashes]
    assert len(stored) > 50 and all(h & ((1 << 64) - 1) in known for h in stored)
