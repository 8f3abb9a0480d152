"""The KV-event wire format of Mooncake Store's master (RFC #1527, kvcache-ai/Mooncake#1527; the
publisher of kvcache-ai/Mooncake#2214), decoded with msgspec. Structs and decoding only.

Read in the Mooncake sources at tag v0.3.12 (the first release with the publisher; v0.3.12.post1 and
main at 3b5a594 send the same bytes), mooncake-store/src/kv_event/kv_event_publisher.cpp:
- frames (l. 346-363): three ZMQ frames, an **empty topic**, the sequence as 8 bytes big-endian
  (`htobe64`), the msgpack payload. The sequence starts at **1** per master process
  (include/kv_event/kv_event_publisher.h l. 82 `next_zmq_sequence_{1}`), one per batch; a dropped
  queue entry reserves a number (l. 175-181), so loss shows as a gap. There is no replay endpoint
  (PUB only; dev/conductor docs/source/design/kv-event/publisher-design.md l. 272-277).
- payload (l. 255-258, 343-344): `[timestamp_ms, [event maps], dp_rank]`: Unix time in
  **milliseconds** (int64), at most 64 events (l. 18), and a trailing dp_rank that is always 0
  (the pool has no DP context; not an engine rank, so it is not read).
- event maps (l. 266-340, sizes from ComputeEventMapSize l. 44-66), in this order: event_id,
  timestamp, event_type ("stored" | "removed"), [type: "BlockStored" | "BlockRemoved" when
  emit_legacy_compat_fields], model_name=nil, block_size=nil, additional_salt=nil, lora_name=nil,
  tenant_id ("default" when the operation had none), backend_id (the cache owner, from
  --kv_events_backend_id), group_id (Mooncake's object group or nil), medium ("cpu" | "disk";
  master_service.cpp v0.3.12 MediumForReplicaType l. 9065-9077), dp_rank=nil, [object_key when
  emit_object_key], seq_hashes ([u64] or []), [block_hashes: the same value cast to **int64**,
  negative above 2^63, or []], then stored: base_block_idx=0, parent_hash=nil, token_ids=nil,
  [parent_block_hash=nil]; removed: base_block_idx=nil. The master never sends "cleared".
- hashes (include/kv_event/key_util.h l. 9-34): seq_hashes[0] is the object key parsed as a decimal
  or 0x-hex u64; any other key gives an empty seq_hashes (the event is still sent, with object_key).

Choices where the sources leave them open:
- The RFC's field names are primary; the legacy aliases (`type`, `block_hashes`,
  `parent_block_hash`) are read when the primary field is absent and must agree with it when both
  are there (a disagreement is a malformed payload), as Conductor does (publisher-design.md l. 88).
- Hashes are accepted as msgpack ints (u64; int64 in the legacy alias, folded to u64), as decimal or
  0x strings (key_util.h's rule), or as byte strings of 8+ bytes (their last 8 bytes, big-endian:
  how vLLM and Conductor fold digests).
- An event without any seq hash but with an object key in a vLLM connector's form
  (`[prefix@]model@tp_rank:N@pcpN@dcpN@pp_rank:N[@group:N]@hash`, or vLLM Ascend's
  `model@pcpN@dcpN@head_or_tp_rank:N@pp_rank:N@hash` / `...@hash@layer_id`) gets the low 64 bits
  of the key's hash, as the newer publisher does (dev/conductor include/kv_event/key_util.h
  ParseKvEventKey l. 107-211; the low 64 bits are vLLM's published int hash). Other keys (e.g.
  SGLang HiCache's `<sha256>_<rank>_k`) stay unidentified: counted by the mirror, never guessed.
- An event that does not decode (an unknown event type, a bad field) is kept in its place as a
  kvidx.engines.common.Unreadable: the mirror sets it aside by the common rule and reads the batch's
  other events; only a bad batch envelope is a ValidationError (the whole message a dead letter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

# version -> (removal rule, default tiers by lower-case medium, "" for none). "object": a removal
# means the object is gone from every medium (the v0.3.12 master publishes `removed` only once no
# replica is left, master_service.cpp PublishKvRemovedAfterEvict l. 9123-9137, Remove l. 4518);
# "medium": only the named medium drops it (the RFC's own rule, as Conductor reads it: dev/conductor
# docs/source/design/kv-event/publisher-design.md l. 189-198).
VERSIONS: dict[str, tuple[str, dict[str, str]]] = {
    "0.3.12": ("object", {"": "POOL", "cpu": "POOL", "disk": "DISK"}),
    "0.3.12.post1": ("object", {"": "POOL", "cpu": "POOL", "disk": "DISK"}),
    "rfc1527-v1": ("medium", {"": "GPU", "gpu": "GPU", "cpu": "CPU", "disk": "DISK"}),
}
SUPPORTED_VERSIONS = tuple(VERSIONS)
DEFAULT_VERSION = "0.3.12.post1"

_U64 = (1 << 64) - 1
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]  # hashed as uint32: others are malformed
LEGACY_TYPES = {"BlockStored": "stored", "BlockRemoved": "removed", "AllBlocksCleared": "cleared"}


class UnsupportedEngineVersion(ValueError):
    pass


def check_version(version: str | None) -> tuple[str, dict[str, str]]:
    """(removal rule, tiers by medium) of a pinned version; a clear error for any other."""
    prof = VERSIONS.get((version or "").strip().lstrip("v"))
    if prof is None:
        raise UnsupportedEngineVersion(
            f"Mooncake Store {version!r} is not a version this relay was checked against (supported: "
            f"{', '.join(SUPPORTED_VERSIONS)}); its KV-event publisher may differ: compare "
            "mooncake-store/src/kv_event/kv_event_publisher.cpp and master_service.cpp's Publish* calls "
            "of that release with kvidx/engines/mooncake/wire.py first")
    return prof


# ---- the events the mirror reads ---------------------------------------------------------------
@dataclass
class Stored:
    hashes: list[int]  # u64 seq hashes (one per block), from seq_hashes or the object key
    object_key: str | None
    medium: str | None
    tenant_id: str
    backend_id: str
    model_name: str | None = None
    block_size: int | None = None
    lora_name: str | None = None
    additional_salt: str | None = None
    parent_hash: int | None = None
    base_block_idx: int | None = None
    token_ids: list[int] | None = None


@dataclass
class Removed:
    hashes: list[int]
    object_key: str | None
    medium: str | None
    tenant_id: str
    backend_id: str
    model_name: str | None = None


@dataclass
class Cleared:
    tenant_id: str
    backend_id: str
    model_name: str | None = None


@dataclass
class Batch:
    ts: float  # seconds (the wire carries milliseconds)
    events: list
    data_parallel_rank: int | None = None  # never the master's trailer: it is not an engine rank


class _Event(msgspec.Struct):
    """One event map, every field optional (the RFC's names and the legacy aliases); unknown keys
    (connector_block_hash, tp_rank ... of newer publishers) are ignored."""
    event_id: int | None = None
    timestamp: int | float | None = None
    event_type: str | None = None
    type: str | None = None
    model_name: str | None = None
    block_size: int | None = None
    additional_salt: str | None = None
    lora_name: str | None = None
    tenant_id: str | None = None
    backend_id: str | None = None
    group_id: str | int | None = None
    medium: str | None = None
    dp_rank: int | None = None
    object_key: str | None = None
    seq_hashes: list[Any] | None = None
    block_hashes: list[Any] | None = None
    base_block_idx: int | None = None
    parent_hash: Any = None
    parent_block_hash: Any = None
    token_ids: list[TokenId] | None = None


class _Batch(msgspec.Struct, array_like=True):
    ts: int | float  # timestamp_ms
    events: list[_Event]
    dp_rank: int | None = None  # trailing; extra trailing elements are ignored


_dec = msgspec.msgpack.Decoder(_Batch)


def parse_hash(x: Any, signed_ok: bool = False) -> int:
    """A hash on the wire as u64: an int (int64 folded when `signed_ok`: the legacy alias), a decimal or
    0x string, or a byte string of at least 8 bytes (its last 8, big-endian)."""
    if isinstance(x, bool):
        raise msgspec.ValidationError(f"hash {x!r} is not an integer")
    if isinstance(x, int):
        if 0 <= x <= _U64:
            return x
        if signed_ok and -(1 << 63) <= x < 0:
            return x & _U64
        raise msgspec.ValidationError(f"hash {x} is not an unsigned 64-bit integer")
    if isinstance(x, str):
        h = numeric_key(x)
        if h is None:
            raise msgspec.ValidationError(f"hash {x[:40]!r} is neither decimal nor 0x hex u64")
        return h
    if isinstance(x, bytes) and len(x) >= 8:
        return int.from_bytes(x[-8:], "big")
    raise msgspec.ValidationError(f"hash of type {type(x).__name__} is not a u64, a string or 8+ bytes")


def numeric_key(key: str) -> int | None:
    """key_util.h ParseSeqHashFromObjectKey: the whole key as a decimal or 0x-hex u64."""
    if key[:2] in ("0x", "0X"):
        digits, base = key[2:], 16
        ok = bool(digits) and all(c in "0123456789abcdefABCDEF" for c in digits)
    else:
        digits, base = key, 10
        ok = digits.isascii() and digits.isdigit()
    if not ok:
        return None
    v = int(digits, base)
    return v if v <= _U64 else None


def _labeled(part: str, label: str) -> bool:
    rest = part[len(label):]
    return part.startswith(label) and rest.isascii() and rest.isdigit()


def _low64_hex(h: str) -> int | None:
    if h[:2] in ("0x", "0X"):
        h = h[2:]
    if not h or not all(c in "0123456789abcdefABCDEF" for c in h):
        return None
    return int(h[-16:], 16)


def connector_key_hash(key: str) -> int | None:
    """The low 64 bits of the block hash in a vLLM (or vLLM Ascend) connector's object key (dev/conductor
    key_util.h ParseKvEventKey), None for any other key."""
    parts = key.split("@")
    if len(parts) < 6:
        return None
    for i in range(1, len(parts)):  # vLLM: [prefix@]model@tp_rank:N@pcpN@dcpN@pp_rank:N[@group:N]@hash
        if not _labeled(parts[i], "tp_rank:"):
            continue
        group = i + 6 == len(parts)
        if not group and i + 5 != len(parts):
            continue
        if not (_labeled(parts[i + 1], "pcp") and _labeled(parts[i + 2], "dcp")
                and _labeled(parts[i + 3], "pp_rank:") and (not group or _labeled(parts[i + 4], "group:"))):
            continue
        h = parts[i + (5 if group else 4)]
        return _low64_hex(h) if parts[i - 1] and h else None
    # vLLM Ascend: model@pcpN@dcpN@head_or_tp_rank:N@pp_rank:N@hash or ...@head_or_tp_rank:N@hash@layer
    for i in range(1, len(parts)):
        if not _labeled(parts[i], "pcp") or i + 4 >= len(parts):
            continue
        if not (_labeled(parts[i + 1], "dcp") and _labeled(parts[i + 2], "head_or_tp_rank:")):
            continue
        if i + 5 == len(parts) and _labeled(parts[i + 3], "pp_rank:"):
            h = parts[i + 4]
        elif i + 5 == len(parts) and parts[i + 4].isascii() and parts[i + 4].isdigit():
            h = parts[i + 3]
        else:
            continue
        return _low64_hex(h) if parts[0] and h else None
    return None


def key_hash(key: str | None) -> int | None:
    """The u64 an object key names: the key itself as a number (v0.3.12's rule), else the hash of a
    vLLM connector key, else None."""
    if not key:
        return None
    h = numeric_key(key)
    return h if h is not None else connector_key_hash(key)


def _hashes(e: _Event) -> list[int] | None:
    seq = None if e.seq_hashes is None else [parse_hash(x) for x in e.seq_hashes]
    legacy = None if e.block_hashes is None else [parse_hash(x, signed_ok=True) for x in e.block_hashes]
    if seq is not None and legacy is not None and legacy and seq != legacy:
        raise msgspec.ValidationError("block_hashes (legacy) disagrees with seq_hashes")
    hashes = seq if seq is not None else legacy
    if not hashes and e.object_key:
        h = key_hash(e.object_key)
        return [h] if h is not None else []
    return hashes


def _event_type(e: _Event) -> str:
    legacy = None
    if e.type is not None:
        legacy = LEGACY_TYPES.get(e.type)
        if legacy is None:
            raise msgspec.ValidationError(f"unknown event type {e.type!r}")
    et = e.event_type if e.event_type is not None else legacy
    if et is None:
        raise msgspec.ValidationError("event without event_type (or the legacy type)")
    if et not in ("stored", "removed", "cleared"):
        raise msgspec.ValidationError(f"unknown event type {et!r}")
    if legacy is not None and legacy != et:
        raise msgspec.ValidationError(f"type {e.type!r} (legacy) disagrees with event_type {et!r}")
    return et


def _event(e: _Event) -> Stored | Removed | Cleared:
    et = _event_type(e)
    tenant = e.tenant_id or "default"  # kv_event_publisher.cpp l. 263-264: an empty tenant is "default"
    backend = e.backend_id or ""
    if et == "cleared":
        return Cleared(tenant, backend, e.model_name)
    hashes = _hashes(e)
    if hashes is None and not e.object_key:
        raise msgspec.ValidationError(f"{et} event without seq_hashes, block_hashes or object_key")
    hashes = hashes or []
    if et == "removed":
        return Removed(hashes, e.object_key, e.medium, tenant, backend, e.model_name)
    parent = e.parent_hash if e.parent_hash is not None else e.parent_block_hash
    parent_h = None if parent is None else parse_hash(parent, signed_ok=e.parent_hash is None)
    if e.parent_hash is not None and e.parent_block_hash is not None and \
            parse_hash(e.parent_block_hash, signed_ok=True) != parent_h:
        raise msgspec.ValidationError("parent_block_hash (legacy) disagrees with parent_hash")
    return Stored(hashes, e.object_key, e.medium, tenant, backend, e.model_name, e.block_size, e.lora_name,
                  e.additional_salt, parent_h, e.base_block_idx, e.token_ids)


class _RawBatch(msgspec.Struct, array_like=True):
    ts: int | float
    events: list[msgspec.Raw]
    dp_rank: int | None = None


_dec_raw = msgspec.msgpack.Decoder(_RawBatch)
_dec_event = msgspec.msgpack.Decoder(_Event)
_KIND_OF_LEGACY = {"BlockStored": "stored", "BlockRemoved": "removed", "AllBlocksCleared": "cleared",
                   "stored": "stored", "removed": "removed", "cleared": "cleared"}


def _unreadable(raw: bytes, detail: str):
    from kvidx.engines.common import read_unreadable

    u = read_unreadable(raw, detail, _KIND_OF_LEGACY, ("seq_hashes", "block_hashes"), ("event_type", "type"))
    try:  # the hashes as the mirror keys objects (u64), in any of the wire's spellings (parse_hash)
        obj = msgspec.msgpack.decode(raw)
        hashes = next(obj[f] for f in ("seq_hashes", "block_hashes") if isinstance(obj.get(f), list))
        u.hashes = [parse_hash(h, signed_ok=True) for h in hashes]
    except (msgspec.ValidationError, msgspec.DecodeError, StopIteration, AttributeError, ValueError,
            TypeError, RecursionError):
        u.hashes = None
    return u


def _one(e: _Event | msgspec.Raw):
    """One event: its Stored/Removed/Cleared, or an Unreadable (kept in its place)."""
    try:
        return _event(e if isinstance(e, _Event) else _dec_event.decode(e))
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError, TypeError, RecursionError) as err:
        raw = bytes(e) if isinstance(e, msgspec.Raw) else msgspec.msgpack.encode(e)
        return _unreadable(raw, str(err) or "nested too deeply")


def decode_payload(payload: bytes) -> Batch:
    """Decode one payload frame. Raises msgspec errors on a bad batch envelope (the relay's dead
    letters); an event that does not decode stays in its place as a common.Unreadable."""
    try:
        return _decode_payload(payload)
    except RecursionError:  # msgspec's depth limit: a malformed frame, not a crash
        raise msgspec.DecodeError("nested too deeply") from None


def _decode_payload(payload: bytes) -> Batch:
    try:
        b = _dec.decode(payload)
    except msgspec.ValidationError as first:
        try:
            msgspec.msgpack.decode(payload)  # msgpack throughout (raw events are not read yet)
            b = _dec_raw.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError):
            raise first from None
    if not isinstance(b.ts, int | float) or b.ts < 0:
        raise msgspec.ValidationError(f"timestamp_ms {b.ts!r} is not a non-negative number")
    return Batch(b.ts / 1000.0, [_one(e) for e in b.events], None)


def is_rfc_payload(payload: bytes) -> bool:
    """Whether a payload is an RFC #1527 batch (events carry `event_type`): what tells this stream from
    vLLM's and SGLang's, which share the `[ts, events, rank]` envelope and the legacy names."""
    try:
        b = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return False
    return (isinstance(b, list) and len(b) >= 2 and isinstance(b[1], list) and bool(b[1])
            and all(isinstance(e, dict) and "event_type" in e for e in b[1]))
