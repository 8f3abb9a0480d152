"""Per-client rate limits on the `write` and `admin` routes (index_service.limits): a client past its
budget gets 429 with Retry-After and a message naming the limit, other clients (another token, or
another address without credentials) keep theirs, the routers' lookups are never limited, and the
buckets stay bounded however many clients there are."""

from __future__ import annotations

import httpx
import pytest

from index_service.app import create_app
from index_service.auth import ADMIN, WRITE, Credentials, parse_credentials
from index_service.limits import Buckets
from tests.helpers import SEEDED_MODEL, ServerThread, seeded_store

A, B = "feeder-a-token-0123456789", "feeder-b-token-9876543210"
USAGE = {"request_id": "r", "model": SEEDED_MODEL, "replica": "replica-0", "prompt_tokens": 64,
         "cached_tokens": 32}
LOOKUP = {"model": SEEDED_MODEL, "token_ids": list(range(1000, 1064))}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_allows_bursts_of_twice_the_rate_then_the_rate():
    clock = Clock()
    b = Buckets({WRITE: 2.0, ADMIN: 0.0}, clock=clock)
    assert [b.take(WRITE, "c") for _ in range(4)] == [0.0] * 4  # a burst of 2 x 2
    assert b.take(WRITE, "c") == pytest.approx(0.5)  # the next token in half a second
    assert Buckets({WRITE: 0.1}, clock=clock).take(WRITE, "c") == 0.0  # a slow rate: one at a time
    assert b.take(WRITE, "other") == 0.0  # another client has its own budget
    clock.now += 0.5
    assert b.take(WRITE, "c") == 0.0 and b.take(WRITE, "c") > 0
    clock.now += 60
    assert [b.take(WRITE, "c") for _ in range(4)] == [0.0] * 4 and b.take(WRITE, "c") > 0  # capped burst
    assert all(b.take(ADMIN, "c") == 0.0 for _ in range(100))  # rate 0: no limit


def test_buckets_are_bounded():
    b = Buckets({WRITE: 1.0}, max_clients=100, clock=Clock())
    for i in range(10_000):
        b.take(WRITE, f"addr:{i}")
    assert len(b.state) == 100


@pytest.fixture
def served():
    creds = Credentials(parse_credentials(f"a read,write {A}\nb read,write {B}\n"))
    app = create_app(seeded_store(), credentials=creds, publish_usage=lambda u: None,
                     rate_limits={WRITE: 0.2, ADMIN: 0.2})  # one request, then one every 5 s
    with ServerThread(app) as base:
        yield base


def test_past_its_budget_a_client_gets_429_and_others_do_not(served):
    with httpx.Client(base_url=served, timeout=10) as c:
        statuses = [c.post("/v1/usage", json=USAGE, headers={"Authorization": f"Bearer {A}"}).status_code
                    for _ in range(2)]
        assert statuses == [202, 429], statuses
        r = c.post("/v1/usage", json=USAGE, headers={"Authorization": f"Bearer {A}"})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert "rate limit" in r.json()["error"] and "'write'" in r.json()["error"], r.text
        # token b's budget is its own; lookups (read) are never limited
        assert c.post("/v1/usage", json=USAGE, headers={"Authorization": f"Bearer {B}"}).status_code == 202
        assert all(c.post("/v1/lookup", json=LOOKUP, headers={"Authorization": f"Bearer {A}"}).status_code
                   == 200 for _ in range(20))
        metrics = c.get("/metrics", headers={"Authorization": f"Bearer {A}"}).text
        assert 'kvidx_rate_limited_total{scope="write"}' in metrics


def test_without_credentials_a_client_is_its_address():
    app = create_app(seeded_store(), publish_usage=lambda u: None, rate_limits={WRITE: 0.2})
    with ServerThread(app) as base, httpx.Client(base_url=base, timeout=10) as c:
        assert [c.post("/v1/usage", json=USAGE).status_code for _ in range(2)] == [202, 429]


def test_a_msgpack_caller_gets_its_429_in_msgpack():
    """The conductor's clients speak msgpack: their refusal is msgpack too, like its other errors."""
    import msgspec

    from index_service.conductor_api import ConductorRegistry

    app = create_app(seeded_store(), conductor=ConductorRegistry(), rate_limits={ADMIN: 0.2})
    with ServerThread(app) as base, httpx.Client(base_url=base, timeout=10) as c:
        body = msgspec.msgpack.encode({"endpoint": "tcp://127.0.0.1:1", "type": "vllm"})
        answers = [c.post("/unregister", content=body, headers={"content-type": "application/msgpack"})
                   for _ in range(2)]
        assert answers[1].status_code == 429, [a.status_code for a in answers]
        assert "rate limit" in msgspec.msgpack.decode(answers[1].content)["error"]

