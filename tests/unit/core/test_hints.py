"""Prefetch hints on the pure shard's answers: which runs to load, their load time at the model's
rates, and the benefit the queue wait can hide."""

import pytest

from kvidx.core import walk
from kvidx.core.hints import prefetch_hint
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
