"""Prefetch hints on a real broker (issue #16): with a model's hints on, the service publishes each
routing decision's prefetch plan on the hints topic, and `kvidx audit` reports how many the engine
followed (its events stored the hinted blocks on GPU before the deadline) and how many paid off (its
usage report counts the prefetched prefix as reused)."""

import json
import time

import httpx
import pytest

from index_service.app import create_app
from index_service.store import ShardStore
from kvidx.cli import main
from kvidx.config import Config, HintsConfig, ModelConfig
from kvidx.core.hashing import prompt_hashes
from kvidx.kafka.publish import Publisher
from relays.sinks import KafkaSink
from schemas.events import SCHEMA_VERSION, BlocksStored, EventBatch
from schemas.hints import encode_hint
from schemas.routes import encode_route
from schemas.usage import encode_usage
from tests.helpers import ServerThread
from tests.integration.helpers import ready


@pytest.mark.kafka
def test_hints_published_and_audited(kafka_bootstrap, topics, capsys):
    b = kafka_bootstrap
    ready(b, topics)
    store = ShardStore(16, config=Config(default=ModelConfig(hints=HintsConfig(prefetch=True))))
    routes, hints = Publisher(b, topics["routes"], encode_route), Publisher(b, topics["hints"], encode_hint)
    store.publish_route, store.publish_hint = routes, hints
    usage = Publisher(b, topics["usage"], encode_usage, linger_ms=5)
    sink = KafkaSink(b, topics["events"], topics["dead_letters"])
    t0 = time.time()
    prompts = {rid: list(range(k * 1000, k * 1000 + 97)) for k, rid in enumerate(("kept", "late", "short"))}
    for rid, tokens in prompts.items():  # each on its own replica: 2 blocks on GPU, 4 on disk only
        h = prompt_hashes(tokens, 16)
        held = [BlocksStored("GPU", 0, h[:2], None, 0), BlocksStored("DISK", 0, h[2:6], h[1], 2)]
        store.apply(EventBatch(SCHEMA_VERSION, "m", rid, 0, 1, 0, t0, t0, 16, held))
    try:
        with ServerThread(create_app(store, publish_usage=usage)) as url, httpx.Client(base_url=url) as c:
            for rid, tokens in prompts.items():
                # a prompt with nothing cached queues its prefill there first: a plan is issued only
                # where the request waits long enough to hide its load (the prefetch gate)
                c.post("/v1/routes", json={"request_id": f"fill-{rid}", "model": "m", "replica": rid,
                                           "token_ids": list(range(50_000, 50_097))})
                r = c.post("/v1/routes", json={"request_id": rid, "model": "m", "replica": rid,
                                               "token_ids": tokens, "credited_tokens": 96})
                assert r.status_code == 202 and r.json()["prefetch"]["tokens"] == 64
                ts = time.time()
                h = prompt_hashes(tokens, 16)
                # "kept" and "short" load the hinted blocks at once, "late" long after its deadline
                at = ts + (30.0 if rid == "late" else 0.0)
                sink.publish(EventBatch(SCHEMA_VERSION, "m", rid, 0, 1, 1, at, at, 16,
                                        [BlocksStored("GPU", 0, h[2:6], h[1], 2)]))
                cached = 32 if rid == "short" else 96
                u = c.post("/v1/usage", json={"request_id": rid, "model": "m", "replica": rid,
                                              "prompt_tokens": 97, "cached_tokens": cached})
                assert u.status_code == 202
        sink.flush()
        for p in (routes, hints, usage):
            p.producer.flush(10)
        assert main(["audit", "--bootstrap", b, "--topic-prefix", topics["prefix"], "--from", repr(t0 - 1),
                     "--to", repr(time.time() + 1), "--json"]) == 0
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        o = report["hints"]["overall"]
        assert (o["issued"], o["followed"], o["paid_off"], o["unreported"]) == (3, 2, 1, 0)
        assert {r["replica"]: r["paid_off"] for r in report["hints"]["by_replica"]} == {
            "kept": 1, "late": 0, "short": 0}
        assert main(["audit", "--bootstrap", b, "--topic-prefix", topics["prefix"], "--from", repr(t0 - 1),
                     "--to", repr(time.time() + 1)]) == 0
        assert "prefetch hints: 3 issued, 2 followed" in capsys.readouterr().out
    finally:
        for p in (routes, hints, usage):
            p.close()
        sink.close()
