"""Nothing acknowledged is lost: the worker is SIGKILLed at 21 random points of a live stream (before
it joined the group, mid-fold, between a commit and a snapshot, during catch-up), restarted each time
(mostly on its RocksDB, sometimes on an empty data dir, as on a new machine), and afterwards both the
compacted snapshots alone and a fresh service instance answer exactly as an in-process fold of the
whole stream."""

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from index_service.store import ShardStore
from kvidx.core import walk
from kvidx.core.hashing import prompt_hashes
from kvidx.kafka.snapshots import read_snapshots
from kvidx.shadow import load_requests
from relays.run import play_recording
from relays.sinks import KafkaSink
from tests.helpers import GEMMA, LLAMA, ROOT, ListSink
from tests.integration.helpers import fresh_service

pytestmark = pytest.mark.kafka
BS = 16
KILLS = 21
SNAPSHOT_INTERVAL = 1.5  # longer than faust's 1 s commit interval: a commit ahead of a snapshot shows


def the_stream():
    """Batches of 4 llama replicas and 2 gemma (sliding window) replicas, interleaved round robin
    (each replica's batches stay in order, as Kafka keeps them)."""
    per_replica = []
    for model, rec, n in (("tiny", LLAMA, 4), ("gemma", GEMMA, 2)):
        for i in range(n):
            sink = ListSink()
            play_recording(rec / "frames.jsonl", model, sink, BS, replica=f"{model}-{i}")
            assert not sink.dead, "the recordings are well formed"
            per_replica.append(sink.batches)
    out = []
    while any(per_replica):
        for lst in per_replica:
            if lst:
                out.append(lst.pop(0))
    return out


def answers(shards, prompts):
    out = {}
    for model, plist in prompts.items():
        shard = shards[model]
        out[model] = [sorted((a.replica, a.cached_tokens, a.resumable_tokens)
                             for a in walk.lookup(shard, prompt_hashes(p, BS), len(p), time.time()))
                      for p in plist]
        out[model].append(sorted((r, st.seq, st.blocks) for r, st in shard.replicas.items()))
    return out


def start_worker(bootstrap, prefix, data_dir, log):
    return subprocess.Popen(
        [sys.executable, "-m", "kvidx.cli", "worker", "--bootstrap", bootstrap, "--topic-prefix", prefix,
         "--data-dir", str(data_dir), "--snapshot-interval", str(SNAPSHOT_INTERVAL), "--web-port", "0",
         "--session-timeout", "2", "--no-supervise"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)


def test_worker_killed_at_random_points_loses_nothing(kafka_bootstrap, topics, tmp_path):
    stream = the_stream()
    expected = ShardStore(BS)
    for b in stream:
        expected.apply(b, b.engine_ts)
    prompts = {"tiny": [r["prompt_token_ids"] for r in load_requests(LLAMA / "requests.jsonl")],
               "gemma": [r["prompt_token_ids"] for r in load_requests(GEMMA / "requests.jsonl")]}
    want = answers(expected.shards, prompts)
    assert any(c for a in want["tiny"][:-1] for (_, c, _) in a), "the stream must have hits"

    sink = KafkaSink(kafka_bootstrap, topics["events"], topics["dead_letters"])
    done = threading.Event()

    def produce():  # paced so that the stream runs through most of the kill points
        for i, b in enumerate(stream):
            sink.publish(b)
            if i % 10 == 9:
                sink.flush(10)
                time.sleep(0.35)
        sink.flush(30)
        done.set()

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    rng = random.Random(20261201)
    log = open(tmp_path / "workers.log", "w")
    data_dir = tmp_path / "w0"
    try:
        for k in range(KILLS):
            if k % 5 == 4:  # now and then a new machine: an empty data dir, rebuild from the topic
                data_dir = tmp_path / f"w{k}"
            w = start_worker(kafka_bootstrap, topics["prefix"], data_dir, log)
            time.sleep(rng.uniform(0.5, 7.0))
            assert w.poll() is None, f"worker {k} died:\n{(tmp_path / 'workers.log').read_text()[-3000:]}"
            w.send_signal(signal.SIGKILL)
            w.wait()
        producer.join(120)
        assert done.is_set() and sink.errors == 0

        # the last worker catches up and snapshots everything; then it is killed too
        w = start_worker(kafka_bootstrap, topics["prefix"], data_dir, log)
        want_batches = {m: sum(st.batches for st in s.replicas.values()) for m, s in expected.shards.items()}
        deadline = time.monotonic() + 120
        shards = {}
        while time.monotonic() < deadline:
            assert w.poll() is None, f"last worker died:\n{(tmp_path / 'workers.log').read_text()[-3000:]}"
            shards = read_snapshots(kafka_bootstrap, topics["snapshots"])
            if all(m in shards and sum(st.batches for st in shards[m].replicas.values()) >= n
                   for m, n in want_batches.items()):
                break
            time.sleep(0.5)
        w.send_signal(signal.SIGKILL)
        w.wait()
        got = {m: sum(st.batches for st in s.replicas.values()) for m, s in shards.items()}
        assert got == want_batches, "the compacted snapshots lack acknowledged batches"
        assert answers(shards, prompts) == want

        # a fresh service instance rebuilds from the snapshots plus the events after them
        store = ShardStore(BS)
        with fresh_service(store, kafka_bootstrap, topics):
            assert answers(store.shards, prompts) == want
    finally:
        done.set()
        log.close()
        sink.close()
