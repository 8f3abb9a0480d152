"""The fleet simulator's Kafka path (kvidx/sim/fleet.py with transport="kafka"): events through a
real broker agree exactly with the engines' reuse. The rest of the simulator:
tests/unit/kvidx/test_simulate.py."""

from __future__ import annotations

import pytest

from kvidx.sim.fleet import run_fleet
from tests.helpers import fleet_config as cfg


@pytest.mark.kafka
@pytest.mark.parametrize("groups", [1, 4])
def test_events_through_kafka_agree_exactly(kafka_bootstrap, topics, trace_reqs, groups):
    reqs = trace_reqs[:120]
    r = run_fleet(reqs, cfg(transport="kafka", bootstrap=kafka_bootstrap, topic_prefix=topics["prefix"],
                            replica_groups=groups, service_instances=2 if groups > 1 else 0), "kv")
    s = r.overall.summary()
    assert s["requests"] == len(reqs) and s["reused_tokens"] > 0
    assert s["recall"] == 1.0 and s["over_credit"] == 0.0, s
    assert r.counters["kafka_wait_timeouts"] == 0
    if groups > 1:  # every lookup through a partial instance merged like the full instance's answer
        assert r.counters["fanout_lookups"] > len(reqs) * 0.9 and r.counters["fanout_mismatches"] == 0
        assert [i["groups"] for i in r.counters["instances"]] == [[0, 2], [1, 3]]
        assert all(i["entries"] for i in r.counters["instances"])
        # the same instances as `kvidx serve --groups` processes (kvidx.sim.census): they reached the
        # in-process instances' index, and the run's last lookups through them over HTTP (each fanned
        # out to the other) answered as the full index does
        assert all(i["rss_bytes"] > 10 << 20 for i in r.counters["instances"])
        assert r.counters["fanout_http_lookups"] > 50 and r.counters["fanout_http_mismatches"] == 0
        assert r.counters["fanout_http_partial"] == 0
        assert 0 < r.counters["fanout_http_lookup_us"]["p50"] <= r.counters["fanout_http_lookup_us"]["p99"]
    if groups > 1:  # the batches went under the groups' keys, to distinct partitions
        from confluent_kafka import Consumer

        c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "keys",
                      "auto.offset.reset": "earliest"})
        c.subscribe([topics["events"]])
        keys: dict[bytes, set[int]] = {}
        for _ in range(20):
            for m in c.consume(1000, 0.5):
                if not m.error():
                    keys.setdefault(m.key(), set()).add(m.partition())
        c.close()
        assert len(keys) > 1 and all(len(p) == 1 for p in keys.values())  # a key stays in one partition
        by_model: dict[bytes, list[int]] = {}
        for k, p in keys.items():
            by_model.setdefault(k.split(b"#")[0], []).extend(p)
        assert all(len(set(p)) == len(p) for p in by_model.values())  # a model's groups: distinct partitions


@pytest.mark.kafka
@pytest.mark.timeout(600)
def test_a_rolling_restart_of_every_worker_and_instance_loses_nothing(kafka_bootstrap, topics, trace_reqs):
    """Two real workers and two partial instances, each restarted once during the run (an instance
    only takes lookups once rebuilt and caught up): no lookup answered blind, no credit lost, and
    every merged answer the full instance's."""
    reqs = trace_reqs[:300]
    r = run_fleet(reqs, cfg(transport="kafka", bootstrap=kafka_bootstrap, topic_prefix=topics["prefix"],
                            replica_groups=4, service_instances=2, rolling_restart=True), "kv")
    c = r.counters
    assert c["rolling_restart"]["restarted_workers"] == 2 and c["rolling_restart"]["restarted_instances"] == 2
    assert c["blind_lookups"] == 0 and c["credit_lost_tokens"] == 0 and c["fanout_mismatches"] == 0
    assert r.overall.summary()["reused_tokens"] > 0
