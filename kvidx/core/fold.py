"""The one fold of an events-topic message: the step the worker, the lookup service's follower and
replay share. Bytes -> a checked EventBatch -> its model's shard -> applied, with the shard's place
in the events partition moved past it (what a snapshot records, and where a rebuild resumes).

Pure: the callers bring the shards (their own store, cache or loader), the clock and the Kafka
position; each decides what an undecodable message means for it (the worker dead-letters it, the
follower and replay count it)."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from kvidx.core.shard import ModelShard
from schemas.events import EventBatch, decode_batch


class Undecodable(ValueError):
    """An events-topic message that is not an EventBatch this kvidx reads (the reason in its text)."""


def decode_event(raw: bytes) -> EventBatch:
    try:
        return decode_batch(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
        raise Undecodable(str(e)[:300]) from None


def fold_message(shard_of: Callable[[EventBatch], ModelShard | None], raw: bytes, now: float,
                 partition: int = -1, offset: int = -1) -> tuple[EventBatch, bool]:
    """Fold one message into the shard `shard_of(batch)` gives (by its model and replica group;
    None: a group this process does not hold, skipped); (the batch, False if it was a redelivery or
    skipped). Raises Undecodable, having changed nothing."""
    batch = decode_event(raw)
    shard = shard_of(batch)
    if shard is None:
        return batch, False
    applied = shard.apply(batch, now)
    if offset >= 0:
        shard.events_partition = partition
        shard.events_offset = max(shard.events_offset, offset + 1)
    return batch, applied
