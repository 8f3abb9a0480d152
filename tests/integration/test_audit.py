"""Offline audit and feedback on a real broker: the audit's figures equal a hand computation over
generated routing decisions and usage reports; POST /v1/usage publishes reports; the feedback caps a
replica whose engine reuses nothing of what the index credits. The feedback's rules and its gain on a
simulated fleet, without a broker: tests/unit/ops/test_feedback.py."""

import json
import random
import time

import httpx
import pytest
from confluent_kafka import Producer

from index_service.app import create_app
from index_service.feedback import FeedbackFollower, ensure_feedback_topic
from index_service.follower import KafkaFollower
from index_service.store import ShardStore
from kvidx.cli import main
from kvidx.core.hashing import prompt_hashes
from kvidx.kafka.log import read_range
from kvidx.kafka.publish import Publisher
from kvidx.ops.feedback import run_feedback
from relays.sinks import KafkaSink
from schemas.events import SCHEMA_VERSION, BlocksStored, EventBatch
from schemas.routes import ROUTES_VERSION, RouteDecision, encode_route
from schemas.usage import USAGE_VERSION, UsageReport, decode_usage, encode_usage
from tests.helpers import ServerThread, wait_for
from tests.integration.helpers import ready


def hand(pairs):
    """The figures by their definitions, from (prompt, reused, credited) triples."""
    p = sum(x[0] for x in pairs)
    r = sum(x[1] for x in pairs)
    c = sum(x[2] for x in pairs)
    m = sum(min(x[1], x[2]) for x in pairs)
    o = sum(max(x[2] - x[1], 0) for x in pairs)
    return {"requests": len(pairs), "prompt_tokens": p, "reused_tokens": r, "credited_tokens": c,
            "over_credited_tokens": o, "reuse_rate": round(r / p, 6), "recall": round(m / r, 6),
            "over_credit": round(o / r, 6), "precision": round(m / c, 6),
            "exact_requests": sum(x[1] == x[2] for x in pairs)}


