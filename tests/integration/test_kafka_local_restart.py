"""`kvidx kafka up|down|status|reset` through the real CLI: nothing lost, nothing cryptic.

A broker killed with SIGKILL comes back on its port with every topic and message; status/down find
it from any working directory; down keeps the data and only reset (confirmed) deletes it; a missing
java is one line, not a traceback. Real brokers (one JVM per test), no mocks.
"""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvidx.kafka.local import _is_broker_pid, _pid_alive
from tests.helpers import ROOT

pytestmark = [
    pytest.mark.kafka,
    pytest.mark.skipif(shutil.which("java") is None, reason="needs java 17+"),
]

N = 40  # messages per topic


def kvidx_kafka(
    *args: str, cwd: Path = ROOT, env: dict[str, str] | None = None, timeout: float = 120, **kw
) -> subprocess.CompletedProcess:
    """Run `kvidx kafka ARGS` as a user would (own process, given cwd); no inherited state dir."""
    base = {k: v for k, v in os.environ.items() if k not in ("KVIDX_STATE_DIR", "XDG_STATE_HOME")}
    full_env = {**base, "PYTHONPATH": str(ROOT), **(env or {})}
    kw.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.run(
        [sys.executable, "-m", "kvidx.cli", "kafka", *args],
        cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout, **kw,
    )


def ok(res: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert res.returncode == 0, f"exit {res.returncode}\nstdout: {res.stdout}\nstderr: {res.stderr}"
    return res


def bootstrap_of(res: subprocess.CompletedProcess) -> str:
    """`up` prints a comment naming the bootstrap, then the export line (shell-ready)."""
    lines = res.stdout.splitlines()
    bootstrap = lines[0].removeprefix("# kafka serving at ")
    assert lines[1] == f"export KAFKA_BOOTSTRAP_SERVERS={bootstrap}", res.stdout
    return bootstrap


def state_of(kafka_dir: Path) -> dict:
    return json.loads((kafka_dir / "kafka.json").read_text())


def wait_gone(pid: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while _pid_alive(pid):
        assert time.monotonic() < deadline, f"pid {pid} still alive"
        time.sleep(0.05)


@pytest.fixture
def cleanup() -> Iterator[list[Path]]:
    """Kafka state dirs (the ".../kafka" dir) to stop after the test: `down`, then SIGKILL if needed."""
    dirs: list[Path] = []
    try:
        yield dirs
    finally:
        for d in dirs:
            pid = None
            with_state = (d / "kafka.json").exists()
            if with_state:
                pid = state_of(d).get("pid")
                kvidx_kafka("down", "--state-dir", str(d), timeout=60)
            if pid and _is_broker_pid(pid, d / "data" / "server.properties"):
                os.kill(pid, signal.SIGKILL)


def produce(bootstrap: str, topic: str, n: int = N) -> list[tuple[bytes, bytes]]:
    from confluent_kafka import Producer

    sent = [(f"k{i}".encode(), f"{topic}-v{i}".encode()) for i in range(n)]
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "log_level": 0})
    for k, v in sent:
        p.produce(topic, key=k, value=v)
    assert p.flush(30) == 0
    return sent


def create_topics(bootstrap: str, **topics: dict[str, str]) -> None:
    """name=config; 3 partitions each."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    futs = admin.create_topics([NewTopic(t, 3, 1, config=c) for t, c in topics.items()])
    for f in futs.values():
        f.result(timeout=30)


def topic_names(bootstrap: str) -> set[str]:
    from confluent_kafka.admin import AdminClient

    md = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0}).list_topics(timeout=20)
    return {t for t in md.topics if not t.startswith("__")}


def read_all(bootstrap: str, topic: str, timeout: float = 60.0) -> list[tuple[bytes, bytes]]:
    """Every message of every partition of `topic`, from offset 0 to the high watermark."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"read-{uuid.uuid4().hex[:8]}",
                  "enable.auto.commit": False, "log_level": 0})
    deadline = time.monotonic() + timeout
    try:
        while True:  # right after a restart the partitions may not have a leader yet
            try:
                parts = sorted(c.list_topics(topic, timeout=10).topics[topic].partitions)
                ends = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in parts}
                break
            except KafkaException:
                assert time.monotonic() < deadline, f"no watermarks for {topic}"
                time.sleep(0.5)
        assert parts, f"topic {topic} has no partitions"
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        pos = dict.fromkeys(parts, 0)
        got = []
        while any(pos[p] < ends[p] for p in parts):
            assert time.monotonic() < deadline, f"read {len(got)} of {sum(ends.values())} from {topic}"
            m = c.poll(0.5)
            if m is None or m.error():
                continue
            got.append((m.key(), m.value()))
            pos[m.partition()] = m.offset() + 1
        return got
    finally:
        c.close()


