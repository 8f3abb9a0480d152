"""A slow consumer under a burst: a service instance that folds slowly falls behind (its lag shows in
/metrics' kvidx_consumer_lag_messages), loses nothing, and catches up (real broker)."""

import time

import pytest
from prometheus_client import generate_latest

from index_service.follower import KafkaFollower
from index_service.metrics import ServiceMetrics
from index_service.store import ShardStore
from relays.run import play_recording
from relays.sinks import KafkaSink
from tests.helpers import LLAMA, wait_for
from tests.integration.helpers import answers, expected_shard, prompts

pytestmark = pytest.mark.kafka


def test_slow_consumer_under_a_burst(kafka_bootstrap, topics, monkeypatch):
    store = ShardStore(16)
    fold = store.fold  # what the follower folds each events-topic message with

    def slow_fold(raw, partition=-1, offset=-1, now=None):
        time.sleep(0.01)  # a consumer ten times slower than the burst
        return fold(raw, partition, offset, now)

    monkeypatch.setattr(store, "fold", slow_fold)
    follower = KafkaFollower(store, kafka_bootstrap, topics["events"], topics["snapshots"]).start()
    try:
        wait_for(lambda: store.ready, what="follower ready")
        sink = KafkaSink(kafka_bootstrap, topics["events"], topics["dead_letters"])
        for i in range(3):  # the burst: three replicas' worth of the recording at once
            play_recording(LLAMA / "frames.jsonl", "tiny", sink, 16, replica=f"r{i}")
        sink.close()
        lags = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            lags.append(store.consumer_lag)
            shard = store.shards.get("tiny")
            if shard and all(shard.replicas.get((f"r{i}", 0)) and shard.replicas[(f"r{i}", 0)].batches == 147
                             for i in range(3)):
                break
            time.sleep(0.2)
        assert max(lags) > 50, "the slow consumer should have fallen behind"
        wait_for(lambda: store.consumer_lag == 0, timeout=10, what="lag back to 0")
        metrics = ServiceMetrics(store)
        assert b"kvidx_consumer_lag_messages 0.0" in generate_latest(metrics.registry)
        want = expected_shard(LLAMA / "frames.jsonl", "tiny")
        ps = prompts(LLAMA / "requests.jsonl")[::5]
        got = answers(store.shards["tiny"], ps)
        single = [a[0][1:] for a in answers(want, ps)]  # (cached, resumable) of the one replica
        for i in range(3):
            mine = [next(x[1:] for x in a if x[0] == f"r{i}") for a in got]
            assert mine == single
    finally:
        follower.stop()
