"""The audit's eviction-foresight figures (pure: join + audit on records): decisions whose credit
foresight cut, and recall / over-credit had it not; route records written before the field read as
no cut."""

import msgspec

from kvidx.ops.audit import audit, join, table
from schemas.routes import ROUTES_VERSION, RouteDecision, decode_route, encode_route
from schemas.usage import USAGE_VERSION, UsageReport


def route(rid: str, credited: int, evicting: int) -> RouteDecision:
    return RouteDecision(ROUTES_VERSION, rid, "m", "r", 0, [1, 2], 100, credited, 10.0, 5.0, "", evicting)


def usage(rid: str, reused: int) -> UsageReport:
    return UsageReport(USAGE_VERSION, rid, "m", "r", 0, 100, reused, 11.0)


def test_audit_reports_what_foresight_cut_and_what_it_would_have_been():
    # a: cut 32 tokens the engine had evicted (right); b: cut 16 it still reused (recall cost)
    j = join([route("a", 16, 32), route("b", 32, 16), route("c", 48, 0)],
             [usage("a", 16), usage("b", 48), usage("c", 48)], 0.0, 20.0)
    rep = audit(j, 0.0, 20.0)
    o, f = rep["overall"], rep["foresight"]
    assert (o["recall"], o["over_credit"]) == (round(96 / 112, 6), 0.0)
    assert f == {"discounted_requests": 2, "discounted_tokens": 48,
                 "recall_without": 1.0, "over_credit_without": round(32 / 112, 6)}
    assert "eviction foresight cut 2 decisions by 48 tokens" in table(rep)


def test_route_records_before_the_field_decode_as_no_cut():
    old = msgspec.msgpack.encode([ROUTES_VERSION, "a", "m", "r", 0, [1], 16, 0, 1.0, 5.0, ""])
    assert decode_route(old).evicting_tokens == 0
    assert decode_route(encode_route(route("a", 0, 7))).evicting_tokens == 7
