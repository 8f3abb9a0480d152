"""The simulator's serving time (kvidx/sim/serving.py): a FIFO prefill server per replica that loads
reused tokens held below GPU memory at their tier's rate, and prefetches that overlap that load with
the queue wait."""

from __future__ import annotations

import pytest

from kvidx.core.hints import prefetch_hint
from kvidx.sim.serving import ServingModel
from schemas.answers import Freshness, ReplicaAnswer, Tier


def model(n: int = 4) -> ServingModel:
    # 1,000 tokens/s of prefill; the CPU loads 10,000 tokens/s, the disk 2,000; 2 bytes per token
    return ServingModel(["a", "b"], n, 1000.0, {"CPU": 10_000.0, "DISK": 2000.0}, 0.001, 2.0)


def answer(replica: str, runs: list[tuple[str, int]]) -> ReplicaAnswer:
    tokens = sum(k for _, k in runs)
    return ReplicaAnswer(replica, 0, tokens, [Tier(t, k) for t, k in runs], tokens, tokens, [], 0, 0, False,
                         [], Freshness(None, None, 0, 0, 0))


def test_reused_tokens_below_gpu_load_at_the_requests_turn():
    sv = model()
    # 1,000 prompt tokens: 200 from GPU, 300 from the CPU (0.03 s), 400 from disk (0.2 s), 100 computed
    # (0.1 s)
    sv.admit(0, "a", 0.0, 1000, 900, {"GPU": 200, "CPU": 300, "DISK": 400}, 0)
    assert sv.ttft[0] == pytest.approx(0.33)
    # the next request on the same replica queues behind the whole turn, load included
    sv.admit(1, "a", 0.1, 100, 0, {}, 0)
    assert sv.ttft[1] == pytest.approx(0.33 - 0.1 + 0.1)
    assert sv.loaded_tokens == 700 and sv.bytes_moved == 1400
    assert sv.report()["gpu_share_of_reused"] == pytest.approx(200 / 900)


def test_a_followed_prefetch_hides_its_load_under_the_queue_wait():
    sv = model()
    sv.admit(0, "a", 0.0, 1000, 0, {}, 0)  # the replica is busy until 1.0 s
    ans = answer("a", [("GPU", 200), ("DISK", 400)])
    hint = prefetch_hint(ans, sv.pricer, sv.queue_s("a", 0.0))
    assert hint is not None and hint.tokens == 400 and hint.load_s == pytest.approx(0.2)
    sv.admit(1, "a", 0.0, 700, 600, {"GPU": 200, "DISK": 400}, 0, hint, followed_at=0.01)
    # the load ended at 0.21 s, long before the request's turn at 1.0 s: only its 100 tokens remain
    assert sv.ttft[1] == pytest.approx(1.0 + 0.1)
    p = sv.prefetch
    assert (p.followed, p.paid_off, p.wasted_tokens) == (1, 1, 0) and p.saved_s == pytest.approx(0.2)
    assert sv.report()["gpu_share_of_reused"] == 1.0


def test_a_prefetch_still_loading_at_the_turn_is_waited_for_and_the_same_without_a_queue():
    sv = model()
    ans = answer("b", [("DISK", 400)])
    hint = prefetch_hint(ans, sv.pricer, 0.0)
    # an idle replica: the turn comes at once, the prefetch (starting 0.05 s later) is waited for in full
    sv.admit(0, "b", 0.0, 500, 400, {"DISK": 400}, 0, hint, followed_at=0.05)
    assert sv.ttft[0] == pytest.approx(0.05 + 0.2 + 0.1)
    assert sv.prefetch.paid_off == 0 and sv.prefetch.saved_s == 0.0
    # not followed: the load stays at the turn, as without hints
    sv2 = model()
    sv2.admit(0, "b", 0.0, 500, 400, {"DISK": 400}, 0, hint, None)
    assert sv2.ttft[0] == pytest.approx(0.3) and sv2.prefetch.followed == 0


def test_prefetched_tokens_the_request_did_not_reuse_are_wasted_but_still_moved():
    sv = model()
    hint = prefetch_hint(answer("a", [("CPU", 500)]), sv.pricer, 1.0)
    # the engine evicted part of it meanwhile: only 200 of the 500 hinted tokens were reused
    sv.admit(0, "a", 0.0, 600, 200, {"CPU": 200}, 0, hint, followed_at=0.0)
    assert sv.prefetch.wasted_tokens == 300 and sv.loaded_tokens == 500


