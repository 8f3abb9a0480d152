"""The Kafka path end to end on a real broker: relay -> Kafka -> faust worker (RocksDB + compacted
snapshots) -> service follower, compared with the in-process path on the real vLLM recording."""

import json
import os
import signal
import subprocess
import sys

import pytest

from index_service.store import ShardStore
from kvidx.engines.recording import read_frames
from relays.run import play_recording
from relays.sinks import KafkaSink
from tests.helpers import GEMMA, LLAMA, ROOT
from tests.integration.helpers import (
    BS,
    answers,
    expected_shard,
    fresh_service,
    prompts,
    start_worker,
    wait_snapshots,
)

pytestmark = pytest.mark.kafka


def test_fixture_through_kafka_matches_in_process(kafka_bootstrap, topics, tmp_path):
    sink = KafkaSink(kafka_bootstrap, topics["events"], topics["dead_letters"])
    frames = play_recording(LLAMA / "frames.jsonl", "tiny", sink, BS)
    assert sink.errors == 0
    batches = frames + 1  # + the relay's start-up ReplicaCleared

    log1 = tmp_path / "worker1.log"
    w1 = start_worker(kafka_bootstrap, topics["prefix"], tmp_path / "w1", log1)
    try:
        shards = wait_snapshots(kafka_bootstrap, topics["snapshots"], {"tiny": batches}, w1, log1)
    finally:
        w1.send_signal(signal.SIGKILL)  # a crash, not a clean stop
        w1.wait()
    want = expected_shard(LLAMA / "frames.jsonl", "tiny")
    llama_prompts = prompts(LLAMA / "requests.jsonl")
    assert answers(shards["tiny"], llama_prompts) == answers(want, llama_prompts)
    assert any(c for a in answers(want, llama_prompts) for (_, c, _) in a), "the fixture must have hits"

    # while the worker is down, another model's events arrive; a new worker on a new machine (empty
    # data dir) rebuilds "tiny" from the compacted topic and folds "gemma" from the events topic
    play_recording(GEMMA / "frames.jsonl", "gemma", sink, BS)
    log2 = tmp_path / "worker2.log"
    w2 = start_worker(kafka_bootstrap, topics["prefix"], tmp_path / "w2", log2)
    try:
        gemma_batches = sum(1 for _ in read_frames(GEMMA / "frames.jsonl")) + 1
        shards = wait_snapshots(kafka_bootstrap, topics["snapshots"],
                                {"tiny": batches, "gemma": gemma_batches}, w2, log2)
    finally:
        w2.terminate()
        w2.wait(30)
    assert answers(shards["tiny"], llama_prompts) == answers(want, llama_prompts)
    gemma_prompts = prompts(GEMMA / "requests.jsonl")
    assert answers(shards["gemma"], gemma_prompts) == answers(expected_shard(GEMMA / "frames.jsonl", "gemma"),
                                                              gemma_prompts)
    # worker 2 either was redelivered tiny's unacknowledged events (then it rebuilt tiny from the
    # compacted topic first) or never saw them: both leave the compacted state whole, as checked above

    # a service instance rebuilds from the snapshots and the events topic and answers alike
    store = ShardStore(BS)
    with fresh_service(store, kafka_bootstrap, topics):
        assert answers(store.shards["tiny"], llama_prompts) == answers(want, llama_prompts)


def test_relay_cli_plays_a_recording(kafka_bootstrap, topics):
    out = subprocess.run(
        [sys.executable, "-m", "kvidx.cli", "relay", "--bootstrap", kafka_bootstrap, "--topic-prefix",
         topics["prefix"], "--model", "tiny", "--play", str(LLAMA / "frames.jsonl")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["played_frames"] == 146
