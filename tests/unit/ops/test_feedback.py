"""The feedback's rules (kvidx/ops/feedback.py) without a broker: credit factors from routing
decisions and usage reports, per-prefix caps applied to answers, and, on a simulated fleet, what capping
a replica whose engine reuses nothing of what the index credits gains. Over a real broker:
tests/integration/test_audit.py."""

from index_service.feedback import FeedbackTable
from kvidx.ops.feedback import compute_factors
from kvidx.sim.feedback import feedback_table, measure_feedback
from schemas.answers import Freshness, ReplicaAnswer, Tier
from schemas.feedback import FEEDBACK_VERSION, CreditFactor
from schemas.routes import ROUTES_VERSION, RouteDecision
from schemas.usage import USAGE_VERSION, UsageReport


def test_compute_factors_rules():
    def pair(i, rep, credited, reused, ts=100.0):
        return (RouteDecision(ROUTES_VERSION, f"q{i}", "m", rep, 0, [], 1000, credited, ts, 10.0),
                UsageReport(USAGE_VERSION, f"q{i}", "m", rep, 0, 1000, reused, ts, "vllm"))

    pairs = [pair(i, "liar", 320, 80) for i in range(20)] + [pair(100 + i, "ok", 320, 304) for i in range(20)]
    pairs += [pair(200 + i, "few", 320, 0) for i in range(5)]
    f = {x.replica: x for x in compute_factors(pairs, 110.0, 60.0, min_requests=20)}
    assert f["liar"].factor == 0.25 and f["ok"].factor == 1.0 and f["few"].factor == 1.0
    # credited with the previous factor: the update is multiplicative (0.25 * 0.5); capped to 0 and
    # still reused: lifted
    prev = {("m", "liar", 0, 0): CreditFactor(FEEDBACK_VERSION, "m", "liar", 0, 0.25, 0, 0, 0, 60, 100, 1000),
            ("m", "zero", 0, 0): CreditFactor(FEEDBACK_VERSION, "m", "zero", 0, 0.0, 0, 0, 0, 60, 100, 1000)}
    pairs = [pair(i, "liar", 80, 40) for i in range(20)] + [pair(50 + i, "zero", 0, 160) for i in range(3)]
    f = {x.replica: x for x in compute_factors(pairs, 110.0, 60.0, prev, min_requests=20)}
    assert f["liar"].factor == 0.125 and f["zero"].factor == 1.0


def test_feedback_per_prefix_caps_only_the_prefix_the_engine_does_not_reuse():
    def pair(i, prefix, credited, reused):
        return (RouteDecision(ROUTES_VERSION, f"q{i}", "m", "r", 0, [prefix, i], 1000, credited, 100.0, 10.0),
                UsageReport(USAGE_VERSION, f"q{i}", "m", "r", 0, 1000, reused, 100.0, "vllm"))

    # the engine reuses what is credited for prompts under prefix 11, nothing under prefix 22 (say its
    # state for that system prompt is evicted silently)
    pairs = [pair(i, 11, 320, 320) for i in range(20)] + [pair(100 + i, 22, 320, 0) for i in range(20)]
    factors = compute_factors(pairs, 110.0, 60.0, min_requests=20)
    by_prefix = {f.prefix: f.factor for f in factors}
    assert by_prefix == {0: 0.5, 11: 1.0, 22: 0.0}
    table = FeedbackTable(clock=lambda: 105.0)
    for f in factors:
        table.put(f)

    def answer():
        return [ReplicaAnswer("r", 0, 320, [Tier("GPU", 320)], 320, 320, [], 0, 0, False, [],
                              Freshness(None, None, 0, 0, 0))]

    assert table.apply("m", answer(), 16, prefix=11)[0].resumable_tokens == 320  # honest prefix
    assert table.apply("m", answer(), 16, prefix=22)[0].resumable_tokens == 0
    assert table.apply("m", answer(), 16, prefix=33)[0].feedback_capped  # no evidence: the replica's


def test_feedback_measured_on_a_simulated_lying_replica():
    r = measure_feedback(2000)
    on, off = r["with_feedback"]["after_cap"], r["without_feedback"]["after_cap"]
    assert r["liar_capped_after_requests"] <= 300 and r["liar_factor"] == 0.0
    assert on["fleet"]["over_credit"] < 0.005 < 0.05 < off["fleet"]["over_credit"]
    assert on["liar_traffic_share"] < 0.01 < 0.05 < off["liar_traffic_share"]
    assert on["fleet"]["reuse_rate"] > off["fleet"]["reuse_rate"] + 0.03
    # what `kvidx feedback --simulate` prints (JSON behind --json): a short table of the same figures
    table = feedback_table(r).splitlines()
    assert len(table) <= 10 and table[0].startswith("feedback on a simulated fleet, 2000 requests")
    row = next(ln for ln in table if ln.startswith("without feedback, after cap"))
    cells = [c.strip() for c in row.split("  ") if c.strip()]
    assert cells == ["without feedback, after cap", str(off["fleet"]["requests"]),
                     f"{100 * off['fleet']['over_credit']:.2f} %", f"{100 * off['fleet']['precision']:.2f} %",
                     f"{100 * off['fleet']['reuse_rate']:.2f} %", f"{100 * off['liar_traffic_share']:.2f} %"]
