"""Durability proportional to change: a worker's snapshots are deltas plus, now and then, a base written
in pieces across snapshots while the fold goes on. On random streams (stores, removals across tiers,
clears, a sliding-window group, > 64 replicas), after every snapshot the parts the manifest names,
read from a compacted key-value store (latest value per key, deletions dropped), rebuild exactly the
live shard, with the compiled map and the reference; and both write the same bytes."""

import random

import msgspec
import pytest

import streams.snapshots as snapshots
from kvidx.core.maskmap import IMPLEMENTATION, PyMaskMap
from kvidx.core.shard import ModelShard
from kvidx.core.snapshot import decode_parts, encode_delta, encode_segments, encode_snapshot
from kvidx.kafka.snapshots import Manifest, assemble, chunk_keys, manifest_key
from streams.snapshots import SnapshotLog
from tests.unit.core.test_native_shard import _stream


class ReferenceShard(ModelShard):
    new_map = PyMaskMap


CLASSES = [ReferenceShard] + ([ModelShard] if IMPLEMENTATION == "native" else [])


def content(sh: ModelShard) -> tuple:
    """A shard's state, independent of the order its maps iterate in."""
    return (msgspec.to_builtins([st for st in sh.by_slot]), sh.blocks_applied, sh.events_offset,
            {gid: (g.kind, g.window, sorted(g.any.items()),
                   {t: sorted(d.items()) for t, d in g.tiers.items() if len(d)})
             for gid, g in sh.groups.items()})


class Compacted(dict):
    """A compacted topic's view: the latest value of every key; a None deletes the key."""

    def write(self, items) -> int:
        n = 0
        for k, v in items:
            if v is None:
                self.pop(k, None)
            else:
                self[k] = v
                n += len(v)
        return n

    def rebuild(self, model: str, cls: type[ModelShard]) -> ModelShard:
        m = msgspec.msgpack.decode(self[manifest_key(model)], type=Manifest)
        return assemble(m, self.get) if cls is ModelShard else _assemble_as(cls, m, self.get)


def _assemble_as(cls, m, get):
    parts = [b"".join(get(k) for k in chunk_keys(ref)) for ref in m.parts()]
    return decode_parts(parts, cls)


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of a few hundred bytes and a new base as soon as the deltas weigh a tenth of the base:
    bases are written over many snapshots, while the stream goes on."""
    monkeypatch.setattr(snapshots, "PIECE_BYTES", 300)
    monkeypatch.setattr(snapshots, "REBASE_AT", 0.1)
    monkeypatch.setattr(snapshots, "BASE_SNAPSHOTS", 10**9)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("seed", range(8))
def test_every_snapshot_rebuilds_the_live_shard(small_pieces, cls, seed):
    r = random.Random(seed)
    n_replicas = r.choice([3, 8, 64, 70])
    roots = [[r.getrandbits(64) for _ in range(r.randint(1, 12))] for _ in range(8)]
    chains = [root + [r.getrandbits(64) for _ in range(r.randint(0, 8))] for root in roots for _ in range(3)]
    shard = cls("m", 16)
    shard.track_changes()
    log = SnapshotLog("m")
    store = Compacted()
    bases = 0
    for i, b in enumerate(_stream(r, n_replicas, chains, 900)):
        shard.apply(b, 2.0)
        shard.events_offset = i + 1
        if r.random() < 0.08:
            snap = log.plan(shard)
            if r.random() < 0.1:  # a publish that failed: nothing moves on, the retry has it all
                continue
            store.write(snap.items)
            log.done(snap, shard)
            bases += log.build is None and snap.nbytes["base"] > 0
            assert content(store.rebuild("m", cls)) == content(shard)
    assert bases >= 3, "the stream must complete several bases"
    live = {k for k in store if not k.endswith("manifest")}
    m = msgspec.msgpack.decode(store[manifest_key("m")], type=Manifest)
    named = {k for ref in m.parts() for k in chunk_keys(ref)}
    assert named <= live and len(live - named) <= 40, "replaced parts are deleted"


@pytest.mark.skipif(IMPLEMENTATION != "native", reason="kvidx_native is not built here")
def test_compiled_and_reference_write_the_same_parts():
    r = random.Random(7)
    chains = [[r.getrandbits(64) for _ in range(r.randint(1, 20))] for _ in range(30)]
    native, ref = ModelShard("m", 16), ReferenceShard("m", 16)
    for s in (native, ref):
        s.track_changes()
    for b in _stream(r, 70, chains, 600):
        native.apply(b, 2.0)
        ref.apply(b, 2.0)
    assert encode_delta(native) == encode_delta(ref)
    for first, last in ((0, 4096), (0, 1), (100, 2000), (4095, 4096)):
        assert encode_segments(native, first, last) == encode_segments(ref, first, last)


def test_a_format_2_snapshot_is_read_and_then_replaced():
    r = random.Random(3)
    chains = [[r.getrandbits(64) for _ in range(8)] for _ in range(10)]
    shard = ModelShard("m", 16)
    for b in _stream(r, 5, chains, 200):
        shard.apply(b, 2.0)
    store = Compacted()
    store.write(snapshots.split("m", encode_snapshot(shard), 4, shard.blocks_applied))
    m = msgspec.msgpack.decode(store[manifest_key("m")], type=Manifest)
    loaded = assemble(m, store.get)
    assert content(loaded) == content(shard) and loaded.snapshot_id == 4
    loaded.track_changes()
    log = SnapshotLog("m", m)
    snap = log.plan(loaded)
    store.write(snap.items)
    log.done(snap, loaded)
    assert snap.manifest.format == 3 and snap.manifest.snapshot_id == 5
    assert not [k for k in store if k.startswith(("m/0/", "m/1/"))], "the format-2 chunks are deleted"
    assert content(store.rebuild("m", ModelShard)) == content(shard)


def test_snapshot_bytes_follow_the_changes_not_the_size():
    """A snapshot after a few changes to a large shard writes about those changes."""
    r = random.Random(11)
    shard = ModelShard("m", 16)
    shard.track_changes()
    log = SnapshotLog("m")
    hashes = [r.getrandbits(64) for _ in range(50_000)]
    from schemas.events import SCHEMA_VERSION, BlocksStored, EventBatch
    for i in range(0, len(hashes), 1000):
        shard.apply(EventBatch(SCHEMA_VERSION, "m", "r0", 0, 1, i, 1.0, 1.0, 16,
                               [BlocksStored("GPU", 0, hashes[i:i + 1000], None, 0)]), 1.0)
    first = log.plan(shard)
    log.done(first, shard)
    assert first.nbytes["base"] >= 50_000 * 16
    shard.apply(EventBatch(SCHEMA_VERSION, "m", "r1", 0, 1, 0, 1.0, 1.0, 16,
                           [BlocksStored("GPU", 0, hashes[:100], None, 0)]), 1.0)
    snap = log.plan(shard)
    assert snap.nbytes["base"] == 0 and snap.nbytes["delta"] < 100 * 16 + 1000