def topic_config(bootstrap: str, topic: str, key: str) -> str:
    from confluent_kafka.admin import AdminClient, ConfigResource

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    res = ConfigResource(ConfigResource.Type.TOPIC, topic)
    return admin.describe_configs([res])[res].result(timeout=20)[key].value


def test_up_after_sigkill_keeps_port_topics_and_messages(tmp_path, cleanup):
    d = tmp_path / "state"
    cleanup.append(d)
    bootstrap = bootstrap_of(ok(kvidx_kafka("up", "--state-dir", str(d))))
    create_topics(bootstrap, events={}, snapshots={"cleanup.policy": "compact"})
    sent = {t: produce(bootstrap, t) for t in ("events", "snapshots")}
    sent["auto"] = produce(bootstrap, "auto")  # auto-created on first produce

    pid = state_of(d)["pid"]
    os.kill(pid, signal.SIGKILL)  # a kill -9 / OOM: no clean shutdown
    wait_gone(pid)
    res = kvidx_kafka("status", "--state-dir", str(d))
    assert res.returncode == 1 and "not running" in res.stdout and str(d) in res.stdout

    again = bootstrap_of(ok(kvidx_kafka("up", "--state-dir", str(d))))
    assert again == bootstrap
    assert state_of(d)["pid"] != pid
    assert topic_names(bootstrap) >= set(sent)
    for topic, msgs in sent.items():
        assert sorted(read_all(bootstrap, topic)) == sorted(msgs), topic
    assert topic_config(bootstrap, "snapshots", "cleanup.policy") == "compact"


def test_a_three_broker_cluster_up_restart_down(tmp_path, cleanup):
    """`kvidx kafka up --brokers 3`: three brokers in the metadata, kvidx's topics at 3 replicas and
    min.insync.replicas 2; a node killed with -9 comes back with `up` (same addresses, messages kept);
    a different broker count on the same data is refused in one line; `down` stops every node."""
    from confluent_kafka.admin import AdminClient

    from kvidx.kafka.topics import ensure_topics
    from schemas.events import topic_names as deployment

    d = tmp_path / "state"
    cleanup.append(d)
    lines = ok(kvidx_kafka("up", "--brokers", "3", "--state-dir", str(d), timeout=240)).stdout.splitlines()
    bootstrap = lines[0].removeprefix("# 3 brokers serving at ")
    assert lines[1] == f"export KAFKA_BOOTSTRAP_SERVERS={bootstrap}" and bootstrap.count(",") == 2
    md = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0}).list_topics(timeout=20)
    assert len(md.brokers) == 3
    names = deployment("c.")
    ensure_topics(bootstrap, names)
    md = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0}).list_topics(timeout=20)
    for topic in names.values():
        assert {len(p.replicas) for p in md.topics[topic].partitions.values()} == {3}, topic
        assert topic_config(bootstrap, topic, "min.insync.replicas") == "2", topic
    sent = produce(bootstrap, names["events"])

    pids = [n["pid"] for n in state_of(d)["nodes"]]
    os.kill(pids[1], signal.SIGKILL)
    wait_gone(pids[1])
    assert kvidx_kafka("status", "--state-dir", str(d)).returncode == 1
    again = ok(kvidx_kafka("up", "--state-dir", str(d), timeout=240)).stdout.splitlines()[0]
    assert again == f"# 3 brokers serving at {bootstrap}"
    assert sorted(read_all(bootstrap, names["events"])) == sorted(sent)
    res = kvidx_kafka("up", "--brokers", "1", "--state-dir", str(d))
    assert res.returncode == 1 and res.stderr.startswith("error: "), res.stderr
    assert "--brokers 3" in res.stderr and "Traceback" not in res.stderr, res.stderr

    pids = [n["pid"] for n in state_of(d)["nodes"]]
    ok(kvidx_kafka("down", "--state-dir", str(d), timeout=60))
    for pid in pids:
        wait_gone(pid)
    assert kvidx_kafka("status", "--state-dir", str(d)).returncode == 1


