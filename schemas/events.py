"""Wire schemas of what relays publish (topic `kvidx.events.v1`), encoded with msgpack.

One Kafka message = one `EventBatch` = one engine batch, so per-message costs are paid per batch,
not per block. Only hashes and counts travel: never token ids or text.

Evolution rule (see README "Schema versions"):
- Adding a field with a default at the end of a struct keeps the version: old readers ignore it
  (structs are encoded as arrays, and msgspec drops trailing extra elements), new readers see the
  default on old messages.
- Removing a field, changing its type or meaning, or reordering fields is a breaking change: bump
  SCHEMA_VERSION and publish to a new topic (`kvidx.events.v2`); readers check `v` and dead-letter
  versions they do not know.
"""

from __future__ import annotations

import os
from typing import Annotated

import msgspec

SCHEMA_VERSION = 1
EVENTS_TOPIC = f"kvidx.events.v{SCHEMA_VERSION}"
SNAPSHOTS_TOPIC = f"kvidx.shards.v{SCHEMA_VERSION}"  # compacted: latest snapshot per shard (model, group)
DEAD_LETTER_TOPIC = "kvidx.deadletter"
CONTROL_TOPIC = "kvidx.control.v1"  # requests to relays (schemas/control.py)
ROUTES_TOPIC = "kvidx.routes.v1"  # routing decisions: pending credit and the audit (schemas/routes.py)
USAGE_TOPIC = "kvidx.usage.v1"  # engine usage reports (what was reused): the audit (schemas/usage.py)
# prefetch plans, eviction advice and placements for routed requests' replicas (schemas/hints.py)
HINTS_TOPIC = "kvidx.hints.v1"
# compacted: the workers registered through Dynamo's API (schemas/registrations.py)
REGISTRATIONS_TOPIC = "kvidx.registrations.v1"
# compacted: the service instances and the replica groups they hold (index_service/fanout.py)
INSTANCES_TOPIC = "kvidx.instances.v1"



def topic_names(prefix: str = "") -> dict[str, str]:
    """The topics of one index deployment; a prefix lets several share a cluster (or a test run)."""
    return {"events": prefix + EVENTS_TOPIC, "snapshots": prefix + SNAPSHOTS_TOPIC,
            "dead_letters": prefix + DEAD_LETTER_TOPIC, "routes": prefix + ROUTES_TOPIC,
            "control": prefix + CONTROL_TOPIC, "usage": prefix + USAGE_TOPIC,
            "registrations": prefix + REGISTRATIONS_TOPIC, "instances": prefix + INSTANCES_TOPIC,
            "hints": prefix + HINTS_TOPIC}


TIERS = ("GPU", "CPU", "DISK", "NODE_SHARED", "POOL")  # fastest first
TIER_IDS = {t: i for i, t in enumerate(TIERS)}


# A canonical block hash: an unsigned 64-bit int (kvidx.core.hashing). A negative one is refused at
# decode (the batch goes to the dead letters), never folded; msgpack holds no int above 2**64 - 1
# (msgspec cannot bound an int beyond int64 itself)
BlockHash = Annotated[int, msgspec.Meta(ge=0)]
# An event's hashes: on the wire an array of BlockHash. Events made in Python hold a list;
# decode_batch reads the array undecoded (msgspec.Raw) and unpacks it, checked as list[BlockHash]
# would be, into a kvidx_native.HashArray (packed u64s the fold reads in place: no Python int per
# hash, most of a batch's decode) where the compiled core is built, else a list.
BlockHashes = msgspec.Raw


class BlocksStored(msgspec.Struct, tag="stored", array_like=True):
    """A chain of blocks newly cached (first live copy) in one tier and KV-cache group.

    hashes[i] is the canonical hash of the block at depth `depth + i` (in index blocks), whose
    parent is hashes[i-1] (or `parent` for i == 0; None at the root). In a mirror replay
    (EventBatch.part > 0) the hashes are live blocks in depth order, not one chain (parent None)."""
    tier: str
    group: int
    hashes: BlockHashes  # list[BlockHash] (see BlockHashes)
    parent: int | None
    depth: int
    engine_hashes: list[int] = []  # engine block hashes (u64; 32-byte digests folded to their last 8)
    group_kind: str = "full_attention"
    sliding_window: int | None = None
    # the engine block size of these blocks when it differs from the batch's (vLLM's partial blocks
    # under --prefix-match-unit: a finer unit the engine may resume at); 0 = the batch's block size
    block_size: int = 0
    # True: `hashes` are partial-block keys (kvidx.core.hashing.tail_key: a block's first tokens hashed
    # from its parent) of an engine that resumes inside blocks; parent and depth are unused. Readers
    # before this field store them as blocks no prompt hash reaches (only their counts are off)
    tail: bool = False
    # True: `hashes` are router keys, the keys a router's own block hashes reach, not canonical blocks:
    # Dynamo keys (kvidx.core.hashing.dynamo_keys; relays started by Dynamo's POST /register, for its
    # /query_by_hash) or SGLang keys (kvidx.core.hashing.sglang_key; SGLang's external-indexer feed,
    # index_service/sglang_indexer.py); as `tail` otherwise. (Named `dynamo` before SGLang's: same slot)
    router_keys: bool = False
    # True: blocks the replica already holds, stored again as an extra physical copy (vLLM recomputes
    # chains in hybrid models): nothing new to index, but they take room and the engine will evict
    # them after everything stored before (eviction foresight). Readers before this field store held
    # blocks again (no change)
    copy: bool = False


class BlocksRemoved(msgspec.Struct, tag="removed", array_like=True):
    """Blocks whose last copy in this tier and group was evicted."""
    tier: str
    group: int
    hashes: BlockHashes  # list[BlockHash] (see BlockHashes)
    engine_hashes: list[int] = []
    tail: bool = False  # partial-block keys (BlocksStored.tail)
    router_keys: bool = False  # router keys (BlocksStored.router_keys)


