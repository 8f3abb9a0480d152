"""The chaos campaign's pure parts (bench/chaos.py): the seeded fault schedule and the recovery time it
reports. The campaign itself runs in tests/integration/test_chaos.py."""

import importlib.util
import sys
import time

from tests.helpers import ROOT

_spec = importlib.util.spec_from_file_location("chaos", ROOT / "bench" / "chaos.py")
chaos = importlib.util.module_from_spec(_spec)
sys.modules["chaos"] = chaos  # its dataclasses look their module up
_spec.loader.exec_module(chaos)

RELAYS = ["chaos-a-e0", "chaos-a-e1", "chaos-b-e0", "chaos-b-e1"]
WORKERS = ["worker-0", "worker-1"]
INSTANCES = ["serve-0", "serve-1"]


def schedule(seed, seconds):
    return chaos.plan(seed, seconds, RELAYS, WORKERS, INSTANCES)


def brokers_of(f):
    return [k for k in [f.kind, *(p.kind for p in f.parts)] if k in chaos.BROKER_KINDS]


def test_the_schedule_is_the_seeds():
    assert [f.describe() for f in schedule(7, 600)] == [f.describe() for f in schedule(7, 600)]
    assert [f.describe() for f in schedule(7, 600)] != [f.describe() for f in schedule(8, 600)]


def test_without_a_mount_no_disk_full():
    kinds = tuple(k for k in chaos.INJECTED if k != "disk_full")
    for f in chaos.plan(3, 1800, RELAYS, WORKERS, INSTANCES, kinds=kinds):
        assert "disk_full" not in [f.kind, *(p.kind for p in f.parts)]


def test_one_broker_fault_at_a_time_with_time_to_catch_up():
    for seed in range(20):
        busy_until = -1.0
        for f in schedule(seed, 1800):
            if brokers_of(f):
                assert len(brokers_of(f)) == 1, f.describe()
                assert f.at >= busy_until, (seed, f.describe())
                busy_until = f.at + f.hold_s + 20
            for p in [f, *f.parts]:
                if p.kind == "broker_stop":
                    assert 5 <= p.hold_s <= 60


def test_the_ci_campaign_meets_every_injected_kind():
    """tests/integration/test_chaos.py runs 3 minutes of seed 6: every kind the campaign injects."""
    kinds = {f.kind for f in schedule(6, 180)}
    assert kinds == set(chaos.INJECTED)
    assert all(f.at < 150 for f in schedule(6, 180))  # 30 s of the run left to heal


def test_an_hour_has_at_least_200_faults():
    assert len(schedule(1, 3600)) >= 200


def answers(*rows):
    """(t, exact) rows, or (t, exact, instance); a 404 is (t, "blind", instance)."""
    out = []
    for t, exact, *inst in rows:
        out.append(chaos.Answer(t, exact is True, exact == "blind", inst[0] if inst else "serve-0"))
    return out


def times(a):
    return [x.t for x in a]


def recovery(a, start, end, instances=("serve-0",)):
    return chaos._recovery(a, times(a), start, end, list(instances))


def test_recovery_is_from_the_fault_to_a_streak_of_exact_answers_after_it_ended():
    a = answers((0, True), (1, False), (2, False), (3, True), (4, True), (5, True), (6, True), (7, True))
    # the fault at 0.5 ended at 2.5; the streak starts at 3
    assert recovery(a, 0.5, 2.5) == 2.5
    # an inexact answer inside the streak pushes it later
    b = answers((0, True), (1, False), (3, True), (4, False), (5, True), (6, True), (7, True), (8, True),
                (9, True))
    assert recovery(b, 0.5, 2.5) == 4.5


def test_every_instance_must_answer_exactly_again():
    """One instance answers exactly while the other still answers 404 (rebuilding): not healed until
    the other's streak."""
    rows = [(0, True, "serve-0"), (1, "blind", "serve-1")]
    rows += [(2 + k, True, "serve-0") for k in range(6)]
    rows += [(8, "blind", "serve-1"), (9, True, "serve-1")]
    rows += [(10 + k, True, "serve-1") for k in range(4)]
    a = answers(*rows)
    assert recovery(a, 0.5, 1.5, ("serve-0", "serve-1")) == 8.5
    assert sum(x.blind for x in a) == 2


