"""The one fold of an events-topic message: the step the worker, the lookup service's follower and
replay share. Bytes -> a checked EventBatch -> its model's shard -> applied, with the shard's place
in the events partition moved past it (what a snapshot records, and where a rebuild resumes).

Pure: the callers bring the shards (their own store, cache or loader), the clock and the Kafka
position; each decides what an undecodable message means for it (the worker dead-letters it, the
follower and replay count it)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from kvidx.core.shard import ModelShard
from schemas.events import (
    SCHEMA_VERSION,
    TIERS,
    BlocksRemoved,
    EventBatch,
    ReplicaCleared,
    decode_batch,
    unpack_hashes,
)
from schemas.events import Event as _Event

log = logging.getLogger("kvidx.fold")


class Undecodable(ValueError):
    """An events-topic message that is not an EventBatch this kvidx reads (the reason in its text)."""


@dataclass
class FoldSetAside:
    """One event of a batch that did not decode (the batch's other events were folded): its position,
    kind ("stored" | "removed" | "cleared" | "other") and what was folded in its place."""
    position: int
    event: str
    action: str  # "skipped" | "removed_every_tier" | "cleared"
    detail: str


def _raw_twin() -> type:
    """EventBatch with its events left undecoded (the same fields and defaults, whatever they are)."""
    fields = []
    for f in msgspec.structs.fields(EventBatch):
        typ = list[msgspec.Raw] if f.name == "events" else f.type
        if f.default is not msgspec.NODEFAULT:
            fields.append((f.name, typ, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, typ, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, typ))
    return msgspec.defstruct("_RawEventBatch", fields, array_like=True)


_raw_decoder = msgspec.msgpack.Decoder(_raw_twin())
_event_decoder = msgspec.msgpack.Decoder(_Event)


def _hashes_ok(x) -> bool:
    return isinstance(x, list) and all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in x)


def _in_place_of(raw: bytes, position: int, detail: str) -> tuple[list, FoldSetAside]:
    """What is folded in place of an event that does not decode, so that setting it aside never
    credits more: nothing for a store; a removal whose group and hashes can be read removes them from
    every tier; a clear, or anything else, clears the replica."""
    try:
        obj = msgspec.msgpack.decode(raw)
    except (msgspec.DecodeError, RecursionError, ValueError, TypeError):
        obj = None
    tag = obj[0] if isinstance(obj, list) and obj and isinstance(obj[0], str) else None
    kind = tag if tag in ("stored", "removed", "cleared") else "other"
    if kind == "stored":
        return [], FoldSetAside(position, kind, "skipped", detail)
    if (kind == "removed" and len(obj) > 3 and isinstance(obj[2], int) and not isinstance(obj[2], bool)
            and _hashes_ok(obj[3])):
        tail, router = (x if isinstance(x, bool) else False for x in (*obj[5:7], False, False)[:2])
        return ([BlocksRemoved(t, obj[2], obj[3], tail=tail, router_keys=router) for t in TIERS],
                FoldSetAside(position, kind, "removed_every_tier", detail))
    return [ReplicaCleared("unplaceable_event")], FoldSetAside(position, kind, "cleared", detail)


def decode_event(raw: bytes, set_aside: list[FoldSetAside] | None = None) -> EventBatch:
    """The EventBatch of an events-topic message. An event in it that does not decode is set aside
    alone (listed in `set_aside`, logged) and the batch's other events are kept in order; raises
    Undecodable when the batch itself cannot be read."""
    try:
        return decode_batch(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
        error = e
    except RecursionError:
        raise Undecodable("nested too deeply") from None
    try:
        twin = _raw_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, RecursionError):
        raise Undecodable(str(error)[:300]) from None
    if twin.v != SCHEMA_VERSION:
        raise Undecodable(f"unsupported schema version {twin.v} (this reader knows {SCHEMA_VERSION})")
    events: list = []
    for i, r in enumerate(twin.events):
        try:
            ev = _event_decoder.decode(r)
            unpack_hashes([ev], i)
            events.append(ev)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
            instead, sa = _in_place_of(bytes(r), i, str(e)[:300])
            events += instead
            log.warning("event=event_set_aside replica=%s seq=%d position=%d kind=%s action=%s",
                        twin.replica, twin.seq, i, sa.event, sa.action)
            if set_aside is not None:
                set_aside.append(sa)
    fields = {f: getattr(twin, f) for f in twin.__struct_fields__}
    fields["events"] = events
    return EventBatch(**fields)


def fold_message(shard_of: Callable[[EventBatch], ModelShard | None], raw: bytes, now: float,
                 partition: int = -1, offset: int = -1, set_aside: list[FoldSetAside] | None = None
                 ) -> tuple[EventBatch, bool]:
    """Fold one message into the shard `shard_of(batch)` gives (by its model and replica group;
    None: a group this process does not hold, skipped); (the batch, False if it was a redelivery or
    skipped). Events that do not decode are set aside one by one (`decode_event`: listed in
    `set_aside`); raises Undecodable, having changed nothing, when the batch itself cannot be read."""
    batch = decode_event(raw, set_aside)
    shard = shard_of(batch)
    if shard is None:
        return batch, False
    applied = shard.apply(batch, now)
    if offset >= 0:
        shard.events_partition = partition
        shard.events_offset = max(shard.events_offset, offset + 1)
    return batch, applied