def test_status_and_down_from_another_directory_keep_data(tmp_path, cleanup):
    env = {"KVIDX_STATE_DIR": str(tmp_path / "st")}
    kafka_dir = tmp_path / "st" / "kafka"
    cleanup.append(kafka_dir)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    bootstrap = bootstrap_of(ok(kvidx_kafka("up", env=env)))  # cwd: the repo
    sent = produce(bootstrap, "events")

    res = ok(kvidx_kafka("status", cwd=elsewhere, env=env))
    assert f"serving at {bootstrap}" in res.stdout
    pid = state_of(kafka_dir)["pid"]
    res = ok(kvidx_kafka("down", cwd=elsewhere, env=env))
    assert "data kept" in res.stderr
    wait_gone(pid)
    res = kvidx_kafka("status", cwd=elsewhere, env=env)
    assert res.returncode == 1 and "not running" in res.stdout and str(kafka_dir) in res.stdout
    assert (kafka_dir / "data" / "kraft-logs" / "meta.properties").is_file()

    assert bootstrap_of(ok(kvidx_kafka("up", cwd=elsewhere, env=env))) == bootstrap
    assert sorted(read_all(bootstrap, "events")) == sorted(sent)


def test_state_dir_is_per_user_and_missing_state_is_an_error(tmp_path):
    """No broker needed: where the state dir is, and what down/status say when nothing is there."""
    home = tmp_path / "home"
    cases = [
        ({"KVIDX_STATE_DIR": str(tmp_path / "k")}, tmp_path / "k" / "kafka"),
        ({"XDG_STATE_HOME": str(tmp_path / "xdg"), "HOME": str(home)}, tmp_path / "xdg" / "kvidx" / "kafka"),
        ({"HOME": str(home)}, home / ".local" / "state" / "kvidx" / "kafka"),
    ]
    for env, expected in cases:
        res = kvidx_kafka("down", cwd=tmp_path, env=env)
        assert res.returncode == 1, res
        assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: no broker state in "), res.stderr
        assert str(expected) in res.stderr
        res = kvidx_kafka("status", cwd=tmp_path, env=env)
        assert res.returncode == 1 and str(expected) in res.stdout, res
    res = kvidx_kafka("down", "--state-dir", str(tmp_path / "flag"), env=cases[0][0])
    assert res.returncode == 1 and str(tmp_path / "flag") in res.stderr
    assert not (tmp_path / "flag").exists() and not (tmp_path / "k").exists()  # looking creates nothing


def test_reset_needs_confirmation_then_wipes(tmp_path, cleanup):
    d = tmp_path / "state"
    cleanup.append(d)
    bootstrap = bootstrap_of(ok(kvidx_kafka("up", "--state-dir", str(d))))
    produce(bootstrap, "doomed", n=3)

    res = kvidx_kafka("reset", "--state-dir", str(d))  # stdin is /dev/null: no terminal
    assert res.returncode == 2, res
    assert res.stderr.count("\n") == 1 and "--yes" in res.stderr and "Traceback" not in res.stderr
    ok(kvidx_kafka("status", "--state-dir", str(d)))  # still serving, data untouched

    pid = state_of(d)["pid"]
    ok(kvidx_kafka("reset", "--state-dir", str(d), "--yes"))
    wait_gone(pid)
    assert not (d / "data").exists() and not (d / "kafka.json").exists()
    bootstrap = bootstrap_of(ok(kvidx_kafka("up", "--state-dir", str(d))))
    assert "doomed" not in topic_names(bootstrap)


