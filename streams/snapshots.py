"""Durable shard snapshots, written: a local RocksDB (rocksdict) and a compacted Kafka topic (their
format and reader: kvidx/kafka/snapshots.py).

What a snapshot costs is what changed since the last one, not what the shard holds
(kvidx/core/snapshot.py has the parts): every snapshot writes a *delta* (the masks of the keys the
fold touched), and a *base* (every key, in pieces by key segment) is rewritten only once the deltas
since the current base outweigh it REBASE_AT times, a few pieces per snapshot beside the deltas (the
fuzzy checkpoint: a base may be taken over many snapshots). So at steady churn a snapshot writes
about the changed entries and, amortized, at most 1 / REBASE_AT as much again for the bases.

Keys (the topic's and the RocksDB's): a part's chunks are `<key>/<i>` (Kafka messages stay well under
1 MB) with `<model>/d/<snapshot id>` for a delta and `<model>/b<generation % 2>/<first segment>` for a
base piece; the manifest `<model>/manifest` names the base and the deltas since it began and is
written last, so a reader never sees a manifest whose parts are not there. A new base goes to the
other generation's keys; once it is complete the old base and the deltas it covers are deleted
(tombstones: compaction drops them). Snapshots go to the same partition as the model's events, so
partition ownership covers both. Format-2 snapshots (one blob, `chunks` in the manifest) are read as
before and replaced by a base at the first snapshot.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import msgspec
from confluent_kafka import Producer
from rocksdict import Options, Rdict

from kvidx.core.shard import ModelShard
from kvidx.core.snapshot import PART_FORMAT, SEGMENTS, encode_delta, encode_segments, segment_bytes
from kvidx.kafka.config import client_config
from kvidx.kafka.snapshots import (
    CHUNK,
    IncompleteSnapshot,
    Item,
    Manifest,
    PartRef,
    assemble,
    chunk_keys,
    manifest_key,
)

log = logging.getLogger("kvidx.streams")
PIECE_BYTES = 1 << 20  # a base piece's target size before chunking
REBASE_AT = 1.5  # a new base once the deltas since the current one began outweigh it this much
BASE_SNAPSHOTS = 256  # a new base is written within about this many snapshots (a floor on its pace)

def _chunked(key: str, data: bytes) -> tuple[PartRef, list[Item]]:
    chunks = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
    ref = PartRef(key, len(chunks), len(data))
    return ref, list(zip(chunk_keys(ref), chunks, strict=True))


def split(model: str, data: bytes, snapshot_id: int, blocks: int) -> list[Item]:
    """A format-2 snapshot (one `snapshot()` blob) as items: how a tool puts a whole shard in."""
    ref, items = _chunked(f"{model}/{snapshot_id % 2}", data)
    m = Manifest(model, snapshot_id, blocks, time.time(), chunks=ref.chunks)
    return items + [(manifest_key(model), msgspec.msgpack.encode(m))]


class Snapshot(msgspec.Struct):
    """One planned snapshot of a model: its items (manifest last) and its manifest."""

    items: list[Item]
    manifest: Manifest
    nbytes: dict[str, int]  # bytes written by kind: delta, base, manifest


class _Build(msgspec.Struct):
    gen: int
    from_delta: int  # the snapshot id it began at: the deltas from it on complete it
    next_segment: int = 0
    pieces: list[PartRef] = []


class SnapshotLog:
    """What a model's durable snapshot is made of (its manifest) and what the next one writes:
    `plan(shard)` changes nothing; `done(plan, shard)` once it is durable."""

    def __init__(self, model: str, manifest: Manifest | None = None):
        self.model = model
        self.snapshot_id = manifest.snapshot_id if manifest is not None else 0
        self.legacy: list[str] = []  # format-2 chunks, deleted once a base replaces them
        self.base: list[PartRef] = []
        self.deltas: list[PartRef] = []
        self.gen = 0
        if manifest is not None and manifest.format == 2:
            self.legacy = chunk_keys(manifest.parts()[0])
        elif manifest is not None:
            self.base, self.deltas, self.gen = list(manifest.base), list(manifest.deltas), manifest.base_gen
        self.build: _Build | None = None
        self._next: tuple | None = None  # the state after the last plan, once it is durable

    @staticmethod
    def _delta_id(ref: PartRef) -> int:
        return int(ref.key.rsplit("/", 1)[1])

    def plan(self, shard: ModelShard) -> Snapshot:
        sid = self.snapshot_id + 1
        delta_ref, items = _chunked(f"{self.model}/d/{sid}", encode_delta(shard))
        nbytes = {"delta": delta_ref.nbytes, "base": 0, "manifest": 0}
        base_bytes = sum(p.nbytes for p in self.base)
        build = self.build
        if build is None and (not self.base or sum(d.nbytes for d in self.deltas) >= REBASE_AT * base_bytes):
            build = _Build(self.gen + 1 if self.base else 0, sid)
        base, deltas, gen, dead = self.base, self.deltas + [delta_ref], self.gen, []
        if build is not None:
            # a first base is written whole; a new one beside the deltas, at least as fast as they come
            budget = (float("inf") if not self.base
                      else max(delta_ref.nbytes, base_bytes / BASE_SNAPSHOTS, PIECE_BYTES))
            build = msgspec.structs.replace(build, pieces=list(build.pieces))
            per_segment = max(segment_bytes(shard), 1.0)
            written = 0
            while build.next_segment < SEGMENTS and written < budget:
                first = build.next_segment
                last = min(SEGMENTS, first + max(1, int(PIECE_BYTES / per_segment)))
                key = f"{self.model}/b{build.gen % 2}/{first}"
                ref, piece = _chunked(key, encode_segments(shard, first, last))
                items += piece
                build.pieces.append(ref)
                build.next_segment = last
                written += ref.nbytes
            nbytes["base"] = written
            if build.next_segment == SEGMENTS:  # complete: it replaces the base and the deltas before it
                dead = [k for p in self.base for k in chunk_keys(p)] + self.legacy
                dead += [k for d in deltas if self._delta_id(d) < build.from_delta for k in chunk_keys(d)]
                deltas = [d for d in deltas if self._delta_id(d) >= build.from_delta]
                base, gen, build = build.pieces, build.gen, None
        m = Manifest(self.model, sid, shard.blocks_applied, time.time(), PART_FORMAT, base_gen=gen, base=base,
                     deltas=deltas)
        encoded = msgspec.msgpack.encode(m)
        nbytes["manifest"] = len(encoded)
        items.append((manifest_key(self.model), encoded))
        items += [(k, None) for k in dead]  # after the manifest that no longer needs them
        self._next = (build, base, deltas, gen, bool(dead))
        return Snapshot(items, m, nbytes)

    def done(self, snap: Snapshot, shard: ModelShard) -> None:
        """`snap` (the last plan) is durable: it is the model's snapshot now."""
        build, base, deltas, gen, replaced = self._next
        self.build, self.base, self.deltas, self.gen = build, base, deltas, gen
        if replaced:
            self.legacy = []
        self.snapshot_id = snap.manifest.snapshot_id
        shard.snapshot_id = self.snapshot_id
        shard.delta_written()


