"""Sessions from routing decisions (kvidx/core/sessions.py): continuation by the previous prompt's last
block, recurrence, sharing, eviction advice (demote, then drop; never a shared block) and placement."""

from __future__ import annotations

import pytest

from kvidx.core.sessions import EvictionAdvice, SessionTracker, advice_seconds, worth_advising

SYS = [1, 2, 3]  # a system prompt every session starts with


def test_a_next_turn_continues_its_session_and_sharing_is_counted():
    t = SessionTracker(block_size=16)
    a = t.observe(SYS + [10, 11], "r0", 0.0)
    b = t.observe(SYS + [20], "r1", 1.0)
    assert a.sid != b.sid
    a2 = t.observe(SYS + [10, 11, 12, 13], "r0", 5.0)  # a's next turn: its last block 11 is in there
    assert a2.sid == a.sid and a2.returns == 1 and a2.gap_s == 5.0
    a3 = t.observe(SYS + [10, 11, 12, 13, 14], "r2", 8.0)
    assert a3.sid == a.sid and a3.gap_s == pytest.approx(4.0) and a3.replica == "r2"
    assert t.passes[1] == 2 and t.passes[10] == 1 and t.passes[14] == 1
    assert t.own_blocks(a3) == [10, 11, 12, 13, 14]
    # a prompt that shares only the system prompt starts its own session
    assert t.observe(SYS + [30], "r0", 9.0).sid not in (a.sid, b.sid)


def test_silent_sessions_are_demoted_then_dropped_and_shared_blocks_never_named():
    t = SessionTracker(block_size=16, idle_factor=4.0, idle_s=30.0, drop_factor=4.0)
    t.observe(SYS + [10], "r0", 0.0)
    t.observe(SYS + [10, 11], "r0", 2.0)  # gap 2 s: silent after 8 s
    t.observe(SYS + [20], "r1", 0.0)  # never came back: silent after 30 s
    assert t.eviction_advice(9.0) == []  # 7 s after its last prompt
    adv = t.eviction_advice(10.5)
    assert [(a.replica, a.action, a.hashes, a.tokens) for a in adv] == [("r0", "demote", [10, 11], 32)]
    assert [(a.replica, a.action) for a in t.eviction_advice(31.0)] == [("r1", "demote")]
    # 4 x 8 s after its last prompt: drop, and the session is forgotten
    assert [(a.replica, a.action, a.hashes) for a in t.eviction_advice(35.0)] == [("r0", "drop", [10, 11])]
    assert len(t.sessions) == 1 and 10 not in t.passes and t.passes[1] == 1
    # a session that speaks again is not advised on its old silence
    t.observe(SYS + [20, 21], "r1", 40.0)
    assert t.eviction_advice(100.0) == []  # its gap is now 40 s: silent after 160 s
    # the system prompt is its own now: the only other session through it was forgotten
    assert [(a.action, a.hashes) for a in t.eviction_advice(201.0)] == [("demote", [1, 2, 3, 20, 21])]


def test_keep_advice_for_sessions_due_back_soon():
    t = SessionTracker(block_size=16)
    t.observe(SYS + [10], "r0", 0.0)
    t.observe(SYS + [10, 11], "r0", 3.0)  # due back at 6 s
    t.observe(SYS + [20], "r1", 0.0)  # never came back: nothing to expect
    assert [(a.action, a.hashes) for a in t.keep_advice(4.0, within_s=2.5)] == [("keep", [10, 11])]
    assert t.keep_advice(4.0, within_s=1.0) == []


