"""Reading the Kafka history (kvidx/kafka/log.py) without a broker: the times `--from`, `--until`
and friends accept. Over a real broker: tests/integration/test_replay.py."""

import pytest

from kvidx.kafka.log import parse_time


def test_parse_time():
    assert parse_time("1764500000.5") == 1764500000.5
    assert parse_time("2025-11-30T10:53:20Z") == 1764500000.0
    assert parse_time("2025-11-30T11:53:20+01:00") == 1764500000.0
    assert parse_time("2025-11-30T10:53:20") == 1764500000.0  # no zone: UTC
    assert parse_time("-15m", now=1000.0) == 100.0
    assert parse_time("now", now=5.0) == 5.0
    with pytest.raises(ValueError):
        parse_time("yesterday-ish")
