"""A batch Kafka does not take costs a mirror replay, never a silent hole: the producer's delivery
failure (here librdkafka's own message timeout against an address where nothing listens) reaches the
live relay of that replica, which replays its mirror (a clear, then its live blocks); a relay of
another replica sharing the sink is left alone, and `drain` counts what was not delivered."""

import time

from kvidx.engines.vllm.relay import VllmPublisherRelay
from relays.run import Relay
from relays.sinks import UNDELIVERED, KafkaSink


def failed_sink() -> KafkaSink:
    # port 1: connection refused at once; the messages time out after 300 ms in librdkafka's queue
    return KafkaSink("127.0.0.1:1", "t.events", "t.deadletter", **{"message.timeout.ms": 300,
                                                                   "log_level": 0})


def test_a_lost_batch_replays_that_replicas_mirror():
    sink = failed_sink()
    mine = Relay(VllmPublisherRelay("m", "r0", 16), sink)
    other = Relay(VllmPublisherRelay("m", "r1", 16), sink)
    before = UNDELIVERED.labels("r0")._value.get()
    mine.start_fresh(replay_from_start=False)  # publishes the replica's clear: it cannot be delivered
    deadline = time.monotonic() + 30
    while sink.batch_errors == 0 and time.monotonic() < deadline:
        sink.producer.poll(0.05)
    assert sink.batch_errors == 1 and sink.delivered == 0
    assert UNDELIVERED.labels("r0")._value.get() == before + 1
    assert mine._resync_wanted.is_set() and not other._resync_wanted.is_set()
    mine.resync_tick()  # the replay is scheduled (within its jitter) ...
    assert mine.resync_tick(now=time.monotonic() + 3600)  # ... and its first part goes out
    assert sink.drain(5.0) == 2  # the clear and the replay's first part: neither delivered


def test_drain_counts_what_is_still_waiting():
    sink = KafkaSink("127.0.0.1:1", "t.events", "t.deadletter", log_level=0)  # 5 min message timeout
    relay = Relay(VllmPublisherRelay("m", "r0", 16), sink)
    relay.start_fresh(replay_from_start=False)  # one batch: the replica's clear
    assert sink.drain(0.5) == 1  # not refused yet, not delivered either: lost if the process exits
    assert sink.errors == 0 and sink.handed == 1
