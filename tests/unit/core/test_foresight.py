"""Eviction foresight (kvidx.core.foresight): blocks that prefills routed to a full replica will evict
before the routed request arrives are not credited, and the answer says so (evicting_tokens)."""

import random

import pytest

from kvidx.core import walk
from kvidx.core.foresight import Foresight, Order, PyOrder, PyRecency, Recency
from kvidx.core.shard import ModelShard
from schemas.events import SCHEMA_VERSION, BlocksRemoved, BlocksStored, EventBatch

P = [100, 101, 102, 103]  # an older conversation's chain
Q = [200, 201, 202, 203]  # a newer one
W = [300, 301, 302, 303, 304, 305]  # a new prompt routed in a burst


def batch(replica, seq, events):
    return EventBatch(SCHEMA_VERSION, "m", replica, 0, 1, seq, 0.0, 0.0, 16, events)


def stored(hashes, parent=None):
    return BlocksStored("GPU", 0, hashes, parent, 0)


def answer(shard, hashes, now):
    (a,) = [a for a in walk.lookup(shard, hashes, len(hashes) * 16 + 1, now) if a.replica == "r"]
    return a


def full_replica() -> ModelShard:
    """Replica r holding P, then Q, at its capacity of 8 blocks (it evicted Q's last block for Z).
    Foresight starts with the model's first route (here P's, before the engine reported it)."""
    s = ModelShard("m", 16)
    s.add_pending("r", 0, P, 65, credited=0, expires=0.5)
    s.apply(batch("r", 0, [stored(P)]), 0.0)
    s.apply(batch("r", 1, [stored(Q)]), 0.0)
    s.apply(batch("r", 2, [BlocksRemoved("GPU", 0, [Q[3]]), stored([900])]), 0.0)
    return s


def test_a_burst_credits_only_what_the_first_prefill_leaves():
    s = full_replica()
    assert answer(s, P, 1.0).resumable_tokens == 64
    # a router sends W there: 6 new blocks into a full cache of 8 evict the 6 oldest (P's four,
    # deepest first, then Q's two deepest left)
    s.add_pending("r", 0, W, len(W) * 16 + 1, credited=0, expires=10.0)
    a = answer(s, P, 1.0)
    assert (a.resumable_tokens, a.cached_tokens, a.evicting_tokens) == (0, 0, 64)
    b = answer(s, Q[:3], 1.0)
    assert (b.resumable_tokens, b.evicting_tokens) == (16, 32)
    assert walk.credited(s, P, 65, "r", now=1.0) == 0
    # the engine's step arrives: the evictions it made and W stored; nothing left to foresee
    s.apply(batch("r", 3, [BlocksRemoved("GPU", 0, [*P, Q[2], Q[1]]), stored(W)]), 1.5)
    a = answer(s, P, 2.0)
    assert (a.resumable_tokens, a.evicting_tokens) == (0, 0)
    b = answer(s, Q[:3], 2.0)
    assert (b.resumable_tokens, b.evicting_tokens) == (16, 0)


def test_no_discount_with_room_without_routes_or_after_expiry():
    s = full_replica()
    s.add_pending("r", 0, W, len(W) * 16 + 1, credited=0, expires=10.0)
    assert answer(s, P, 10.0).evicting_tokens == 0  # the route expired unreported: no demand left
    t = ModelShard("m", 16)  # never evicted: its capacity is not known, nothing is foreseen
    t.apply(batch("r", 0, [stored(P)]), 0.0)
    t.add_pending("r", 0, W, len(W) * 16 + 1, credited=0, expires=10.0)
    assert answer(t, P, 1.0).resumable_tokens == 64
    u = full_replica()  # no route since the first: nothing known to be coming
    assert answer(u, P, 1.0).evicting_tokens == 0
    v = ModelShard("m", 16)  # no route at all: foresight keeps nothing
    v.apply(batch("r", 0, [stored(P)]), 0.0)
    assert not v.foresight.active and not v.foresight.slots


def test_a_route_touches_what_it_reuses():
    s = full_replica()
    # a prompt extending P is routed first: P becomes the most recent, so W's prefill evicts Q and Z
    s.add_pending("r", 0, [*P, 500], 81, credited=64, expires=10.0)
    s.add_pending("r", 0, W[:3], 49, credited=0, expires=10.0)  # 4 new blocks in all: Q and Z go
    assert answer(s, P, 1.0).resumable_tokens == 64
    assert answer(s, Q[:3], 1.0).evicting_tokens == 48


