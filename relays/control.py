"""Relays listen on the control topic for resync requests (a mirror replay, shallowest blocks
first, spread out in time): what an operator or a worker that lost its state asks for."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec
from confluent_kafka import Consumer, Producer, TopicPartition

from kvidx.kafka.config import client_config
from kvidx.kafka.delivery import require_delivered
from kvidx.kafka.log import watermarks
from schemas.control import CONTROL_VERSION, ResyncRequest, decode_control, encode_control

log = logging.getLogger("kvidx.relay")


class ControlListener:
    def __init__(self, bootstrap: str, topic: str, model: str, replica: str,
                 on_resync: Callable[[ResyncRequest], None]):
        self.model, self.replica, self.on_resync = model, replica, on_resync
        self.consumer = Consumer({**client_config(), "bootstrap.servers": bootstrap,
                                  "group.id": f"kvidx-relay-{replica}-{time.time_ns()}",
                                  "enable.auto.commit": False})
        # every partition from its current end, fixed now: a request sent after start() is seen
        parts = []
        for p in self._partitions(topic):
            _, hi = watermarks(self.consumer, topic, p)
            parts.append(TopicPartition(topic, p, hi))
        self.consumer.assign(parts)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="relay-control", daemon=True)

    def _partitions(self, topic: str) -> list[int]:
        for _ in range(50):
            t = self.consumer.list_topics(topic, timeout=10).topics.get(topic)
            if t is not None and t.error is None and t.partitions:
                return sorted(t.partitions)
            time.sleep(0.2)
        raise RuntimeError(f"control topic {topic} not found")

    def start(self) -> ControlListener:
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self.stop_event.is_set():
                msg = self.consumer.poll(0.2)
                if msg is None or msg.error():
                    continue
                try:
                    req = decode_control(msg.value())
                except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
                    log.warning("event=bad_control_message bytes=%d", len(msg.value() or b""))
                    continue
                if req.matches(self.model, self.replica):
                    log.info("event=resync_requested replica=%s reason=%s replica_groups=%d", self.replica,
                             req.reason, req.replica_groups)
                    self.on_resync(req)
        finally:
            self.consumer.close()

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(5)


def send_resync(bootstrap: str, topic: str, model: str = "*", replica: str = "*", reason: str = "",
                replica_groups: int = 0) -> None:
    p = Producer({**client_config(), "bootstrap.servers": bootstrap})
    req = ResyncRequest(CONTROL_VERSION, model, replica, reason, time.time(), replica_groups)
    p.produce(topic, value=encode_control(req))
    require_delivered(p, f"resync request on {topic}", bootstrap=bootstrap)
