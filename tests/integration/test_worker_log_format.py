"""`kvidx worker` logs like every other command (`ts=... level=... logger=... message`), faust's,
aiokafka's and kvidx's own lines alike, not in faust's `[ts] [pid] [LEVEL]` format."""

import os
import re
import signal
import subprocess
import sys

import pytest

from tests.helpers import ROOT, wait_for

pytestmark = pytest.mark.kafka


def test_worker_lines_are_kvidx_lines(kafka_bootstrap, topics, tmp_path):
    log_path = tmp_path / "worker.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvidx.cli", "worker", "--bootstrap", kafka_bootstrap, "--topic-prefix",
             topics["prefix"], "--data-dir", str(tmp_path / "w"), "--web-port", "0", "--no-supervise"],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        wait_for(lambda: "partitions" in log_path.read_text() or proc.poll() is not None, 90,
                 "the worker to be assigned its partitions")
        assert proc.poll() is None, log_path.read_text()[-3000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    lines = log_path.read_text().splitlines()
    assert not [x for x in lines if re.match(r"\[\d{4}-\d\d-\d\d ", x)], "faust's own format"
    records = [x for x in lines if x.startswith("ts=")]
    assert any("logger=faust." in x for x in records) and any("logger=aiokafka" in x for x in records)
    assert all(re.match(r"ts=\S+ \S+ level=[A-Z]+ logger=\S+ ", x) for x in records)
