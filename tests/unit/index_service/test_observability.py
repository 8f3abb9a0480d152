"""The Prometheus series operators expect exist and mean what ops/README.md says, and the Grafana
dashboard (ops/grafana/kvidx-dashboard.json) queries only series the code exports.

Expected: events/s per replica (relay and index side), consumer lag (service and worker), freshness,
dead letters by reason, lookup latency, agreement (credited vs reused)."""

from __future__ import annotations

import json
import re
import time

import httpx
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

import relays.run  # noqa: F401  (registers the relay series)
import streams.worker as worker
from index_service.app import create_app
from tests.helpers import ROOT, ServerThread, seeded_store
from tests.helpers import SEEDED_MODEL as MODEL

DASHBOARD = ROOT / "ops" / "grafana" / "kvidx-dashboard.json"


def sample_names(families) -> set[str]:
    out = set()
    for f in families:
        if f.type == "counter":
            out |= {f.name + "_total", f.name + "_created"}
        elif f.type == "histogram":
            out |= {f.name + s for s in ("_bucket", "_sum", "_count", "_created")}
        else:
            out.add(f.name)
        out |= {s.name for s in f.samples}
    return out


def scrape(client: httpx.Client) -> dict[str, list]:
    text = client.get("/metrics").text
    fams = list(text_string_to_metric_families(text))
    samples: dict[str, list] = {}
    for f in fams:
        for s in f.samples:
            samples.setdefault(s.name, []).append(s)
    samples["__names__"] = sample_names(fams)  # type: ignore[assignment]
    return samples


def test_service_series():
    t0 = time.time()
    ets = t0 - 100.0  # the engine stamped the seeded batches 100 s before they were applied
    app = create_app(seeded_store(engine_ts=ets), max_tokens=4096)
    prompt = list(range(1000, 1000 + 10 * 16))
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        assert client.post("/v1/lookup", json={"model": MODEL, "token_ids": prompt}).status_code == 200
        assert client.post("/v1/lookup", json={"model": MODEL, "token_ids": [-1]}).status_code == 422
        r = client.post("/v1/routes", json={"request_id": "obs-1", "model": MODEL, "replica": "tcp://10.0.0.3:5557",
                                            "token_ids": prompt, "credited_tokens": 144})
        assert r.status_code == 202, r.text
        # the same decision again: a duplicate, not counted
        client.post("/v1/routes", json={"request_id": "obs-1", "model": MODEL, "replica": "tcp://10.0.0.3:5557",
                                        "token_ids": prompt, "credited_tokens": 144})
        for model in (MODEL, "not-indexed"):
            r = client.post("/v1/usage", json={"request_id": "obs-1", "model": model,
                                               "replica": "tcp://10.0.0.3:5557", "prompt_tokens": 160,
                                               "cached_tokens": 128})
            assert r.status_code == 202, r.text
        s = scrape(client)
    t1 = time.time()

    def one(name, **labels):
        got = [x.value for x in s.get(name, []) if all(x.labels.get(k) == v for k, v in labels.items())]
        assert len(got) == 1, (name, labels, s.get(name))
        return got[0]

    # lookup latency and outcomes
    assert one("kvidx_lookup_latency_seconds_count", form="json") == 1
    assert one("kvidx_lookups_total", form="json", status="422") == 1
    # events per replica, freshness, gaps, blocks: one series per replica that sent events
    rows = s["kvidx_replica_batches_applied_total"]
    assert len(rows) == 4 and {x.labels["dp_rank"] for x in rows} == {"0"}
    assert all(x.value == 1 for x in rows)
    # ages and lags bracketed by the clock readings around them: applied after t0, scraped after
    # applying, before t1
    age = one("kvidx_replica_event_age_seconds", replica="tcp://10.0.0.1:5557")
    lag = one("kvidx_replica_apply_lag_seconds", replica="tcp://10.0.0.1:5557")
    assert t0 - ets <= lag <= age <= t1 - ets
    assert one("kvidx_replica_seq_gaps_total", replica="tcp://10.0.0.1:5557") == 0
    assert one("kvidx_replica_blocks", replica="tcp://10.0.0.3:5557") == 40
    assert t0 - ets <= one("kvidx_replica_event_age_max_seconds", model=MODEL) <= t1 - ets
    assert one("kvidx_consumer_lag_messages") == 0
    # agreement: credited (routes, once per decision) vs reused (usage); unknown models are "other"
    assert one("kvidx_routes_credited_tokens_total", model=MODEL) == 144
    assert one("kvidx_usage_reused_tokens_total", model=MODEL) == 128
    assert one("kvidx_usage_prompt_tokens_total", model=MODEL) == 160
    assert one("kvidx_usage_reused_tokens_total", model="other") == 128
    rows = [x for v in s.values() if isinstance(v, list) for x in v]
    assert not any(x.labels.get("model") == "not-indexed" for x in rows)


