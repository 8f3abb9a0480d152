"""Prefetch hints through the service over real HTTP (issue #16): off by default; with a model's
`hints.prefetch` on, /v1/rank answers carry the cheapest replica's prefetch plan and /v1/routes
answers the chosen replica's where the gate issues it, published on the hints topic in its versioned
schema; the gate's throttle learns from usage reports."""

from __future__ import annotations

import json
import time

import httpx
import numpy as np
import pytest

from index_service.app import create_app
from index_service.store import ShardStore
from kvidx.config import Config, HintsConfig, ModelConfig
from kvidx.core.hashing import prompt_hashes
from kvidx.core.hints import PROBE_EVERY
from kvidx.core.sessions import SessionTracker
from schemas.events import SCHEMA_VERSION, BlocksStored, EventBatch
from schemas.hints import HINTS_VERSION, decode_hint, encode_hint
from tests.helpers import ServerThread

MODEL = "m"
P = np.random.default_rng(5).integers(0, 50_000, 97).tolist()  # 6 blocks of 16 and one token


def hashes(t: list[int]) -> list[int]:
    return list(prompt_hashes(np.asarray(t, dtype="<u4").tobytes(), 16))


def store_with(hints: HintsConfig) -> ShardStore:
    """Replica "r": P's first 2 blocks on GPU, the next 4 on disk only."""
    store = ShardStore(16, config=Config(default=ModelConfig(hints=hints)))
    h = hashes(P)
    now = time.time()
    store.apply(EventBatch(SCHEMA_VERSION, MODEL, "r", 0, 1, 0, now, now, 16, [
        BlocksStored("GPU", 0, h[:2], None, 0), BlocksStored("DISK", 0, h[2:6], h[1], 2)]))
    return store


def test_hints_are_off_unless_the_operator_turns_them_on():
    with ServerThread(create_app(store_with(HintsConfig()))) as base, httpx.Client(base_url=base) as c:
        rank = c.post("/v1/rank", json={"model": MODEL, "token_ids": P}).json()
        assert rank["replicas"][0]["resumable_tokens"] == 96 and "prefetch" not in rank
        r = c.post("/v1/routes", json={"request_id": "a", "model": MODEL, "replica": "r", "token_ids": P})
        assert r.status_code == 202 and "prefetch" not in r.json() and "kv_hint" not in r.json()


def test_rank_and_routes_carry_the_prefetch_plan_and_the_topic_gets_it():
    store = store_with(HintsConfig(prefetch=True, kv_bytes_per_token=1000))
    sent = []
    store.publish_hint = sent.append
    with ServerThread(create_app(store)) as base, httpx.Client(base_url=base) as c:
        rank = c.post("/v1/rank", json={"model": MODEL, "token_ids": P}).json()
        plan = rank["prefetch"]
        assert plan["replica"] == "r" and plan["tokens"] == 64 and plan["bytes"] == 64_000
        assert [(x["tier"], x["start"], x["end"]) for x in plan["runs"]] == [("DISK", 32, 96)]
        # the default disk rate (40,000 tokens/s): 64 tokens in 1.6 ms; nothing queued yet
        assert plan["load_s"] == pytest.approx(64 / 40_000) and plan["deadline_s"] == 0.0
        assert rank["replicas"][0]["price"]["load_s"] == pytest.approx(plan["load_s"])
        # routed to "r" with nothing queued there: the load would start 2 ms after the turn (the gate's
        # delay), so the plan is not issued (issue #41)
        r = c.post("/v1/routes", json={"request_id": "q", "model": MODEL, "replica": "r", "token_ids": P})
        assert r.status_code == 202 and "prefetch" not in r.json()
        # now 97 tokens of prefill are queued there (12 ms at 8,000 tokens/s): the 1.6 ms load is hidden
        r = c.post("/v1/routes", json={"request_id": "a", "model": MODEL, "replica": "r", "token_ids": P,
                                       "credited_tokens": 96})
        assert r.status_code == 202 and r.json()["prefetch"]["runs"] == plan["runs"]
        again = c.post("/v1/routes", json={"request_id": "a", "model": MODEL, "replica": "r", "token_ids": P})
        assert again.json()["duplicate"] is True
        # after the first decision, its prefill is queued on "r": the next plan has a deadline
        later = c.post("/v1/rank", json={"model": MODEL, "token_ids": P}).json()["prefetch"]
        assert later["deadline_s"] > 0 and later["benefit_s"] == pytest.approx(min(later["load_s"],
                                                                                   later["deadline_s"]))
    assert len(sent) == 1  # the duplicate decision publishes nothing
    rec = decode_hint(encode_hint(sent[0]))
    got = (rec.v, rec.kind, rec.request_id, rec.replica, rec.block_size)
    assert got == (HINTS_VERSION, "prefetch", "a", "r", 16)
    assert rec.block_hashes == hashes(P)
    assert [(x.tier, x.start, x.end) for x in rec.runs] == [("DISK", 32, 96)]


