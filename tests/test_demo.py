"""`kvidx demo` as a newcomer runs it: exit 0, the agreement line, and no error line on a good run
(through Kafka the router used to ask before the index knew the model: a 404 logged)."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT


def _demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvidx.cli", "demo", "--requests", "40", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)


def _agreement(stdout: str) -> dict:
    line = next(x for x in stdout.splitlines() if x.startswith("[demo] agreement"))
    return json.loads(line.split(": ", 1)[1])


def test_demo_in_process():
    p = _demo()
    assert p.returncode == 0, p.stderr
    assert _agreement(p.stdout)["requests"] == 40
    assert "404" not in p.stderr and "level=WARNING" not in p.stderr and "level=ERROR" not in p.stderr


@pytest.mark.kafka
def test_demo_through_kafka_logs_no_404(kafka_bootstrap):
    p = _demo("--kafka", "--bootstrap", kafka_bootstrap)
    assert p.returncode == 0, p.stderr
    assert _agreement(p.stdout)["recall"] >= 0.99
    assert "status=404" not in p.stderr, p.stderr
    assert "level=WARNING" not in p.stderr and "level=ERROR" not in p.stderr, p.stderr
