"""Two faust workers share the partitions; one is killed with SIGKILL; the other takes its models
over, rebuilds them from the compacted topic, folds what arrived since, and its shards answer exactly
like the in-process fold of everything published (real broker)."""

import signal
import time

import pytest

from kvidx.engines.recording import read_frames
from kvidx.kafka.snapshots import read_snapshots
from kvidx.shadow import InProcessIndex
from relays.run import play_recording
from relays.sinks import KafkaSink
from tests.helpers import GEMMA, LLAMA
from tests.integration.helpers import answers, both_assigned, prompts, stop_workers
from tests.integration.helpers import group_worker as worker

pytestmark = pytest.mark.kafka
MODELS = [f"model-{i}" for i in range(6)]


def snapshots_cover(bootstrap, topic, want: int, procs, logs, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p, log in zip(procs, logs, strict=True):
            assert p.poll() is None, open(log).read()[-3000:]
        shards = read_snapshots(bootstrap, topic)
        if all(m in shards and sum(st.batches for st in shards[m].replicas.values()) >= want
               for m in MODELS):
            return shards
        time.sleep(0.5)
    raise AssertionError("snapshots incomplete:\n" + "\n".join(open(log).read()[-2000:] for log in logs))


def test_killed_worker_hands_its_models_over(kafka_bootstrap, topics, tmp_path):
    sink = KafkaSink(kafka_bootstrap, topics["events"], topics["dead_letters"])
    logs = [tmp_path / "w1.log", tmp_path / "w2.log"]
    w1 = worker(kafka_bootstrap, topics["prefix"], tmp_path / "w1", logs[0])
    w2 = worker(kafka_bootstrap, topics["prefix"], tmp_path / "w2", logs[1])
    try:
        both_assigned(kafka_bootstrap, topics["prefix"] + "kvidx-worker", [w1, w2], logs)
        for m in MODELS:  # only now: with both workers in the group, each folds some of the models
            play_recording(LLAMA / "frames.jsonl", m, sink, 16, replica="llama")
        n_llama = sum(1 for _ in read_frames(LLAMA / "frames.jsonl")) + 1
        snapshots_cover(kafka_bootstrap, topics["snapshots"], n_llama, [w1, w2], logs)
        assert "shard_loaded" in open(logs[0]).read() and "shard_loaded" in open(logs[1]).read(), \
            "both workers should own some models"
        loaded_before = open(logs[1]).read().count("shard_loaded")
        w1.send_signal(signal.SIGKILL)
        w1.wait()
        for m in MODELS:  # more events while one worker is dead
            play_recording(GEMMA / "frames.jsonl", m, sink, 16, replica="gemma")
        n_gemma = sum(1 for _ in read_frames(GEMMA / "frames.jsonl")) + 1
        shards = snapshots_cover(kafka_bootstrap, topics["snapshots"], n_llama + n_gemma, [w2], logs[1:])
    finally:
        stop_workers(w1, w2)
        sink.close()
    want = InProcessIndex("x", 16)
    frames = [(f, "llama") for f in read_frames(LLAMA / "frames.jsonl")]
    frames += [(f, "gemma") for f in read_frames(GEMMA / "frames.jsonl")]
    from kvidx.engines.vllm.relay import VllmPublisherRelay
    relays = {"llama": VllmPublisherRelay("x", "llama", 16), "gemma": VllmPublisherRelay("x", "gemma", 16)}
    for name, relay in relays.items():
        for f in sorted((f for f, n in frames if n == name), key=lambda f: f.recv_ns):
            for b in relay.on_frame(f).batches:
                want.shard.apply(b, 0.0)
    ps = prompts(LLAMA / "requests.jsonl")[::4] + prompts(GEMMA / "requests.jsonl")[::4]
    expected = answers(want.shard, ps)
    for m in MODELS:
        assert answers(shards[m], ps) == expected, m
    # w2 took w1's models over: it loaded them (from the compacted topic, or from its own RocksDB when
    # it had owned them before w1 joined and its copy is as new)
    assert open(logs[1]).read().count("shard_loaded") > loaded_before