def test_a_hints_record_of_another_version_is_refused():
    store = store_with(HintsConfig(prefetch=True))
    sent = []
    store.publish_hint = sent.append
    with ServerThread(create_app(store)) as base, httpx.Client(base_url=base) as c:
        for rid in ("q", "a"):  # the first queues prefill on "r", so the second's plan is issued
            c.post("/v1/routes", json={"request_id": rid, "model": MODEL, "replica": "r", "token_ids": P})
    sent[0].v = HINTS_VERSION + 1
    with pytest.raises(ValueError, match="unsupported hints version"):
        decode_hint(encode_hint(sent[0]))


def metric(text: str, name: str) -> float | None:
    line = next((x for x in text.splitlines() if x.startswith(name + "{")), None)
    return None if line is None else float(line.rsplit(" ", 1)[1])


def test_the_gates_throttle_learns_from_usage_reports_and_its_ratio_is_on_metrics():
    """Issued plans paid off when the engine's usage report reused their tokens; a model whose plans do
    not pay is throttled (issue #41). The gate's counts and pay-off ratio on /metrics."""
    store = store_with(HintsConfig(prefetch=True))
    with ServerThread(create_app(store)) as base, httpx.Client(base_url=base) as c:
        def route(rid: str) -> bool:
            r = c.post("/v1/routes", json={"request_id": rid, "model": MODEL, "replica": "r", "token_ids": P,
                                           "ttl_s": 60})
            assert r.status_code == 202
            return "prefetch" in r.json()

        def usage(rid: str, cached: int) -> None:
            r = c.post("/v1/usage", json={"request_id": rid, "model": MODEL, "replica": "r",
                                          "prompt_tokens": 97, "cached_tokens": cached})
            assert r.status_code == 202

        assert not route("q")  # nothing queued: declined
        text = c.get("/metrics").text
        assert metric(text, "kvidx_hints_declined_total") == 1
        assert metric(text, "kvidx_hint_payoff_ratio") is None
        # every later decision finds the earlier ones' prefill queued (pending for 60 s): issued, until
        # their engines report that they reused only the GPU blocks (32 tokens, not the plan's 96)
        issued = []
        for k in range(40):
            issued.append(route(f"a{k}"))
            usage(f"a{k}", 32)
        # the first 16 bets lost: from then on one plan in PROBE_EVERY that could pay is issued
        assert issued[:16] == [True] * 16 and sum(issued[16:]) == 24 // PROBE_EVERY
        text = c.get("/metrics").text
        assert metric(text, "kvidx_hint_payoff_ratio") == 0.0
        assert metric(text, "kvidx_hints_issued_total") == 16 + 24 // PROBE_EVERY
        assert metric(text, "kvidx_hints_throttled_total") == 24 - 24 // PROBE_EVERY


def test_sessions_give_placements_and_eviction_advice_on_the_hints_topic(monkeypatch):
    """hints.sessions on: each recorded decision feeds the model's session tracker; a recurring session
    on a replica with a long queue gets a placement to the idle one, and a silent session, eviction advice
    (its own blocks, never the shared system prompt). The service's clock is the test's: the decisions
    are 10 ms apart and the silence 0.5 s, whatever the machine's load."""
    import types

    import index_service.query as query_mod
    store = ShardStore(16, config=Config(default=ModelConfig(hints=HintsConfig(sessions=True))))
    sent = []
    store.publish_hint = sent.append
    system = P[:32]
    turn1, other = system + P[32:80], system + list(range(7000, 7050))
    now = time.time()
    clock = [now]
    monkeypatch.setattr(query_mod, "time", types.SimpleNamespace(time=lambda: clock[0]))
    for rep in ("busy", "idle"):
        store.apply(EventBatch(SCHEMA_VERSION, MODEL, rep, 0, 1, 0, now, now, 16, []))
    app = create_app(store)
    # silent after 0.3 s (not 30 s, or 4 gaps and at least 5 s); as if 8 sessions of each class had
    # fallen silent before and none came back (return probability 1/10: the advice is worth issuing)
    app.state.pipeline.trackers[MODEL] = SessionTracker(16, idle_s=0.3, min_idle_s=0.3,
                                                        demoted_by={0: 8, 1: 8})
    with ServerThread(app) as base, httpx.Client(base_url=base) as c:
        def route(rid: str, replica: str, tokens: list[int]) -> None:
            clock[0] += 0.01
            r = c.post("/v1/routes", json={"request_id": rid, "model": MODEL, "replica": replica,
                                           "token_ids": tokens, "ttl_s": 60})
            assert r.status_code == 202 and "prefetch" not in r.json()
        # a long prefill queued on "busy" (pending credit of 400,000 tokens: 50 s at 8,000 tokens/s)
        route("big", "busy", list(range(10_000, 410_000)))
        route("o1", "idle", other)
        route("a1", "busy", turn1)
        route("a2", "busy", turn1 + P[80:96])  # the session comes back: recurring, its replica busy
        placements = [h for h in sent if h.kind == "placement"]
        assert [(h.replica, h.target, h.request_id) for h in placements] == [("busy", "idle", "a2")]
        assert placements[0].block_hashes == hashes(turn1 + P[80:96]) and placements[0].benefit_s > 1.0
        clock[0] += 0.5
        route("x", "idle", list(range(20_000, 20_040)))  # any decision: the tracker looks at the silent
        text = c.get("/metrics").text  # the kinds' throttles beside the prefetch gate's
        n_advice = sum(h.kind == "eviction" for h in sent)
        assert f'kvidx_hints_issued_total{{kind="eviction",model="{MODEL}"}} {float(n_advice)}' in text
        assert f'kvidx_hints_issued_total{{kind="placement",model="{MODEL}"}} 1.0' in text
    advice = {(h.replica, tuple(h.block_hashes)): h.action for h in sent if h.kind == "eviction"}
    # each with its benefit (room for active sessions) and expected cost (reload if it comes back), in s
    assert all(h.benefit_s > 0 and 0 < h.load_s < h.benefit_s for h in sent if h.kind == "eviction")
    # every session fell silent (the last decision's own, just started, is not); the system prompt's
    # 2 blocks, shared by two sessions, are never named
    assert advice == {("busy", tuple(hashes(list(range(10_000, 410_000))))): "demote",
                      ("idle", tuple(hashes(other)[2:])): "demote",
                      ("busy", tuple(hashes(turn1 + P[80:96])[2:])): "demote"}


