"""Audit of the hints (issue #16): of the prefetch hints the service published (`kvidx.hints.v1`), how
many the engines followed and how many paid off, per model, replica and time window.

- followed: every block the hint named was stored in GPU memory on its replica (a BlocksStored in tier
  GPU in that replica's events, `kvidx.events.v1`) between the hint and its deadline (+ `grace_s`):
  the engine loaded it while the request was queued, not at its turn;
- paid off: followed, and the engine reused the prefetched prefix (its usage report for the same
  request id, `kvidx.usage.v1`, counts at least the hint's last prefetched token as cached). The pay-off
  ratio overall, per window and of the last WINDOW plans (the span the service's gate throttles on:
  kvidx.core.hints.PrefetchGate, which learns online from the usage reports alone).

Blocks are the hint's own block hashes (the model's index block size), so nothing but hashes and
counts is read. A hint without a usage report is counted `unreported` (it cannot have paid off).
Eviction advice and placements (kvidx.core.sessions), from the same events and the routing decisions
(`kvidx.routes.v1`), within `follow_s` of the hint:
- a placement is followed when its target stored every placed block on GPU, and paid off when a later
  decision sent a prompt through them to the target;
- eviction advice is followed when its replica removed every advised block from GPU, and paid off when
  no later decision sent a prompt through them to that replica (the blocks were dead weight).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvidx.core.hints import WINDOW
from schemas.events import BlocksRemoved, BlocksStored, EventBatch
from schemas.hints import HintRecord
from schemas.routes import RouteDecision
from schemas.usage import UsageReport


@dataclass
class HintTally:
    issued: int = 0
    followed: int = 0
    paid_off: int = 0
    unreported: int = 0
    tokens: int = 0  # hinted tokens, all hints
    paid_off_tokens: int = 0
    benefit_s: float = 0.0  # the load time the paid-off hints were expected to hide

    def add(self, h: HintRecord, followed: bool, reported: bool, paid: bool) -> None:
        self.issued += 1
        self.followed += followed
        self.unreported += not reported
        self.paid_off += paid
        self.tokens += h.tokens
        if paid:
            self.paid_off_tokens += h.tokens
            self.benefit_s += h.benefit_s

    def summary(self) -> dict:
        return {"issued": self.issued, "followed": self.followed, "paid_off": self.paid_off,
                "unreported": self.unreported,
                "followed_rate": round(self.followed / self.issued, 6) if self.issued else 0.0,
                "paid_off_rate": round(self.paid_off / self.issued, 6) if self.issued else 0.0,
                "tokens": self.tokens, "paid_off_tokens": self.paid_off_tokens,
                "benefit_s": round(self.benefit_s, 4)}


def _hinted_blocks(h: HintRecord) -> set[int]:
    bs = h.block_size
    out: set[int] = set()
    for r in h.runs:
        out.update(h.block_hashes[r.start // bs:r.end // bs])  # the full index blocks the run covers
    return out


def gpu_changes(batches: Iterable[EventBatch], kind: type = BlocksStored
                ) -> dict[tuple[str, str, int], list[tuple[float, list[int]]]]:
    """Per (model, replica, dp_rank), the GPU blocks each batch stored (or, with kind=BlocksRemoved,
    removed), with the batch's engine time."""
    out: dict[tuple[str, str, int], list[tuple[float, list[int]]]] = {}
    for b in batches:
        blocks = [x for e in b.events if isinstance(e, kind) and e.tier == "GPU" for x in e.hashes]
        if blocks:
            out.setdefault((b.model, b.replica, b.dp_rank), []).append((b.engine_ts, blocks))
    return out


def _all_within(changes: list[tuple[float, list[int]]], want: set[int], t0: float, t1: float) -> bool:
    seen: set[int] = set()
    for ts, blocks in changes:
        if t0 <= ts <= t1:
            seen.update(x for x in blocks if x in want)
    return bool(want) and seen == want


