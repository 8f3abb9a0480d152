"""TensorRT-LLM's KV-cache event formats, decoded with msgspec.

1. The pull API: `LLM.get_kv_cache_events()` and trtllm-serve's `POST /kv_cache_events`
   (tensorrt_llm/serve/openai_server.py, `get_kv_cache_events`: a JSON list of the events drained
   from the engine, each serialized by `KVCacheEventSerializer` in tensorrt_llm/_utils.py):

       {"event_id": int, "data": {...}, "window_size": int, "attention_dp_rank": int}

   `attention_dp_rank` is written only when it is not None (_utils.py `to_json_str`; added with
   attention-DP gathering, PR #6563). `data` is one of (same file, `_created_to_json` ...):
       {"type": "created", "num_blocks_per_cache_level": [primary, secondary]}
       {"type": "stored", "parent_hash": u64 | null, "blocks": [
           {"type": "stored_block", "block_hash": u64,
            "tokens": [{"type": "unique_token", "token_id": int, "token_extra_id": int}, ...],
            "cache_level": 0 | 1, "priority": int}]}        # lora_id: not serialized (TODO upstream)
       {"type": "removed", "block_hashes": [u64, ...]}
       {"type": "updated", "block_hash": u64,
        "cache_level": {"type": "event_diff", "new_value": int, "old_value": int} | null,
        "priority": {"type": "event_diff", "new_value": int, "old_value": int} | null}
   Hashes are `size_t` (BlockKeyHasher, cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp): unsigned
   64-bit, about half >= 2^63; msgspec decodes JSON ints up to 2^64-1 exactly.
   cache_level 0 = primary (GPU), 1 = secondary (host) (kvCacheEventManager.cpp
   `enqueueStoredEvent`: `block->isPrimary() ? kPrimaryLevel : kSecondaryLevel`).
   An `updated` event made by a cache-level move carries no priority diff (kvCacheManager.cpp
   `getFreeBlock` / `onboardBlock`: `KVCacheUpdatedData(hash).cacheLevelUpdated(...)` only): the
   1.2.0rc2 serializer then raises (`_event_diff_to_json(None)`, NVIDIA/TensorRT-LLM issue #4666) and
   the drained events are lost; fixed releases write `"priority": null` (PR #11576). Both decode
   here: a diff may be null or absent.
   event_id: one counter per KVCacheEventManager (per attention-DP rank), +1 per enqueued event;
   consecutive removals of one window size are merged into the previous `removed` event without a
   new id (`enqueueRemovedEvent`); when more than `event_buffer_max_size` events wait, the oldest are
   discarded (`KVCacheEventManager::worker`): an id gap.

2. The ZMQ publisher (tensorrt_llm/serve/kv_zmq_publisher.py `KvZmqPublisher`, newer releases): vLLM's
   wire format (`[ts, [event], attention_dp_rank]`, one event per message, map events
   BlockStored/BlockRemoved/AllBlocksCleared, 3 frames with an 8-byte big-endian sequence), hashes
   converted to *signed* int64 (`_to_signed_i64`), `block_size` = tokens_per_block, partial blocks
   and their removals suppressed, only the largest attention window. kvidx/engines/vllm/wire.py decodes it
   as is (`fold_engine_hash` masks signed hashes back to u64): use `zmq_publisher_relay` below.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

# Versions whose serializer output was checked (format identical across them, modulo
# attention_dp_rank, which is optional here). 1.2.0rc2: the `updated`-event serializer bug above.
SUPPORTED_VERSIONS = ("0.20", "0.21", "1.0", "1.1", "1.2", "1.3")
BUGGY_UPDATED_SERIALIZER = ("1.2.0rc2",)
PRIMARY, SECONDARY = 0, 1


class UnsupportedVersion(RuntimeError):
    pass


def check_version(version: str) -> str:
    """The engine version as reported by trtllm-serve's GET /version (`tensorrt_llm.version`):
    returns the matching pinned series, or raises UnsupportedVersion with a clear message."""
    m = re.match(r"^\s*(\d+)\.(\d+)", version or "")
    series = f"{m.group(1)}.{m.group(2)}" if m else ""
    if series not in SUPPORTED_VERSIONS:
        raise UnsupportedVersion(
            f"TensorRT-LLM {version!r} is not a version this relay was checked against "
            f"(supported series: {', '.join(SUPPORTED_VERSIONS)}); refusing to guess its event format")
    return series


class UniqueToken(msgspec.Struct):
    token_id: int
    token_extra_id: int = 0
    type: str = "unique_token"


class StoredBlock(msgspec.Struct):
    block_hash: int
    tokens: list[UniqueToken]
    cache_level: int = PRIMARY
    priority: int | None = None
    type: str = "stored_block"
    mm_keys: list[Any] | None = None  # newer releases (multimodal): extra keys of the block
    lora_id: int | None = None  # not serialized upstream yet; accepted if it appears


class Created(msgspec.Struct, tag="created", tag_field="type"):
    num_blocks_per_cache_level: list[int]


class Stored(msgspec.Struct, tag="stored", tag_field="type"):
    parent_hash: int | None
    blocks: list[StoredBlock]
    lora_name: str | None = None  # newer releases (read by kv_zmq_publisher.py when present)


class Removed(msgspec.Struct, tag="removed", tag_field="type"):
    block_hashes: list[int]


class Diff(msgspec.Struct):
    new_value: int | None = None
    old_value: int | None = None
    type: str = "event_diff"


class Updated(msgspec.Struct, tag="updated", tag_field="type"):
    block_hash: int
    cache_level: Diff | None = None
    priority: Diff | None = None


EventData = Created | Stored | Removed | Updated


class Event(msgspec.Struct):
    event_id: int
    data: EventData
    window_size: int | None = None
    attention_dp_rank: int | None = None


_dec_event = msgspec.json.Decoder(Event)
_dec_list = msgspec.json.Decoder(list[msgspec.Raw])
_enc = msgspec.json.Encoder()
U64 = (1 << 64) - 1


def decode_event(raw: bytes | dict) -> Event:
    """One event object (JSON bytes or an already parsed dict). Raises msgspec errors."""
    if isinstance(raw, dict):
        return msgspec.convert(raw, Event)
    return _dec_event.decode(raw)


EVENT_KINDS = {"stored": "stored", "removed": "removed", "updated": "updated", "created": "created"}


def read_loosely(raw: bytes | dict, detail: str):
    """An event that did not decode, read as far as it goes: (event_id or None, attention-DP rank,
    window size, a kvidx.engines.common.Unreadable with its kind and block hashes)."""
    from kvidx.engines.common import Unreadable

    obj = raw
    if not isinstance(raw, dict):
        try:
            obj = msgspec.json.decode(raw)
        except (msgspec.DecodeError, RecursionError, ValueError, TypeError):
            obj = None
    blob = raw if isinstance(raw, bytes | bytearray) else _enc.encode(raw) if obj is not None else b""
    obj = obj if isinstance(obj, dict) else {}
    data = obj.get("data") if isinstance(obj.get("data"), dict) else {}

    def int_or_none(x):
        return x if isinstance(x, int) and not isinstance(x, bool) else None

    hashes = data.get("block_hashes")
    if "block_hash" in data:
        hashes = [data["block_hash"]]
    elif isinstance(data.get("blocks"), list):
        hashes = [b.get("block_hash") if isinstance(b, dict) else None for b in data["blocks"]]
    if not (isinstance(hashes, list) and all(int_or_none(h) is not None and 0 <= h <= U64 for h in hashes)):
        hashes = None
    kind = EVENT_KINDS.get(data.get("type"), "other") if isinstance(data.get("type"), str) else "other"
    return (int_or_none(obj.get("event_id")), int_or_none(obj.get("attention_dp_rank")) or 0,
            int_or_none(obj.get("window_size")), Unreadable(bytes(blob), kind, hashes, detail[:300]))


def split_poll(body: bytes) -> list[bytes]:
    """A poll's response body (a JSON array) as one raw JSON document per event, so that one bad
    event is dead-lettered alone. Raises msgspec errors if the body is not a JSON array."""
    return [bytes(r) for r in _dec_list.decode(body)]


def encode_event(ev: Any) -> bytes:
    return _enc.encode(ev)


def check_hash(h: int) -> int:
    if not 0 <= h <= U64:
        raise ValueError(f"block hash {h} is not an unsigned 64-bit value")
    return h


def zmq_publisher_relay(model: str, replica: str, index_block_size: int, dp_rank: int | None = None):
    """The relay core for TensorRT-LLM's vLLM-format ZMQ publisher: vLLM's own (same wire format;
    full blocks only, so no partial-block credit on this path)."""
    from kvidx.engines.vllm.relay import VllmPublisherRelay
    return VllmPublisherRelay(model, replica, index_block_size, dp_rank)