def _reset_on_tty(state_dir: Path, answer: bytes) -> tuple[int, str]:
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvidx.cli", "kafka", "reset", "--state-dir", str(state_dir)],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdin=slave, stdout=slave, stderr=slave,
        )
        os.write(master, answer)  # waits in the tty's line buffer until input() reads it
        rc = proc.wait(timeout=60)
        out = b""
        while select.select([master], [], [], 0.2)[0]:
            try:
                out += os.read(master, 4096)
            except OSError:
                break
        return rc, out.decode(errors="replace")
    finally:
        os.close(master)
        os.close(slave)


def test_reset_asks_on_a_terminal(tmp_path):
    """The prompt, 'n' keeps the data, 'y' deletes it (a stopped broker's data: no JVM needed)."""
    d = tmp_path / "state"
    (d / "data" / "kraft-logs").mkdir(parents=True)
    (d / "data" / "kraft-logs" / "meta.properties").write_text("x\n")
    rc, out = _reset_on_tty(d, b"n\n")
    assert rc == 1 and f"delete all topics and messages of the broker at {d / 'data'}? [y/N]" in out, out
    assert (d / "data").exists()
    rc, out = _reset_on_tty(d, b"y\n")
    assert rc == 0, out
    assert not (d / "data").exists()


def test_up_moves_off_a_taken_port_and_keeps_data(tmp_path, cleanup):
    d = tmp_path / "state"
    cleanup.append(d)
    bootstrap = bootstrap_of(ok(kvidx_kafka("up", "--state-dir", str(d))))
    sent = produce(bootstrap, "events")
    old = state_of(d)
    ok(kvidx_kafka("down", "--state-dir", str(d)))

    squatters = []
    try:
        for port in (old["port"], old["controller_port"]):  # someone else took both ports meanwhile
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
            squatters.append(s)
        res = ok(kvidx_kafka("up", "--state-dir", str(d)))
    finally:
        for s in squatters:
            s.close()
    moved = bootstrap_of(res)
    assert moved != bootstrap
    line = [ln for ln in res.stderr.splitlines() if f"broker port {old['port']} is taken" in ln]
    assert len(line) == 1 and f"export KAFKA_BOOTSTRAP_SERVERS={moved}" in line[0], res.stderr
    assert f"by pid {os.getpid()}" in line[0]
    assert f"controller port {old['controller_port']} is taken" in res.stderr
    assert state_of(d)["bootstrap"] == moved
    assert sorted(read_all(moved, "events")) == sorted(sent)


def test_up_without_java_and_fetch_without_mvn_fail_in_one_line(tmp_path):
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    env = {"PATH": str(empty_bin), "KVIDX_STATE_DIR": str(tmp_path / "st")}
    base = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    res = subprocess.run(  # (the timeout bounds a hang; it is not a speed claim)
        [sys.executable, "-m", "kvidx.cli", "kafka", "up"], cwd=ROOT, capture_output=True, text=True,
        env={**base, "PYTHONPATH": str(ROOT), **env}, stdin=subprocess.DEVNULL, timeout=30,
    )
    assert res.returncode != 0
    out = res.stdout + res.stderr
    assert "Traceback" not in out
    assert out.count("\n") == 1 and out.startswith("error: ") and "java" in out and "JAVA_HOME" in out, out

    env["KVIDX_KAFKA_HOME"] = str(tmp_path / "jars")  # an empty jar cache: needs mvn
    res = kvidx_kafka("fetch", env=env, timeout=30)
    out = res.stdout + res.stderr
    assert res.returncode == 1 and "Traceback" not in out
    assert out.count("\n") == 1 and out.startswith("error: ") and "mvn" in out, out