def test_a_prefetch_the_request_does_not_reuse_holds_the_channel_not_the_turn():
    sv = model()
    hint = prefetch_hint(answer("a", [("DISK", 1000)]), sv.pricer, 0.0)  # 0.5 s of disk load
    # the index was wrong: the engine had all of it on GPU
    sv.admit(0, "a", 0.0, 1100, 1000, {"GPU": 1000}, 0, hint, followed_at=0.0)
    assert sv.ttft[0] == pytest.approx(0.1) and sv.prefetch.wasted_tokens == 1000
    assert sv.channel_free["a"] == pytest.approx(0.5)


def test_a_prefetch_that_came_late_is_regretted_by_the_seconds_it_added():
    sv = model()
    hint = prefetch_hint(answer("b", [("DISK", 400)]), sv.pricer, 0.0)  # 0.2 s of disk load
    # an idle replica: its turn is at once; the hint reaches it 0.05 s later: the request waits 0.25 s
    # for what the turn would have loaded in 0.2 s
    sv.admit(0, "b", 0.0, 500, 400, {"DISK": 400}, 0, hint, followed_at=0.05)
    p = sv.prefetch
    assert (p.paid_off, p.regretted) == (0, 1) and p.lost_s == pytest.approx(0.05)
    assert p.saved_s == 0.0 and p.wasted_s == 0.0 and sv.placement.lost_s == 0.0


def test_a_wasted_prefetch_costs_the_next_prefetch_its_wait_on_the_channel():
    sv = model()
    # the index was wrong: 1,000 disk tokens (0.5 s of channel) prefetched, the engine had them on GPU
    wrong = prefetch_hint(answer("a", [("DISK", 1000)]), sv.pricer, 0.0)
    sv.admit(0, "a", 0.0, 1100, 1000, {"GPU": 1000}, 0, wrong, followed_at=0.0)  # busy until 0.1 s
    assert sv.prefetch.wasted_s == pytest.approx(0.5) and sv.prefetch.lost_s == 0.0
    # the next request's 400 disk tokens (0.2 s) start loading at 0.5 s, done at 0.7 s: its turn (0.1 s)
    # waits 0.6 s instead of loading 0.2 s: 0.4 s lost, its TTFT 0.8 s against 0.4 s without the hint
    hint = prefetch_hint(answer("a", [("DISK", 400)]), sv.pricer, 0.1)
    sv.admit(1, "a", 0.0, 500, 400, {"DISK": 400}, 0, hint, followed_at=0.0)
    assert sv.ttft[1] == pytest.approx(0.8)
    p = sv.prefetch
    assert p.regretted == 1 and p.lost_s == pytest.approx(0.8 - 0.4) and p.saved_s == 0.0
    assert (p.wasted_tokens, p.wasted_s) == (1000, pytest.approx(0.5))


def test_a_placements_copy_on_the_channel_is_charged_the_prefetch_wait_it_caused():
    sv = model()
    assert sv.reserve_channel("a", 0.0, 0.3, 3000) == pytest.approx(0.3)  # a copy to "a", 0.3 s
    hint = prefetch_hint(answer("a", [("DISK", 400)]), sv.pricer, 0.0)
    # the prefetch starts after the copy, at 0.3 s, done at 0.5 s: TTFT 0.6 s against 0.3 s without
    # the copy (the turn waiting 0.2 s for the load, then 0.1 s of prefill)
    sv.admit(0, "a", 0.0, 500, 400, {"DISK": 400}, 0, hint, followed_at=0.0)
    assert sv.ttft[0] == pytest.approx(0.6)
    assert sv.placement.lost_s == pytest.approx(0.3)
    # the load itself took as long as at the turn: the prefetch lost nothing
    assert sv.prefetch.lost_s == 0.0 and sv.prefetch.regretted == 0
    # the other replica's channel is not the copy's
    other = prefetch_hint(answer("b", [("DISK", 400)]), sv.pricer, 0.0)
    sv.admit(1, "b", 0.0, 500, 400, {"DISK": 400}, 0, other, followed_at=0.0)
    assert sv.placement.lost_s == pytest.approx(0.3)


def test_the_turns_seconds_on_a_prompt_prefix_beyond_gpu_hits():
    sv = model()
    split = {"GPU": 200, "CPU": 300, "DISK": 400}  # 900 reused: 0.03 s of CPU and 0.2 s of disk loads
    assert sv.prefix_turn_s(1000, 900, split) == pytest.approx(0.1 + 0.23)  # the whole turn
    assert sv.prefix_turn_s(200, 900, split) == 0.0  # GPU hits only
    assert sv.prefix_turn_s(550, 900, split) == pytest.approx(350 * 0.23 / 700)  # loads at their mean rate
    assert sv.prefix_turn_s(800, 300, {"GPU": 300}) == pytest.approx(0.5)  # 500 recomputed
    assert sv.prefix_turn_s(800, 500, {"GPU": 200, "CPU": 300}) == pytest.approx(0.3 + 0.03)
