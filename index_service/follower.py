"""Keeps a service instance's shards current from Kafka: a read replica of the workers' state.

Start-up: rebuild every shard from the compacted snapshot topic, then consume the events topic from
the offsets those snapshots cover (events already in a snapshot are skipped by the fold's (epoch,
seq) check). After that, every event batch is folded as it arrives, so a lookup sees an engine event
a few milliseconds after the relay published it. Several instances fed this way answer alike.

Routing decisions (the routes topic) are followed too, from a few minutes back: a prompt routed
through any instance counts as pending credit on every instance.

Ready (`/healthz` 200) means caught up: the snapshots applied and every message that was in the events
topic (from the snapshots' offsets) and in the routes topic (from the look-back) when the follower
started, folded; the end offsets are taken at start and read again, from the leaders the metadata
names then, before ready (a paused and resumed ex-leader can answer the first read with its stale end).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

import msgspec
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

from index_service.store import ShardStore
from kvidx.core.groups import key_group
from kvidx.core.snapshot import SnapshotFormatError
from kvidx.kafka.background import Background
from kvidx.kafka.config import client_config
from kvidx.kafka.log import watermarks
from kvidx.kafka.reach import message, wait_for_broker
from kvidx.kafka.snapshots import read_snapshots
from kvidx.kafka.topics import KafkaAdminError
from schemas.events import EVENTS_TOPIC, SNAPSHOTS_TOPIC
from schemas.routes import decode_route

log = logging.getLogger("kvidx.service")


def retention_gap(snapshot_offsets: list[int], low: int) -> int:
    """Messages of a partition that retention deleted before any snapshot folded them: from the
    furthest snapshot of the partition to the oldest offset kept (0 if a snapshot reaches it). A
    snapshot behind `low` alone loses nothing: its model had no events after it while the worker folded
    the partition further (every dirty shard is snapshotted before the worker acknowledges)."""
    furthest = max(snapshot_offsets, default=low)
    return max(0, low - furthest)


class KafkaFollower(Background):
    thread_name = "kafka-follower"

    def __init__(self, store: ShardStore, bootstrap: str, events_topic: str = EVENTS_TOPIC,
                 snapshot_topic: str = SNAPSHOTS_TOPIC, routes_topic: str | None = None,
                 routes_lookback_s: float = 600.0, prepare: Callable[[], None] | None = None,
                 status_every_s: float = 30.0):
        """`prepare()` runs once the broker answers, before anything is read (e.g. creating the
        topics). Until then the follower logs one line per attempt and /healthz says why it waits."""
        self.store = store
        self.prepare = prepare
        self.status_every_s = status_every_s
        self.bootstrap = bootstrap
        self.events_topic = events_topic
        self.snapshot_topic = snapshot_topic
        self.routes_topic = routes_topic
        self.routes_lookback_s = routes_lookback_s
        self.undecodable = 0
        self._confirmations = 0  # second reads of the end offsets before ready (_ready_if_confirmed)
        super().__init__()

    def run(self) -> None:
        self._follow()

    def failed(self, e: BaseException) -> None:
        if isinstance(e, SnapshotFormatError | KafkaAdminError):  # one line, and /healthz says why
            self.store.not_ready_reason = str(e)
            log.error("event=follower_stopped reason=%r", str(e))
        else:  # surfaced through /healthz
            log.exception("event=follower_failed")

    def _wait_for_broker(self) -> bool:
        def waiting(why: str) -> None:
            self.store.not_ready_reason = message(self.bootstrap, why)

        self.store.not_ready_reason = f"connecting to Kafka at {self.bootstrap}"
        if not wait_for_broker(self.bootstrap, log, self.stop_event, on_attempt=waiting):
            return False
        if self.prepare is not None:
            self.prepare()
        self.store.not_ready_reason = "rebuilding the shards from the snapshot topic and the events topic"
        return True

    def _follow(self) -> None:
        if not self._wait_for_broker():
            return
        t0 = time.monotonic()
        shards = read_snapshots(self.bootstrap, self.snapshot_topic, groups=self.store.groups)
        starts: dict[int, int] = {}
        folded: dict[int, list[tuple[str, int]]] = {}  # partition -> (model, its snapshot's offset)
        for key in sorted(shards):  # a model's replica groups merged in group order
            shard = shards.pop(key)
            partition, offset = shard.events_partition, shard.events_offset
            if partition >= 0:
                folded.setdefault(partition, []).append((shard.model, offset))
            if not self.store.put_group(shard):
                continue  # a group this instance does not hold
            if partition >= 0:
                starts[partition] = min(starts.get(partition, offset), offset)
        log.info("event=snapshots_loaded models=%d seconds=%.3f", len(self.store.shards),
                 time.monotonic() - t0)
        c = Consumer({**client_config(), "bootstrap.servers": self.bootstrap,
                      "group.id": f"kvidx-service-{time.time_ns()}",
                      # the broker answers a waiting fetch as soon as an event arrives: a long wait
                      # costs no freshness, a short one CPU (5 ms: ~2 % of a core on an idle broker;
                      # 100 ms and a 50 ms poll: the service idled at ~8 ms/s, 500 and 250: ~4,
                      # which at 500 lookups/s is 8 us of CPU a lookup)
                      "enable.auto.commit": False, "fetch.wait.max.ms": 500, "fetch.min.bytes": 1,
                      # a position the retention passed: go on from the oldest event left (as the
                      # worker does), never jump to the end and wait there
                      "auto.offset.reset": "earliest", "topic.metadata.refresh.interval.ms": 5000})
        try:
            parts = self._partitions(c)
            ends: dict[tuple[str, int], int] = {}  # (topic, partition) -> its end offset at start
            for p in parts:
                lo, hi = watermarks(c, self.events_topic, p)
                if p in starts and starts[p] < lo:
                    starts[p] = lo  # from the oldest event kept, not the end
                    self._check_retention(p, folded[p], lo)
                if hi > max(lo, starts.get(p, 0)):
                    ends[(self.events_topic, p)] = hi
            assignment = [TopicPartition(self.events_topic, p, starts.get(p, OFFSET_BEGINNING))
                          for p in parts]
            if self.routes_topic:
                routes = self._routes_start(c)
                for tp in routes:  # offset -1: no decision in the look-back
                    lo, hi = watermarks(c, tp.topic, tp.partition)
                    if tp.offset >= 0 and hi > max(lo, tp.offset):
                        ends[(tp.topic, tp.partition)] = hi
                assignment += routes
            c.assign(assignment)
            offsets = {(tp.topic, tp.partition): tp.offset for tp in assignment}
            if not ends:
                self._ready_if_confirmed(c, t0, ends, offsets)
            lag_at = 0.0
            status_at = time.monotonic() + self.status_every_s
            while not self.stop_event.is_set():
                now = time.monotonic()
                if now >= lag_at:  # consumer lag, from the watermarks the fetches already returned
                    lag_at = now + 1.0
                    self.store.consumer_lag = self._lag(c, parts)
                    if ends and self._passed(c, ends):  # no message left to see (retention took it)
                        self._ready_if_confirmed(c, t0, ends, offsets)
                if now >= status_at:
                    status_at = now + self.status_every_s
                    log.info("event=service_status ready=%s models=%d batches_applied=%d "
                             "routes_applied=%d consumer_lag=%d", self.store.ready, len(self.store.shards),
                             self.store.batches_applied, self.store.routes_applied, self.store.consumer_lag)
                first = c.poll(0.25)  # wake on the first message, then take what is there (0.25 s:
                # the longest a stop waits; an event wakes it at once)
                msgs = [first, *c.consume(2000, 0)] if first is not None else []
                for k, msg in enumerate(msgs):
                    if len(msgs) > 100 and time.monotonic() >= lag_at:  # a large batch in hand: the
                        lag_at = time.monotonic() + 1.0  # lag counts what is still to fold of it
                        self.store.consumer_lag = self._lag(c, parts) + len(msgs) - k
                    if msg.error():
                        continue
                    if msg.topic() == self.routes_topic:
                        self._route(msg.value())
                    else:
                        key, held = msg.key(), self.store.groups
                        if held is not None and key and key_group(key.decode(errors="replace")) not in held:
                            self.store.skipped_batches += 1  # a group held elsewhere: not even decoded
                        elif not self.store.fold(msg.value(), msg.partition(), msg.offset()):
                            self.undecodable += 1  # the worker dead-letters it; a replica only skips
                    where = (msg.topic(), msg.partition())
                    if ends and msg.offset() + 1 >= ends.get(where, 0):
                        ends.pop(where, None)
                        if not ends:
                            self._ready_if_confirmed(c, t0, ends, offsets)
        finally:
            c.close()

    def _ready_if_confirmed(self, c: Consumer, t0: float, ends: dict[tuple[str, int], int],
                            offsets: dict[tuple[str, int], int]) -> None:
        """Ready, once a second read of the end offsets, from the partitions' leaders as the metadata
        says now, finds nothing past the consumer's position; else those ends go into `ends` and the
        follower reads on. The first read can be a stale one: a partition's leader paused and resumed
        (a zombie) answers with its old high watermark until it learns it was replaced, and an instance
        taking that for the end would be ready without events the new leader acknowledged (seen once in
        CI, tests/integration/test_replication.py). Confirmed reads are bounded: the third says ready."""
        if self.store.ready:
            return
        self._confirmations += 1
        if self._confirmations <= 2:
            more = self._ends_past_position(c, offsets)
            if more:
                ends.update(more)
                log.info("event=end_offsets_moved partitions=%d: reading on before ready", len(more))
                return
        self._ready(t0)

    def _ends_past_position(self, c: Consumer, offsets: dict[tuple[str, int], int]
                            ) -> dict[tuple[str, int], int]:
        """The end offsets, read again after a metadata refresh, of the assigned partitions the consumer
        is not at the end of (`offsets`: where each was assigned from, for those it has not read yet)."""
        for topic in sorted({t for t, _ in offsets}):
            c.list_topics(topic, timeout=10)  # the partitions' leaders as the cluster says now
        keys = [k for k, start in offsets.items() if start >= 0 or k[0] == self.events_topic]
        positions = c.position([TopicPartition(t, p) for t, p in keys])
        at = {(tp.topic, tp.partition): tp.offset for tp in positions}
        more = {}
        for key in keys:
            lo, hi = watermarks(c, *key)
            pos = at.get(key, -1)
            if pos < 0:
                pos = max(offsets[key], 0)
            if hi > max(lo, pos):
                more[key] = hi
        return more

    def _check_retention(self, partition: int, folded: list[tuple[str, int]], low: int) -> None:
        """Say so (once, one line, counted in /healthz and /metrics) when the events topic's retention
        deleted events of `partition` that no snapshot had folded: a worker was down longer than the
        retention. `folded`: (model, offset) of every snapshot of the partition."""
        lost = retention_gap([o for _, o in folded], low)
        if not lost:
            return  # a snapshot reaches `low`: the older ones' models had no events in between
        self.store.events_lost += lost
        models = ",".join(sorted({m for m, o in folded if o < low}))
        log.error("event=events_lost topic=%s partition=%d from_offset=%d to_offset=%d models=%s: the events "
                  "topic's retention deleted %d messages no snapshot had folded; these models' indexes "
                  "miss them until their relays resync (kvidx resync --model MODEL)",
                  self.events_topic, partition, low - lost, low, models, lost)

    def _passed(self, c: Consumer, ends: dict[tuple[str, int], int]) -> bool:
        """Drop from `ends` the partitions the consumer is positioned at or past the end of (retention
        can delete the last message before it is read); True when none is left."""
        for tp in c.position([TopicPartition(t, p) for t, p in ends]):
            if tp.offset >= ends[(tp.topic, tp.partition)]:
                ends.pop((tp.topic, tp.partition))
        return not ends

    def _lag(self, c: Consumer, parts: list[int]) -> int:
        positions = c.position([TopicPartition(self.events_topic, p) for p in parts])
        lag = 0
        for tp in positions:
            hi = c.get_watermark_offsets(tp, cached=True)[1]
            if tp.offset >= 0 and hi >= 0:
                lag += max(0, hi - tp.offset)
        return lag

    def _routes_start(self, c: Consumer) -> list[TopicPartition]:
        """The routes topic's partitions, positioned `routes_lookback_s` back in time."""
        since_ms = int((time.time() - self.routes_lookback_s) * 1000)
        parts = [TopicPartition(self.routes_topic, p, since_ms)
                 for p in self._partitions(c, self.routes_topic)]
        for attempt in range(50):  # a new topic's partitions may still be electing their leader
            try:
                return c.offsets_for_times(parts, timeout=10)
            except KafkaException:
                if attempt == 49:
                    raise
                time.sleep(0.2)
        return parts

    def _route(self, raw: bytes) -> None:
        try:
            self.store.apply_route(decode_route(raw))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            self.undecodable += 1

    def _partitions(self, c: Consumer, topic: str | None = None) -> list[int]:
        topic = topic or self.events_topic
        for _ in range(100):
            t = c.list_topics(topic, timeout=10).topics.get(topic)
            if t is not None and t.error is None and t.partitions:
                return sorted(t.partitions)
            time.sleep(0.2)
        raise RuntimeError(f"topic {topic} not found")

    def _ready(self, t0: float) -> None:
        gc.freeze()  # what the rebuild made lives on: out of the collector's full scans (http_protocol.serve)
        self.store.ready = True
        self.store.not_ready_reason = None
        log.info("event=caught_up seconds=%.3f batches=%d", time.monotonic() - t0,
                 self.store.batches_applied)
