"""A live relay whose broker stops answering mid-stream (a hung or partitioned broker: SIGSTOP) says so
within seconds, with how many batches wait, says so again once they are delivered, and loses and
duplicates nothing."""

import logging
import os
import signal
import threading
import time

import pytest

from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.engines.vllm.sim import SimVllmEngine
from kvidx.kafka.local import LocalKafka
from kvidx.kafka.topics import ensure_topics
from kvidx.sim.prompts import workload_requests
from relays.run import Relay
from relays.sinks import KafkaSink
from relays.zmq_source import ZmqSource
from schemas.events import decode_batch, topic_names
from tests.helpers import wait_for

pytestmark = pytest.mark.kafka


class Lines(logging.Handler):
    """The relay's and the Kafka client's log lines, taken on their own loggers: whatever logging
    state earlier tests of the same process left (levels, propagation, disabled loggers), these are
    the lines an operator would read."""

    def __init__(self, *names: str):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []
        self.loggers = [logging.getLogger(n) for n in names]
        self.saved = [(lg.level, lg.disabled) for lg in self.loggers]
        for lg in self.loggers:
            lg.disabled = False
            lg.setLevel(logging.INFO)
            lg.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    @property
    def text(self) -> str:
        return "\n".join(self.messages)

    def close(self) -> None:
        for lg, (level, disabled) in zip(self.loggers, self.saved, strict=True):
            lg.removeHandler(self)
            lg.setLevel(level)
            lg.disabled = disabled
        super().close()


def test_hung_broker_is_reported_and_nothing_is_lost(tmp_path):
    broker = LocalKafka(log=lambda m: None)
    bootstrap = broker.start(tmp_path / "kafka")
    names = topic_names("hang.")
    ensure_topics(bootstrap, names)
    engine = SimVllmEngine(num_blocks=40, block_size=32, endpoint="tcp://127.0.0.1:*",
                           replay_endpoint="tcp://127.0.0.1:*")
    sink = KafkaSink(bootstrap, names["events"], names["dead_letters"])
    relay = Relay(VllmPublisherRelay("sim", "sim-0", 16), sink,
                  ZmqSource(engine.endpoint, engine.replay_endpoint))
    relay.start_fresh()
    thread = threading.Thread(target=relay.run_live, args=(0.05,), daemon=True)
    lines = Lines("kvidx.relay", "kvidx.kafka.client")
    thread.start()
    try:
        time.sleep(0.3)
        work = workload_requests(5, 60)
        for prompt, output in work[:20]:
            engine.serve(prompt, output)
        wait_for(lambda: sink.waiting() == 0 and relay.batches_published > 1, what="first batches delivered")

        os.kill(broker.pid, signal.SIGSTOP)  # the broker hangs: connections stay open, nothing answers
        for prompt, output in work[20:]:
            engine.serve(prompt, output)
        wait_for(lambda: "event=broker_not_answering" in lines.text, timeout=30,
                 what="the relay to say the broker does not answer")
        said = next(m for m in lines.messages if "event=broker_not_answering" in m)
        assert "event=broker_back" not in lines.text  # said while the broker is still stopped
        assert bootstrap in said and "waiting_batches=" in said and "waiting_batches=0" not in said, said

        os.kill(broker.pid, signal.SIGCONT)
        wait_for(lambda: "event=broker_back" in lines.text, timeout=60, what="the relay to say it is back")
        assert sink.errors == 0
        assert "probably due to broker version" not in lines.text  # librdkafka's misleading guess
    finally:
        try:
            os.kill(broker.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        relay.close()
        thread.join(5)
        sink.close()
        engine.close()
        lines.close()

    # every batch the relay published is in the topic exactly once, in order
    from confluent_kafka import Consumer
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "hang-check", "auto.offset.reset": "earliest"})
    c.subscribe([names["events"]])
    seqs = []
    deadline = time.monotonic() + 30
    while len(seqs) < relay.batches_published and time.monotonic() < deadline:
        for m in c.consume(500, 0.5):
            if not m.error():
                seqs.append(decode_batch(m.value()).seq)
    c.close()
    broker.stop()
    assert len(seqs) == relay.batches_published
    live = [s for s in seqs if s >= 0]
    assert live == sorted(set(live)) and live[-1] == engine.next_seq - 1