def test_gc_pauses_series():
    """Each generation 1 and 2 collection is timed into kvidx_gc_pause_seconds (the loop's stalls)."""
    import gc

    app = create_app(seeded_store(), max_tokens=4096)
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        before = scrape(client)
        gc.collect(2)
        gc.collect(1)
        gc.collect(2)
        after = scrape(client)

    def count(s, generation):
        return [x.value for x in s["kvidx_gc_pause_seconds_count"] if x.labels["generation"] == generation][0]

    # other threads may collect too: at least ours
    assert count(after, "2") - count(before, "2") >= 2
    assert count(after, "1") - count(before, "1") >= 1
    inf = [x.value for x in after["kvidx_gc_pause_seconds_bucket"]
           if x.labels == {"generation": "2", "le": "+Inf"}]
    assert inf == [count(after, "2")]


def test_worker_consumer_lag_series(tmp_path):
    from faust.types import TP

    app, w = worker.create_app("127.0.0.1:1", tmp_path, web_port=0, events_topic="obs.events")
    m = app.monitor
    tp = TP("obs.events", 3)
    m.track_tp_end_offset(tp, 100)
    m.tp_read_offsets[tp] = 89
    m.on_tp_commit({tp: 50})
    m.track_tp_end_offset(TP("other.topic", 0), 1000)
    got = {(s.name, s.labels.get("partition")): s.value
           for f in worker.CONSUMER_LAG.collect() for s in f.samples}
    w.close()
    assert got == {("kvidx_worker_consumer_lag_messages", "3"): 10,
                   ("kvidx_worker_uncommitted_messages", "3"): 50}


def test_relay_and_worker_series_registered():
    names = sample_names(REGISTRY.collect())
    for n in ("kvidx_relay_frames_total", "kvidx_relay_blocks_total", "kvidx_relay_dead_letters_total",
              "kvidx_relay_gaps_total", "kvidx_worker_dead_letters_total", "kvidx_worker_batches_total",
              "kvidx_worker_apply_lag_seconds_bucket", "kvidx_worker_consumer_lag_messages"):
        assert n in names, n
    from kvidx.core.shard import NATIVE_FOLD  # the compiled fold's count, where it is built
    for n in ("kvidx_worker_fold_compiled_batches_total", "kvidx_worker_fold_reference_batches_total"):
        assert (n in names) == (NATIVE_FOLD is not None), n


def test_dashboard_queries_exported_series():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    # everything any kvidx process exports: the service's registry (after traffic) and the global one
    app = create_app(seeded_store(), max_tokens=64)
    app.state.metrics.routed(MODEL, 1)
    app.state.metrics.usage(MODEL, 2, 1)
    app.state.metrics.observe("json", 200, 1e-4)
    app.state.metrics.answered(MODEL, 10, 5)
    exported = sample_names(app.state.metrics.registry.collect()) | sample_names(REGISTRY.collect())
    used = {n for e in exprs for n in re.findall(r"\bkvidx_[a-z_]+", e)}
    missing = sorted(used - exported)
    assert not missing, f"the dashboard queries series nobody exports: {missing}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24


def test_the_autoscaler_configuration_in_operations_md_queries_exported_series():
    """docs/operations.md's KEDA example reads series the service exports (issue 41's signals)."""
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("## Autoscaling on the index's signals", 1)[1]
    (yaml,) = re.findall(r"```yaml\n(.*?)```", section, re.S)
    used = set(re.findall(r"\bkvidx_[a-z_]+", yaml))
    assert {"kvidx_lookup_below_gpu_tokens_total", "kvidx_replica_blocks_removed_total"} <= used
    app = create_app(seeded_store(), max_tokens=64)
    app.state.metrics.answered(MODEL, 10, 5, 3)
    exported = sample_names(app.state.metrics.registry.collect())
    missing = sorted(used - exported)
    assert not missing, f"operations.md's autoscaler queries series nobody exports: {missing}"
    table = set(re.findall(r"\bkvidx_[a-z_]+", section.split("```yaml")[0]))
    assert not sorted(table - exported), "operations.md's signal table names series nobody exports"
