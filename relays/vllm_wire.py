"""vLLM's KV-event wire format (vllm/distributed/kv_events.py), decoded with msgspec.

Checked against vLLM 0.32.0 (events as maps tagged by "type", defaults omitted) and the older
positional encoding (events as arrays whose first element is the tag, as vLLM <= 0.25 sends them).
The batch is always an array `[ts, events, data_parallel_rank]` (the rank may be absent).
Hashes are `int | bytes` (64-bit ints by default, 32-byte digests with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
"""

from __future__ import annotations

from typing import Any

import msgspec

SUPPORTED_VERSIONS = ("0.8", "0.32")  # positional (<= 0.25) and tagged-map (>= 0.26) encodings
EngineHash = int | bytes


class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[EngineHash]
    medium: str | None = "GPU"
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# Older releases: the same events as positional arrays, tag first.
class _BlockStoredPos(msgspec.Struct, tag="BlockStored", array_like=True):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None


class _BlockRemovedPos(msgspec.Struct, tag="BlockRemoved", array_like=True):
    block_hashes: list[EngineHash]
    medium: str | None = "GPU"


class _AllBlocksClearedPos(msgspec.Struct, tag="AllBlocksCleared", array_like=True):
    pass


class _BatchPos(msgspec.Struct, array_like=True):
    ts: float
    events: list[_BlockStoredPos | _BlockRemovedPos | _AllBlocksClearedPos]
    data_parallel_rank: int | None = None


class Batch(msgspec.Struct):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None


_dec_map = msgspec.msgpack.Decoder(_Batch)
_dec_pos = msgspec.msgpack.Decoder(_BatchPos)


def _from_positional(b: _BatchPos) -> Batch:
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for e in b.events:
        if isinstance(e, _BlockStoredPos):
            events.append(BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size,
                                      e.lora_id, e.medium, e.lora_name))
        elif isinstance(e, _BlockRemovedPos):
            events.append(BlockRemoved(e.block_hashes, e.medium))
        else:
            events.append(AllBlocksCleared())
    return Batch(b.ts, events, b.data_parallel_rank)


def decode_payload(payload: bytes) -> Batch:
    """Decode one payload frame, map-encoded or positional. Raises msgspec errors on bad input."""
    try:
        b = _dec_map.decode(payload)
        return Batch(b.ts, b.events, b.data_parallel_rank)
    except msgspec.ValidationError as map_error:
        try:
            return _from_positional(_dec_pos.decode(payload))
        except msgspec.ValidationError:
            raise map_error from None


def fold_engine_hash(h: EngineHash) -> int:
    """An engine hash as an unsigned 64-bit int, as vLLM folds its digests: the last 8 bytes."""
    if isinstance(h, int):
        return h & 0xFFFF_FFFF_FFFF_FFFF
    return int.from_bytes(h[-8:], "big")
