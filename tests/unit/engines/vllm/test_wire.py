"""vLLM KV-event wire decoding (kvidx/engines/vllm/wire.py): 0.32 tagged maps, older positional arrays."""

from __future__ import annotations

from collections import Counter

import msgspec
import pytest

from kvidx.engines.common import Unreadable
from kvidx.engines.recording import read_frames
from kvidx.engines.vllm.sim import chain_digests, external_hash, none_hash
from kvidx.engines.vllm.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_payload,
    fold_engine_hash,
)
from tests.helpers import GEMMA, LLAMA

enc = msgspec.msgpack.encode
BIG = 17229991920652456757  # a real hash from the llama fixture, >= 2**63


def test_decode_real_032_frames():
    frames = list(read_frames(LLAMA / "frames.jsonl"))
    assert len(frames) == 146
    counts: Counter = Counter()
    stored_blocks = 0
    big = 0
    for f in frames:
        b = decode_payload(f.payload)
        assert b.data_parallel_rank == 0
        assert b.ts > 1.7e9
        for e in b.events:
            counts[type(e).__name__] += 1
            if isinstance(e, BlockStored):
                stored_blocks += len(e.block_hashes)
                assert e.block_size == 32 and e.medium == "GPU" and e.group_idx == 0
                assert e.kv_cache_spec_kind == "full_attention"
                assert len(e.token_ids) == 32 * len(e.block_hashes)
                assert e.extra_keys == [None] * len(e.block_hashes)
            if isinstance(e, BlockStored | BlockRemoved):
                assert all(isinstance(h, int) and 0 <= h < 2**64 for h in e.block_hashes)
                big += sum(h >= 2**63 for h in e.block_hashes)
    # decode.txt of the fixture: 196 BlockStored (259 blocks), 194 BlockRemoved, 1 AllBlocksCleared
    assert counts == {"BlockStored": 196, "BlockRemoved": 194, "AllBlocksCleared": 1}
    assert stored_blocks == 259
    assert big > 0


def test_decode_real_first_frame_hashes_match_vllm_sha256():
    first = next(iter(read_frames(LLAMA / "frames.jsonl")))
    e = decode_payload(first.payload).events[0]
    assert isinstance(e, BlockStored) and e.parent_block_hash is None
    digests = chain_digests(e.token_ids, 32, none_hash())
    assert [external_hash(d) for d in digests] == e.block_hashes


def test_decode_real_hybrid_frames():
    kinds = set()
    for f in read_frames(GEMMA / "frames.jsonl"):
        for e in decode_payload(f.payload).events:
            if isinstance(e, BlockStored):
                kinds.add((e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window))
    assert kinds == {(0, "sliding_window", 32), (1, "full_attention", None)}


def test_decode_tagged_map_with_defaults_omitted_and_unknown_fields():
    payload = enc([1.5, [
        {"type": "BlockStored", "block_hashes": [BIG], "parent_block_hash": None,
         "token_ids": list(range(16)), "block_size": 16, "locality": "local", "ownership": "x",
         "session_id": "s"},
        {"type": "BlockRemoved", "block_hashes": [BIG]},
        {"type": "AllBlocksCleared"},
    ], 3])
    b = decode_payload(payload)
    assert b.ts == 1.5 and b.data_parallel_rank == 3
    s, r, c = b.events
    assert isinstance(s, BlockStored) and s.block_hashes == [BIG] and s.medium == "GPU"
    assert s.group_idx is None and s.lora_name is None and s.extra_keys is None
    assert isinstance(r, BlockRemoved) and r.block_hashes == [BIG] and r.medium == "GPU"
    assert isinstance(c, AllBlocksCleared)


