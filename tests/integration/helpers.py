"""Helpers of the broker tests (imported as `tests.integration.helpers`): the in-process fold of a
recording to compare with, the answers a lookup gives, a faust worker in a subprocess and the wait for
its snapshots, and waiting until a fresh topic's partitions have leaders."""

import contextlib
import os
import subprocess
import sys
import time

from kvidx.core import walk
from kvidx.core.hashing import prompt_hashes
from kvidx.engines.recording import read_frames
from kvidx.kafka.snapshots import read_snapshots
from kvidx.shadow import InProcessIndex, load_requests
from tests.helpers import ROOT

BS = 16


def expected_shard(recording, model):
    index = InProcessIndex(model, BS)
    for f in sorted(read_frames(recording), key=lambda f: f.recv_ns):
        index.feed(f)
    return index.shard


def prompts(requests_path):
    return [r["prompt_token_ids"] for r in load_requests(requests_path)]


def answers(shard, prompt_list):
    """What a lookup reports for each prompt: (replica, cached, resumable) per replica."""
    out = []
    for p in prompt_list:
        res = walk.lookup(shard, prompt_hashes(p, BS), len(p), time.time())
        out.append(sorted((a.replica, a.cached_tokens, a.resumable_tokens) for a in res))
    return out


def start_worker(bootstrap, prefix, data_dir, log_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "kvidx.cli", "worker", "--bootstrap", bootstrap, "--topic-prefix", prefix,
         "--data-dir", str(data_dir), "--snapshot-interval", "0.5", "--web-port", "0", "--no-supervise"],
        cwd=ROOT, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_snapshots(bootstrap, topic, want: dict[str, int], proc, log_path, timeout=90):
    """Until the compacted topic holds, for each model, a snapshot covering `want[model]` batches."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"worker died:\n{open(log_path).read()[-3000:]}"
        shards = read_snapshots(bootstrap, topic)
        if all(m in shards and sum(st.batches for st in shards[m].replicas.values()) >= n
               for m, n in want.items()):
            return shards
        time.sleep(0.5)
    raise AssertionError(f"no complete snapshot in {timeout}s:\n{open(log_path).read()[-3000:]}")


def ready(b, topics):
    from kvidx.kafka.log import consumer, offsets_at, partitions

    c = consumer(b, "test")
    try:
        for t in (topics["events"], topics["routes"]):
            offsets_at(c, t, partitions(c, t), time.time() - 60)
    finally:
        c.close()


@contextlib.contextmanager
def fresh_service(store, bootstrap: str, topics: dict, timeout: float = 60.0):
    """A new service instance's follower on `store`: rebuilt from the snapshots and the events after
    them (failing on the follower's error or a timeout), stopped afterwards."""
    from index_service.follower import KafkaFollower

    follower = KafkaFollower(store, bootstrap, topics["events"], topics["snapshots"]).start()
    try:
        deadline = time.monotonic() + timeout
        while not store.ready and time.monotonic() < deadline:
            assert follower.error is None, follower.error
            time.sleep(0.1)
        assert store.ready, "the fresh service did not catch up"
        yield store
    finally:
        follower.stop()


def group_worker(bootstrap, prefix, data_dir, log):
    """A worker that leaves the consumer group 6 s after it dies (a failover test's pace)."""
    return subprocess.Popen(
        [sys.executable, "-m", "kvidx.cli", "worker", "--bootstrap", bootstrap, "--topic-prefix", prefix,
         "--data-dir", str(data_dir), "--snapshot-interval", "0.5", "--web-port", "0",
         "--session-timeout", "6", "--no-supervise"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=open(log, "w"),
        stderr=subprocess.STDOUT, start_new_session=True)


def both_assigned(bootstrap, group: str, procs, logs, timeout=120) -> None:
    """Until the consumer group has two members that both own partitions of the events topic (so the
    test's events are split between the workers, whatever the machine's load)."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p, log in zip(procs, logs, strict=True):
            assert p.poll() is None, open(log).read()[-3000:]
        try:
            desc = admin.describe_consumer_groups([group])[group].result(10)
            owners = [m for m in desc.members if m.assignment and m.assignment.topic_partitions]
            if len(owners) == 2:
                return
        except Exception:  # noqa: BLE001 - the group does not exist yet
            pass
        time.sleep(0.5)
    raise AssertionError("the two workers were never both assigned partitions")


def stop_workers(*procs) -> None:
    """Terminate the worker processes still running, and wait for them; one still running after 60 s
    (a consumer leaving a group whose other member was killed can wait out the session) is killed, so
    a test's teardown does not fail a test that is about something else."""
    for w in procs:
        if w.poll() is None:
            w.terminate()
    for w in procs:
        try:
            w.wait(60)
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait(10)
