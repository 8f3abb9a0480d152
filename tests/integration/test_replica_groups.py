"""One model split in 4 replica groups (kvidx.core.groups) over a real broker: relays key each
replica's batches by its group, two faust workers fold and snapshot the groups they own, and a service
instance that merges the four group snapshots (or follows the topic) answers exactly like one shard
that folded everything in process; one holding groups 0 and 2 holds only their replicas. Then one
worker is killed, more events arrive, and the other takes its groups over with the same answers."""

import signal
import time

import pytest

from index_service.store import ShardStore
from kvidx.config import Config, ModelConfig
from kvidx.core.groups import hashed_group, shard_key
from kvidx.engines.recording import read_frames
from kvidx.kafka.snapshots import read_snapshots
from kvidx.kafka.topics import group_partition
from relays.run import play_recording
from relays.sinks import KafkaSink, StoreSink
from tests.helpers import LLAMA
from tests.integration.helpers import (
    answers,
    both_assigned,
    fresh_service,
    group_worker,
    prompts,
    stop_workers,
)

G = 4
MODEL = "m"


def _replicas(n_per_group: int) -> list[str]:
    """Replica names covering every group n times (the groups come from a hash of the name)."""
    out: dict[int, list[str]] = {g: [] for g in range(G)}
    i = 0
    while any(len(v) < n_per_group for v in out.values()):
        name = f"node-{i}:5557"
        g = hashed_group(name, G)
        if len(out[g]) < n_per_group:
            out[g].append(name)
        i += 1
    return sorted(r for v in out.values() for r in v)


def _expected(plays: list[tuple[str, object]]):
    """The one shard that folds every replica's recording in process, through the same relays."""
    store = ShardStore(16)
    for replica, path in plays:
        play_recording(path, MODEL, StoreSink(store), 16, replica=replica)
    return store.shards[MODEL]


def _recordings(tmp_path):
    """The llama recording whole and cut at a third and two thirds: replicas of one model that hold
    different blocks."""
    lines = (LLAMA / "frames.jsonl").read_text().splitlines(keepends=True)
    out = [LLAMA / "frames.jsonl"]
    for third in (1, 2):
        cut = tmp_path / f"llama_{third}_3.jsonl"
        cut.write_text("".join(lines[:len(lines) * third // 3]))
        out.append(cut)
    return out


def _snapshots(bootstrap, topic, want: dict[str, int], procs, logs, timeout=120):
    """Until every group's snapshot covers `want[replica]` batches of each of its replicas."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p, log in zip(procs, logs, strict=True):
            assert p.poll() is None, open(log).read()[-3000:]
        shards = read_snapshots(bootstrap, topic)
        held = {}
        for s in shards.values():
            held.update({rep: st.batches for (rep, _), st in s.replicas.items()})
        if all(held.get(r, 0) >= n for r, n in want.items()):
            return shards
        time.sleep(0.5)
    raise AssertionError("group snapshots incomplete:\n"
                         + "\n".join(open(log).read()[-2000:] for log in logs))


def _merged(shards, groups=None) -> ShardStore:
    store = ShardStore(16, groups=groups)
    for key in sorted(shards):
        store.put_group(shards[key])
    return store


@pytest.mark.timeout(600)
def test_four_groups_two_workers_answer_like_one_shard(kafka_bootstrap, topics, tmp_path):
    config = Config(models={MODEL: ModelConfig(replica_groups=G)})
    sink = KafkaSink(kafka_bootstrap, topics["events"], topics["dead_letters"],
                     replica_group=config.replica_group)
    reps = _replicas(2)
    recs = _recordings(tmp_path)
    first = [(r, recs[i % 3]) for i, r in enumerate(reps)]
    logs = [tmp_path / "w1.log", tmp_path / "w2.log"]
    w1 = group_worker(kafka_bootstrap, topics["prefix"], tmp_path / "w1", logs[0])
    w2 = group_worker(kafka_bootstrap, topics["prefix"], tmp_path / "w2", logs[1])
    # batches per play: the relay's start (a ReplicaCleared) and one per frame
    n_batches = {p: 1 + sum(1 for _ in read_frames(p)) for p in recs}
    ps = prompts(LLAMA / "requests.jsonl")
    try:
        both_assigned(kafka_bootstrap, topics["prefix"] + "kvidx-worker", [w1, w2], logs)
        for r, path in first:
            play_recording(path, MODEL, sink, 16, replica=r)
        want = {r: n_batches[p] for r, p in first}
        shards = _snapshots(kafka_bootstrap, topics["snapshots"], want, [w1, w2], logs)
        # one snapshot per group, each holding its group's replicas only, in distinct partitions
        assert sorted(shards) == sorted(shard_key(MODEL, g) for g in range(G))
        for key, s in shards.items():
            assert {rep for rep, _ in s.replicas} == {r for r in reps
                                                      if shard_key(MODEL, hashed_group(r, G)) == key}
            assert s.events_partition == group_partition(MODEL, s.replica_group, 4)
        assert "shard_loaded" in open(logs[0]).read() and "shard_loaded" in open(logs[1]).read(), \
            "both workers should own some groups"
        expected = answers(_expected(first), ps)
        assert sum(1 for row in expected for a in row if a[2]) > len(ps)  # prompts with hits on several
        assert answers(_merged(shards).shards[MODEL], ps) == expected
        with fresh_service(ShardStore(16), kafka_bootstrap, topics) as store:
            assert answers(store.shards[MODEL], ps) == expected
        with fresh_service(ShardStore(16, groups=frozenset({0, 2})), kafka_bootstrap, topics) as part:
            mine = {r for r in reps if hashed_group(r, G) in (0, 2)}
            assert {rep for rep, _ in part.shards[MODEL].replicas} == mine
            assert answers(part.shards[MODEL], ps) == [[a for a in row if a[0] in mine] for row in expected]

        w1.send_signal(signal.SIGKILL)  # its groups go to w2, which rebuilds them from the snapshots
        w1.wait()
        second = [(r, recs[i % 3]) for i, r in enumerate(reversed(reps))]
        for r, path in second:  # every replica's relay restarts and publishes another recording
            play_recording(path, MODEL, sink, 16, replica=r)
        for r, p in second:
            want[r] += n_batches[p]
        shards = _snapshots(kafka_bootstrap, topics["snapshots"], want, [w2], logs[1:])
    finally:
        stop_workers(w1, w2)
        sink.close()
    after = _expected(first + second)
    expected = answers(after, ps)
    assert answers(_merged(shards).shards[MODEL], ps) == expected