def test_placement_only_when_the_wait_avoided_exceeds_the_copy():
    t = SessionTracker(block_size=16)
    s = t.observe(SYS + [10], "r0", 0.0)
    assert t.placement(s, {"r0": 5.0, "r1": 0.0}, 1000.0) is None  # never came back
    s = t.observe(SYS + [10, 11], "r0", 1.0)  # 5 blocks, 80 tokens: 0.08 s to copy at 1,000 tokens/s
    # due back in 1 s: of r0's 2 s queue 1 s is left then, of r2's 1.2 s 0.2 s
    p = t.placement(s, {"r0": 2.0, "r1": 1.5, "r2": 1.2}, 1000.0, bytes_per_token=2)
    assert (p.source, p.target, p.tokens, p.bytes) == ("r0", "r2", 80, 160)
    assert p.copy_s == pytest.approx(0.08) and p.benefit_s == pytest.approx(0.8)
    assert t.placement(s, {"r0": 1.05, "r1": 0.0}, 1000.0) is None  # 0.05 s left at r0 < 0.08 s copy
    assert t.placement(s, {"r0": 0.9, "r1": 0.0}, 1000.0) is None  # drained before it is back


def test_placement_weighs_the_wait_by_the_return_rate_and_counts_the_room_it_takes():
    """Issue #41: a copy pays only if the session comes back (its class's measured rate, 1/2 unmeasured)
    and costs the room it takes at the target, priced per token."""
    t = SessionTracker(block_size=16)
    t.observe(SYS + [10], "r0", 0.0)
    s = t.observe(SYS + [10, 11], "r0", 1.0)  # 80 tokens, 0.08 s to copy; 0.8 s of wait avoided
    queues = {"r0": 2.0, "r2": 1.2}
    assert t.placement(s, queues, 1000.0) is not None  # 1/2 x 0.8 s > 0.08 s
    # 0.08 s + 80 x 4 ms of room: 0.4 s, all of the 0.4 s expected
    assert t.placement(s, queues, 1000.0, room_s=0.004) is None
    assert t.placement(s, queues, 1000.0, room_s=0.003) is not None
    cls = t.traffic_class(s)
    t.demoted_by[cls], t.returned_by[cls] = 98, 0  # its class almost never comes back: 1/100
    assert t.placement(s, queues, 1000.0) is None  # 0.008 s expected < 0.08 s copy


def test_eviction_advice_in_seconds_from_the_measured_return_rate():
    t = SessionTracker(block_size=16, idle_s=10.0, min_idle_s=1.0)
    for k in range(4):  # four one-prompt sessions, all silent by 11 s
        t.observe(SYS + [100 + k], "r0", 0.0)
    first = t.eviction_advice(11.0)
    assert len(first) == 4 and all(a.p_return == 0.5 for a in first)  # nothing measured yet: 1/2
    t.observe(SYS + [100, 7], "r0", 12.0)  # one of the demoted sessions comes back
    t.observe(SYS + [200], "r1", 12.0)
    later = [a for a in t.eviction_advice(25.0) if a.replica == "r1"]
    assert later[0].p_return == (1 + 1) / (4 + 2)
    # demote: its room spares 16 tokens of others a reload (1 ms/token); it costs p x the same reload
    benefit, cost = advice_seconds(later[0], 0.001, 0.01, 0.001)
    assert benefit == pytest.approx(16 * 0.001) and cost == pytest.approx(later[0].p_return * 16 * 0.001)
    drop = EvictionAdvice("r0", 0, "drop", [1], 16, 0.0, 0.0, 0.25)
    assert advice_seconds(drop, 0.001, 0.01, 0.001)[1] == pytest.approx(0.25 * 16 * 0.01)