def _rocks_options() -> Options:
    opts = Options()
    opts.create_if_missing(True)
    return opts


class LocalStore:
    """The worker's RocksDB: the same items as the topic, for a fast local restart."""

    def __init__(self, path: str | Path):
        Path(path).mkdir(parents=True, exist_ok=True)
        opts = _rocks_options()
        # pass the options again on every open: rocksdict otherwise reopens without them
        self.db = Rdict(str(path), options=opts)

    def save(self, items: list[Item]) -> None:
        for k, v in items:  # parts first, manifest next, deletions last: a torn write keeps a whole one
            if v is None:
                del self.db[k.encode()]
            else:
                self.db[k.encode()] = v

    def load(self, model: str) -> tuple[ModelShard, Manifest] | None:
        """The model's snapshot here, or None (none, or incomplete: a save failed part way)."""
        raw = self.db.get(manifest_key(model).encode())
        if raw is None:
            return None
        m = msgspec.msgpack.decode(raw, type=Manifest)
        try:
            return assemble(m, lambda k: self.db.get(k.encode())), m
        except IncompleteSnapshot as e:
            log.warning("event=local_snapshot_incomplete model=%s detail=%s", model, e)
            return None

    def close(self) -> None:
        self.db.close()


class SnapshotTopic:
    def __init__(self, bootstrap: str, topic: str):
        self.bootstrap = bootstrap
        self.topic = topic
        self.producer = Producer({**client_config(), "bootstrap.servers": bootstrap,
                                  "enable.idempotence": True, "message.max.bytes": 4 << 20})

    def publish(self, items: list[Item], partition: int) -> None:
        for k, v in items:
            while True:
                try:
                    self.producer.produce(self.topic, key=k.encode(), value=v, partition=partition)
                    break
                except BufferError:  # the producer's queue is full (a large base): let it drain
                    self.producer.poll(0.1)
        if self.producer.flush(60) > 0:
            raise RuntimeError(f"snapshot to {self.topic} not acknowledged")


