"""`kvidx worker` runs its faust worker as a supervised child. Its supervisor killed with -9 must not
leave the child behind (it used to hang 2 min 24 s in faust's shutdown, holding its group membership
and the data dir's RocksDB lock), and a supervisor that finds its data dir locked waits for the lock
(it used to stop for good with "configuration_error")."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from kvidx.engines.recording import read_frames
from kvidx.kafka.local import _pid_alive
from relays.run import play_recording
from relays.sinks import KafkaSink
from tests.helpers import LLAMA, ROOT
from tests.integration.helpers import BS, stop_workers, wait_snapshots

BATCHES = sum(1 for _ in read_frames(LLAMA / "frames.jsonl")) + 1  # + the relay's start-up clear


def worker(bootstrap: str, prefix: str, data_dir: Path, log: Path, supervised: bool = True):
    args = [sys.executable, "-m", "kvidx.cli", "worker", "--bootstrap", bootstrap, "--topic-prefix", prefix,
            "--data-dir", str(data_dir), "--snapshot-interval", "0.5", "--web-port", "0",
            "--session-timeout", "6"]
    return subprocess.Popen(args + ([] if supervised else ["--no-supervise"]), cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def wait_line(log: Path, needle: str, proc, after: int = 0, timeout: float = 90.0) -> int:
    """Until `log` has a line with `needle` past byte `after`; returns where it ends."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        at = text.find(needle, after)
        if at >= 0:
            return at + len(needle)
        assert proc.poll() is None, f"exited {proc.returncode}:\n{text[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"no {needle!r} in {timeout}s:\n{log.read_text()[-3000:]}")


def feed(bootstrap: str, topics: dict) -> None:
    sink = KafkaSink(bootstrap, topics["events"], topics["dead_letters"])
    play_recording(LLAMA / "frames.jsonl", "tiny", sink, BS)
    assert sink.drain(60) == 0
    sink.close()


def keep_feeding(bootstrap: str, topics: dict, stop: threading.Event) -> None:
    """The recording again and again, as new replicas each time, until `stop`."""
    sink = KafkaSink(bootstrap, topics["events"], topics["dead_letters"])
    i = 0
    while not stop.is_set():
        play_recording(LLAMA / "frames.jsonl", "tiny", sink, BS, replica=f"stream-{i}")
        i += 1
    sink.close()


def test_a_worker_whose_supervisor_is_killed_stops(kafka_bootstrap, topics, tmp_path):
    """Killed while events stream in (folded, not yet acknowledged: faust's shutdown waited for them)."""
    feed(kafka_bootstrap, topics)
    log = tmp_path / "worker.log"
    sup = worker(kafka_bootstrap, topics["prefix"], tmp_path / "w", log)
    streaming = threading.Event()
    feeder = threading.Thread(target=keep_feeding, args=(kafka_bootstrap, topics, streaming), daemon=True)
    try:
        wait_snapshots(kafka_bootstrap, topics["snapshots"], {"tiny": BATCHES}, sup, log)
        (child,) = children(sup.pid)
        feeder.start()
        time.sleep(3)  # the worker folds the stream
        sup.send_signal(signal.SIGKILL)
        sup.wait()
        deadline = time.monotonic() + 30  # faust's graceful stop, or the child's own kill at 10 s
        while _pid_alive(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = _pid_alive(child)
        if alive:
            os.kill(child, signal.SIGKILL)
        assert not alive, f"the worker outlived its supervisor by 30 s:\n{log.read_text()[-3000:]}"
    finally:
        streaming.set()
        if feeder.is_alive():
            feeder.join(30)
        stop_workers(sup)

    # its successor on the same data dir starts at once (the lock went with the child)
    log2 = tmp_path / "worker2.log"
    sup2 = worker(kafka_bootstrap, topics["prefix"], tmp_path / "w", log2)
    try:
        wait_line(log2, "event=worker_waiting_for", sup2)
        assert "locked" not in log2.read_text()
    finally:
        stop_workers(sup2)


def test_a_supervisor_waits_for_a_locked_data_dir(kafka_bootstrap, topics, tmp_path):
    feed(kafka_bootstrap, topics)
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    a = worker(kafka_bootstrap, topics["prefix"], tmp_path / "w", log_a, supervised=False)
    b = None
    try:
        wait_snapshots(kafka_bootstrap, topics["snapshots"], {"tiny": BATCHES}, a, log_a)
        b = worker(kafka_bootstrap, topics["prefix"], tmp_path / "w", log_b)
        at = wait_line(log_b, f"(pid {a.pid}) (its RocksDB LOCK is held)", b)
        at = wait_line(log_b, "event=waiting what=worker", b, at)
        a.send_signal(signal.SIGKILL)  # the holder goes: the waiting supervisor's next child starts
        a.wait()
        wait_line(log_b, "event=worker_waiting_for", b, at)
        assert b.poll() is None, log_b.read_text()[-3000:]
    finally:
        stop_workers(*(p for p in (a, b) if p is not None))
