"""Keeps a service instance's shards current from Kafka: a read replica of the workers' state.

Start-up: rebuild every shard from the compacted snapshot topic, then consume the events topic from
the offsets those snapshots cover (events already in a snapshot are skipped by the fold's (epoch,
seq) check). After that, every event batch is folded as it arrives, so a lookup sees an engine event
a few milliseconds after the relay published it. Several instances fed this way answer alike.
"""

from __future__ import annotations

import logging
import threading
import time

import msgspec
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from index_service.store import ShardStore
from kvidx.kafka.config import client_config
from schemas.events import EVENTS_TOPIC, SNAPSHOTS_TOPIC, decode_batch
from streams.snapshots import read_snapshots, watermarks

log = logging.getLogger("kvidx.service")


class KafkaFollower:
    def __init__(self, store: ShardStore, bootstrap: str, events_topic: str = EVENTS_TOPIC,
                 snapshot_topic: str = SNAPSHOTS_TOPIC):
        self.store = store
        self.bootstrap = bootstrap
        self.events_topic = events_topic
        self.snapshot_topic = snapshot_topic
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kafka-follower", daemon=True)
        self.undecodable = 0
        self.error: BaseException | None = None

    def start(self) -> KafkaFollower:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(10)

    def _run(self) -> None:
        try:
            self._follow()
        except BaseException as e:  # surfaced through /healthz
            self.error = e
            log.exception("event=follower_failed")

    def _follow(self) -> None:
        t0 = time.monotonic()
        shards = read_snapshots(self.bootstrap, self.snapshot_topic)
        starts: dict[int, int] = {}
        for shard in shards.values():
            self.store.put(shard)
            if shard.events_partition >= 0:
                p = shard.events_partition
                starts[p] = min(starts.get(p, shard.events_offset), shard.events_offset)
        log.info("event=snapshots_loaded models=%d seconds=%.3f", len(shards), time.monotonic() - t0)
        c = Consumer({**client_config(), "bootstrap.servers": self.bootstrap,
                      "group.id": f"kvidx-service-{time.time_ns()}",
                      "enable.auto.commit": False, "fetch.wait.max.ms": 5, "fetch.min.bytes": 1,
                      "topic.metadata.refresh.interval.ms": 5000})
        try:
            parts = self._partitions(c)
            ends = {}
            for p in parts:
                lo, hi = watermarks(c, self.events_topic, p)
                if hi > max(lo, starts.get(p, 0)):
                    ends[p] = hi
            c.assign([TopicPartition(self.events_topic, p, starts.get(p, OFFSET_BEGINNING)) for p in parts])
            if not ends:
                self._ready(t0)
            while not self.stop_event.is_set():
                first = c.poll(0.05)  # wake on the first message, then take what is there
                msgs = [first, *c.consume(2000, 0)] if first is not None else []
                for msg in msgs:
                    if msg.error():
                        continue
                    try:
                        batch = decode_batch(msg.value())
                    except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
                        self.undecodable += 1  # the worker dead-letters it; a replica only skips
                        continue
                    self.store.apply(batch)
                    if ends and msg.offset() + 1 >= ends.get(msg.partition(), 0):
                        ends.pop(msg.partition(), None)
                        if not ends:
                            self._ready(t0)
        finally:
            c.close()

    def _partitions(self, c: Consumer) -> list[int]:
        for _ in range(100):
            t = c.list_topics(self.events_topic, timeout=10).topics.get(self.events_topic)
            if t is not None and t.error is None and t.partitions:
                return sorted(t.partitions)
            time.sleep(0.2)
        raise RuntimeError(f"topic {self.events_topic} not found")

    def _ready(self, t0: float) -> None:
        self.store.ready = True
        log.info("event=caught_up seconds=%.3f batches=%d", time.monotonic() - t0,
                 self.store.batches_applied)