def test_decode_positional_form():
    toks = list(range(16))
    payload = enc([2.0, [["BlockStored", [BIG, 5], 7, toks + toks, 16, None, "GPU"],
                         ["BlockRemoved", [BIG], "GPU"], ["AllBlocksCleared"]], 0])
    b = decode_payload(payload)
    assert b.data_parallel_rank == 0
    s, r, c = b.events
    assert isinstance(s, BlockStored)
    assert (s.block_hashes, s.parent_block_hash, s.token_ids, s.block_size, s.medium) == (
        [BIG, 5], 7, toks + toks, 16, "GPU")
    assert isinstance(r, BlockRemoved) and r.block_hashes == [BIG] and r.medium == "GPU"
    assert isinstance(c, AllBlocksCleared)


def test_decode_positional_minimal_and_without_rank():
    b = decode_payload(enc([2.0, [["BlockStored", [1], None, list(range(16)), 16], ["BlockRemoved", [1]]]]))
    assert b.data_parallel_rank is None
    assert b.events[0].medium == "GPU" and b.events[0].parent_block_hash is None
    assert b.events[1].block_hashes == [1]


def test_batch_without_dp_rank():
    b = decode_payload(enc([1.0, [{"type": "AllBlocksCleared"}]]))
    assert b.data_parallel_rank is None and isinstance(b.events[0], AllBlocksCleared)
    assert decode_payload(enc([1.0, []])).events == []


def test_bytes_hashes_and_fold():
    d1, d2 = chain_digests(list(range(64)), 32, none_hash())
    payload = enc([1.0, [{"type": "BlockStored", "block_hashes": [d2], "parent_block_hash": d1,
                          "token_ids": list(range(32, 64)), "block_size": 32},
                         {"type": "BlockRemoved", "block_hashes": [d1]}], 0])
    s, r = decode_payload(payload).events
    assert s.block_hashes == [d2] and isinstance(s.block_hashes[0], bytes)
    assert s.parent_block_hash == d1 and r.block_hashes == [d1]
    assert fold_engine_hash(d2) == external_hash(d2) == int.from_bytes(d2[-8:], "big")
    assert fold_engine_hash(bytes(24) + (2**64 - 1).to_bytes(8, "big")) == 2**64 - 1


def test_fold_ints():
    assert fold_engine_hash(BIG) == BIG
    assert fold_engine_hash(2**64 - 1) == 2**64 - 1
    assert fold_engine_hash(2**64 + 5) == 5
    assert fold_engine_hash(-1) == 2**64 - 1  # a signed 64-bit hash folds to its unsigned value


def test_ints_at_and_above_2_63_round_trip():
    hs = [2**63, 2**63 + 1, 2**64 - 1, 0, 1]
    b = decode_payload(enc([1.0, [{"type": "BlockRemoved", "block_hashes": hs}], 0]))
    assert b.events[0].block_hashes == hs


@pytest.mark.parametrize("payload", [
    b"",
    b"\xc1",
    b"not msgpack at all",
    enc({"ts": 1.0, "events": []}),
    enc([1.0]),
    enc(["x", [], 0]),
    enc([1.0, "events", 0]),
])
def test_malformed_payloads_raise_msgspec_errors(payload):
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        decode_payload(payload)


@pytest.mark.parametrize("event,kind,hashes", [
    ({"type": "Nope"}, "other", None),
    ({"type": "BlockStored", "block_hashes": [1]}, "stored", [1]),
    ({"type": "BlockRemoved", "block_hashes": [1.5]}, "removed", None),
    ({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": ["a"],
      "block_size": 16}, "stored", [1]),
    (["Nope", [1]], "other", [1]),
    (["BlockStored", [1]], "stored", [1]),
    (["BlockRemoved", [7, 8], 3], "removed", [7, 8]),
    (7, "other", None),
])
def test_an_event_that_does_not_decode_costs_that_event_only(event, kind, hashes):
    good = {"type": "BlockRemoved", "block_hashes": [9]}
    b = decode_payload(enc([1.0, [good, event, good], 0]))
    first, bad, last = b.events
    assert first == last == BlockRemoved([9])
    assert isinstance(bad, Unreadable) and (bad.kind, bad.hashes) == (kind, hashes)
    assert msgspec.msgpack.decode(bad.raw) == event and bad.detail