def audit_session_hints(hints: list[HintRecord], routes: Iterable[RouteDecision], batches: list[EventBatch],
                        follow_s: float = 60.0) -> dict:
    """Placements and eviction advice: issued, followed, paid off (the module docstring's rules)."""
    stores, removals = gpu_changes(batches), gpu_changes(batches, BlocksRemoved)
    watched = {x for h in hints for x in h.block_hashes}
    through: dict[int, list[tuple[float, str]]] = {}  # watched block -> (when, where) prompts went through it
    for d in routes:
        for x in d.block_hashes:
            if x in watched:
                through.setdefault(x, []).append((d.ts, d.replica))
    out = {k: HintTally() for k in ("placement", "eviction")}
    per_replica: dict[tuple[str, str, str], HintTally] = {}  # (kind, model, replica acting)
    for h in hints:
        if h.kind not in out or not h.block_hashes:
            continue
        want = set(h.block_hashes)
        at = h.target if h.kind == "placement" else h.replica
        changes = (stores if h.kind == "placement" else removals).get((h.model, at, h.dp_rank), [])
        followed = _all_within(changes, want, h.ts, h.ts + follow_s)
        came = any(ts > h.ts and rep == at for ts, rep in through.get(h.block_hashes[-1], ()))
        paid = followed and (came if h.kind == "placement" else not came)
        out[h.kind].add(h, followed, True, paid)
        per_replica.setdefault((h.kind, h.model, at), HintTally()).add(h, followed, True, paid)

    def brief(t: HintTally) -> dict:
        return {x: v for x, v in t.summary().items() if x != "unreported"}

    report: dict = {k: brief(t) for k, t in out.items()}
    for kind in out:
        report[kind]["by_replica"] = [{"model": m, "replica": r, **brief(t)}
                                      for (k, m, r), t in sorted(per_replica.items()) if k == kind]
    return report


def audit_hints(hints: Iterable[HintRecord], usages: Iterable[UsageReport], batches: list[EventBatch],
                t_from: float, window_s: float, grace_s: float = 0.1, routes: Iterable[RouteDecision] = ()
                ) -> dict:
    """The hints stamped from `t_from` on, tallied overall, per model, replica and time window."""
    stores = gpu_changes(batches)
    by_usage: dict[str, UsageReport] = {}
    for u in usages:
        by_usage.setdefault(u.request_id, u)
    overall = HintTally()
    paid_flags: list[bool] = []  # the prefetch plans' fates in time order, for the recent ratio
    groups: dict[str, dict] = {"by_model": {}, "by_replica": {}, "over_time": {}}
    sessions: list[HintRecord] = []  # eviction advice and placements
    for h in sorted(hints, key=lambda h: h.ts):
        if h.ts < t_from:
            continue
        if h.kind != "prefetch":
            sessions.append(h)
            continue
        want = _hinted_blocks(h)
        seen: set[int] = set()
        for ts, stored in stores.get((h.model, h.replica, h.dp_rank), ()):
            if h.ts <= ts <= h.ts + h.deadline_s + grace_s:
                seen.update(x for x in stored if x in want)
        followed = bool(want) and seen == want
        u = by_usage.get(h.request_id)
        end = max((r.end for r in h.runs), default=0)
        paid = followed and u is not None and u.cached_tokens >= end
        overall.add(h, followed, u is not None, paid)
        paid_flags.append(paid)
        for name, key in (("by_model", h.model), ("by_replica", (h.model, h.replica, h.dp_rank)),
                          ("over_time", int((h.ts - t_from) // window_s))):
            groups[name].setdefault(key, HintTally()).add(h, followed, u is not None, paid)
    return {
        # the prefetch plans; recent_paid_off_rate: of the last WINDOW, the span the service's gate
        # (kvidx.core.hints.PrefetchGate) throttles on
        "overall": {**overall.summary(), "recent_paid_off_rate": round(sum(paid_flags[-WINDOW:]) / len(
            paid_flags[-WINDOW:]), 6) if paid_flags else 0.0},
        **audit_session_hints(sessions, routes, batches),
        "by_model": [{"model": k, **t.summary()} for k, t in sorted(groups["by_model"].items())],
        "by_replica": [{"model": m, "replica": r, "dp_rank": d, **t.summary()}
                       for (m, r, d), t in sorted(groups["by_replica"].items())],
        "over_time": [{"window": w, "start": t_from + w * window_s, **t.summary()}
                      for w, t in sorted(groups["over_time"].items())],
    }
