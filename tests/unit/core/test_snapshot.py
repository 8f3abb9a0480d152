"""Snapshots are versioned and store tiers by name: a format-1 snapshot (tiers by position) still loads
as it was written, a tier inserted into the speed order later cannot shift what a snapshot means,
and a snapshot of a newer format or of an unknown tier is refused with a clear message, never
misread."""

import time

import msgspec
import pytest

import kvidx.core.snapshot as snapshot_mod
import kvidx.core.walk as walk_mod
from kvidx.core import walk
from kvidx.core.shard import ModelShard
from kvidx.core.snapshot import (
    SNAPSHOT_FORMAT,
    V1_TIERS,
    SnapshotFormatError,
    decode_snapshot,
    encode_snapshot,
)
from schemas.events import SCHEMA_VERSION, TIERS, BlocksStored, EventBatch

HASHES = list(range(1000, 1010))


def tiered_shard() -> ModelShard:
    s = ModelShard("m", 16)
    events = [BlocksStored("GPU", 0, HASHES[:4], None, 0), BlocksStored("CPU", 0, HASHES[4:7], None, 0),
              BlocksStored("DISK", 0, HASHES[7:], None, 0)]
    s.apply(EventBatch(v=SCHEMA_VERSION, model="m", replica="r0", dp_rank=0, epoch=1, seq=0, engine_ts=1.0,
                       relay_ts=1.0, block_size=16, events=events), 1.0)
    return s


def tiers_of(s: ModelShard) -> list:
    return [a.tiers for a in walk.lookup(s, HASHES, 16 * len(HASHES), time.time())]


def v1_bytes(s: ModelShard) -> bytes:
    """What format 1 wrote: no format field, tiers by their position in the speed order."""
    groups = {}
    for gid, g in s.groups.items():
        tiers = {}
        for tid, d in g.tiers.items():
            words = max(1, (len(s.by_slot) + 63) // 64)
            keys, masks = d.export(words)  # the mask layout is the same in both formats
            tiers[V1_TIERS.index(TIERS[tid])] = (keys, (words, masks))
        groups[gid] = (g.kind, g.window, tiers)
    return msgspec.msgpack.encode({"model": s.model, "block_size": s.block_size,
                                   "replicas": [st for st in s.by_slot if st is not None], "groups": groups,
                                   "blocks_applied": s.blocks_applied, "events_offset": s.events_offset,
                                   "unreported_eviction_kinds": []})


def test_snapshots_store_tiers_by_name():
    raw = msgspec.msgpack.decode(encode_snapshot(tiered_shard()))
    assert raw["format"] == SNAPSHOT_FORMAT
    assert sorted(raw["groups"][0][2]) == ["CPU", "DISK", "GPU"]


def test_format_1_loads_as_written():
    s = tiered_shard()
    want = tiers_of(s)
    assert [t.tier for t in want[0]] == ["GPU", "CPU", "DISK"]
    assert tiers_of(decode_snapshot(v1_bytes(s))) == want
    assert tiers_of(decode_snapshot(encode_snapshot(s))) == want


def test_a_tier_inserted_into_the_speed_order_does_not_shift_a_snapshot(monkeypatch):
    s = tiered_shard()
    want = tiers_of(s)
    data = encode_snapshot(s)
    old_v1 = v1_bytes(s)
    new_order = ("HBM", *TIERS)  # a faster tier added in front: every id moves by one
    for mod in (walk_mod, snapshot_mod):
        monkeypatch.setattr(mod, "TIERS", new_order)
    monkeypatch.setattr(snapshot_mod, "TIER_IDS", {t: i for i, t in enumerate(new_order)})
    assert tiers_of(decode_snapshot(data)) == want
    assert tiers_of(decode_snapshot(old_v1)) == want


def test_newer_formats_and_unknown_tiers_are_refused():
    raw = msgspec.msgpack.decode(encode_snapshot(tiered_shard()))
    with pytest.raises(SnapshotFormatError, match="format 3.*upgrade kvidx"):
        decode_snapshot(msgspec.msgpack.encode({**raw, "format": 3}))
    raw["groups"][0][2]["HBM"] = raw["groups"][0][2].pop("GPU")
    with pytest.raises(SnapshotFormatError, match="tier 'HBM'"):
        decode_snapshot(msgspec.msgpack.encode(raw))
