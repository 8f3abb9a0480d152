"""The fleet simulator's Kafka path (kvidx/sim/fleet.py with transport="kafka"): events through a
real broker agree exactly with the engines' reuse. The rest of the simulator:
tests/unit/kvidx/test_simulate.py."""

from __future__ import annotations

import pytest

from kvidx.sim.fleet import run_fleet
from tests.helpers import fleet_config as cfg


@pytest.mark.kafka
def test_events_through_kafka_agree_exactly(kafka_bootstrap, topics, trace_reqs):
    reqs = trace_reqs[:120]
    r = run_fleet(reqs, cfg(transport="kafka", bootstrap=kafka_bootstrap, topic_prefix=topics["prefix"]),
                  "kv")
    s = r.overall.summary()
    assert s["requests"] == len(reqs) and s["reused_tokens"] > 0
    assert s["recall"] == 1.0 and s["over_credit"] == 0.0, s
    assert r.counters["kafka_wait_timeouts"] == 0
