"""On a replicated cluster, the way production runs Kafka: three KRaft nodes (a controller quorum of 3,
`default.replication.factor` 3, `min.insync.replicas` 2) started from Kafka's jars for this module.

- every topic kvidx creates takes the cluster's replication (it used to be created with one replica,
  whatever the cluster), and one made earlier with fewer replicas is reported;
- `kvidx relay --play` through a paused partition leader delivers every batch, or exits 1 naming the
  count it could not deliver (it used to exit 0 with the recording lost);
- a relay started while the active controller is killed, or while two brokers hang (no quorum),
  waits it out (it used to exit after ~30 s with a traceback).
"""

import json
import os
import subprocess
import sys
import threading
import time
import uuid

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

from index_service.store import ShardStore
from kvidx.core.groups import shard_key
from kvidx.engines.recording import read_frames
from kvidx.kafka.cluster import LocalKafkaCluster
from kvidx.kafka.topics import create_topics, ensure_topics, partition_for
from schemas.events import topic_names
from tests.helpers import LLAMA, ROOT
from tests.integration.helpers import BS, answers, expected_shard, fresh_service, prompts

FRAMES = LLAMA / "frames.jsonl"
PLAYED = sum(1 for _ in read_frames(FRAMES))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalKafkaCluster(3) as c:
        c.start(tmp_path_factory.mktemp("cluster"))
        yield c


def fresh_names() -> dict[str, str]:
    prefix = f"r{uuid.uuid4().hex[:8]}."
    names = topic_names(prefix)
    names["prefix"] = prefix
    return names


