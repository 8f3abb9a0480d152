"""Where a relay's batches go: Kafka (the production path) or a shard store in process (demo, shadow).

Kafka: an idempotent producer (acks=all, no duplicates on retry), key = model so that every event of a
model, and so of each replica, stays in order in one partition. Malformed engine messages go to the
dead-letter topic with the reason in headers and the message with its token ids redacted.
"""

from __future__ import annotations

import logging
from typing import Protocol

from confluent_kafka import KafkaException, Producer

from kvidx.kafka.config import client_config
from relays.redact import redact
from relays.vllm_relay import DeadLetter
from schemas.events import DEAD_LETTER_TOPIC, EVENTS_TOPIC, EventBatch, encode_batch

log = logging.getLogger("kvidx.relay")


class Sink(Protocol):
    def publish(self, batch: EventBatch) -> None: ...
    def dead_letter(self, dl: DeadLetter, model: str, replica: str) -> None: ...
    def flush(self, timeout: float = 10.0) -> int: ...


class KafkaSink:
    def __init__(self, bootstrap: str, events_topic: str = EVENTS_TOPIC,
                 dead_letter_topic: str = DEAD_LETTER_TOPIC, **config):
        self.events_topic = events_topic
        self.dead_letter_topic = dead_letter_topic
        self.errors = 0
        self.producer = Producer({
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,  # implies acks=all and ordered, duplicate-free retries
            "linger.ms": 2,
            "message.max.bytes": 16 << 20,
            **client_config(),
            **config,
        })

    def _on_delivery(self, err, msg) -> None:
        if err is not None:
            self.errors += 1
            log.error("event=delivery_failed topic=%s error=%s", msg.topic(), err)

    def _produce(self, topic: str, key: bytes, value: bytes, headers=None) -> None:
        while True:
            try:
                self.producer.produce(topic, value=value, key=key, headers=headers,
                                      on_delivery=self._on_delivery)
                break
            except BufferError:  # local queue full: let librdkafka drain, never drop
                self.producer.poll(0.05)
            except KafkaException as e:
                raise RuntimeError(f"cannot publish to {topic}: {e}") from e
        self.producer.poll(0)

    def publish(self, batch: EventBatch) -> None:
        self._produce(self.events_topic, batch.model.encode(), encode_batch(batch))

    def dead_letter(self, dl: DeadLetter, model: str, replica: str) -> None:
        f = dl.frame
        value, how = redact(f.payload)  # never prompt tokens, not even in dead letters
        headers = [("reason", dl.reason.encode()), ("detail", dl.detail.encode()),
                   ("model", model.encode()), ("replica", replica.encode()),
                   ("endpoint", f.endpoint.encode()), ("seq", str(f.seq).encode()),
                   ("topic", f.topic), ("redaction", how.encode()), ("bytes", str(len(f.payload)).encode())]
        self._produce(self.dead_letter_topic, f"{model}/{replica}".encode(), value, headers)

    def flush(self, timeout: float = 10.0) -> int:
        return self.producer.flush(timeout) if self.producer is not None else 0

    def close(self) -> None:
        self.flush()
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
