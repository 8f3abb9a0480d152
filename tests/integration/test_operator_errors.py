"""Operator errors that need a broker: the worker supervisor's configuration errors (a RocksDB another
worker holds, a web port in use) and a relay at a dead engine saying what it waits for. The broker-free
cases (unreachable broker, missing input files, SIGTERM) are in tests/unit/kvidx/test_operator_errors.py."""

import subprocess
import sys

import pytest

from tests.commands import Running, env, run
from tests.helpers import ROOT


@pytest.mark.kafka
def test_worker_configuration_errors_stop_the_supervisor(kafka_bootstrap, tmp_path):
    import socket

    from rocksdict import Rdict

    # a data dir whose RocksDB another worker holds
    (tmp_path / "w" / "shards").mkdir(parents=True)
    held = Rdict(str(tmp_path / "w" / "shards"))
    try:
        p = subprocess.run([sys.executable, "-m", "kvidx.cli", "worker", "--bootstrap", kafka_bootstrap,
                            "--data-dir", str(tmp_path / "w"), "--web-port", "0"],
                           cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
        out = p.stdout + p.stderr
        assert p.returncode == 2, out  # it stops (subprocess's timeout bounds a hang)
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
