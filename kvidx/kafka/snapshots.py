"""The snapshot topic's format and its reader: what every process that rebuilds shards from the
compacted snapshot topic needs (the service's follower, a restarted worker, replay and the tools).
The writer (what a snapshot writes, when a new base begins, the worker's RocksDB copy) is
streams/snapshots.py.

Keys: a part's chunks are `<key>/<i>`; the manifest `<model>/manifest` names the base and the deltas
since it began and is written last, so a reader never sees a manifest whose parts are not there.
Format-2 snapshots (one blob, `chunks` in the manifest) are read as before.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable, Iterator

import msgspec
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from kvidx.core.groups import key_group
from kvidx.core.shard import ModelShard
from kvidx.core.snapshot import PART_FORMAT, SnapshotFormatError, decode_parts, decode_snapshot
from kvidx.kafka.config import client_config
from kvidx.kafka.log import watermarks

log = logging.getLogger("kvidx.kafka.snapshots")
CHUNK = 512 * 1024  # Kafka messages stay well under 1 MB

Item = tuple[str, bytes | None]  # a key and its value (None: delete it)


class PartRef(msgspec.Struct, array_like=True):
    key: str  # the part's chunks are f"{key}/{i}"
    chunks: int
    nbytes: int


class Manifest(msgspec.Struct):
    model: str
    snapshot_id: int
    blocks: int
    created: float
    format: int = 2  # format-2 manifests have no field: one snapshot() blob in `chunks` chunks
    chunks: int = 0
    base_gen: int = 0
    base: list[PartRef] = []  # the base's pieces
    deltas: list[PartRef] = []  # every delta since the base began, oldest first

    def parts(self) -> list[PartRef]:
        if self.format == 2:
            return [PartRef(f"{self.model}/{self.snapshot_id % 2}", self.chunks, 0)]
        return self.base + self.deltas


def manifest_key(model: str) -> str:
    return f"{model}/manifest"


def chunk_keys(ref: PartRef) -> list[str]:
    return [f"{ref.key}/{i}" for i in range(ref.chunks)]


class IncompleteSnapshot(LookupError):
    pass


def assemble(m: Manifest, get: Callable[[str], bytes | None]) -> ModelShard:
    """The shard a manifest describes, its parts read with `get(key)` one at a time (each is dropped
    once applied); IncompleteSnapshot if one is missing, SnapshotFormatError if unreadable."""
    if m.format not in (2, PART_FORMAT):
        raise SnapshotFormatError(f"snapshot manifest of model {m.model!r} has format {m.format}; this "
                                  f"kvidx reads formats 2-{PART_FORMAT}: upgrade kvidx to read it")

    def data(ref: PartRef) -> bytes:
        chunks = [get(k) for k in chunk_keys(ref)]
        if any(c is None for c in chunks):
            raise IncompleteSnapshot(f"snapshot of model {m.model!r} lacks part {ref.key}")
        return b"".join(chunks)

    if m.format == 2:
        shard = decode_snapshot(data(m.parts()[0]))
    else:
        shard = decode_parts(data(ref) for ref in m.parts())
    shard.snapshot_id = m.snapshot_id
    return shard


def _read_to_end(bootstrap: str, topic: str, partitions: list[int] | None,
                 timeout_s: float) -> Iterator[tuple[str, bytes | None, int]]:
    """(key, value, partition) of every message of the topic up to its end now."""
    c = Consumer({**client_config(), "bootstrap.servers": bootstrap,
                  "group.id": f"kvidx-snapshot-reader-{time.time_ns()}",
                  "enable.auto.commit": False, "fetch.max.bytes": 64 << 20})
    try:
        md = c.list_topics(topic, timeout=10)
        tmeta = md.topics.get(topic)
        if tmeta is None or tmeta.error is not None:
            return
        parts = sorted(tmeta.partitions) if partitions is None else partitions
        ends = {}
        for p in parts:
            lo, hi = watermarks(c, topic, p)
            if hi > lo:
                ends[p] = hi
        if not ends:
            return
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
        deadline = time.monotonic() + timeout_s
        while ends and time.monotonic() < deadline:
            for msg in c.consume(1000, 0.5):
                if msg.error():
                    continue
                yield msg.key().decode(), msg.value(), msg.partition()
                if msg.offset() + 1 >= ends.get(msg.partition(), 0):
                    ends.pop(msg.partition(), None)
        if ends:
            raise TimeoutError(f"could not read {topic} to its end in {timeout_s}s")
    finally:
        c.close()


def release_free_memory() -> None:
    """Give the heap's free pages back to the OS (glibc keeps them after a rebuild's many chunk-sized
    buffers: freed large buffers raise its mmap threshold, so later ones come from the heap); a
    no-op where there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def read_snapshot_logs(bootstrap: str, topic: str, partitions: list[int] | None = None,
                       timeout_s: float = 120.0, attempts: int = 3,
                       keep: Callable[[list[Item]], None] | None = None,
                       groups: frozenset[int] | None = None) -> dict[str, tuple[ModelShard, Manifest]]:
    """The newest complete snapshot of every shard (a model's replica group) in the compacted topic
    (all partitions unless given), with its manifest. Read again if a part went missing meanwhile
    (a new base replaced it). `keep(items)`: also given each shard's snapshot items (a worker's local
    copy). `groups`: only the shards of these replica groups (the others are not even kept in memory
    while reading)."""
    for attempt in range(attempts):
        latest: dict[str, bytes] = {}
        partition_of: dict[str, int] = {}
        for key, value, partition in _read_to_end(bootstrap, topic, partitions, timeout_s):
            if groups is not None and key_group(key) not in groups:
                continue
            if value is None:
                latest.pop(key, None)
            else:
                latest[key] = value
                partition_of[key] = partition
        manifests = [msgspec.msgpack.decode(v, type=Manifest) for k, v in latest.items()
                     if k.endswith("/manifest")]
        out, missing = {}, []
        for m in manifests:
            kept: list[Item] = []

            def get(key: str, kept=kept, latest=latest) -> bytes | None:
                value = latest.pop(key, None)  # each part dropped once applied
                if keep is not None and value is not None:
                    kept.append((key, value))
                    if len(kept) >= 64:
                        keep(kept[:])
                        kept.clear()
                return value

            try:
                shard = assemble(m, get)
            except IncompleteSnapshot as e:
                missing.append(str(e))
                continue
            if keep is not None:
                keep(kept + [(manifest_key(m.model), msgspec.msgpack.encode(m))])
            shard.events_partition = partition_of[manifest_key(m.model)]
            out[m.model] = (shard, m)
        if not missing:
            latest.clear()
            release_free_memory()
            return out
        log.warning("event=snapshot_incomplete attempt=%d detail=%s", attempt + 1, missing[0])
    return out


def read_snapshots(bootstrap: str, topic: str, partitions: list[int] | None = None,
                   timeout_s: float = 120.0, groups: frozenset[int] | None = None) -> dict[str, ModelShard]:
    """The newest complete snapshot of every shard in the compacted topic (all partitions unless
    given; only the replica groups in `groups` if given), by shard key."""
    return {m: s for m, (s, _) in read_snapshot_logs(bootstrap, topic, partitions, timeout_s,
                                                     groups=groups).items()}
