"""A shard whose disk is full: the worker keeps folding and snapshotting to the compacted topic (the
durable copy), counts the local failure, and a worker elsewhere rebuilds everything (real broker)."""

import errno

import pytest

from kvidx.engines.recording import read_frames
from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.kafka.snapshots import read_snapshots
from schemas.events import encode_batch
from streams.snapshots import LocalStore
from streams.worker import LOCAL_ERRORS, ShardWorker
from tests.helpers import LLAMA
from tests.integration.helpers import answers, expected_shard, prompts

pytestmark = pytest.mark.kafka


def test_full_disk_on_a_shard_loses_nothing(kafka_bootstrap, topics, tmp_path, monkeypatch):
    def full(self, items):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(LocalStore, "save", full)
    worker = ShardWorker(kafka_bootstrap, tmp_path / "w", topics["snapshots"], topics["dead_letters"])
    relay = VllmPublisherRelay("tiny", "tcp://127.0.0.1:5557", 16, epoch=0)
    offset = 0
    failures = LOCAL_ERRORS._value.get()
    for f in sorted(read_frames(LLAMA / "frames.jsonl"), key=lambda f: f.recv_ns):
        for b in relay.on_frame(f).batches:
            worker.fold(encode_batch(b), 0, offset)
            offset += 1
        if offset % 40 == 0:
            worker.snapshot_dirty()  # never raises for the local disk
    worker.snapshot_dirty()
    worker.close()
    assert LOCAL_ERRORS._value.get() > failures
    rebuilt = read_snapshots(kafka_bootstrap, topics["snapshots"])["tiny"]
    ps = prompts(LLAMA / "requests.jsonl")
    assert answers(rebuilt, ps) == answers(expected_shard(LLAMA / "frames.jsonl", "tiny"), ps)