@pytest.mark.parametrize("recency", [PyRecency, Recency])
def test_order_and_trust(recency):
    f = Foresight()
    f.recency_type = recency
    f.stored(0, 0, [1, 2, 3], deepest_first=True, held_before=0)
    f.stored(0, 0, [4, 5], deepest_first=False, held_before=3)
    f.settle()  # an engine batch ends: 5 held
    assert f.slots[(0, 0)].order.head(99) == [3, 2, 1, 4, 5]
    f.removed(0, 0, [3])
    f.stored(0, 0, [6], deepest_first=True, held_before=4)
    f.settle()  # capacity 5 learned
    f.routed(0, 0, [], [7, 8], expires=5.0, deepest_first=True)
    masks, pressure = f.doomed(1.0)
    assert masks == {0: {2: 1, 1: 1}} and pressure == {0: 2}
    f.removed(0, 0, [2])  # the engine's step: one eviction, 7 stored; only 8 still coming
    f.stored(0, 0, [7], deepest_first=True, held_before=4)
    f.settle()
    assert f.doomed(1.0) == ({0: {1: 1}}, {0: 1})
    f.removed(0, 0, [1])  # a block evicted while another is stored again as an extra copy:
    f.copied(0, 0, [4], deepest_first=True)  # as full as before, and 4 is the newest now
    f.settle()
    assert f.slots[(0, 0)].order.head(99) == [5, 6, 8, 7, 4]
    assert f.doomed(1.0) == ({0: {5: 1}}, {0: 1})
    f.uncopied(0, 0, [4])  # the engine evicted that copy: room for 8
    assert f.doomed(1.0) == ({}, {})
    f.cleared(0)
    assert f.doomed(1.0) == ({}, {})
    # a slot that held blocks before foresight saw it waits until those are gone
    f.stored(1, 0, [10], deepest_first=True, held_before=2)
    f.settle()
    f.removed(1, 0, [11])
    f.routed(1, 0, [], [12, 13, 14], expires=5.0, deepest_first=True)
    assert f.doomed(1.0)[1] == {}
    f.removed(1, 0, [15])  # the second unknown block gone: the order is whole
    assert f.doomed(1.0)[1] == {1: 1}


def test_real_recordings_with_routes_keep_their_agreement():
    """Routes recorded on real vLLM recordings: foresight must not cut real reuse. Hybrid models
    (gemma2: sliding window + full attention; Qwen3-Next: state space + full attention, one with
    evictions) keep one order per replica for all groups (their shared pool): per-group orders had
    cut the gemma2 concurrency-4 recall from 0.990 to 0.848."""
    from kvidx.shadow import run_shadow_engine
    from tests.helpers import FIXTURES, GEMMA, LLAMA

    v032 = FIXTURES / "vllm-0.32"
    cases = ((LLAMA, 1.0, False), (GEMMA, 0.989, True), (v032 / "gemma2_swa_c1", 1.0, True),
             (v032 / "qwen3next_c1_evict", 1.0, True))
    for fixture, recall, pooled in cases:
        result, shard = run_shadow_engine("vllm", fixture / "frames.jsonl", fixture / "requests.jsonl",
                                          pending_ttl=2.0)
        s = result.agreement.summary()
        assert s["recall"] >= recall and s["over_credit"] <= 0.004, (fixture.name, s)
        assert shard.foresight.active and shard.foresight.slots
        assert shard.foresight.pooled == pooled


def hybrid_stored(hashes, group, parent=None):
    kind, window = ("full_attention", None) if group == 0 else ("sliding_window", 32)
    return BlocksStored("GPU", group, hashes, parent, 0, group_kind=kind, sliding_window=window)


