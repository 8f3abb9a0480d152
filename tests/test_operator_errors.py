"""An operator's mistakes get one clear line within seconds, never a traceback or a silent wait: every
command with an unreachable broker and with a missing input file, the kafka commands from another
directory, and the worker supervisor's configuration errors and SIGTERM."""

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from conftest import LLAMA, ROOT

DEAD = "127.0.0.1:1"  # nothing listens on port 1: connection refused at once
LIMIT_S = 10.0


def env(**extra):
    e = dict(os.environ, PYTHONPATH=str(ROOT), **extra)
    e.pop("KAFKA_BOOTSTRAP_SERVERS", None)
    return e


def run(args, cwd=ROOT, **extra):
    """A one-shot command: exits non-zero within LIMIT_S; returns its output."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "kvidx.cli", *args], cwd=cwd, env=env(**extra),
                       capture_output=True, text=True, timeout=LIMIT_S + 20)
    took = time.monotonic() - t0
    out = p.stdout + p.stderr
    assert p.returncode != 0, f"{args} exited 0:\n{out}"
    assert took < LIMIT_S, f"{args} took {took:.1f}s:\n{out}"
    assert "Traceback" not in out, out
    return out


class Running:
    """A long-running command: its output, line by line, as it comes."""

    def __init__(self, args, **extra):
        self.proc = subprocess.Popen([sys.executable, "-m", "kvidx.cli", *args], cwd=ROOT, env=env(**extra),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_line(self, *needles, timeout=LIMIT_S) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                if all(n in line for n in needles):
                    return line
            time.sleep(0.05)
        raise AssertionError(f"no line with {needles} in {timeout}s:\n{''.join(self.lines)}")

    def stop(self, sig=signal.SIGTERM, timeout=10.0) -> float:
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"did not stop in {timeout}s:\n{''.join(self.lines)}") from None
        self.reader.join(5)
        return time.monotonic() - t0

    def output(self) -> str:
        return "".join(self.lines)


FRAMES = str(LLAMA / "frames.jsonl")
REQUESTS = str(LLAMA / "requests.jsonl")
ONE_SHOT_UNREACHABLE = [
    ["relay", "--model", "m", "--play", FRAMES],
    ["replay", "--model", "m", "--until", "now"],
    ["checkpoint"],
    ["audit", "--from", "-1d"],
    ["feedback"],
    ["resync", "--model", "m"],
    ["demo", "--kafka"],
    ["simulate", "--kafka"],
]


@pytest.mark.parametrize("args", ONE_SHOT_UNREACHABLE, ids=lambda a: a[0])
def test_one_shot_commands_name_the_unreachable_broker(args):
    out = run([*args, "--bootstrap", DEAD])
    assert f"cannot reach Kafka at {DEAD}" in out and "connection refused" in out, out
    assert len([ln for ln in out.splitlines() if ln.strip()]) <= 3, out  # not 194 librdkafka lines


def test_no_bootstrap_at_all_is_one_line():
    out = run(["replay", "--model", "m", "--until", "now"])
    assert "KAFKA_BOOTSTRAP_SERVERS" in out and len(out.strip().splitlines()) == 1, out


@pytest.mark.parametrize("args", [
    ["relay", "--model", "m", "--endpoint", "tcp://127.0.0.1:5557"],
    ["serve", "--port", "0"],
    ["worker", "--web-port", "0"],
], ids=lambda a: a[0])
def test_services_say_which_broker_they_wait_for_and_stop_on_sigterm(args, tmp_path):
    extra = ["--data-dir", str(tmp_path / "w")] if args[0] == "worker" else []
    r = Running([*args, *extra, "--bootstrap", DEAD])
    try:
        line = r.wait_line("event=broker_unreachable", DEAD)
        assert "connection refused" in line
        r.wait_line("event=broker_unreachable", "attempt=2", timeout=LIMIT_S)  # keeps trying, says so
    finally:
        took = r.stop()
    assert took < 3.0, f"SIGTERM took {took:.1f}s:\n{r.output()}"
    assert "Traceback" not in r.output(), r.output()
    if args[0] == "worker":  # no second child was started after the SIGTERM
        assert r.output().count("event=worker_start") == 1, r.output()


def test_serve_healthz_says_why_it_is_not_ready():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = Running(["serve", "--port", str(port), "--bootstrap", DEAD])
    try:
        r.wait_line("event=serving", f":{port}")
        r.wait_line("event=broker_unreachable")
        deadline = time.monotonic() + LIMIT_S
        while True:  # the ready line comes as uvicorn binds: give it the moment it takes
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5)
                raise AssertionError("/healthz answered 200 without a broker")
            except urllib.error.HTTPError as e:
                assert e.code == 503
                assert f"cannot reach Kafka at {DEAD}" in e.read().decode()
                break
            except urllib.error.URLError:
                assert time.monotonic() < deadline, "the service does not listen"
                time.sleep(0.05)
    finally:
        r.stop()


@pytest.mark.parametrize("args,path", [
    (["relay", "--model", "m", "--play", "/nonexistent/frames.jsonl"], "/nonexistent/frames.jsonl"),
    (["relay", "--model", "m", "--play", REQUESTS], REQUESTS),
    (["replay", "--model", "m", "--until", "now", "--prompts", "/nonexistent/p.json"], "/nonexistent/p.json"),
    (["serve", "--auth-token-file", "/nonexistent/token"], "/nonexistent/token"),
    (["shadow", "--recording", "/nonexistent/f.jsonl", "--requests", REQUESTS], "/nonexistent/f.jsonl"),
    (["shadow", "--recording", FRAMES, "--requests", "/nonexistent/r.jsonl"], "/nonexistent/r.jsonl"),
    (["shadow", "--engine", "trtllm", "--recording", FRAMES, "--requests", REQUESTS], FRAMES),
    (["shadow", "--engine", "sglang", "--recording", FRAMES, "--requests", REQUESTS], FRAMES),
    (["relay", "--engine", "sglang", "--model", "m", "--play", FRAMES], FRAMES),
], ids=["relay-missing", "relay-requests-log", "replay-prompts", "serve-token", "shadow-recording",
        "shadow-requests", "shadow-trtllm-on-vllm", "shadow-sglang-on-vllm", "relay-sglang-on-vllm"])
def test_bad_input_files_are_named(args, path):
    # the broker is unreachable too: the file is checked first, before anything touches Kafka
    bootstrap = ["--bootstrap", DEAD] if args[0] in ("relay", "replay", "serve") else []
    out = run([*args, *bootstrap])
    assert path in out and out.startswith("error:"), out
    assert len(out.strip().splitlines()) == 1, out
    if "sglang" in args:
        assert "use --engine vllm" in out, out


def test_kafka_status_and_down_from_another_directory(tmp_path):
    state = tmp_path / "state"
    for cmd in ("status", "down"):
        out = run(["kafka", cmd], cwd=tmp_path, KVIDX_STATE_DIR=str(state))
        assert str(state) in out, out


@pytest.mark.kafka
def test_worker_configuration_errors_stop_the_supervisor(kafka_bootstrap, tmp_path):
    import socket

    from rocksdict import Rdict

    # a data dir whose RocksDB another worker holds
    (tmp_path / "w" / "shards").mkdir(parents=True)
    held = Rdict(str(tmp_path / "w" / "shards"))
    try:
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "kvidx.cli", "worker", "--bootstrap", kafka_bootstrap,
                            "--data-dir", str(tmp_path / "w"), "--web-port", "0"],
                           cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
        out = p.stdout + p.stderr
        assert p.returncode == 2 and time.monotonic() - t0 < 20, out
        assert "is in use by another worker" in out and str(tmp_path / "w") in out, out
        assert "Traceback" not in out and out.count("event=worker_start") == 1, out
    finally:
        held.close()
    # a web port in use
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = run(["worker", "--bootstrap", kafka_bootstrap, "--data-dir", str(tmp_path / "w2"),
                   "--web-port", str(port)])
        assert f"port {port} is in use" in out and "--web-port" in out, out


@pytest.mark.kafka
def test_relay_at_a_dead_engine_says_what_it_waits_for(kafka_bootstrap):
    r = Running(["relay", "--model", "m", "--endpoint", "tcp://127.0.0.1:1", "--bootstrap", kafka_bootstrap,
                 "--topic-prefix", "deadengine.", "--status-interval", "1"])
    try:
        start = r.wait_line("event=relay_start", "tcp://127.0.0.1:1")
        assert "waiting_for" in start
        status = r.wait_line("event=relay_status", "frames=0")
        assert "last_event_age_s=none" in status and "tcp://127.0.0.1:1" in status
    finally:
        r.stop()
    assert "Traceback" not in r.output()
