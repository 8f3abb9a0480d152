"""Durable shard snapshots: a local RocksDB (rocksdict) and a compacted Kafka topic.

A snapshot of a model's shard is split into chunks (Kafka messages stay well under 1 MB), keyed
`<model>/<slot>/<i>`, plus a manifest `<model>/manifest` naming the slot, chunk count and snapshot
id, written last. Slots alternate (double buffering), so a new snapshot never overwrites the chunks
the current manifest points to: a reader never mixes two snapshots. The
topic is compacted, so it keeps only the newest snapshot of every model: a worker on a new machine
rebuilds its shards from it without the relays, then resumes the events topic from the offsets it
committed when that snapshot was written (events after it are folded again; the fold is idempotent).
Snapshots go to the same partition as the model's events, so partition ownership covers both.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import msgspec
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Producer, TopicPartition
from rocksdict import Options, Rdict

from kvidx.core.shard import ModelShard
from kvidx.kafka.config import client_config

log = logging.getLogger("kvidx.streams")
CHUNK = 512 * 1024


class Manifest(msgspec.Struct):
    model: str
    snapshot_id: int
    chunks: int
    blocks: int
    created: float


def chunk_key(m: Manifest, i: int) -> str:
    return f"{m.model}/{m.snapshot_id % 2}/{i}"


def split(model: str, data: bytes, snapshot_id: int, blocks: int) -> list[tuple[str, bytes]]:
    chunks = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
    manifest = Manifest(model, snapshot_id, len(chunks), blocks, time.time())
    return [(chunk_key(manifest, i), c) for i, c in enumerate(chunks)] + [
        (f"{model}/manifest", msgspec.msgpack.encode(manifest))]


def _rocks_options() -> Options:
    opts = Options()
    opts.create_if_missing(True)
    return opts


class LocalStore:
    """The worker's RocksDB: the last snapshot of each shard it owns, for a fast local restart."""

    def __init__(self, path: str | Path):
        Path(path).mkdir(parents=True, exist_ok=True)
        opts = _rocks_options()
        # pass the options again on every open: rocksdict otherwise reopens without them
        self.db = Rdict(str(path), options=opts)

    def save(self, items: list[tuple[str, bytes]]) -> None:
        for k, v in items:  # chunks first, manifest last: a torn write keeps the old manifest
            self.db[k.encode()] = v

    def load(self, model: str) -> ModelShard | None:
        raw = self.db.get(f"{model}/manifest".encode())
        if raw is None:
            return None
        m = msgspec.msgpack.decode(raw, type=Manifest)
        data = b"".join(self.db[chunk_key(m, i).encode()] for i in range(m.chunks))
        shard = ModelShard.restore(data)
        shard.snapshot_id = m.snapshot_id
        return shard

    def close(self) -> None:
        self.db.close()


class SnapshotTopic:
    def __init__(self, bootstrap: str, topic: str):
        self.bootstrap = bootstrap
        self.topic = topic
        self.producer = Producer({**client_config(), "bootstrap.servers": bootstrap,
                                  "enable.idempotence": True, "message.max.bytes": 4 << 20})

    def publish(self, items: list[tuple[str, bytes]], partition: int) -> None:
        for k, v in items:
            self.producer.produce(self.topic, key=k.encode(), value=v, partition=partition)
        if self.producer.flush(30) > 0:
            raise RuntimeError(f"snapshot to {self.topic} not acknowledged")


def watermarks(c: Consumer, topic: str, partition: int, timeout_s: float = 30.0) -> tuple[int, int]:
    """(low, high) offsets; retried while a new topic's partitions still elect their leader."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return c.get_watermark_offsets(TopicPartition(topic, partition), timeout=5)
        except KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def read_snapshots(bootstrap: str, topic: str, partitions: list[int] | None = None,
                   timeout_s: float = 30.0) -> dict[str, ModelShard]:
    """The newest complete snapshot of every model in the compacted topic (all partitions unless
    given)."""
    c = Consumer({**client_config(), "bootstrap.servers": bootstrap,
                  "group.id": f"kvidx-snapshot-reader-{time.time_ns()}",
                  "enable.auto.commit": False, "fetch.max.bytes": 64 << 20})
    try:
        md = c.list_topics(topic, timeout=10)
        tmeta = md.topics.get(topic)
        if tmeta is None or tmeta.error is not None:
            return {}
        parts = sorted(tmeta.partitions) if partitions is None else partitions
        ends = {}
        for p in parts:
            lo, hi = watermarks(c, topic, p)
            if hi > lo:
                ends[p] = hi
        if not ends:
            return {}
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
        latest: dict[str, bytes] = {}
        partition_of: dict[str, int] = {}
        deadline = time.monotonic() + timeout_s
        while ends and time.monotonic() < deadline:
            for msg in c.consume(1000, 0.5):
                if msg.error():
                    continue
                latest[msg.key().decode()] = msg.value()
                partition_of[msg.key().decode()] = msg.partition()
                if msg.offset() + 1 >= ends.get(msg.partition(), 0):
                    ends.pop(msg.partition(), None)
        if ends:
            raise TimeoutError(f"could not read {topic} to its end in {timeout_s}s")
    finally:
        c.close()
    shards = {}
    for key, raw in latest.items():
        if not key.endswith("/manifest") or raw is None:
            continue
        m = msgspec.msgpack.decode(raw, type=Manifest)
        parts_ = [latest.get(chunk_key(m, i)) for i in range(m.chunks)]
        if any(p is None for p in parts_):
            log.warning("event=snapshot_incomplete model=%s", m.model)
            continue
        shards[m.model] = ModelShard.restore(b"".join(parts_))
        shards[m.model].snapshot_id = m.snapshot_id
        shards[m.model].events_partition = partition_of[key]
    return shards