def test_a_hybrid_replica_has_one_pool_in_vllms_free_order():
    """A hybrid model's groups share the replica's pool: one order, keyed by (group, hash), in the
    order vLLM frees a prefill's blocks (window runs before the last first, as the prefill moved on;
    then group by group, deepest first), and one capacity. A burst routed there discounts the
    oldest blocks of any group, and a window group's missing window cuts the credit."""
    f = Foresight()
    f.pool()
    # one prefill in two chunks: full attention 0..3 (two events), window runs [2, 3] then [12, 13]
    f.stored(1, 0, [10, 11], True, 0)
    f.stored(1, 1, [2, 3], True, 0, freed_early=True)
    f.stored(1, 0, [12, 13], True, 0)
    f.stored(1, 1, [12, 13], True, 0, freed_early=True)
    f.settle()
    (r,) = f.slots.values()
    g1 = 1 << 64
    assert r.order.head(8) == [g1 | 3, g1 | 2, 13, 12, 11, 10, g1 | 13, g1 | 12]
    assert r.peak == 8
    f.removed(1, 1, [2])  # evicted: the pool is full at 8 blocks
    f.routed(1, 0, [], [40, 41], expires=5.0, deepest_first=True)
    masks, pressure = f.doomed(1.0)
    assert pressure == {1: 1} and masks == {1: {3: 2}}  # one over: the window run's last block goes

    s = ModelShard("m", 16)
    s.add_pending("r", 0, [10, 11, 12], 49, credited=0, expires=0.5)  # foresight starts
    s.apply(batch("r", 0, [hybrid_stored([50], 0), hybrid_stored([50], 1), hybrid_stored([10, 11, 12, 13], 0),
                           hybrid_stored([12, 13], 1, 11)]), 0.0)
    s.apply(batch("r", 1, [BlocksRemoved("GPU", 0, [50]), BlocksRemoved("GPU", 1, [50]),
                           hybrid_stored([20], 0), hybrid_stored([20], 1)]), 0.0)
    assert s.foresight.pooled
    prompt = [10, 11, 12, 13, 14]
    assert answer(s, prompt, 1.0).resumable_tokens == 64
    # a burst of three new full-attention blocks into the full pool of 8: the three oldest go (13,
    # 12 and 11, deepest first); the window before any later boundary is then gone too
    s.add_pending("r", 0, [30, 31, 32], 49, credited=0, expires=10.0)
    a = answer(s, prompt, 1.0)
    assert (a.resumable_tokens, a.evicting_tokens) == (0, 64)
    assert walk.credited(s, prompt, 81, "r", now=1.0) == 0


@pytest.mark.skipif(Order is PyOrder, reason="kvidx_native is not built")
def test_the_compiled_order_agrees_with_the_reference():
    rng = random.Random(5)
    for _ in range(30):
        a, b = PyOrder(), Order()
        for _ in range(300):
            hs = rng.sample(range(1, 60), rng.randrange(0, 8)) + [rng.getrandbits(64)] * rng.randrange(0, 2)
            op = rng.randrange(4)
            if op == 0:
                rev, mv = rng.random() < 0.5, rng.random() < 0.5
                assert a.append(hs, rev, mv) == b.append(hs, rev, mv)
            elif op == 1:
                rev = rng.random() < 0.5
                a.touch(hs, rev)
                b.touch(hs, rev)
            elif op == 2:
                assert a.discard(hs) == b.discard(hs)
            else:
                k = rng.randrange(0, 70)
                assert a.head(k) == b.head(k)
            assert len(a) == len(b) and all((h in a) == (h in b) for h in hs)
        assert a.head(999) == b.head(999)


def _recency_state(r) -> tuple:
    return (r.order.head(len(r.order)), dict(r.unconfirmed), dict(r.copies), dict(r.markers), r.peak, r.full,
            r.evicting, r.untrusted, r.extra, r.transient, r.held(), r.overflow())


@pytest.mark.skipif(Recency is PyRecency, reason="kvidx_native is not built")
@pytest.mark.parametrize("seed", range(6))
def test_the_compiled_recency_agrees_with_the_reference(seed):
    """Every method of kvidx_native.Recency against PyRecency's, on random runs (routes, stores,
    evictions, copies, expiries, batch ends, doomed heads), state compared after every step."""
    rng = random.Random(seed)
    for _ in range(10):
        untrusted = rng.choice([0, 0, 3])
        a, b = PyRecency(untrusted), Recency(untrusted)
        for step in range(300):
            hs = rng.sample(range(1, 40), rng.randrange(0, 8)) + [rng.getrandbits(64)] * rng.randrange(0, 2)
            op = rng.randrange(9)
            flag = rng.random() < 0.5
            for r in (a, b):
                if op == 0:
                    r.stored(hs, flag)
                elif op == 1:
                    r.removed(hs)
                elif op == 2:
                    r.copied(hs, flag)
                elif op == 3:
                    r.uncopied(hs)
                elif op == 5:
                    r.expire(hs, float(step % 9))
                elif op == 6:
                    r.settle(flag)
                elif op == 7:
                    r.release(hs)
            if op == 4:  # a route: touched blocks, then incoming ones
                cut = rng.randrange(0, len(hs) + 1)
                args = (hs[:cut], hs[cut:], float(step % 7), flag, step % 3)
                assert a.routed(*args) == b.routed(*args)
            if op == 8:
                room = a.overflow()
                assert a.doomed(room) == b.doomed(room)
            assert _recency_state(a) == _recency_state(b), f"step {step} op {op}"
