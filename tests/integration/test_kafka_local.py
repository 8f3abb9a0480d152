"""LocalKafka: a real broker starts, round-trips a message, and stops cleanly."""

from __future__ import annotations

import os
import shutil
import time
import uuid

import pytest

from kvidx.kafka.local import LocalKafka

pytestmark = [
    pytest.mark.kafka,
    pytest.mark.skipif(shutil.which("java") is None, reason="needs java 17+"),
]


def test_local_kafka_roundtrip_and_stop(tmp_path):
    from confluent_kafka import Consumer, Producer

    kafka = LocalKafka()
    bootstrap = kafka.start(tmp_path / "kafka")
    pid = kafka.pid
    try:
        assert bootstrap.startswith("127.0.0.1:")
        topic = f"t-{uuid.uuid4().hex[:8]}"
        producer = Producer({"bootstrap.servers": bootstrap})
        producer.produce(topic, key=b"k", value=b"hello")
        assert producer.flush(20) == 0

        consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"g-{topic}",
                "auto.offset.reset": "earliest",
            }
        )
        try:
            consumer.subscribe([topic])
            got = None
            deadline = time.monotonic() + 30
            while got is None and time.monotonic() < deadline:
                msg = consumer.poll(0.5)
                if msg is not None and not msg.error():
                    got = msg
        finally:
            consumer.close()
        assert got is not None, "no message consumed within 30 s"
        assert (got.key(), got.value()) == (b"k", b"hello")
    finally:
        kafka.stop()

    assert kafka.proc is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
