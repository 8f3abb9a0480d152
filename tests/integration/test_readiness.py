"""A service instance is ready (/healthz 200) only once it has applied the snapshots and every message
that was in the events and routes topics when it started; from then on /v1/models lists what a lookup
answers for (real broker; the folds slowed down so that catching up takes a while)."""

import time

import pytest
from fastapi.testclient import TestClient

from index_service.app import create_app
from index_service.follower import KafkaFollower
from index_service.store import ShardStore
from kvidx.kafka.publish import Publisher
from relays.run import play_recording
from relays.sinks import KafkaSink
from schemas.routes import ROUTES_VERSION, RouteDecision, encode_route
from tests.helpers import LLAMA, wait_for

ROUTES = 40


@pytest.mark.parametrize("events", [True, False], ids=["events+routes", "routes-only"])
def test_ready_means_every_message_there_at_start_applied(events, kafka_bootstrap, topics, monkeypatch):
    if events:
        sink = KafkaSink(kafka_bootstrap, topics["events"], topics["dead_letters"])
        play_recording(LLAMA / "frames.jsonl", "tiny", sink, 16, replica="r0")
        sink.close()
    publish = Publisher(kafka_bootstrap, topics["routes"], encode_route)
    for i in range(ROUTES):
        publish(RouteDecision(ROUTES_VERSION, f"q{i}", "tiny", "r0", 0, [i + 1], 16, 0, time.time(), 600.0))
    publish.close()

    store = ShardStore(16)
    fold, apply_route = store.fold, store.apply_route

    def slow_fold(raw, partition=-1, offset=-1, now=None):
        time.sleep(0.005)  # catching up takes a while: a /healthz that said ready early would show it
        return fold(raw, partition, offset, now)

    def slow_route(d):
        time.sleep(0.05)  # slower still: routes still to apply when the events are done
        return apply_route(d)

    monkeypatch.setattr(store, "fold", slow_fold)
    monkeypatch.setattr(store, "apply_route", slow_route)
    at_ready = {}
    follower = KafkaFollower(store, kafka_bootstrap, topics["events"], topics["snapshots"], topics["routes"])
    ready = follower._ready

    def seen_at_ready(t0):  # what the instance had applied when it turned ready
        shard = store.shards.get("tiny")
        state = shard.replicas.get(("r0", 0)) if shard else None
        at_ready.update(batches=state.batches if state else 0, routes=store.routes_applied,
                        models=sorted(store.shards))
        ready(t0)

    monkeypatch.setattr(follower, "_ready", seen_at_ready)
    client = TestClient(create_app(store=store))
    follower.start()
    try:
        wait_for(lambda: client.get("/healthz").status_code == 200, timeout=120, what="/healthz ready")
        models = client.get("/v1/models").json()["models"]
        assert [m["model"] for m in models] == ["tiny"]
        wait_for(lambda: store.consumer_lag == 0, timeout=60, what="nothing left to fold")
        # nothing was published after the start: at ready, it had all of it
        state = store.shards["tiny"].replicas.get(("r0", 0))
        everything = state.batches if state else 0
        assert everything > 100 if events else everything == 0
        assert at_ready == {"batches": everything, "routes": ROUTES, "models": ["tiny"]}
    finally:
        follower.stop()
