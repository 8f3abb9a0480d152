"""Offline audit: join what the index credited (routing decisions, `kvidx.routes.v1`) with what the
engines reused (usage reports, `kvidx.usage.v1`) by request id, over a time range.

Figures (as the shadow audit, kvidx/shadow.py `Agreement`), per model, replica, engine, tier and
time window:
- reuse rate  = sum(reused) / sum(prompt tokens)  (the engines' own prefix-cache hit rate)
- recall      = sum(min(credited, reused)) / sum(reused)  (how much of the real reuse was credited)
- over-credit = sum(max(credited - reused, 0)) / sum(reused)  (credit the engine did not honour)
plus `precision` = sum(min(credited, reused)) / sum(credited), the share of the credit that was real
(the feedback's signal), and `foresight`: the decisions whose credit eviction foresight cut (the
answer's evicting_tokens, carried by the decision) and the overall recall and over-credit had it not
(credited + evicting): how much over-credit it removed and how much recall it cost. Prompt tokens
are the engine's. A decision's `tier` is the one its usage report carries (the router copies the
slowest tier of the credited prefix from the lookup answer; "unknown" when it does not).

Hints (`kvidx.hints.v1`, where a model's hints are on): how many the engines followed (the hinted
blocks stored on GPU before the request's expected start, from the events) and how many paid off (the
usage report counts the prefetched prefix as reused), per model, replica and window
(kvidx/ops/hint_audit.py); the report's `hints`, absent when no hint was published in the range.

Joining: decisions stamped in [from, to] are audited; their usage reports may arrive up to `--grace`
seconds later. Unmatched: decisions in the range without a usage report (`routes`), and reports in
the range whose decision is not found, even `--grace` seconds before the range (`usages`).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from kvidx.core.hints import WINDOW
from kvidx.kafka.log import add_kafka_args, bootstrap_of, iso, parse_time, read_range
from kvidx.ops.hint_audit import audit_hints
from kvidx.shadow import Agreement
from schemas.events import decode_batch, topic_names
from schemas.hints import decode_hint
from schemas.routes import RouteDecision, decode_route
from schemas.usage import UsageReport, decode_usage

log = logging.getLogger("kvidx.ops.audit")


class Tally(Agreement):
    """The shadow audit's tally (kvidx.shadow.Agreement), keyed by no request number, plus precision
    (the share of the credit the engine honoured) and an undefined over-credit when nothing was
    reused but something was credited."""

    def add(self, prompt: int, reused: int, credited: int) -> None:  # type: ignore[override]
        super().add(self.requests, prompt, reused, credited)

    def summary(self) -> dict:
        s = super().summary()
        r, c = self.reused_tokens, self.credited_tokens
        s["over_credited_tokens"] = self.over_tokens
        # nothing reused: 0 if nothing was credited either, else undefined (None)
        if not r and self.requests:
            s["over_credit"] = None if self.over_tokens else 0.0
        s["precision"] = None if not self.requests else round(self.matched_tokens / c, 6) if c else 1.0
        return s


@dataclass
class Joined:
    pairs: list[tuple[RouteDecision, UsageReport]] = field(default_factory=list)
    unmatched_routes: list[RouteDecision] = field(default_factory=list)
    unmatched_usages: list[UsageReport] = field(default_factory=list)
    undecodable: int = 0


def _decode_all(msgs, decode) -> tuple[list, int]:
    out, bad = [], 0
    for m in msgs:
        try:
            out.append(decode(m.value))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError):
            bad += 1
    return out, bad


def join(routes: Iterable[RouteDecision], usages: Iterable[UsageReport], t_from: float, t_to: float
         ) -> Joined:
    """Decisions stamped in [t_from, t_to] with their usage reports (first of each request id)."""
    by_route: dict[str, RouteDecision] = {}
    for d in routes:
        by_route.setdefault(d.request_id, d)
    by_usage: dict[str, UsageReport] = {}
    for u in usages:
        by_usage.setdefault(u.request_id, u)
    j = Joined()
    for rid, d in by_route.items():
        if not t_from <= d.ts <= t_to:
            continue
        u = by_usage.get(rid)
        if u is None:
            j.unmatched_routes.append(d)
        else:
            j.pairs.append((d, u))
    for rid, u in by_usage.items():
        if t_from <= u.ts <= t_to and rid not in by_route:
            j.unmatched_usages.append(u)
    j.pairs.sort(key=lambda p: p[0].ts)
    return j


def read_joined(bootstrap: str, names: dict[str, str], t_from: float, t_to: float, grace_s: float = 300.0
                ) -> Joined:
    routes, bad_r = _decode_all(read_range(bootstrap, names["routes"], t_from - grace_s, t_to, "audit"),
                                decode_route)
    usages, bad_u = _decode_all(read_range(bootstrap, names["usage"], t_from, t_to + grace_s, "audit"),
                                decode_usage)
    j = join(routes, usages, t_from, t_to)
    j.undecodable = bad_r + bad_u
    return j


def read_hints(bootstrap: str, names: dict[str, str], j: Joined, t_from: float, t_to: float, window_s: float
               ) -> dict | None:
    """The hints published in [t_from, t_to], their follow-through (the replicas' events up to the last
    hint's deadline) and pay-off (the usage reports read for `j`); None when there are none."""
    hints, bad = _decode_all(read_range(bootstrap, names["hints"], t_from, t_to, "audit-hints"), decode_hint)
    if not hints and not bad:
        return None
    until = max((h.ts + h.deadline_s for h in hints), default=t_to) + 60.0
    batches, _ = _decode_all(read_range(bootstrap, names["events"], t_from, until, "audit-hints"),
                             decode_batch)
    usages = [u for _, u in j.pairs] + j.unmatched_usages
    routes = [d for d, _ in j.pairs] + j.unmatched_routes
    report = audit_hints(hints, usages, batches, t_from, window_s, routes=routes)
    report["undecodable"] = bad
    return report


def _group(pairs, key: Callable) -> dict:
    out: dict = {}
    for d, u in pairs:
        k = key(d, u)
        t = out.get(k)
        if t is None:
            t = out[k] = Tally()
        t.add(u.prompt_tokens, u.cached_tokens, d.credited_tokens)
    return out


def audit(j: Joined, t_from: float, t_to: float, window_s: float | None = None) -> dict:
    """The audit's figures as one JSON-ready dict."""
    if not window_s:
        window_s = max(1.0, (t_to - t_from) / 24)
    overall = Tally()
    for d, u in j.pairs:
        overall.add(u.prompt_tokens, u.cached_tokens, d.credited_tokens)
    without = Tally()  # the same credit without eviction foresight
    for d, u in j.pairs:
        without.add(u.prompt_tokens, u.cached_tokens, d.credited_tokens + d.evicting_tokens)
    w = without.summary()
    cut = [d.evicting_tokens for d, _ in j.pairs if d.evicting_tokens]
    foresight = {"discounted_requests": len(cut), "discounted_tokens": sum(cut),
                 "recall_without": w["recall"], "over_credit_without": w["over_credit"]}
    unmatched_by_model: dict[str, int] = {}
    for d in j.unmatched_routes:
        unmatched_by_model[d.model] = unmatched_by_model.get(d.model, 0) + 1

    def rows(groups: dict, names: tuple[str, ...]) -> list[dict]:
        out = []
        for k, t in sorted(groups.items(), key=lambda kv: kv[0]):
            k = k if isinstance(k, tuple) else (k,)
            out.append({**dict(zip(names, k, strict=True)), **t.summary()})
        return out

    windows = _group(j.pairs, lambda d, u: int((d.ts - t_from) // window_s))
    over_time = []
    for w, t in sorted(windows.items()):
        start = t_from + w * window_s
        over_time.append({"window": w, "start": start, "start_iso": iso(start), **t.summary()})
    return {
        "from": t_from, "to": t_to, "from_iso": iso(t_from), "to_iso": iso(t_to), "window_s": window_s,
        "overall": overall.summary(),
        "foresight": foresight,
        "unmatched": {"routes": len(j.unmatched_routes), "usages": len(j.unmatched_usages),
                      "routes_by_model": unmatched_by_model, "undecodable": j.undecodable},
        "prompt_tokens_disagree": sum(1 for d, u in j.pairs if d.prompt_tokens != u.prompt_tokens),
        "by_model": rows(_group(j.pairs, lambda d, u: d.model), ("model",)),
        "by_replica": rows(_group(j.pairs, lambda d, u: (d.model, d.replica, d.dp_rank)),
                           ("model", "replica", "dp_rank")),
        "by_engine": rows(_group(j.pairs, lambda d, u: u.engine or "unknown"), ("engine",)),
        "by_tier": rows(_group(j.pairs, lambda d, u: u.tier or "unknown"), ("tier",)),
        "over_time": over_time,
    }


# ---- output ----------------------------------------------------------------------------------------
_COLS = ("requests", "prompt_tokens", "reused_tokens", "credited_tokens", "reuse_rate", "recall",
         "over_credit", "precision")


def table(report: dict) -> str:
    lines = [f"audit {report['from_iso']} .. {report['to_iso']} (windows of {report['window_s']:g} s)"]
    u = report["unmatched"]
    lines.append(f"unmatched: {u['routes']} decisions without a usage report, {u['usages']} usage reports "
                 f"without a decision, {u['undecodable']} undecodable")

    def section(title: str, rows: list[dict], keys: tuple[str, ...]) -> None:
        lines.append("")
        lines.append(title)
        head = [*keys, *_COLS]
        cells = [[_fmt(r.get(k)) for k in head] for r in rows]
        widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(head)]
        lines.append("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
        for c in cells:
            lines.append("  ".join(x.rjust(w) for x, w in zip(c, widths, strict=True)))

    section("overall", [report["overall"]], ())
    f = report.get("foresight")
    if f and f["discounted_requests"]:
        lines.append(f"eviction foresight cut {f['discounted_requests']} decisions by "
                     f"{f['discounted_tokens']} tokens; without it: recall {_fmt(f['recall_without'])}, "
                     f"over-credit {_fmt(f['over_credit_without'])}")
    section("per model", report["by_model"], ("model",))
    section("per replica", report["by_replica"], ("model", "replica", "dp_rank"))
    section("per engine", report["by_engine"], ("engine",))
    section("per tier", report["by_tier"], ("tier",))
    section("over time", report["over_time"], ("start_iso",))
    h = report.get("hints")
    if h:
        o = h["overall"]
        lines.append("")
        lines.append(f"prefetch hints: {o['issued']} issued, {o['followed']} followed "
                     f"({_fmt(o['followed_rate'])}), {o['paid_off']} paid off ({_fmt(o['paid_off_rate'])}), "
                     f"{o['unreported']} without a usage report; {o['benefit_s']:g} s of load hidden by the "
                     f"paid-off ones; pay-off ratio of the last {WINDOW}: "
                     f"{_fmt(o.get('recent_paid_off_rate', 0.0))}")
        for kind in ("placement", "eviction"):
            k = h[kind]
            if k["issued"]:
                lines.append(f"{kind}: {k['issued']} issued, {k['followed']} followed, "
                             f"{k['paid_off']} paid off")
        for r in h["by_replica"]:
            lines.append(f"  {r['model']} {r['replica']} dp{r['dp_rank']}: {r['issued']} issued, "
                         f"{r['followed']} followed, {r['paid_off']} paid off")
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4f}"
    return "" if v is None else str(v)


NO_PLOTS = "note: no PNG plots: matplotlib is not installed (pip install -e '.[plots]'); the JSON is written"


def plots(report: dict, out: Path) -> list[Path]:
    """PNG plots: the figures over time, and credited vs reused per replica (none without the
    `plots` extra: the caller says so)."""
    try:
        import matplotlib
    except ImportError:
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    ot = report["over_time"]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    x = [(w["start"] - report["from"]) / 60 for w in ot]
    for k in ("reuse_rate", "recall", "precision"):
        a1.plot(x, [w[k] for w in ot], marker="o", label=k)
    a1.plot(x, [2.0 if w["over_credit"] is None else min(w["over_credit"], 2.0) for w in ot], marker="o",
            label="over_credit (capped at 2)")
    a1.set_ylabel("ratio")
    a1.legend()
    a1.grid(alpha=0.3)
    a1.set_title(f"kvidx audit {report['from_iso']} .. {report['to_iso']}")
    a2.plot(x, [w["credited_tokens"] for w in ot], marker="o", label="credited tokens")
    a2.plot(x, [w["reused_tokens"] for w in ot], marker="o", label="reused tokens")
    a2.set_xlabel(f"minutes since {report['from_iso']} (windows of {report['window_s']:g} s)")
    a2.set_ylabel("tokens")
    a2.legend()
    a2.grid(alpha=0.3)
    fig.tight_layout()
    p = out / "over_time.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    written.append(p)

    reps = report["by_replica"]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(reps) + 2), 5))
    labels = [f"{r['model']}\n{r['replica']}#{r['dp_rank']}" for r in reps]
    idx = range(len(reps))
    ax.bar([i - 0.2 for i in idx], [r["credited_tokens"] for r in reps], 0.4, label="credited")
    ax.bar([i + 0.2 for i in idx], [r["reused_tokens"] for r in reps], 0.4, label="reused")
    ax.set_xticks(list(idx), labels, fontsize=7)
    ax.set_ylabel("tokens")
    ax.set_title("credited vs reused per replica")
    ax.legend()
    fig.tight_layout()
    p = out / "by_replica.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    written.append(p)
    return written


