"""Records a service instance sends to a topic as it takes them (routing decisions, prefetch hints,
usage reports), keyed by model: never blocking a request, every failure counted and logged."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from confluent_kafka import Producer

from kvidx.kafka.config import client_config
from kvidx.kafka.delivery import flush_until

log = logging.getLogger("kvidx.kafka.publish")


class Publisher:
    """`publisher(record)` sends `encode(record)` to `topic` (key = the record's model)."""

    def __init__(self, bootstrap: str, topic: str, encode: Callable[[Any], bytes], linger_ms: int = 1):
        self.topic = topic
        self.encode = encode
        self.errors = 0
        self.producer = Producer({**client_config(), "bootstrap.servers": bootstrap,
                                  "enable.idempotence": True, "linger.ms": linger_ms})

    def __call__(self, record: Any) -> None:
        try:
            self.producer.produce(self.topic, key=record.model.encode(), value=self.encode(record),
                                  on_delivery=self._delivered)
        except BufferError:  # the local queue is full (broker unreachable): counted, never a failed request
            self.errors += 1
            log.error("event=publish_queue_full topic=%s", self.topic)
        self.producer.poll(0)

    def _delivered(self, err, msg) -> None:
        if err is not None:
            self.errors += 1
            log.error("event=publish_failed topic=%s error=%s", self.topic, err)

    def close(self, deadline_s: float = 10.0) -> None:
        """What is still buffered reaches the broker, or is logged as lost after `deadline_s`."""
        if lost := flush_until(self.producer, deadline_s, f"records for {self.topic}"):
            log.error("event=undelivered_at_close topic=%s waiting=%d", self.topic, lost)
