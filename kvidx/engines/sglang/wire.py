"""SGLang's KV-event wire format (python/sglang/srt/disaggregation/kv_events.py), decoded with msgspec.

Checked against the released wheels (sglang on PyPI), file sglang/srt/disaggregation/kv_events.py:

- 0.4.9.post6, 0.5.3 (lines 37-71): `EventBatch(array_like, omit_defaults)` = `[ts, events,
  attn_dp_rank]` (`attn_dp_rank: Optional[int] = None`, a trailing default: omitted when None; the
  publisher sets it to its rank, so it is there; older builds had no such field: `[ts, events]`).
  `KVCacheEvent(array_like, omit_defaults, tag=True)`: events are **positional arrays, tag first**:
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id]`,
  `["BlockRemoved", block_hashes]`, `["AllBlocksCleared"]`. Hashes: Python's `hash(tuple(page))`
  (mem_cache/radix_cache.py `_record_store_event`, 0.4.9.post6 l. 497-528): a content hash of the
  page alone, not chained; a root child's parent is `hash(())` (its parent's key is empty).
- 0.5.10 (lines 37-95): the same arrays plus a trailing `medium: Optional[str] = None`
  ("GPU" / "CPU_PINNED", l. 60-61) on BlockStored and BlockRemoved. Hashes: SHA-256 chained per
  page (mem_cache/hicache_storage.py `get_hash_str` l. 17-32: sha256(prior digest + tokens as u32 LE)),
  published as the first 8 bytes as a **signed** int64 (`hash_str_to_int64`). One event per page.
- 0.5.22, 0.5.23 (lines 233-300): `EventBatch(array_like)` without omit_defaults = always
  `[ts, events, attn_dp_rank]`; `KVCacheEvent(omit_defaults, tag=True)` without array_like: events
  are **maps tagged by "type"**, fields in declaration order, optional ones omitted when None:
  BlockStored{block_hashes, parent_block_hash, token_ids, block_size, lora_id, [medium],
  [cache_salt], [session_id], [lora_name]}, BlockRemoved{block_hashes, [medium]}. StorageMedium
  (l. 261-267): GPU "GPU", CPU "CPU_PINNED", DISK, EXTERNAL. Per-page events are coalesced
  (mem_cache/events.py `KVCacheEventRecorder.enqueue`, l. 140-170): one BlockStored per
  parent-linked chain, consecutive BlockRemoved (one per evicted radix node, l. 273-303) merged.
- Replay (ZmqEventPublisher._service_replay): <= 0.5.10 answers `[b"", seq, payload]` (no topic)
  and ends with `[b"", END_SEQ, b""]`; 0.5.22+ answers `[b"", topic, seq, payload]` and ends with
  `[b"", b"", END_SEQ, b""]` (kv_events.py 0.5.23 l. 630-648). relays/zmq_source.py takes both.

The relay is pinned to one version: a payload in the other encoding is a dead letter
("version_mismatch"), never silently re-read.

EAGLE speculative decoding: the radix tree is keyed on bigrams and a stored page's `token_ids` are
token pairs `[(raw[j], raw[j + 1]) for j in range(start, end)]` (mem_cache/events.py `record_store`,
"bigram pages expose tuples"; 0.5.23 wheel), msgpack arrays of two ints on the wire, `block_size` =
the number of pairs. They are decoded here as they come (`PageToken`); the mirror turns them back
into single tokens (kvidx.core.spec_decode.unpair_tokens), so a prefix gets the same index key with
or without drafting.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

# version -> (encoding, hash kind)
VERSIONS: dict[str, tuple[str, str]] = {
    "0.4.9.post6": ("positional", "py_tuple_hash"),
    "0.5.3": ("positional", "py_tuple_hash"),
    "0.5.10": ("positional", "sha256_int64"),
    "0.5.22": ("map", "sha256_int64"),
    "0.5.23": ("map", "sha256_int64"),
}
SUPPORTED_VERSIONS = tuple(VERSIONS)
DEFAULT_VERSION = "0.5.23"
# Python's hash(()): the parent SGLang <= 0.5.3 gives a root child (radix_cache.py 0.4.9.post6 l. 503-508)
PY_EMPTY_TUPLE_HASH = hash(())


class UnsupportedEngineVersion(ValueError):
    pass


def check_version(version: str) -> tuple[str, str]:
    """(encoding, hash kind) of a pinned SGLang version; a clear error for any other."""
    prof = VERSIONS.get(version)
    if prof is None:
        raise UnsupportedEngineVersion(
            f"SGLang {version!r} is not a version this relay was checked against "
            f"(supported: {', '.join(SUPPORTED_VERSIONS)}); its KV-event encoding may differ. "
            f"Pin --engine-version to the closest checked release only after comparing "
            f"sglang/srt/disaggregation/kv_events.py")
    return prof


# ---- normalized events (what the mirror reads) ------------------------------------------------
# a page token: an int, or an EAGLE bigram (token, next token), which the mirror unpairs
PageToken = int | tuple[int, int]


@dataclass
class Batch:
    ts: float
    events: list
    data_parallel_rank: int | None  # SGLang's attn_dp_rank (named as vLLM's for the shared relay)


# ---- 0.5.22+: maps tagged by "type"; these are also the events the mirror reads ----------------
class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[PageToken]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class _BatchMap(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    attn_dp_rank: int | None = None


# ---- <= 0.5.10: positional arrays, tag first ---------------------------------------------------
class _StoredPos(msgspec.Struct, tag="BlockStored", array_like=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[PageToken]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None  # 0.5.10+


class _RemovedPos(msgspec.Struct, tag="BlockRemoved", array_like=True):
    block_hashes: list[int]
    medium: str | None = None  # 0.5.10+


class _ClearedPos(msgspec.Struct, tag="AllBlocksCleared", array_like=True):
    pass


class _BatchPos(msgspec.Struct, array_like=True):
    ts: float
    events: list[_StoredPos | _RemovedPos | _ClearedPos]
    attn_dp_rank: int | None = None  # absent in the oldest builds: `[ts, events]`


_dec = {"map": msgspec.msgpack.Decoder(_BatchMap), "positional": msgspec.msgpack.Decoder(_BatchPos)}
_I64 = 1 << 63


class VersionMismatch(msgspec.ValidationError):
    """The payload decodes in the other encoding than the pinned version's (dead letter reason
    "version_mismatch")."""


def _norm_event(e):
    if isinstance(e, BlockStored | BlockRemoved | AllBlocksCleared):
        ev = e
    elif isinstance(e, _StoredPos):
        ev = BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id, e.medium)
    elif isinstance(e, _RemovedPos):
        ev = BlockRemoved(e.block_hashes, e.medium)
    else:
        ev = AllBlocksCleared()
    for h in () if isinstance(ev, AllBlocksCleared) else ev.block_hashes:
        if not -_I64 <= h < _I64:
            raise msgspec.ValidationError(f"block hash {h} is not a signed 64-bit int")
    return ev


def _norm(b: _BatchMap | _BatchPos) -> Batch:
    return Batch(b.ts, [_norm_event(e) for e in b.events], b.attn_dp_rank)


class _RawBatch(msgspec.Struct, array_like=True):
    """The envelope with its events undecoded: read one by one when the batch does not decode."""
    ts: float
    events: list[msgspec.Raw]
    attn_dp_rank: int | None = None


_dec_raw = msgspec.msgpack.Decoder(_RawBatch)
_dec_event = {"map": msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared),
              "positional": msgspec.msgpack.Decoder(_StoredPos | _RemovedPos | _ClearedPos)}
EVENT_KINDS = {"BlockStored": "stored", "BlockRemoved": "removed", "AllBlocksCleared": "cleared"}


def _decode_event(raw: msgspec.Raw, encoding: str):
    from kvidx.engines.common import read_unreadable

    try:
        return _norm_event(_dec_event[encoding].decode(raw))
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as e:
        return read_unreadable(bytes(raw), str(e) or "nested too deeply", EVENT_KINDS)


def decode_payload(payload: bytes, encoding: str = "map") -> Batch:
    """Decode one payload frame in the pinned encoding ("map" or "positional"). Raises msgspec errors
    on a bad batch envelope, VersionMismatch when the batch is the other encoding; an event that does
    not decode stays in its place as a common.Unreadable (the batch's other events are read)."""
    try:
        return _decode_payload(payload, encoding)
    except RecursionError:  # msgspec's depth limit: a malformed frame, not a crash
        raise msgspec.DecodeError("nested too deeply") from None


def _decode_payload(payload: bytes, encoding: str) -> Batch:
    try:
        return _norm(_dec[encoding].decode(payload))
    except msgspec.ValidationError as first:
        other = "positional" if encoding == "map" else "map"
        try:
            _norm(_dec[other].decode(payload))
        except (msgspec.ValidationError, msgspec.DecodeError):
            pass
        else:
            raise VersionMismatch(f"version_mismatch: payload is {other}-encoded, "
                                  f"the pinned version sends {encoding}") from None
        try:
            msgspec.msgpack.decode(payload)  # msgpack throughout (raw events are not read yet)
            rb = _dec_raw.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError):
            raise first from None
        from kvidx.engines.common import per_event

        return Batch(rb.ts, per_event(rb.events, lambda r: _decode_event(r, encoding)), rb.attn_dp_rank)


def u64(h: int) -> int:
    """A signed SGLang hash as the unsigned 64-bit int the schema carries (engine_hashes)."""
    return h & 0xFFFF_FFFF_FFFF_FFFF
