"""The follower's readiness: the end offsets read at start are read again, from the leaders the metadata
names then, before the instance says ready (a paused and resumed ex-leader answers the first read with
its stale high watermark: tests/integration/test_replication.py met it once). The consumer here is a
stand-in that answers offsets only: the reads' order is the logic under test; the real broker's
behaviour is in the integration tests."""

from __future__ import annotations

from confluent_kafka import TopicPartition

from index_service.follower import KafkaFollower
from index_service.store import ShardStore


class OffsetsOnly:
    """Answers watermarks from a script (one (low, high) per read, the last repeated) and positions."""

    def __init__(self, highs: list[int], position: int):
        self.highs, self.at, self.refreshed = highs, position, 0

    def list_topics(self, topic, timeout=None):
        self.refreshed += 1

    def get_watermark_offsets(self, tp, timeout=None, cached=False):
        return 0, (self.highs.pop(0) if len(self.highs) > 1 else self.highs[0])

    def position(self, tps):
        return [TopicPartition(tp.topic, tp.partition, self.at) for tp in tps]


def follower() -> KafkaFollower:
    return KafkaFollower(ShardStore(16), "localhost:1", events_topic="ev")


def test_a_stale_first_end_is_read_again_and_the_follower_reads_on():
    f, ends = follower(), {}
    c = OffsetsOnly([7], position=-1001)  # the first read (at start) said 0; the leader now says 7
    f._ready_if_confirmed(c, 0.0, ends, {("ev", 0): 0})
    assert not f.store.ready and ends == {("ev", 0): 7} and c.refreshed == 1
    c.at = 7  # read to 7: the next read agrees
    ends.clear()
    f._ready_if_confirmed(c, 0.0, ends, {("ev", 0): 0})
    assert f.store.ready and not ends


def test_an_end_that_agrees_makes_it_ready_at_once():
    f, ends = follower(), {}
    f._ready_if_confirmed(OffsetsOnly([5], position=5), 0.0, ends, {("ev", 0): 0, ("routes", 0): -1})
    assert f.store.ready


def test_a_topic_that_keeps_growing_does_not_keep_it_waiting():
    f, ends = follower(), {}
    c = OffsetsOnly([10, 20, 30, 40], position=0)
    for _ in range(2):
        f._ready_if_confirmed(c, 0.0, ends, {("ev", 0): 0})
        assert not f.store.ready and ends
        ends.clear()
    f._ready_if_confirmed(c, 0.0, ends, {("ev", 0): 0})  # the third confirmation says ready
    assert f.store.ready
