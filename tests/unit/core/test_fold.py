"""The one fold step of the worker, the service's follower and replay (kvidx.core.fold)."""

import msgspec
import pytest

from kvidx.core import walk
from kvidx.core.fold import Undecodable, fold_message
from kvidx.core.shard import ModelShard
from schemas.events import SCHEMA_VERSION, BlocksStored, EventBatch, encode_batch


def _raw(seq: int, model: str = "m", v: int = SCHEMA_VERSION) -> bytes:
    stored = BlocksStored("GPU", 0, [seq + 1], None, 0)
    return encode_batch(EventBatch(v, model, "r", 0, 1, seq, 1.0, 1.0, 16, [stored]))


def test_fold_applies_once_and_moves_the_shards_offset():
    shards: dict[str, ModelShard] = {}

    def shard_of(batch: EventBatch) -> ModelShard:
        return shards.setdefault(batch.model, ModelShard(batch.model, 16))

    batch, applied = fold_message(shard_of, _raw(0), 2.0, partition=3, offset=41)
    assert applied and batch.seq == 0
    s = shards["m"]
    assert (s.events_partition, s.events_offset) == (3, 42) and walk.prefix_blocks(s, [1]) == {0: 1}
    assert fold_message(shard_of, _raw(0), 2.0, 3, 42)[1] is False  # a redelivery changes nothing more
    assert s.events_offset == 43 and s.replicas[("r", 0)].duplicates == 1
    fold_message(shard_of, _raw(1), 2.0)  # no Kafka position (a replay of a file): offsets untouched
    assert s.events_offset == 43


@pytest.mark.parametrize("raw", [b"\x93junk", msgspec.msgpack.encode({"v": 1}),
                                 _raw(0, v=SCHEMA_VERSION + 1)])
def test_undecodable_messages_raise_and_change_nothing(raw):
    shards: dict[str, ModelShard] = {}
    with pytest.raises(Undecodable):
        fold_message(lambda b: shards.setdefault(b.model, ModelShard(b.model, 16)), raw, 0.0, 0, 5)
    assert shards == {}


def test_a_group_the_caller_does_not_hold_is_skipped():
    stored = BlocksStored("GPU", 0, [7], None, 0)
    raw = encode_batch(EventBatch(SCHEMA_VERSION, "m", "r", 0, 1, 0, 1.0, 1.0, 16, [stored], replica_group=2))
    shard = ModelShard("m", 16)
    batch, applied = fold_message(lambda b: shard if b.replica_group == 0 else None, raw, 0.0, 0, 5)
    assert batch.replica_group == 2 and not applied and shard.events_offset == 0 and not shard.replicas
