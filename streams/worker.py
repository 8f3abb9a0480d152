"""The stream worker (faust-streaming): folds relay event batches into per-model shards.

- Consumes `kvidx.events.v1` (key = a model's replica group, kvidx.core.groups) in batches, folds each
  batch into that group's shard (kvidx.core.shard: the same fold the embedded and shadow paths run).
- Durability: every `snapshot_interval` seconds the dirty shards are written to the local RocksDB and
  to the compacted snapshot topic (streams.snapshots: what changed since the last snapshot, and now
  and then pieces of a new base); only then are the folded events acknowledged, so the committed
  offsets never run ahead of what a restarted worker can rebuild. Redelivered events are skipped by
  the shard's (epoch, seq) check.
- A restarted or new worker rebuilds a shard on its first event: local RocksDB if it has it,
  otherwise the compacted topic (no relays needed).
- Lag: per model, engine timestamp -> applied (histogram); consumer lag of the events topic per
  partition (kvidx_worker_consumer_lag_messages, from faust's monitor at scrape time).
Malformed messages on the events topic go to the dead-letter topic with a counter; never dropped
silently.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import faust
from confluent_kafka import Producer
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from kvidx import index
from kvidx.config import ShardSettings
from kvidx.core.fold import Undecodable, fold_message
from kvidx.core.groups import shard_key
from kvidx.core.maskmap import IMPLEMENTATION as MASKMAP_IMPLEMENTATION
from kvidx.core.shard import ModelShard
from kvidx.core.snapshot import SnapshotFormatError
from kvidx.fold_metrics import compiled_fold_families
from kvidx.kafka.config import client_config, faust_credentials
from kvidx.kafka.snapshots import read_snapshot_logs
from schemas.events import DEAD_LETTER_TOPIC, EVENTS_TOPIC, SNAPSHOTS_TOPIC
from streams.snapshots import LocalStore, SnapshotLog, SnapshotTopic

log = logging.getLogger("kvidx.streams")

APPLIED = Counter("kvidx_worker_batches_total", "Event batches folded, by outcome", ["model", "outcome"])
BLOCKS = Counter("kvidx_worker_block_events_total", "Block events folded", ["model"])
DEAD = Counter("kvidx_worker_dead_letters_total", "Undecodable event messages", ["reason"])
LAG = Histogram("kvidx_worker_apply_lag_seconds", "Engine event time to applied in the shard",
                ["model"], buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30))
SNAP = Histogram("kvidx_worker_snapshot_seconds", "Time to write one shard snapshot", ["model"])
SNAP_BYTES = Counter("kvidx_worker_snapshot_bytes_total", "Snapshot bytes written to the compacted topic "
                     "(and the same to RocksDB), by part", ["model", "part"])
LOCAL_ERRORS = Counter("kvidx_worker_local_store_errors_total",
                       "Snapshots the local RocksDB could not store (full disk ...)")
INDEXED = Gauge("kvidx_worker_indexed_blocks", "Distinct blocks in the shard",
                ["model", "group", "replica_group"])
CORE = Gauge("kvidx_core_info", "The index core that runs (maskmap: native | python)", ["maskmap"])
CORE.labels(MASKMAP_IMPLEMENTATION).set(1)


class _ConsumerLag:
    """Consumer lag of the events topic per partition, read at scrape time from faust's monitor: to
    the last message read, and to the last committed offset (events are acknowledged only once a
    snapshot holds them, so the committed lag runs a snapshot interval behind)."""

    app: faust.App | None = None
    topic = EVENTS_TOPIC

    def collect(self):
        read = GaugeMetricFamily("kvidx_worker_consumer_lag_messages",
                                 "Events-topic messages not yet read, per partition", labels=["partition"])
        committed = GaugeMetricFamily("kvidx_worker_uncommitted_messages",
                                      "Events-topic messages past the committed offset, per partition",
                                      labels=["partition"])
        m = self.app.monitor if self.app is not None else None
        if m is not None and m.tp_end_offsets is not None:
            for tp, end in sorted(dict(m.tp_end_offsets).items()):
                if tp.topic != self.topic:
                    continue
                last = m.tp_read_offsets.get(tp)
                read.add_metric([str(tp.partition)], max(0, end - (last + 1 if last is not None else 0)))
                done = m.tp_committed_offsets.get(tp)
                committed.add_metric([str(tp.partition)], max(0, end - (done if done is not None else 0)))
        yield read
        yield committed


CONSUMER_LAG = _ConsumerLag()
REGISTRY.register(CONSUMER_LAG)


class _CompiledFold:
    """How many batches the compiled fold took and handed to the Python fold, read at scrape time."""

    def collect(self):
        yield from compiled_fold_families("kvidx_worker")


REGISTRY.register(_CompiledFold())


class ShardWorker:
    """The fold-and-snapshot state machine, independent of faust so it can be tested directly."""

    def __init__(self, bootstrap: str, data_dir: str | Path, snapshot_topic: str = SNAPSHOTS_TOPIC,
                 dead_letter_topic: str = DEAD_LETTER_TOPIC, settings: ShardSettings | None = None):
        """`settings`: how shards are made (the deployment configuration: per-model index block size,
        eviction kinds, pools), the same the service instances use."""
        self.bootstrap = bootstrap
        self.local = LocalStore(Path(data_dir) / "shards")
        self.topic = SnapshotTopic(bootstrap, snapshot_topic)
        self.snapshot_topic = snapshot_topic
        self.dead_letter_topic = dead_letter_topic
        self.settings = settings or ShardSettings(index_block_size=16)
        self.shards: dict[str, ModelShard] = {}
        self.logs: dict[str, SnapshotLog] = {}  # what each model's durable snapshot is made of
        self.partition_of: dict[str, int] = {}
        self.dirty: set[str] = set()
        self._topic_cache: dict[int, dict] = {}  # partition -> its (shard, manifest) by model, at load
        self._dlq: Producer | None = None
        self.batches_folded = 0
        self.last_snapshot_at: float | None = None

    def shard(self, key: str, partition: int, model: str, group: int) -> ModelShard:
        """The shard of `key` (kvidx.core.groups.shard_key: a model's replica group), loaded on first use."""
        s = self.shards.get(key)
        if s is None:
            try:
                s = self._load(key, partition, model, group)
            except SnapshotFormatError as e:  # refused, never misread; nothing is acknowledged
                log.error("event=worker_stopped reason=%r", str(e))
                logging.shutdown()
                os._exit(78)  # EX_CONFIG: the supervisor stops instead of restarting into the same wall
        self.partition_of[key] = partition
        return s

    def _load(self, key: str, partition: int, model: str, group: int) -> ModelShard:
        """The shard's newest snapshot (local RocksDB or the compacted topic), else a new shard."""
        # The local copy may be older than the compacted topic's (another worker owned the shard
        # meanwhile): take the newer snapshot. Snapshot ids grow across owners: a worker goes on
        # from the id it loaded.
        local = self.local.load(key)
        if partition not in self._topic_cache:  # one read of the partition for all its shards
            # (what it reads is kept in the local RocksDB too: the next snapshots only add to it)
            self._topic_cache[partition] = read_snapshot_logs(self.bootstrap, self.snapshot_topic,
                                                              [partition], keep=self._keep_local)
        remote = self._topic_cache[partition].pop(key, None)
        found, source = local, "rocksdb"
        if remote is not None and (local is None or remote[1].snapshot_id > local[1].snapshot_id):
            found, source = remote, "snapshot_topic"
        if found is None:
            s, manifest, source = self.settings.new_shard(model), None, "new"
            s.replica_group = group
        else:
            (s, manifest) = found
            self.settings.configure(s)
        s.track_changes()
        self.logs[key] = SnapshotLog(key, manifest)
        if s.block_size != self.settings.block_size(model):
            log.warning("event=block_size_changed model=%s snapshot=%d configured=%d: the snapshot "
                        "keeps its own (the relays hash with theirs)", model, s.block_size,
                        self.settings.block_size(model))
        log.info("event=shard_loaded model=%s replica_group=%d source=%s blocks_applied=%d", model, group,
                 source, s.blocks_applied)
        self.shards[key] = s
        return s

    def _keep_local(self, items: list[tuple[str, bytes]]) -> None:
        try:
            self.local.save(items)
        except Exception as e:  # noqa: BLE001 - as in snapshot_dirty: the topic has it
            LOCAL_ERRORS.inc()
            log.error("event=local_snapshot_failed error=%s", str(e)[:200])

    def fold(self, raw: bytes, partition: int, offset: int = -1, now: float | None = None) -> None:
        now = time.time() if now is None else now
        try:
            batch, applied = fold_message(lambda b: self.shard(shard_key(b.model, b.replica_group), partition,
                                                               b.model, b.replica_group),
                                          raw, now, partition, offset)
        except Undecodable as e:
            self.dead_letter(raw, "undecodable_event_batch", str(e))
            return
        self.batches_folded += 1
        APPLIED.labels(batch.model, "applied" if applied else "duplicate").inc()
        if applied:
            self.dirty.add(shard_key(batch.model, batch.replica_group))
            BLOCKS.labels(batch.model).inc(sum(len(getattr(e, "hashes", ())) for e in batch.events))
            if batch.seq >= 0:
                LAG.labels(batch.model).observe(max(0.0, now - batch.engine_ts))

    def revoke(self, partitions: set[int]) -> list[str]:
        """Partitions taken away by a rebalance: forget their shards (the new owner rebuilds them
        from the compacted topic and the unacknowledged events; a snapshot written from here now
        could overwrite its newer one)."""
        gone = [m for m, p in self.partition_of.items() if p in partitions]
        for m in gone:
            self.shards.pop(m, None)
            self.logs.pop(m, None)
            self.partition_of.pop(m, None)
            self.dirty.discard(m)
        for p in partitions:
            self._topic_cache.pop(p, None)
        if gone:
            log.info("event=models_revoked models=%d", len(gone))
        return gone

    def snapshot_dirty(self) -> int:
        """Write every changed shard to RocksDB and the compacted topic; returns how many."""
        n = 0
        for key in sorted(self.dirty):
            shard = self.shards[key]
            model = shard.model
            t0 = time.perf_counter()
            # nothing moves on until the topic has the snapshot: a retry after a failed publish
            # writes the same ids again, with every change since the last durable one
            snap = self.logs[key].plan(shard)
            # the compacted topic is the durable copy; the local RocksDB only speeds up a restart
            # here, so a full or failing disk is reported and survived, not fatal
            self.topic.publish(snap.items, self.partition_of[key])
            self.logs[key].done(snap, shard)
            self.dirty.discard(key)
            for part, nbytes in snap.nbytes.items():
                SNAP_BYTES.labels(model, part).inc(nbytes)
            try:
                self.local.save(snap.items)
            except Exception as e:  # noqa: BLE001 - rocksdict raises plain Exceptions on I/O errors
                LOCAL_ERRORS.inc()
                log.error("event=local_snapshot_failed model=%s error=%s", model, str(e)[:200])
            SNAP.labels(model).observe(time.perf_counter() - t0)
            for gid, n in index.keys_by_group(shard):
                INDEXED.labels(model, str(gid), str(shard.replica_group)).set(n)
            n += 1
        self.last_snapshot_at = time.time()
        return n

    def dead_letter(self, raw: bytes, reason: str, detail: str) -> None:
        DEAD.labels(reason).inc()
        log.warning("event=dead_letter reason=%s bytes=%d detail=%s", reason, len(raw), detail[:120])
        if self._dlq is None:
            self._dlq = Producer({**client_config(), "bootstrap.servers": self.bootstrap,
                                  "enable.idempotence": True})
        self._dlq.produce(self.dead_letter_topic, value=raw,
                          headers=[("reason", reason.encode()), ("detail", detail.encode())])
        self._dlq.flush(10)

    def close(self) -> None:
        self.local.close()


def create_app(bootstrap: str, data_dir: str | Path, *, app_id: str = "kvidx-worker",
               events_topic: str = EVENTS_TOPIC, snapshot_topic: str = SNAPSHOTS_TOPIC,
               dead_letter_topic: str = DEAD_LETTER_TOPIC, snapshot_interval: float = 2.0,
               settings: ShardSettings | None = None, metrics_port: int | None = None,
               metrics_host: str = "127.0.0.1", web_port: int = 6066, partitions: int = 4,
               session_timeout: float = 30.0, status_interval: float = 30.0,
               replication_factor: int = 1) -> tuple[faust.App, ShardWorker]:
    """`session_timeout`: how long a dead worker keeps its partitions before the group gives them to
    the others (they then rebuild the shards from the compacted topic and carry on).
    `replication_factor`: of the topics faust makes itself (its assignor's), as kvidx's own
    (kvidx.kafka.topics.replication)."""
    app = faust.App(
        app_id, broker=f"kafka://{bootstrap}", datadir=str(Path(data_dir) / "faust"),
        web_enabled=web_port > 0, web_bind="127.0.0.1", web_port=web_port or 6066,
        topic_partitions=partitions, topic_replication_factor=replication_factor,
        consumer_auto_offset_reset="earliest", broker_credentials=faust_credentials(client_config()),
        broker_commit_every=100_000, broker_session_timeout=session_timeout,
        broker_heartbeat_interval=max(0.5, session_timeout / 10),
        broker_commit_interval=1.0, stream_buffer_maxsize=20_000,
        # a worker that rejoins the group while a restarted broker has not loaded the events topic's
        # metadata yet is assigned nothing ("Ignoring missing topic"); aiokafka rejoins once its
        # metadata shows the partitions, which by default is up to 5 minutes later: 10 s instead
        consumer_metadata_max_age_ms=10_000,
    )
    worker = ShardWorker(bootstrap, data_dir, snapshot_topic, dead_letter_topic, settings=settings)
    CONSUMER_LAG.app, CONSUMER_LAG.topic = app, events_topic
    topic = app.topic(events_topic, key_type=bytes, value_type=bytes, value_serializer="raw",
                      key_serializer="raw")

    pending: list = []  # folded events not yet covered by a durable snapshot
    streams: list = []

    @app.agent(topic)
    async def fold(stream):
        streams.append(stream)
        # acks are manual: an event is acknowledged only once a snapshot holds it, so committed
        # offsets never run ahead of what a restarted worker can rebuild. Not `take_events`: it
        # acknowledges each batch itself when the next one is asked for (a kill before the next
        # snapshot then lost every event folded since the last one).
        async for events in stream.noack().noack_take(5000, within=0.05):
            for ev in events:
                worker.fold(ev.value, ev.message.partition, ev.message.offset)
            pending.extend(events)

    @app.on_partitions_revoked.connect
    async def on_revoked(app, revoked, **kwargs):
        mine = {tp.partition for tp in revoked if tp.topic == events_topic}
        worker.revoke(mine)
        # their events will be redelivered to the new owner: never ack them from here
        pending[:] = [ev for ev in pending if ev.message.partition not in mine]

    @app.timer(interval=status_interval)
    async def status():
        age = (f"{time.time() - worker.last_snapshot_at:.1f}" if worker.last_snapshot_at is not None
               else "none")
        log.info("event=worker_status models=%d batches_folded=%d unacked_events=%d last_snapshot_age_s=%s",
                 len(worker.shards), worker.batches_folded, len(pending), age)

    @app.timer(interval=snapshot_interval)
    async def snapshot():
        if not pending:
            return
        done = list(pending)
        try:
            worker.snapshot_dirty()
        except Exception as e:  # noqa: BLE001 - broker down, topic gone ...: keep the events unacked
            log.error("event=snapshot_failed error=%s retry_in_s=%.1f", str(e)[:200], snapshot_interval)
            return
        del pending[:len(done)]  # events folded meanwhile are not in this snapshot
        for ev in done:
            await streams[0].ack(ev)

    if metrics_port:
        start_http_server(metrics_port, addr=metrics_host)
    return app, worker
