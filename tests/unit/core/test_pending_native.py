"""Pending credit's compiled bookkeeping (native/src/credits.rs) against its Python reference
(`_Credits.add_reference`, `confirm_reference`, `release_reference`): random routes, confirmations and
expiries over slots past 64 bits, both ways, must leave the same counts and masks after every step."""

import random

import pytest

from kvidx.core import pending
from kvidx.core.pending import _Credits

pytestmark = pytest.mark.skipif(pending._native is None, reason="kvidx_native is not built here")


@pytest.mark.parametrize("seed", range(6))
def test_compiled_add_and_confirm_leave_the_references_state(seed):
    r = random.Random(seed)
    hashes = [r.getrandbits(64) for _ in range(40)]
    native, ref = _Credits(), _Credits()
    for step in range(400):
        slot = r.choice([0, 1, 5, 63, 64, 70, 130])
        run = r.sample(hashes, r.randint(0, 12))
        x = r.random()
        if x < 0.45:
            native.add(slot, run)
            ref.add_reference(slot, tuple(run))  # any iterable, as the routes pass them
        elif x < 0.85:
            native.confirm(slot, run)
            ref.confirm_reference(slot, run)
        else:  # a route expires: one count each
            native.release(slot, tuple(run))
            ref.release_reference(slot, run)
        assert native.refs == ref.refs and native.masks == ref.masks, f"step {step}"
    assert ref.masks  # something stayed pending: the comparison saw both kinds of state
