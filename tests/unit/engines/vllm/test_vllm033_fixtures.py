"""vLLM 0.33 conformance: event streams made with vLLM 0.33.0's own event structs and block hasher
(tests/fixtures/vllm-0.33/, its README says how; no 0.33 CPU build exists to record a real engine),
with EAGLE's lookahead (L = 1), multi-module MTP's (L = 3) and none, over prompts that diverge at,
just before and just after block boundaries and L tokens after them. `kvidx shadow` with its
defaults credits exactly what the engine reuses on each; a relay pinned to 0.32 refuses the
lookahead streams (dead letters) instead of over-crediting them."""

from __future__ import annotations

import pytest

from kvidx.engines import RelayOptions
from kvidx.shadow import run_shadow_engine
from tests.helpers import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "vllm-0.33"
VARIANTS = ["eagle_L1", "mtp_L3", "no_lookahead_L0"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_shadow_with_defaults_is_exact(variant):
    d = FIXTURES / variant
    res, shard = run_shadow_engine("vllm", d / "frames.jsonl", d / "requests.jsonl")
    s = res.agreement.summary()
    assert res.dead_letters == 0
    assert s["requests"] >= 150 and s["reused_tokens"] > 0
    assert s["recall"] == 1.0 and s["over_credit"] == 0.0 and s["exact_requests"] == s["requests"], s
    assert shard.lookahead == int(variant.rsplit("L", 1)[1])


@pytest.mark.parametrize("variant", ["eagle_L1", "mtp_L3"])
def test_a_relay_pinned_to_032_refuses_lookahead(variant):
    d = FIXTURES / variant
    res, _ = run_shadow_engine("vllm", d / "frames.jsonl", d / "requests.jsonl",
                               options=RelayOptions(engine_version="0.32.0"))
    assert res.set_aside.get(("wrong_engine", "stored"), 0) > 0 and res.dead_letters == 0
    assert res.agreement.summary()["over_credit"] == 0.0
