"""The simulator's eviction advice ledger (kvidx/sim/advice.py): per session, followed, regretted when
the session comes back through its advised blocks, and what its return's turn paid for them."""

from __future__ import annotations

import pytest

from kvidx.sim.advice import EvictionLedger
from kvidx.sim.serving import ServingModel


def ledger() -> EvictionLedger:
    # 1,000 tokens/s of prefill, CPU loads at 10,000; index blocks of 100 tokens
    return EvictionLedger(ServingModel(["a"], 4, 1000.0, {"CPU": 10_000.0}, 0.001, 2.0), 100)


def test_a_session_advised_away_that_comes_back_is_regretted_with_the_seconds_its_turn_paid():
    e = ledger()
    for key in (("m", 1), ("m", 2), ("m", 3)):
        e.issued.add(key)
    e.follow(("m", 1), 13)  # session 1's prompt: blocks 11, 12, 13 (300 tokens)
    e.follow(("m", 2), 11)  # session 2's: block 11, a prefix of session 1's
    # a request through both: 500 tokens, 100 reused from GPU, 100 from the CPU: of the longest advised
    # prefix (300 tokens) 100 loaded (0.01 s) and 100 recomputed (0.1 s), counted once
    e.came_back([11, 12, 13, 14, 15], 200, {"GPU": 100, "CPU": 100})
    assert e.lost_s == pytest.approx(0.11)
    c = e.counts()
    assert (c.issued, c.followed, c.regretted, c.paid_off) == (3, 2, 2, 0)
    # advice followed for session 3, which never comes back: it paid off; a request through blocks
    # no advice named changes nothing
    e.follow(("m", 3), 31)
    e.came_back([21, 22], 0, {})
    c = e.counts()
    assert (c.followed, c.regretted, c.paid_off) == (3, 2, 1) and c.lost_s == pytest.approx(0.11)
    assert c.report()["lost_s"] == pytest.approx(0.11)


def test_a_return_served_from_gpu_costs_nothing():
    e = ledger()
    e.follow(("m", 1), 12)
    e.came_back([11, 12, 13], 300, {"GPU": 300})  # the LRU kept the blocks: the advice cost no time
    assert e.lost_s == 0.0 and e.counts().regretted == 1