def test_routes_carry_dynamos_fetch_hint_when_another_replica_holds_more_on_gpu():
    """hints.fetch on (issue #41 item 5): routed to "s", which holds 2 of P's 6 blocks, while "r" holds all
    6 on GPU and has a control endpoint, the answer's `kv_hint` is Dynamo's KvHint (kv.fetch@1.0) naming
    r's endpoint and r's engine hashes of the 6 blocks, root-aligned; its text is what Dynamo's own
    constructors make (tests/fixtures/dynamo-1.6.1, bench/peers/http/kv_hint_check.py). The usage report
    tells the fetch gate whether it paid off; /metrics counts the kind."""
    cfg = Config(default=ModelConfig(hints=HintsConfig(fetch=True, fetch_endpoints={"r": "tcp://10.0.0.5:25000"})))
    store = ShardStore(16, config=cfg)
    h = hashes(P)
    engine = [2**64 - 1 - i for i in range(6)]
    now = time.time()
    store.apply(EventBatch(SCHEMA_VERSION, MODEL, "r", 0, 1, 0, now, now, 16, [
        BlocksStored("GPU", 0, h[:6], None, 0, engine_hashes=engine)]))
    store.apply(EventBatch(SCHEMA_VERSION, MODEL, "s", 0, 1, 0, now, now, 16, [
        BlocksStored("GPU", 0, h[:2], None, 0, engine_hashes=engine[:2])]))
    with ServerThread(create_app(store)) as base, httpx.Client(base_url=base) as c:
        r = c.post("/v1/routes", json={"request_id": "f1", "model": MODEL, "replica": "s", "token_ids": P})
        assert r.status_code == 202
        want = ('{"protocol_version":"0.1","message_id":"f1","actions":[{"action_id":"a1","action_type":'
                '"kv.fetch","action_version":"1.0","payload":{"block_hashes":[' + ",".join(map(str, engine))
                + '],"source_control_endpoint":"tcp://10.0.0.5:25000"}}]}')
        assert r.json()["kv_hint"] == json.loads(want)
        assert json.dumps(r.json()["kv_hint"], separators=(",", ":")) == want
        # routed to "r" itself, or to "s" once "s" holds as much: nothing to fetch
        r2 = c.post("/v1/routes", json={"request_id": "f2", "model": MODEL, "replica": "r", "token_ids": P})
        assert "kv_hint" not in r2.json()
        c.post("/v1/usage", json={"request_id": "f1", "model": MODEL, "replica": "s", "prompt_tokens": 97,
                                  "cached_tokens": 96})
        text = c.get("/metrics").text
        assert 'kvidx_hints_issued_total{kind="fetch",model="m"} 1.0' in text
        assert 'kvidx_hint_payoff_ratio{kind="fetch",model="m"} 1.0' in text


def test_fetch_hints_need_their_sources_endpoints():
    with pytest.raises(ValueError, match="hints.fetch needs hints.fetch_endpoints"):
        Config(default=ModelConfig(hints=HintsConfig(fetch=True))).check()