class ReplicaCleared(msgspec.Struct, tag="cleared", array_like=True):
    """Everything this replica (DP rank) held is gone: a cache reset, an engine restart, or a gap
    the relay could not fill (an unknown state is treated as empty)."""
    reason: str
    # not "": only this tier is empty now (SGLang's CLEAR_ALL_AT_TIER, index_service/sglang_indexer.py).
    # A reader before this field clears the whole replica: it under-credits until the next stores
    tier: str = ""


Event = BlocksStored | BlocksRemoved | ReplicaCleared


class EventBatch(msgspec.Struct, array_like=True):
    v: int
    model: str
    replica: str
    dp_rank: int
    epoch: int  # bumps when the engine or relay restarts: (epoch, seq) orders a replica's batches
    seq: int  # the engine's batch sequence number within the epoch
    engine_ts: float  # the engine's batch timestamp (s since the epoch)
    relay_ts: float  # when the relay published it
    block_size: int  # the engine's block size in tokens (resume granularity)
    events: list[Event]
    # > 0: a part of a mirror replay (resync), ordered after the engine batch `seq`: (epoch, seq, part)
    part: int = 0
    # prompt tokens the engine always recomputes at the end (1; 2 for SGLang with EAGLE, which
    # matches on token pairs): it resumes from at most n - recompute_tokens of n tokens
    recompute_tokens: int = 1
    # vLLM >= 0.33 lookahead block hashing (EAGLE, MTP): the L prompt tokens after a block that its
    # hash covers; the index keys blocks with them, and a prompt of n tokens has (n - L) // B blocks
    lookahead_tokens: int = 0
    # group -> blocks whose extra physical copy (BlocksStored.copy) the engine evicted in this batch
    # while another copy stays (eviction foresight counts the room copies take). Not an event: a
    # reader before this field would retract a block that is still cached
    copies_removed: dict[int, list[BlockHash]] = {}
    # the replica group of the model's index this replica belongs to (kvidx.core.groups): the batch's
    # Kafka key is the group's shard key. Readers before this field fold every group into one shard
    replica_group: int = 0
    # the engine's host tier in engine blocks where loading a host block frees the host's oldest
    # (TensorRT-LLM: onboardBlock -> getFreeBlock offloads the GPU victim into the host's front slot,
    # freeing that block and its subtree): a hit whose own loads free the rest of it is cut there.
    # 0: no such tier. Readers before this field credit the whole held prefix
    host_tier_blocks: int = 0
    # 1: the engine resumes from the prefix its fastest tier holds, then loads one contiguous run from
    # its lower tiers (vLLM: the local hit, then the KV connector's hit from there): a block only the
    # fastest tier holds, after one it would have to load, is not reused. 0: every tier's blocks count
    # in prompt order (TensorRT-LLM onboards block by block). Readers before this field credit both
    external_after_local: int = 0


def enc_hook(obj: object) -> list[int]:
    """msgspec's enc_hook for a decoded batch's hashes (a HashArray: written as the list it equals);
    encode_batch has it, any other encoder of decoded events needs it."""
    if type(obj).__name__ == "HashArray":
        return obj.tolist()  # type: ignore[attr-defined]
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=enc_hook)
_decoder = msgspec.msgpack.Decoder(EventBatch)
_hash_list = msgspec.msgpack.Decoder(list[BlockHash])
_HASHED = (BlocksStored, BlocksRemoved)


def _unpack_python(events: list, kinds: tuple, raw: type, first: int = 0) -> None:
    """kvidx_native.unpack_hashes without the compiled core: the hashes as lists."""
    for i, ev in enumerate(events):
        if type(ev) in kinds and type(ev.hashes) is raw:
            try:
                ev.hashes = _hash_list.decode(ev.hashes)
            except (msgspec.ValidationError, msgspec.DecodeError) as e:  # (a Raw made by hand)
                at, why = f"$.events[{first + i}].hashes", str(e)
                why = why.replace("`$", f"`{at}", 1) if " - at `$" in why else f"{why} - at `{at}`"
                raise msgspec.ValidationError(why) from None


def _unpacker():
    # the compiled core where kvidx.core.maskmap uses it (built, and KVIDX_NATIVE not 0; that module
    # raises where KVIDX_REQUIRE_NATIVE asks for it): schemas import nothing of kvidx
    if os.environ.get("KVIDX_NATIVE") == "0":
        return _unpack_python
    try:
        from kvidx_native import unpack_hashes as native
    except ImportError:
        return _unpack_python
    return native


_unpack = _unpacker()


def unpack_hashes(events: list, first: int = 0) -> None:
    """The undecoded hashes (msgspec.Raw) of `events`, decoded in place (BlockHashes); `first`: the
    position of events[0] in its batch, for the error. Raises msgspec.ValidationError as decoding
    them as list[BlockHash] would, at the first that is not (those before it unpacked)."""
    _unpack(events, _HASHED, msgspec.Raw, first)


def encode_batch(batch: EventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(data: bytes) -> EventBatch:
    """Decode and check the version; raises msgspec.ValidationError / DecodeError / ValueError."""
    try:
        batch = _decoder.decode(data)
    except RecursionError:  # msgspec steps over an undecoded value (BlockHashes) recursively
        raise msgspec.DecodeError("nested too deeply") from None
    if batch.v != SCHEMA_VERSION:
        raise ValueError(f"unsupported schema version {batch.v} (this reader knows {SCHEMA_VERSION})")
    _unpack(batch.events, _HASHED, msgspec.Raw)
    return batch