def test_a_fault_no_answer_noticed_recovers_in_no_time():
    a = answers(*[(t, True) for t in range(10)])
    assert recovery(a, 0.5, 3.5) == 0.0


def test_a_fault_never_healed_counts_to_the_last_answer():
    a = answers((0, True), (1, False), (2, True), (3, False), (4, False))
    assert recovery(a, 0.5, 1.5) == 3.5


def test_the_truth_is_what_the_engine_held_in_the_window():
    """The checker's ground truth: an engine's cached prefix of a prompt, in index blocks, in every
    state it was in during a window (and the answer a lookup must not exceed)."""
    import time

    from kvidx.core.hashing import prompt_hashes
    from kvidx.engines.vllm.sim import SimVllmEngine

    e = SimVllmEngine(num_blocks=4, block_size=chaos.ENGINE_BLOCK, endpoint="tcp://127.0.0.1:*")
    try:
        truth = chaos.Truth({"r": e})
        first = list(range(100))  # 3 engine blocks of KV (100 prompt + 5 output - 1 tokens)
        t0 = time.time()
        truth.serve("r", first, [1, 2, 3, 4, 5])
        hashes = prompt_hashes(first, chaos.INDEX_BLOCK)
        assert truth.now("r", hashes) == 96  # 3 engine blocks = 6 index blocks of the 6 the prompt has
        assert truth.credits("r", hashes, t0 - 10, t0 - 5) == [0]  # before: nothing cached
        t1 = time.time()
        other = list(range(1000, 1100))
        truth.serve("r", other, [1])  # 4 blocks in all: the first prompt's blocks are evicted
        assert truth.now("r", hashes) < 96
        assert max(truth.credits("r", hashes, t1 - 0.001, time.time())) == 96  # within the lag: allowed
    finally:
        e.close()


def test_the_truth_knows_a_half_block_two_engine_blocks_share():
    """An index block is held while any cached engine block holds it: the first half of two engine
    blocks (same first 16 tokens, different last 16) is held by either (a lookup may credit it)."""
    from kvidx.core.hashing import prompt_hashes
    from kvidx.engines.vllm.sim import SimVllmEngine

    e = SimVllmEngine(num_blocks=8, block_size=chaos.ENGINE_BLOCK, endpoint="tcp://127.0.0.1:*")
    try:
        truth = chaos.Truth({"r": e})
        a = list(range(64))
        b = list(range(48)) + list(range(500, 516))  # block 2's first half as a's, its second other
        truth.serve("r", a, [1])
        truth.serve("r", b, [1])
        probe = list(range(48)) + list(range(900, 916))  # a third second half: no engine block has it
        assert truth.now("r", prompt_hashes(probe, chaos.INDEX_BLOCK)) == 48
        assert truth.now("r", prompt_hashes(a, chaos.INDEX_BLOCK)) == 64
        assert truth.now("r", prompt_hashes(b, chaos.INDEX_BLOCK)) == 64
    finally:
        e.close()


def test_the_truth_keeps_a_shared_half_block_when_the_last_served_engine_block_goes_first():
    """Eviction out of recency order (vLLM frees a request's blocks tail first; an offload tier drops
    what it likes): the engine block that last stored an index block is gone, another engine block
    holding the same first half is still cached, and the index block is still held. A checker that
    kept one engine block per index block (the last one served) would say it is gone."""
    from kvidx.core.hashing import prompt_hashes
    from kvidx.engines.vllm.sim import SimVllmEngine, chain_digests

    e = SimVllmEngine(num_blocks=8, block_size=chaos.ENGINE_BLOCK, endpoint="tcp://127.0.0.1:*")
    try:
        truth = chaos.Truth({"r": e})
        a = list(range(64))
        b = list(range(48)) + list(range(500, 516))  # b's second engine block shares a's first half
        truth.serve("r", a, [1])
        truth.serve("r", b, [1])  # the last to store index block 2
        b_second = chain_digests(b, chaos.ENGINE_BLOCK, e._root)[1]
        with truth.lock:  # the engine drops b's second block, a's stays
            state = truth.states["r"][-1]
            assert b_second in state
            truth.times["r"].append(time.time())
            truth.states["r"].append(state - {b_second})
        assert truth.now("r", prompt_hashes(b, chaos.INDEX_BLOCK)) == 48  # block 2 through a's
        assert truth.now("r", prompt_hashes(a, chaos.INDEX_BLOCK)) == 64
    finally:
        e.close()
