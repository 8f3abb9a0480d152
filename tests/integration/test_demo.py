"""`kvidx demo --kafka` as a newcomer runs it: exit 0, the agreement line, and no error line on a good
run (through Kafka the router used to ask before the index knew the model: a 404 logged). The
in-process demo is tests/unit/kvidx/test_demo.py."""

import pytest

from tests.commands import demo_agreement, run_demo


@pytest.mark.kafka
def test_demo_through_kafka_logs_no_404(kafka_bootstrap):
    p = run_demo("--kafka", "--bootstrap", kafka_bootstrap)
    assert p.returncode == 0, p.stderr
    assert demo_agreement(p.stdout)["recall"] >= 0.99
    assert "status=404" not in p.stderr, p.stderr
    assert "level=WARNING" not in p.stderr and "level=ERROR" not in p.stderr, p.stderr
