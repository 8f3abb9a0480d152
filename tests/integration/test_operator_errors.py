"""Operator errors that need a broker: the worker supervisor's configuration errors (a RocksDB another
worker holds: it waits; a web port in use: it stops) and a relay at a dead engine saying what it waits
for. The broker-free cases (unreachable broker, missing input files, SIGTERM) are in
tests/unit/kvidx/test_operator_errors.py."""


import pytest

from tests.commands import Running, run


@pytest.mark.kafka
def test_worker_configuration_errors(kafka_bootstrap, tmp_path):
    import os
    import socket

    from rocksdict import Rdict

    # a data dir whose RocksDB another worker holds: the supervisor says so, naming the holder, and
    # waits for the lock (a worker that is stopping frees it) instead of stopping for good
    (tmp_path / "w" / "shards").mkdir(parents=True)
    held = Rdict(str(tmp_path / "w" / "shards"))
    r = Running(["worker", "--bootstrap", kafka_bootstrap, "--data-dir", str(tmp_path / "w"),
                 "--web-port", "0"])
    try:
        line = r.wait_line("is in use by another worker", timeout=60)
        assert str(tmp_path / "w") in line and f"(pid {os.getpid()})" in line, line
        r.wait_line("event=waiting what=worker", timeout=30)
        held.close()
        held = None
        r.wait_line("event=worker_waiting_for", timeout=60)  # the lock freed: the worker runs
    finally:
        if held is not None:
            held.close()
        r.stop(timeout=30)
    assert "Traceback" not in r.output(), r.output()
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
