"""A service instance rebuilding from a snapshot older than the events topic's retention (a worker
down longer than retention.ms): the deleted events are said once and counted, and the instance goes on
from the oldest event kept. Before, the consumer's out-of-range reset jumped to the end of the
partition and the instance waited there, not ready, until the next event arrived."""

import pytest

from index_service.store import ShardStore
from kvidx.engines.recording import read_frames
from kvidx.kafka.log import watermarks
from relays.run import play_recording
from relays.sinks import KafkaSink
from tests.helpers import LLAMA
from tests.integration.helpers import fresh_service, start_worker, stop_workers, wait_snapshots

pytestmark = pytest.mark.kafka
BS = 16


def test_a_snapshot_older_than_retention_is_said_and_not_waited_on(kafka_bootstrap, topics, tmp_path):
    from confluent_kafka import Consumer, TopicPartition
    from confluent_kafka.admin import AdminClient

    sink = KafkaSink(kafka_bootstrap, topics["events"], topics["dead_letters"])
    play_recording(LLAMA / "frames.jsonl", "tiny", sink, BS, replica="r0")
    assert sink.flush(30) == 0
    log = tmp_path / "worker.log"
    worker = start_worker(kafka_bootstrap, topics["prefix"], tmp_path / "w", log)
    try:
        batches = sum(1 for _ in read_frames(LLAMA / "frames.jsonl")) + 1
        shard = wait_snapshots(kafka_bootstrap, topics["snapshots"], {"tiny": batches}, worker, log)["tiny"]
    finally:
        stop_workers(worker)
    # the worker is down; another replica's events arrive, and retention deletes the first part of them
    play_recording(LLAMA / "frames.jsonl", "tiny", sink, BS, replica="r1")
    assert sink.flush(30) == 0
    sink.close()
    p, folded = shard.events_partition, shard.events_offset
    c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "retention-test"})
    try:
        lo, hi = watermarks(c, topics["events"], p)
    finally:
        c.close()
    assert lo <= folded < hi
    cut = (folded + hi) // 2
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    for fut in admin.delete_records([TopicPartition(topics["events"], p, cut)]).values():
        fut.result(30)

    store = ShardStore(BS)
    # no event is sent from here on: a follower that waited for a new one would never be ready, and
    # fresh_service fails on its timeout (a bound on a hang, not a speed)
    with fresh_service(store, kafka_bootstrap, topics, timeout=60):
        assert store.events_lost == cut - folded
        states = {st.replica: st for st in store.shards["tiny"].replicas.values()}
        assert states["r0"].batches == batches  # from the snapshot
        assert states["r1"].batches == hi - cut  # the events retention kept, none more