def relay_play(bootstrap: str, names: dict, model: str, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("KVIDX_TOPIC_REPLICATION", None)
    return subprocess.run(
        [sys.executable, "-m", "kvidx.cli", "relay", "--bootstrap", bootstrap, "--topic-prefix",
         names["prefix"], "--model", model, "--play", str(FRAMES), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def topic_settings(bootstrap: str, topic: str) -> tuple[set[int], int]:
    """(the replica counts of its partitions, its effective min.insync.replicas)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + 30
    while True:  # a new topic's metadata reaches every broker within moments
        try:
            md = admin.list_topics(topic, timeout=10).topics[topic]
            res = ConfigResource(ResourceType.TOPIC, topic)
            isr = int(admin.describe_configs([res])[res].result(10)["min.insync.replicas"].value)
            if md.error is None and md.partitions:
                return {len(p.replicas) for p in md.partitions.values()}, isr
        except Exception:  # noqa: BLE001 - UNKNOWN_TOPIC_OR_PART until the metadata is there
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def delivered_answers(cluster, names: dict, model: str) -> None:
    """A fresh service on the cluster answers the recording exactly as the in-process fold of it."""
    want = expected_shard(FRAMES, model)
    asked = prompts(LLAMA / "requests.jsonl")
    with fresh_service(ShardStore(BS), cluster.bootstrap, names, timeout=120) as store:
        assert answers(store.shards[model], asked) == answers(want, asked)


def test_topics_take_the_clusters_replication(cluster):
    names = fresh_names()
    repl = ensure_topics(cluster.bootstrap, {k: v for k, v in names.items() if k != "prefix"})
    assert (repl.factor, repl.brokers) == (3, 3)
    for key, topic in names.items():
        if key == "prefix":
            continue
        assert topic_settings(cluster.bootstrap, topic) == ({3}, 2), topic


def test_a_workers_topics_and_fausts_take_it_too(cluster, tmp_path):
    """`kvidx worker` on the cluster: its topics and the ones faust makes itself (its assignor's) all
    have 3 replicas, as `kvidx kafka topics` reports."""
    from kvidx.kafka.topics import topic_report

    names = fresh_names()
    log = tmp_path / "worker.log"
    w = subprocess.Popen([sys.executable, "-m", "kvidx.cli", "worker", "--bootstrap", cluster.bootstrap,
                          "--topic-prefix", names["prefix"], "--data-dir", str(tmp_path / "w"),
                          "--web-port", "0", "--no-supervise"], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=open(log, "w"),
                         stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert w.poll() is None, log.read_text()[-3000:]
            repl, rows = topic_report(cluster.bootstrap, names["prefix"])
            faust = [r for r in rows if r["topic"].startswith(names["prefix"] + "kvidx-worker")]
            if faust and all(r["ok"] for r in rows):
                break
            assert time.monotonic() < deadline, (rows, log.read_text()[-3000:])
            time.sleep(1)
    finally:
        w.terminate()
        w.wait(60)
    assert {r["replicas"] for r in rows} == {3} and {r["min_insync"] for r in rows} == {2}, rows


def test_a_topic_with_fewer_replicas_is_reported(cluster, caplog, monkeypatch):
    names = fresh_names()
    monkeypatch.setenv("KVIDX_TOPIC_REPLICATION", "1")  # an operator's earlier deployment
    create_topics(cluster.bootstrap, [names["events"]])
    monkeypatch.delenv("KVIDX_TOPIC_REPLICATION")
    with caplog.at_level("WARNING", logger="kvidx.kafka"):
        create_topics(cluster.bootstrap, [names["events"]])
    assert any("event=topic_under_replicated" in r.getMessage() and names["events"] in r.getMessage()
               and "replicas=1 asked=3" in r.getMessage() for r in caplog.records)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "kvidx.cli", "kafka", "topics", "--bootstrap",
                          cluster.bootstrap, "--topic-prefix", names["prefix"]], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith(names["events"]))
    assert "UNDER-REPLICATED (asked 3)" in line, out.stdout
    assert "cluster: 3 broker(s); asked: 3 replicas" in out.stdout


def _events_leader(cluster, names: dict, model: str) -> int:
    partition = partition_for(shard_key(model, 0).encode(), 4)
    return cluster.leader(names["events"], partition)


def _settled(cluster, names: dict, model: str, timeout_s: float = 60.0) -> None:
    """Until every broker is back in the events partition's in-sync set: a resumed ex-leader answers
    with its old high watermark for a moment (a follower started then can take the end for 0; the
    follower's part, not this test's, noted in the stop's issue note)."""
    partition = partition_for(shard_key(model, 0).encode(), 4)
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        p = admin.list_topics(names["events"], timeout=10).topics[names["events"]].partitions[partition]
        if len(p.isrs) == len(p.replicas):
            return
        time.sleep(0.5)
    raise AssertionError(f"partition {partition} of {names['events']} never back in sync")


def test_play_through_a_paused_leader_delivers_every_batch(cluster):
    """The events partition's leader hangs for 30 s while the recording is played: the relay waits for
    the new leader and delivers everything (exit 0), and a fresh service answers as on one broker."""
    names = fresh_names()
    ensure_topics(cluster.bootstrap, {k: v for k, v in names.items() if k != "prefix"})
    leader = _events_leader(cluster, names, "tiny")
    cluster.pause(leader)
    resume = threading.Timer(30.0, cluster.resume, (leader,))
    resume.start()
    try:
        out = relay_play(cluster.bootstrap, names, "tiny")
    finally:
        resume.join()
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["played_frames"] == PLAYED and summary["undelivered"] == 0, summary
    _settled(cluster, names, "tiny")
    delivered_answers(cluster, names, "tiny")


def test_play_that_cannot_deliver_exits_non_zero_with_the_count(cluster, monkeypatch):
    """Kafka cannot acknowledge the batches within the relay's deadline (the events topic wants all 3
    replicas in sync and a follower hangs): exit 1, naming how many were not delivered, in one line
    (the relay used to print delivery_errors 0 and exit 0 with nothing in Kafka)."""
    names = fresh_names()
    monkeypatch.setenv("KVIDX_MIN_INSYNC_REPLICAS", "3")
    ensure_topics(cluster.bootstrap, {k: v for k, v in names.items() if k != "prefix"})
    monkeypatch.delenv("KVIDX_MIN_INSYNC_REPLICAS")
    leader, controller = _events_leader(cluster, names, "tiny"), cluster.active_controller()
    follower = next(n for n in cluster.nodes if n not in (leader, controller))
    cluster.pause(follower)
    try:
        out = relay_play(cluster.bootstrap, names, "tiny", "--deliver-timeout", "5")
    finally:
        cluster.resume(follower)
    assert out.returncode == 1 and out.stdout.strip(), out.stdout + out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["undelivered"] > 0, summary
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and f"{summary['undelivered']} of " in errors[0], out.stderr
    assert "Traceback" not in out.stderr


def test_relay_started_during_a_controller_failover(cluster):
    """The active controller is killed as a relay starts (its topics are still to be made): the relay
    waits the failover out and delivers, or exits with one line; never a traceback or a silent 0."""
    names = fresh_names()
    controller = cluster.active_controller()
    cluster.kill(controller)
    back = threading.Timer(5.0, cluster.restart, (controller,))  # a crashed node, restarted by its unit
    back.start()
    try:
        out = relay_play(cluster.bootstrap, names, "tiny")
    finally:
        back.join()
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["undelivered"] == 0, summary
    delivered_answers(cluster, names, "tiny")


def test_relay_started_while_two_brokers_hang(cluster):
    """Two of the three nodes hang for 40 s as a relay starts with its topics still to be made: no
    controller quorum, so no topic can be created until they come back. The relay waits it out, one
    line per attempt, and delivers everything (it used to exit after 30 s with a traceback)."""
    names = fresh_names()
    hung = [cluster.active_controller()]
    hung.append(hung[0] % 3 + 1)
    for node in hung:
        cluster.pause(node)
    resume = threading.Timer(40.0, lambda: [cluster.resume(n) for n in hung])
    resume.start()
    try:
        out = relay_play(cluster.bootstrap, names, "tiny")
    finally:
        resume.join()
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 0, out.stdout + out.stderr
    assert "event=kafka_admin_retry" in out.stderr, out.stderr  # it did have to wait
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["undelivered"] == 0, summary
    delivered_answers(cluster, names, "tiny")