def test_advice_is_issued_only_for_classes_that_seldom_come_back():
    """Issue #41: the return probability is learned per traffic class (how often a session came back),
    and advice is issued only where its benefit is over twice its expected cost."""
    t = SessionTracker(block_size=16, idle_s=10.0, min_idle_s=1.0)
    for k in range(6):  # six one-prompt sessions fall silent and never return
        t.observe(SYS + [100 + k], "r0", 0.0)
    for k in range(6):  # six that came back once, fall silent, and all come back
        t.observe(SYS + [200 + k], "r1", 0.0)
        t.observe(SYS + [200 + k, 300 + k], "r1", 1.0)
    t.eviction_advice(12.0)
    for k in range(6):
        t.observe(SYS + [200 + k, 300 + k, 400 + k], "r1", 13.0)
    assert t.p_return(0) == 1 / 8 and t.p_return(1) == 7 / 8
    t.observe(SYS + [500], "r0", 14.0)  # one of each class falls silent again
    t.observe(SYS + [600], "r1", 14.0)
    t.observe(SYS + [600, 601], "r1", 15.0)
    advice = {a.replica: a for a in t.eviction_advice(30.0) if a.hashes[-1] in (500, 601)}
    assert advice["r0"].p_return == 1 / 8 and advice["r1"].p_return == 7 / 8
    # demote, its reload and its room priced alike (1 ms a token): worth it for the one-shot class only
    assert worth_advising(advice["r0"], 0.001, 0.01, 0.001) == (16 * 0.001, pytest.approx(16 * 0.001 / 8))
    assert worth_advising(advice["r1"], 0.001, 0.01, 0.001) is None
    # a drop is recomputed at ten times the reload: not even for a class that returns 1 time in 8
    drop = EvictionAdvice("r0", 0, "drop", [1], 16, 0.0, 0.0, 1 / 8)
    assert worth_advising(drop, 0.001, 0.01, 0.001) is None


def test_a_prompt_of_another_session_through_demoted_blocks_counts_as_their_return():
    """What a demotion risks is any prompt through its blocks, not only the session's own next one."""
    t = SessionTracker(block_size=16, idle_s=10.0, min_idle_s=1.0)
    t.observe(SYS + [100, 101], "r0", 0.0)
    t.observe(SYS + [200, 201], "r0", 0.0)
    assert len(t.eviction_advice(11.0)) == 2 and t.p_return(0) == 1 / 4
    t.observe(SYS + [100, 555], "r1", 12.0)  # a new conversation branching through block 100
    t.observe(SYS + [100, 101, 7], "r1", 12.5)  # and the advised session itself: counted once
    assert (t.demoted, t.returned) == (2, 1) and t.p_return(0) == 2 / 4


def test_placements_whose_sessions_go_elsewhere_throttle_the_kind():
    """Issue #41: a copy paid off when the session's next prompt went to its target; once most of the
    last ones did not, only one placement in PROBE_EVERY that could pay is issued."""
    from kvidx.core.hints import MIN_OUTCOMES, PROBE_EVERY
    t = SessionTracker(block_size=16)
    issued = []
    for k in range(40):
        first = [1000 * k + 1]
        t.observe(first, "r0", 0.0)
        s = t.observe(first + [1000 * k + 2], "r0", 1.0)  # it came back: recurring
        issued.append(t.placement(s, {"r0": 2.0, "r2": 1.2}, 1000.0) is not None)
        if issued[-1]:
            t.observe(first + [1000 * k + 2, 1000 * k + 3], "r0", 2.0)  # not to the copy's target
    assert issued[:MIN_OUTCOMES] == [True] * MIN_OUTCOMES
    assert sum(issued[MIN_OUTCOMES:]) == (40 - MIN_OUTCOMES) // PROBE_EVERY
    assert t.placement_gate.payoff_ratio == 0.0 and t.placement_gate.throttled > 0


def test_demotions_that_come_back_throttle_eviction_advice_and_silent_ones_pay():
    t = SessionTracker(block_size=16, idle_s=1.0, min_idle_s=1.0)
    adv = EvictionAdvice("r0", 0, "demote", [1, 2], 32, 5.0, 0.0, p_return=0.0)
    assert t.worth_advising(adv, 0.001, 0.002, 0.001) is not None  # nothing to lose: issued
    t.observe([7, 8], "r0", 0.0)
    [a] = t.eviction_advice(1.5)  # silent 1.5 s: demote
    assert a.action == "demote"
    t.observe([7, 8, 9], "r1", 2.0)  # it came back through its demoted blocks: that bet lost
    assert list(t.eviction_gate.outcomes) == [False]
    t.observe([50, 51], "r0", 3.0)
    assert [x.action for x in t.eviction_advice(4.5)] == ["demote"]
    # [50, 51] silent until its drop: that demotion paid off ([7, 8, 9], silent too, is demoted now)
    assert sorted(x.action for x in t.eviction_advice(10.0)) == ["demote", "drop"]
    assert list(t.eviction_gate.outcomes) == [False, True]
