"""The prefix price (kvidx/core/price.py, and the compiled answer writer's copy of it in
native/src/answer.rs) and the pending credit's queue (kvidx/core/pending.py) against numbers worked
out by hand in each test: rates of 1000 tokens/s recompute and 2000 tokens/s from CPU (DISK 500/s),
so every term is a count of tokens over a round rate. Runs in both builds (the compiled half where
kvidx_native is built; CI's pure-Python pass runs the rest with KVIDX_NATIVE=0)."""

from __future__ import annotations

import json

import pytest

from kvidx.core import maskmap, walk
from kvidx.core.pending import PendingCredits
from kvidx.core.price import PriceConfig, Pricer, price
from kvidx.core.shard import ModelShard
from schemas.answers import Freshness, Price, ReplicaAnswer, Tier
from schemas.events import SCHEMA_VERSION, BlocksStored, EventBatch

CFG = PriceConfig(recompute_tokens_per_s=1000.0,
                  load_tokens_per_s={"GPU": 0.0, "CPU": 2000.0, "DISK": 500.0})
H = list(range(1000, 1010))  # ten 16-token index blocks of one prompt
N = 161  # the prompt's tokens


def _answer(tiers: list[Tier], resumable: int, inflight: int) -> ReplicaAnswer:
    return ReplicaAnswer("r", 0, sum(t.tokens for t in tiers), tiers, resumable, resumable, [], 0, inflight,
                         False, [], Freshness(None, None, 0, 0, 0))


def _same(got: Price, want: Price) -> None:
    assert got.prefill_tokens == want.prefill_tokens
    for f in ("prefill_s", "load_s", "queue_s", "total_s"):
        assert getattr(got, f) == pytest.approx(getattr(want, f), rel=1e-12, abs=1e-15), f


def test_price_from_worked_numbers():
    # GPU 32 free + CPU 64 / 2000 + DISK 24 (of 48: the resumable part only) / 500 = 0.032 + 0.048
    a = _answer([Tier("GPU", 32), Tier("CPU", 64), Tier("DISK", 48)], resumable=120, inflight=145)
    _same(price(a, 200, CFG), Price(80, 0.080, 0.080, 0.145, 0.305))
    # nothing cached, nothing queued: the whole prompt recomputed
    _same(price(_answer([], 0, 0), 200, CFG), Price(200, 0.2, 0.0, 0.0, 0.2))
    # a tier without a rate loads for free; the queue alone
    _same(Pricer(CFG)(_answer([Tier("NODE_SHARED", 16)], 16, 1000), 16), Price(0, 0.0, 0.0, 1.0, 1.0))


def _shard() -> ModelShard:
    """a: H[:6] in CPU; b: H[:2] in CPU and the whole prompt routed to it (32 tokens credited, so 129
    tokens of prefill in flight) until t=5."""
    s = ModelShard("m", 16)
    for i, (rep, n) in enumerate([("a", 6), ("b", 2)]):
        s.apply(EventBatch(SCHEMA_VERSION, "m", rep, 0, 1, 0, 0.0, 0.0, 16,
                           [BlocksStored("CPU", 0, H[:n], None, 0)]), 0.0 + i)
    s.add_pending("b", 0, H, N, credited=32, expires=5.0)
    return s


# replica -> (resumable tokens, in-flight prefill tokens, price), by hand
BEFORE_EXPIRY = {
    "a": (96, 0, Price(65, 0.065, 96 / 2000, 0.0, 0.065 + 0.048)),
    # resumable to the prompt's last full block (160); load: the 32 cached CPU tokens; queue: 129
    "b": (160, 129, Price(1, 0.001, 32 / 2000, 0.129, 0.001 + 0.016 + 0.129)),
}
AFTER_EXPIRY = {
    "a": BEFORE_EXPIRY["a"],
    # the route expired: its credit and its queued prefill are gone
    "b": (32, 0, Price(129, 0.129, 32 / 2000, 0.0, 0.129 + 0.016)),
}


@pytest.mark.parametrize("now,want", [(1.0, BEFORE_EXPIRY), (5.0, AFTER_EXPIRY)])
def test_typed_answer_price_before_and_after_the_route_expires(now, want):
    s = _shard()
    pricer = Pricer(CFG)
    got = {a.replica: a for a in walk.lookup(s, H, N, now)}
    assert set(got) == set(want)
    for rep, (resumable, inflight, p) in want.items():
        a = got[rep]
        assert (a.resumable_tokens, a.inflight_prefill_tokens) == (resumable, inflight), rep
        _same(pricer(a, N), p)


@pytest.mark.skipif(maskmap.lookup_json is None, reason="the compiled core is not built or KVIDX_NATIVE=0")
@pytest.mark.parametrize("now,want", [(1.0, BEFORE_EXPIRY), (5.0, AFTER_EXPIRY)])
def test_compiled_answer_price_before_and_after_the_route_expires(now, want):
    s = _shard()
    pricer = Pricer(CFG)
    out = walk.lookup_json(s, H, N, now, pricer.per_token, pricer.load_cost, rank=True)
    assert out is not None, "the compiled writer declined a one-tier full-attention shard"
    body = json.loads(out[0])
    got = {r["replica"]: r for r in body["replicas"]}
    assert set(got) == set(want)
    for rep, (resumable, inflight, p) in want.items():
        r = got[rep]
        assert (r["resumable_tokens"], r["inflight_prefill_tokens"]) == (resumable, inflight), rep
        _same(Price(**r["price"]), p)
    totals = [r["price"]["total_s"] for r in body["replicas"]]
    assert totals == sorted(totals)  # ranked by price


def test_expired_routes_leave_the_queue():
    p = PendingCredits()
    p.add(0, [1, 2], expires=5.0, prefill_tokens=100)
    p.add(0, [3], expires=7.0, prefill_tokens=50)
    p.add(1, [1], expires=6.0, prefill_tokens=30)
    assert p.inflight == {0: 150, 1: 30} and p.masks == {1: 0b11, 2: 0b1, 3: 0b1}
    assert p.expire(4.9) == 0 and p.inflight == {0: 150, 1: 30}
    assert p.expire(5.0) == 1 and p.inflight == {0: 50, 1: 30} and p.masks == {1: 0b10, 3: 0b1}
    assert p.expire(6.5) == 1 and p.inflight == {0: 50, 1: 0} and p.masks == {3: 0b1}
    assert p.expire(100.0) == 1 and p.inflight == {0: 0, 1: 0} and p.masks == {} and len(p) == 0