# ---- usage reports into Kafka (the service's POST /v1/usage) ---------------------------------------
# ---- CLI -------------------------------------------------------------------------------------------
def cmd_audit(args) -> int:
    names = topic_names(args.topic_prefix)
    now = time.time()
    t_to = parse_time(args.to, now) if args.to else now
    t_from = parse_time(getattr(args, "from"), now)
    if t_from >= t_to:
        sys.exit("error: --from must be before --to")
    j = read_joined(bootstrap_of(args), names, t_from, t_to, args.grace)
    report = audit(j, t_from, t_to, args.window)
    hints = read_hints(bootstrap_of(args), names, j, t_from, t_to, report["window_s"])
    if hints is not None:
        report["hints"] = hints
    if not report["overall"]["requests"]:  # not silent: nothing was measured, no ratio is 1.0
        u = report["unmatched"]
        print(f"warning: no request between {iso(t_from)} and {iso(t_to)} has both a routing decision "
              f"({names['routes']}) and a usage report ({names['usage']}): {u['routes']} decisions and "
              f"{u['usages']} usage reports unmatched; nothing to audit", file=sys.stderr)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "audit.json").write_text(json.dumps(report, indent=1))
        report["plots"] = [str(p) for p in plots(report, out)]
        if not report["plots"]:
            print(NO_PLOTS, file=sys.stderr)
    print(json.dumps(report) if args.json else table(report))
    return 0


def add_cli(subparsers) -> None:
    """Register `audit`."""
    p = subparsers.add_parser(
        "audit", help="join routing decisions with engine usage reports: reuse, recall, over-credit",
        description="Joins what the index credited (kvidx.routes.v1) with what the engines reused "
                    "(kvidx.usage.v1, POST /v1/usage) by request id and reports reuse rate, recall, "
                    "over-credit and precision per model, replica, engine, tier and time window, as a "
                    "table, JSON (--json) and PNG plots (--out DIR).")
    add_kafka_args(p)
    p.add_argument("--from", required=True, help="start: ISO 8601, epoch seconds, or -1h / -1d")
    p.add_argument("--to", help="end (default: now)")
    p.add_argument("--window", type=float, help="seconds per time window (default: the range / 24)")
    p.add_argument("--grace", type=float, default=300.0, metavar="S",
                   help="usage reports may arrive up to S seconds after their decision")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", help="write audit.json and PNG plots to this directory")
    p.set_defaults(func=cmd_audit)
