"""Prefetch hints on the pure shard's answers: which runs to load, their load time at the model's
rates, and the benefit the queue wait can hide; the gate that issues only those that can pay."""

import pytest

from kvidx.core import walk
from kvidx.core.hints import MIN_OUTCOMES, PROBE_EVERY, PrefetchGate, PrefetchHint, PrefetchRun, prefetch_hint
from kvidx.core.price import PriceConfig, Pricer
from kvidx.core.shard import ModelShard
from schemas.events import SCHEMA_VERSION, BlocksStored, EventBatch

H = list(range(2000, 2010))  # one chain of ten 16-token index blocks
CFG = Pricer(PriceConfig(recompute_tokens_per_s=8000.0,
                         load_tokens_per_s={"GPU": 0.0, "CPU": 160.0, "DISK": 32.0}))


def answer(events):
    s = ModelShard("m", 16)
    s.apply(EventBatch(SCHEMA_VERSION, "m", "a", 0, 1, 0, 0.0, 0.0, 16, events), 0.0)
    return next(a for a in walk.lookup(s, H, 161, 0.0) if a.replica == "a")


def test_runs_below_gpu_in_prompt_order_with_load_time_and_hidden_part():
    a = answer([BlocksStored("GPU", 0, H[:2], None, 0), BlocksStored("CPU", 0, H[2:5], H[1], 2),
                BlocksStored("DISK", 0, H[5:6], H[4], 5)])
    assert a.resumable_tokens == 96
    h = prefetch_hint(a, CFG, queue_s=0.25, bytes_per_token=1000)
    assert [(r.tier, r.start, r.end) for r in h.runs] == [("CPU", 32, 80), ("DISK", 80, 96)]
    assert h.tokens == 64 and h.bytes == 64_000
    assert h.load_s == pytest.approx(48 / 160 + 16 / 32)
    assert h.deadline_s == 0.25 and h.benefit_s == pytest.approx(0.25)  # the wait hides only 0.25 s
    assert prefetch_hint(a, CFG, queue_s=2.0).benefit_s == pytest.approx(h.load_s)


def test_no_hint_when_everything_resumable_is_on_gpu_or_free_to_load():
    assert prefetch_hint(answer([BlocksStored("GPU", 0, H[:4], None, 0)]), CFG, 1.0) is None
    free = Pricer(PriceConfig(load_tokens_per_s={"GPU": 0.0, "CPU": 0.0}))
    assert prefetch_hint(answer([BlocksStored("CPU", 0, H[:4], None, 0)]), free, 1.0) is None


# ---- the gate (issue #41): a plan is issued only when it can pay, fewer while the kind's bets lose ----

def plan(replica: str = "a", load_s: float = 0.010, queue_s: float = 0.050) -> PrefetchHint:
    return PrefetchHint(replica, 0, [PrefetchRun("CPU", 0, 160, load_s)], 160, load_s, queue_s,
                        min(load_s, queue_s), 0)


def test_a_plan_that_cannot_pay_is_not_issued():
    gate = PrefetchGate(delay_s=0.002, margin_s=0.001)
    assert not gate.admit(plan(queue_s=0.0), 10.0)  # idle replica: the turn would wait for the hint
    assert not gate.admit(plan(queue_s=0.0025), 10.0)  # hides 0.5 ms: under the 1 ms margin
    assert gate.net_gain_s(0.010, 0.0, ("a", 0), 10.0) == pytest.approx(-0.002)  # what it would cost
    assert (gate.issued, gate.declined) == (0, 2)


def test_a_plan_that_can_pay_is_issued_and_holds_its_replicas_channel():
    gate = PrefetchGate(delay_s=0.002, margin_s=0.001)
    assert gate.admit(plan(queue_s=0.050), 10.0)  # loads from 10.002 to 10.012, the turn at 10.050
    assert gate.net_gain_s(0.010, 0.050, ("a", 0), 10.0) == pytest.approx(0.010)
    # the next plan for "a", its turn in 11 ms: the channel is busy until 10.012, so it would hide 0
    assert not gate.admit(plan(queue_s=0.011), 10.0)
    assert gate.admit(plan("b", queue_s=0.011), 10.0)  # another replica's channel is free
    assert gate.admit(plan(queue_s=0.030), 10.0)  # hides 18 ms after the first plan's load
    assert gate.channel_free[("a", 0)] == pytest.approx(10.022)
    assert gate.expected_s(0.010, 0.0, ("c", 0), 10.0) == 0.0  # the router counts only what is issued
    assert gate.expected_s(0.010, 0.050, ("c", 0), 10.0) == pytest.approx(0.010)


def test_a_losing_kind_is_throttled_to_probes_and_recovers():
    gate = PrefetchGate(delay_s=0.002, margin_s=0.001)
    for _ in range(MIN_OUTCOMES):
        gate.outcome(False)
    assert gate.is_throttled and gate.payoff_ratio == 0.0
    t = 10.0
    issued = []
    for _ in range(2 * PROBE_EVERY):
        t += 1.0  # the channel is free again each time: every plan passes the gain test
        issued.append(gate.admit(plan(), t))
    assert sum(issued) == 2 and gate.throttled == 2 * PROBE_EVERY - 2  # one probe in PROBE_EVERY
    assert gate.expected_s(0.010, 0.050, ("a", 0), t) == 0.0  # a router does not count on it
    for _ in range(MIN_OUTCOMES):  # the probes pay off: the ratio climbs back over the floor
        gate.outcome(True)
    assert gate.payoff_ratio == 0.5 and not gate.is_throttled
    assert gate.admit(plan(), t + 1.0)
    assert gate.report() == {"declined": 0, "throttled": 2 * PROBE_EVERY - 2, "payoff_ratio": 0.5}