@pytest.mark.kafka
def test_audit_equals_hand_computation(kafka_bootstrap, topics, tmp_path, capsys):
    rng = random.Random(11)
    t1 = time.time() - 3600
    t2 = t1 + 1200
    window = 300.0
    prod = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    models, replicas, engines, tiers = ["llama", "qwen"], ["r0", "r1", "r2"], ["vllm-0.32", "sglang"], \
        ["GPU", "CPU", ""]
    expected = []  # (model, replica, engine, tier, window, prompt, reused, credited)
    unmatched_routes = unmatched_usages = 0
    msgs = []
    for i in range(400):
        model, rep = rng.choice(models), rng.choice(replicas)
        ts = t1 + rng.uniform(-200, 1400)  # some outside the range on both sides
        n = rng.randint(50, 4000)
        credited = rng.randrange(0, n, 16)
        reused = max(0, min(n - 1, credited + rng.choice([0, 0, 0, -16, -64, 32, -credited])))
        kind = rng.random()
        d = RouteDecision(ROUTES_VERSION, f"q{i}", model, rep, 0, [], n, credited, ts, 10.0)
        u = UsageReport(USAGE_VERSION, f"q{i}", model, rep, 0, n, reused, ts + rng.uniform(0.1, 5),
                        rng.choice(engines), rng.choice(tiers))
        if kind > 0.05:
            msgs.append((ts, topics["routes"], model, encode_route(d)))
        if kind < 0.05 or kind > 0.1:
            msgs.append((u.ts, topics["usage"], model, encode_usage(u)))
            if kind > 0.1 and rng.random() < 0.03:  # a duplicate report: counted once
                msgs.append((u.ts + 1, topics["usage"], model, encode_usage(u)))
        in_range = t1 <= ts <= t2
        if kind <= 0.05:
            unmatched_usages += t1 <= u.ts <= t2
        elif kind <= 0.1:
            unmatched_routes += in_range
        elif in_range:
            expected.append((model, rep, u.engine or "unknown", u.tier or "unknown", int((ts - t1) // window),
                             n, reused, credited))
    for ts, topic, model, value in sorted(msgs):  # produced as they happened (time order)
        prod.produce(topic, key=model.encode(), value=value, timestamp=int(ts * 1000))
    assert prod.flush(20) == 0
    out = tmp_path / "audit"
    capsys.readouterr()
    assert main(["audit", "--bootstrap", kafka_bootstrap, "--topic-prefix", topics["prefix"], "--from",
                 repr(t1), "--to", repr(t2), "--window", str(window), "--json", "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)

    assert report["overall"] == hand([x[5:] for x in expected])
    assert report["unmatched"]["routes"] == unmatched_routes
    assert report["unmatched"]["usages"] == unmatched_usages
    for section, cols in (("by_model", (0,)), ("by_replica", (0, 1)), ("by_engine", (2,)), ("by_tier", (3,)),
                          ("over_time", (4,))):
        groups = {}
        for x in expected:
            groups.setdefault(tuple(x[c] for c in cols), []).append(x[5:])
        rows = report[section]
        assert len(rows) == len(groups), section
        for row in rows:
            key = {"by_model": lambda r: (r["model"],), "by_replica": lambda r: (r["model"], r["replica"]),
                   "by_engine": lambda r: (r["engine"],), "by_tier": lambda r: (r["tier"],),
                   "over_time": lambda r: (r["window"],)}[section](row)
            figures = {k: row[k] for k in hand(groups[key])}
            assert figures == hand(groups[key]), (section, key)
    for png in ("over_time.png", "by_replica.png"):
        assert (out / png).stat().st_size > 10_000
    assert json.loads((out / "audit.json").read_text())["overall"] == report["overall"]
    # the table form
    assert main(["audit", "--bootstrap", kafka_bootstrap, "--topic-prefix", topics["prefix"],
                 "--from", repr(t1), "--to", repr(t2)]) == 0
    text = capsys.readouterr().out
    assert "per replica" in text and f"{unmatched_routes} decisions without a usage report" in text


@pytest.mark.kafka
def test_usage_endpoint_and_feedback_cap_a_lying_replica(kafka_bootstrap, topics):
    b = kafka_bootstrap
    ready(b, topics)
    store = ShardStore(16)
    store.publish_route = Publisher(b, topics["routes"], encode_route)
    follower = KafkaFollower(store, b, topics["events"], topics["snapshots"], topics["routes"]).start()
    fb = FeedbackFollower(b, ensure_feedback_topic(b, topics)).start()
    usage = Publisher(b, topics["usage"], encode_usage, linger_ms=5)
    sink = KafkaSink(b, topics["events"], topics["dead_letters"])
    tokens = list(range(1000, 1320))  # 320 tokens: 20 blocks, 304 resumable
    h = prompt_hashes(tokens, 16)
    now = time.time()
    for rep in ("honest", "liar"):
        sink.publish(EventBatch(SCHEMA_VERSION, "m", rep, 0, 1, 0, now, now, 16,
                                [BlocksStored("GPU", 0, h, None, 0)]))
    sink.flush()
    server = ServerThread(create_app(store, publish_usage=usage, feedback=fb))
    url = server.__enter__()
    try:
        with httpx.Client(base_url=url, timeout=10) as c:
            def answer():  # {} until the follower has folded the model's first events (404 till then)
                got = c.post("/v1/lookup", json={"model": "m", "token_ids": tokens}).json()
                return {a["replica"]: a for a in got.get("replicas", [])}
            wait_for(lambda: len(answer()) == 2, what="both replicas in the index")
            assert all(a["resumable_tokens"] == 304 and "feedback_capped" not in a for a in answer().values())
            # routers record decisions and forward the engines' usage; the liar reuses nothing
            for i in range(24):
                rep = ("honest", "liar")[i % 2]
                credited = answer()[rep]["resumable_tokens"]
                assert c.post("/v1/routes", json={"request_id": f"q{i}", "model": "m", "replica": rep,
                                                  "token_ids": tokens, "credited_tokens": credited,
                                                  "ttl_s": 0.01}).status_code == 202
                reused = credited if rep == "honest" else 0
                r = c.post("/v1/usage", json={"request_id": f"q{i}", "model": "m", "replica": rep,
                                              "prompt_tokens": 320, "cached_tokens": reused,
                                              "engine": "vllm-0.32", "tier": "GPU"})
                assert r.status_code == 202 and r.json()["published"] is True
            bad = c.post("/v1/usage", json={"request_id": "x", "model": "m", "replica": "a",
                                            "prompt_tokens": 10, "cached_tokens": 11})
            assert bad.status_code == 422 and "cached_tokens" in bad.json()["error"]
            assert c.post("/v1/usage", json={"request_id": "x"}).status_code == 422
            usage.producer.flush(10)
            store.publish_route.producer.flush(10)
            got = [decode_usage(m.value) for m in read_range(b, topics["usage"], None, None)]
            assert len(got) == 24 and got[1].replica == "liar" and got[1].cached_tokens == 0
            assert got[0].engine == "vllm-0.32" and got[0].tier == "GPU"

            factors = {f.replica: f for f in run_feedback(b, topics, window_s=300, min_requests=10)}
            assert factors["liar"].factor == 0.0 and factors["honest"].factor == 1.0
            assert factors["liar"].credited_tokens == 12 * 304 and factors["liar"].reused_tokens == 0

            def capped():
                a = answer()
                return a["liar"]["resumable_tokens"] == 0 and a["liar"].get("feedback_capped") is True
            wait_for(capped, what="the service to apply the credit factor")
            ans = c.post("/v1/lookup", json={"model": "m", "token_ids": tokens}).json()["replicas"]
            assert ans[0]["replica"] == "honest" and ans[0]["resumable_tokens"] == 304
            assert "feedback_capped" not in ans[0]
            liar = ans[1]
            assert liar["index_resumable_tokens"] == 304 and liar["credit_factor"] == 0.0
            assert liar["price"]["prefill_tokens"] == 320  # priced as no reuse
    finally:
        server.__exit__(None, None, None)
        fb.stop()
        follower.stop()
        store.publish_route.close()
        usage.close()
        sink.close()
