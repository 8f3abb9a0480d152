"""Where a relay's batches go: Kafka (the production path) or a shard store in process (demo, shadow).

Kafka: an idempotent producer (acks=all, no duplicates on retry), key = the shard key of the replica's
group (kvidx.core.groups; the model's name with one group) so that every event of a replica stays in
order in one partition. Malformed engine messages go to the
dead-letter topic with the reason in headers and the message with its token ids redacted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from confluent_kafka import KafkaException, Producer
from prometheus_client import Counter

from kvidx.core.groups import shard_key
from kvidx.engines.contract import DeadLetter
from kvidx.kafka.config import client_config
from kvidx.kafka.delivery import DELIVERY_DEADLINE_S, flush_until
from kvidx.kafka.topics import group_partition
from relays.redact import redact
from schemas.events import DEAD_LETTER_TOPIC, EVENTS_TOPIC, EventBatch, decode_batch, encode_batch

log = logging.getLogger("kvidx.relay")


class Sink(Protocol):
    def publish(self, batch: EventBatch) -> None: ...
    def dead_letter(self, dl: DeadLetter, model: str, replica: str) -> None: ...
    def flush(self, timeout: float = 10.0) -> int: ...


UNDELIVERED = Counter("kvidx_relay_undelivered_batches_total", "Event batches Kafka did not acknowledge "
                      "(after librdkafka's retries); the relay replays its mirror for each replica hit",
                      ["replica"])


STALL_S = 3.0  # batches waiting this long with none delivered: the broker does not answer
STALL_REPEAT_S = 15.0


class KafkaSink:
    def __init__(self, bootstrap: str, events_topic: str = EVENTS_TOPIC,
                 dead_letter_topic: str = DEAD_LETTER_TOPIC,
                 replica_group: Callable[..., int] | None = None, **config):
        """`replica_group(model, replica, groups=None)`: the replica's group (kvidx.config.Config.
        replica_group; `groups` overrides the model's group count); None: one group per model."""
        self.bootstrap = bootstrap
        self.replica_group = replica_group
        self._groups: dict[tuple[str, str], int] = {}
        self._partitions = 0  # the events topic's partition count, once a group > 0 is published
        self.events_topic = events_topic
        self.dead_letter_topic = dead_letter_topic
        self.errors = 0  # messages refused or timed out (event batches and dead letters)
        self.batch_errors = 0  # of which event batches
        self.delivered = 0
        self.handed = 0  # messages handed to the producer (event batches and dead letters)
        # told (model, replica, dp_rank) of every event batch Kafka did not take: a live relay then
        # replays its mirror (relays.run.Relay), so a lost batch costs a resync, never a wrong index
        self.on_undelivered: list[Callable[[str, str, int], None]] = []
        # broker health as the relay sees it (check_health): when progress was last seen, since when
        # batches have been waiting without any delivery, and when that was last said
        self._progress_at = time.monotonic()
        self._progress_mark = 0
        self._stalled_since: float | None = None
        self._stall_said_at = 0.0
        self.producer = Producer({
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,  # implies acks=all and ordered, duplicate-free retries
            "linger.ms": 2,
            "message.max.bytes": 16 << 20,
            **client_config(),
            **config,
        })

    def _on_delivery(self, err, msg) -> None:
        if err is None:
            self.delivered += 1
            return
        self.errors += 1
        if msg.topic() != self.events_topic:
            log.error("event=delivery_failed topic=%s error=%s", msg.topic(), err)
            return
        self.batch_errors += 1
        try:
            b = decode_batch(msg.value())
            who = (b.model, b.replica, b.dp_rank)
        except Exception:  # noqa: BLE001 - our own encoding; never let a callback raise
            who = None
        log.error("event=delivery_failed topic=%s replica=%s error=%s action=%s", msg.topic(),
                  who[1] if who else "?", err, "mirror_replay" if self.on_undelivered else "none")
        if who is not None:
            UNDELIVERED.labels(who[1]).inc()
            for tell in self.on_undelivered:
                tell(*who)

    def drain(self, deadline_s: float = DELIVERY_DEADLINE_S) -> int:
        """Wait until Kafka acknowledged or refused every message handed over, up to `deadline_s`
        (through a leader's or the controller's failover), saying every few seconds how many wait;
        returns how many were not delivered: refused, plus still waiting (lost if the process exits)."""
        if self.producer is not None:
            flush_until(self.producer, deadline_s, "event batches")
        # counted from the callbacks, not the producer's queue (which holds its own requests too)
        return self.handed - self.delivered

    def waiting(self) -> int:
        """Messages handed to the producer and not yet acknowledged by the broker."""
        return len(self.producer) if self.producer is not None else 0

    def check_health(self, now: float | None = None) -> None:
        """Say within seconds that the broker does not answer (librdkafka keeps the batches and retries;
        nothing is lost, but without this it says nothing for a minute, then something misleading),
        and say so again once the waiting batches are delivered."""
        now = time.monotonic() if now is None else now
        waiting = self.waiting()
        if self.delivered != self._progress_mark or waiting == 0:
            self._progress_mark, self._progress_at = self.delivered, now
            if self._stalled_since is not None and waiting == 0:
                log.info("event=broker_back bootstrap=%s after_s=%.1f delivered_total=%d", self.bootstrap,
                         now - self._stalled_since, self.delivered)
                self._stalled_since = None
            return
        if now - self._progress_at < STALL_S:
            return
        if self._stalled_since is None:
            self._stalled_since = self._progress_at
        elif now - self._stall_said_at < STALL_REPEAT_S:
            return
        self._stall_said_at = now
        log.warning("event=broker_not_answering bootstrap=%s waiting_batches=%d for_s=%.1f "
                    "hint=%r", self.bootstrap, waiting, now - self._stalled_since,
                    "batches are kept and retried; check the broker at that address")

    def _produce(self, topic: str, key: bytes, value: bytes, headers=None,
                 partition: int | None = None, acked: Callable | None = None) -> None:
        where = {} if partition is None else {"partition": partition}
        on_delivery = self._on_delivery
        if acked is not None:
            def on_delivery(err, msg) -> None:
                self._on_delivery(err, msg)
                acked(err)
        while True:
            try:
                self.producer.produce(topic, value=value, key=key, headers=headers,
                                      on_delivery=on_delivery, **where)
                self.handed += 1
                break
            except BufferError:  # local queue full: let librdkafka drain, never drop
                self.producer.poll(0.05)
            except KafkaException as e:
                raise RuntimeError(f"cannot publish to {topic}: {e}") from e
        self.producer.poll(0)

    def publish(self, batch: EventBatch, acked: Callable | None = None) -> None:
        """`acked(error or None)` once the broker answered for this batch (from a poll)."""
        if self.replica_group is not None:
            who = (batch.model, batch.replica)
            g = self._groups.get(who)
            if g is None:
                g = self._groups[who] = self.replica_group(*who)
            batch.replica_group = g
        g = batch.replica_group
        partition = group_partition(batch.model, g, self._partition_count()) if g else None
        self._produce(self.events_topic, shard_key(batch.model, g).encode(), encode_batch(batch),
                      partition=partition, acked=acked)

    def publish_acked(self, batch: EventBatch, timeout: float = 10.0) -> Callable[[], None]:
        """Publish (in call order) and return `wait()`, which returns once the broker acknowledged the
        batch (an API that answers "applied" only then loses nothing it acknowledged) and raises
        RuntimeError if it did not within `timeout`."""
        done = threading.Event()
        errors: list[str] = []

        def acked(err) -> None:
            if err is not None:
                errors.append(str(err))
            done.set()

        self.publish(batch, acked)

        def wait() -> None:
            deadline = time.monotonic() + timeout
            while not done.is_set():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the broker at {self.bootstrap} did not acknowledge in "
                                       f"{timeout:.0f} s")
                self.producer.poll(0.02)
            if errors:
                raise RuntimeError(f"the broker refused the batch: {errors[0]}")

        return wait

    def regroup(self, model: str, replica: str, groups: int, dry_run: bool = False) -> tuple[int, int]:
        """(the replica's group now, its group among `groups`); unless `dry_run`, its batches go to the
        new one from now on."""
        if self.replica_group is None:  # made without the deployment's configuration (tests, tools)
            log.warning("event=regroup_ignored replica=%s reason=%r", replica, "no replica groups here")
            return 0, 0
        who = (model, replica)
        old = self._groups.get(who)
        if old is None:
            old = self._groups[who] = self.replica_group(model, replica)
        new = self.replica_group(model, replica, groups)
        if not dry_run:
            self._groups[who] = new
        return old, new

    def _partition_count(self) -> int:
        if not self._partitions:
            meta = self.producer.list_topics(self.events_topic, timeout=30).topics.get(self.events_topic)
            if meta is None or meta.error is not None or not meta.partitions:
                raise RuntimeError(f"cannot publish replica groups: topic {self.events_topic} not found")
            self._partitions = len(meta.partitions)
        return self._partitions

    def dead_letter(self, dl: DeadLetter, model: str, replica: str) -> None:
        f = dl.frame
        value, how = redact(f.payload)  # never prompt tokens, not even in dead letters
        headers = [("reason", dl.reason.encode()), ("detail", dl.detail.encode()),
                   ("model", model.encode()), ("replica", replica.encode()),
                   ("endpoint", f.endpoint.encode()), ("seq", str(f.seq).encode()),
                   ("topic", f.topic), ("redaction", how.encode()), ("bytes", str(len(f.payload)).encode())]
        if dl.position >= 0:  # one event set aside: its place in the batch (frame.seq is the batch's)
            headers += [("position", str(dl.position).encode()), ("event", dl.event.encode())]
        self._produce(self.dead_letter_topic, f"{model}/{replica}".encode(), value, headers)

    def flush(self, timeout: float = 10.0) -> int:
        return self.producer.flush(timeout) if self.producer is not None else 0

    def close(self, deadline_s: float = 30.0) -> None:
        if self.producer is not None and (lost := flush_until(self.producer, deadline_s, "event batches")):
            log.error("event=undelivered_at_close waiting=%d bootstrap=%s", lost, self.bootstrap)
        self.producer = None  # librdkafka's handle goes with the last reference


class StoreSink:
    """Folds batches straight into a ShardStore (no broker): the embedded default."""

    def __init__(self, store):
        self.store = store
        self.dead: list[DeadLetter] = []

    def publish(self, batch: EventBatch) -> None:
        self.store.apply(batch)

    def dead_letter(self, dl: DeadLetter, model: str, replica: str) -> None:
        self.dead.append(dl)

    def flush(self, timeout: float = 10.0) -> int:
        return 0
