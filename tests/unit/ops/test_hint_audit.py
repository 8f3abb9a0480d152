"""The hints' audit (kvidx/ops/hint_audit.py): followed = every hinted block stored on GPU on the hint's
replica between the hint and its deadline (+ grace); paid off = followed and the usage report counts
the prefetched prefix as reused."""

from __future__ import annotations

from kvidx.ops.hint_audit import audit_hints
from schemas.events import SCHEMA_VERSION, BlocksRemoved, BlocksStored, EventBatch
from schemas.hints import HINTS_VERSION, HintRecord, PrefetchRunRecord
from schemas.routes import ROUTES_VERSION, RouteDecision
from schemas.usage import USAGE_VERSION, UsageReport

H = list(range(100, 108))  # a prompt of 8 blocks of 16 tokens


def hint(rid: str, replica: str, ts: float, runs=((2, 6),), deadline: float = 1.0) -> HintRecord:
    rr = [PrefetchRunRecord("DISK", a * 16, b * 16, 0.01) for a, b in runs]
    tokens = sum(r.end - r.start for r in rr)
    return HintRecord(HINTS_VERSION, "prefetch", rid, "m", replica, 0, H, 16, rr, tokens, 0.04, deadline,
                      0.04, 0, ts)


def gpu(replica: str, ts: float, hashes: list[int]) -> EventBatch:
    stored = [BlocksStored("GPU", 0, hashes, None, 0)]
    return EventBatch(SCHEMA_VERSION, "m", replica, 0, 1, 0, ts, ts, 16, stored)


def usage(rid: str, replica: str, cached: int) -> UsageReport:
    return UsageReport(USAGE_VERSION, rid, "m", replica, 0, 128, cached, 0.0)


def test_followed_and_paid_off_by_their_definitions():
    hints = [hint("a", "r0", 10.0),  # loaded in time, reused: paid off
             hint("b", "r0", 20.0),  # loaded in time, the engine reused less than the prefetched prefix
             hint("c", "r1", 30.0),  # loaded after the deadline: at the request's turn, not followed
             hint("d", "r1", 40.0),  # only part of it loaded: not followed
             hint("e", "r0", 50.0),  # followed, no usage report
             hint("f", "r1", 60.0)]  # nothing loaded at all
    batches = [gpu("r0", 10.2, H[2:6]), gpu("r0", 20.5, H[2:4]), gpu("r0", 20.9, H[4:6]),
               gpu("r1", 31.5, H[2:6]), gpu("r1", 40.1, H[2:5]), gpu("r0", 50.1, H[:8]),
               gpu("r0", 60.1, H[2:6])]  # f's blocks, but on another replica
    usages = [usage("a", "r0", 96), usage("b", "r0", 64), usage("c", "r1", 96), usage("d", "r1", 96),
              usage("f", "r1", 96)]
    r = audit_hints(hints, usages, batches, t_from=0.0, window_s=30.0)
    o = r["overall"]
    assert (o["issued"], o["followed"], o["paid_off"], o["unreported"]) == (6, 3, 1, 1)
    assert o["tokens"] == 6 * 64 and o["paid_off_tokens"] == 64 and o["benefit_s"] == 0.04
    assert o["recent_paid_off_rate"] == round(1 / 6, 6)  # fewer than the gate's window: all of them
    reps = {x["replica"]: (x["issued"], x["followed"], x["paid_off"]) for x in r["by_replica"]}
    assert reps == {"r0": (3, 3, 1), "r1": (3, 0, 0)}
    assert [(w["window"], w["issued"]) for w in r["over_time"]] == [(0, 2), (1, 3), (2, 1)]
    # hints before the range are not audited
    assert audit_hints(hints, usages, batches, t_from=45.0, window_s=30.0)["overall"]["issued"] == 2


def session_hint(kind: str, replica: str, ts: float, blocks: list[int], target: str = "",
                 action: str = "") -> HintRecord:
    return HintRecord(HINTS_VERSION, kind, "", "m", replica, 0, blocks, 16, [], 16 * len(blocks), 0.01, 0.0,
                      0.5, 0, ts, action=action, target=target)


def removed(replica: str, ts: float, hashes: list[int]) -> EventBatch:
    return EventBatch(SCHEMA_VERSION, "m", replica, 0, 1, 0, ts, ts, 16, [BlocksRemoved("GPU", 0, hashes)])


def decision(replica: str, ts: float, hashes: list[int]) -> RouteDecision:
    return RouteDecision(ROUTES_VERSION, f"q{ts}", "m", replica, 0, hashes, 16 * len(hashes), 0, ts, 10.0)


def test_placements_and_eviction_advice_followed_and_paid_off_by_their_definitions():
    hints = [session_hint("placement", "r0", 10.0, H[:4], target="r1"),  # copied, and the session came
             session_hint("placement", "r0", 20.0, H[4:6], target="r2"),  # copied, never used there
             session_hint("placement", "r0", 30.0, H[6:8], target="r3"),  # never copied
             session_hint("eviction", "r0", 40.0, H[:2], action="demote"),  # removed, came back: not paid
             session_hint("eviction", "r1", 50.0, H[2:4], action="demote"),  # removed, never back: paid
             session_hint("eviction", "r2", 60.0, H[4:6], action="drop")]  # never removed
    batches = [gpu("r1", 10.5, H[:4]), gpu("r2", 20.5, H[4:6]), gpu("r3", 200.0, H[6:8]),
               removed("r0", 41.0, H[:2]), removed("r1", 51.0, H[2:4])]
    routes = [decision("r1", 15.0, H[:5]),  # through the placement on r1
              decision("r0", 45.0, H[:3]),  # back on r0 after its advice
              decision("r0", 55.0, H[:4])]  # through r1's advised blocks, but on r0
    r = audit_hints(hints, [], batches, t_from=0.0, window_s=60.0, routes=routes)
    got = {k: (r[k]["issued"], r[k]["followed"], r[k]["paid_off"]) for k in ("placement", "eviction")}
    assert got == {"placement": (3, 2, 1), "eviction": (3, 2, 1)}
    assert r["overall"]["issued"] == 0  # no prefetch plan among them
    by = {(x["replica"], x["issued"], x["paid_off"]) for x in r["placement"]["by_replica"]}
    assert by == {("r1", 1, 1), ("r2", 1, 0), ("r3", 1, 0)}  # per target
    assert [x["replica"] for x in r["eviction"]["by_replica"]] == ["r0", "r1", "r2"]
