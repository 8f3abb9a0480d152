"""Pending credit's compiled bookkeeping (kvidx_native.Credits, native/src/credits.rs) against its Python
reference (kvidx.core.pending.PyCredits): random routes, confirmations and expiries over slots past 64
bits, both ways, must leave the same counts and masks after every step."""

import random

import pytest

from kvidx.core import pending
from kvidx.core.pending import PyCredits

pytestmark = pytest.mark.skipif(pending.Credits is PyCredits, reason="kvidx_native is not built here")


@pytest.mark.parametrize("seed", range(6))
def test_compiled_credits_leave_the_references_state(seed):
    r = random.Random(seed)
    hashes = [r.getrandbits(64) for _ in range(40)]
    native, ref = pending.Credits(), PyCredits()
    for step in range(400):
        slot = r.choice([0, 1, 5, 63, 64, 70, 130])
        run = r.sample(hashes, r.randint(0, 12))
        x = r.random()
        if x < 0.45:
            native.add(slot, run)
            ref.add(slot, tuple(run))  # any iterable, as the routes pass them
        elif x < 0.85:
            native.confirm(slot, run)
            ref.confirm(slot, run)
        else:  # a route expires: one count each
            native.release(slot, tuple(run))
            ref.release(slot, run)
        assert native.refs == ref.refs and dict(native.masks.items()) == ref.masks, f"step {step}"
        assert bool(native.masks) == bool(ref.masks) and len(native.masks) == len(ref.masks)
    assert ref.masks  # something stayed pending: the comparison saw both kinds of state


def test_a_hash_that_is_not_a_u64_is_refused_before_anything_changes():
    c = pending.Credits()
    with pytest.raises((OverflowError, TypeError)):
        c.add(0, [1, -2])
    assert not c.masks and c.refs == {}
