"""Feedback: stop crediting what an engine does not reuse.

An engine can keep reusing far less than the index credits on one replica: a hybrid model's state
evicted without an event, a cache the engine cannot use, a relay publishing for the wrong replica. The
index cannot see it from the events; the audit can (kvidx/ops/audit.py: routes joined with usage).

Per (model, replica, DP rank), and per prefix on it (the prompt's first canonical block: the system
prompt or the conversation it starts), over the last `window` seconds of joined decisions:

    ratio  = sum(reused) / sum(credited)        (the engine's reuse per credited token)
    factor = min(1, previous_factor * ratio)    (decisions were credited with the previous factor)

published when the replica had at least `min_requests` credited decisions; a factor >= `threshold`
(default 0.8) is published as 1.0 (no cap: small errors are the index's normal races, not a lying
engine). No credited decisions but reuse reported lifts the cap (1.0); no evidence keeps the previous
factor. Each factor expires (`expires_at`, 3 windows later) unless refreshed, so a stopped feedback job
leaves no cap behind.

Factors go to the compacted topic `kvidx.feedback.v1` (key = model, replica, rank). A service instance
reads it (index_service/feedback.py, passed as `create_app(feedback=...)`) and, in every lookup answer,
multiplies that replica's `resumable_tokens` by the factor of the prompt's prefix there, or, with no
evidence for that prefix, the replica's factor (rounded down to the index block size),
adding `"feedback_capped": true`, `"credit_factor"` and `"index_resumable_tokens"` (the uncapped
value); replicas are re-sorted and priced with the capped value. Routers should report the capped
value as `credited_tokens` (what they relied on): the multiplicative update above assumes it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable

import msgspec
from confluent_kafka import Producer

from index_service.feedback import ensure_feedback_topic
from kvidx.kafka.config import client_config
from kvidx.kafka.delivery import require_delivered
from kvidx.kafka.log import add_kafka_args, bootstrap_of
from schemas.feedback import FEEDBACK_VERSION, CreditFactor, factor_key
from schemas.routes import RouteDecision
from schemas.usage import UsageReport

log = logging.getLogger("kvidx.ops.feedback")


# ---- the computation -------------------------------------------------------------------------------
def compute_factors(pairs: Iterable[tuple[RouteDecision, UsageReport]], now: float, window_s: float,
                    previous: dict[tuple[str, str, int, int], CreditFactor] | None = None,
                    min_requests: int = 20, threshold: float = 0.8) -> list[CreditFactor]:
    previous = previous or {}
    sums: dict[tuple[str, str, int, int], list[int]] = {}
    for d, u in pairs:
        if not now - window_s <= d.ts <= now:
            continue
        keys = [(d.model, d.replica, d.dp_rank, 0)]  # the whole replica, and the prompt's prefix on it
        if d.block_hashes:
            keys.append((d.model, d.replica, d.dp_rank, d.block_hashes[0]))
        for k in keys:
            s = sums.setdefault(k, [0, 0, 0, 0])  # credited, reused, n, n_credited
            s[0] += d.credited_tokens
            s[1] += u.cached_tokens
            s[2] += 1
            s[3] += d.credited_tokens > 0
    out = []
    for key in sorted(set(sums) | {k for k, f in previous.items() if f.factor < 1 and f.expires_at > now}):
        credited, reused, n, n_credited = sums.get(key, (0, 0, 0, 0))
        prev = previous.get(key)
        f_prev = prev.factor if prev is not None and prev.expires_at > now else 1.0
        if n_credited >= min_requests and credited > 0:
            f = min(1.0, f_prev * reused / credited)
            f = 1.0 if f >= threshold else round(f, 4)
        elif credited == 0 and reused > 0:
            f = 1.0  # capped to nothing, yet the engine reuses: lift
        else:
            f = f_prev  # not enough evidence: keep
        model, replica, rank, prefix = key
        out.append(CreditFactor(FEEDBACK_VERSION, model, replica, rank, f, credited, reused, n, window_s,
                                now, now + 3 * window_s, prefix))
    return out


def publish_factors(bootstrap: str, topic: str, factors: list[CreditFactor]) -> None:
    p = Producer({**client_config(), "bootstrap.servers": bootstrap, "enable.idempotence": True})
    refused: list[str] = []
    for f in factors:
        p.produce(topic, key=factor_key(*f.key), value=msgspec.msgpack.encode(f),
                  on_delivery=lambda err, _msg: err is not None and refused.append(str(err)))
    require_delivered(p, f"credit factor(s) on {topic}", refused=len(refused), bootstrap=bootstrap)


def read_factors(bootstrap: str, topic: str) -> dict[tuple[str, str, int, int], CreditFactor]:
    from kvidx.kafka.log import read_range

    out = {}
    for m in read_range(bootstrap, topic, None, None, "feedback-read"):
        if m.value is None:
            key = tuple(msgspec.msgpack.decode(m.key))
            out.pop((*key, 0) if len(key) == 3 else key, None)
            continue
        f = msgspec.msgpack.decode(m.value, type=CreditFactor)
        out[f.key] = f
    return out


def run_feedback(bootstrap: str, names: dict[str, str], now: float | None = None, window_s: float = 900.0,
                 min_requests: int = 20, threshold: float = 0.8, grace_s: float = 60.0,
                 dry_run: bool = False) -> list[CreditFactor]:
    """One feedback round from Kafka: join the window's decisions and usage, compute, publish."""
    from kvidx.ops.audit import read_joined

    now = time.time() if now is None else now
    topic = ensure_feedback_topic(bootstrap, names)
    previous = read_factors(bootstrap, topic)
    j = read_joined(bootstrap, names, now - window_s, now, grace_s)
    factors = compute_factors(j.pairs, now, window_s, previous, min_requests, threshold)
    changed = [f for f in factors if (p := previous.get((f.model, f.replica, f.dp_rank))) is None
               or p.factor != f.factor or f.factor < 1.0]
    if not dry_run and changed:
        publish_factors(bootstrap, topic, changed)
    for f in factors:
        if f.factor < 1.0:
            log.warning("event=credit_capped model=%s replica=%s dp_rank=%d factor=%.4f credited=%d "
                        "reused=%d", f.model, f.replica, f.dp_rank, f.factor, f.credited_tokens,
                        f.reused_tokens)
    return factors


# ---- CLI -------------------------------------------------------------------------------------------
def cmd_feedback(args) -> int:
    from schemas.events import topic_names

    if args.simulate:
        from kvidx.sim.feedback import feedback_table, measure_feedback

        result = measure_feedback(args.simulate)
        print(json.dumps(result) if args.json else feedback_table(result))
        return 0
    b = bootstrap_of(args)
    names = topic_names(args.topic_prefix)
    while True:
        factors = run_feedback(b, names, window_s=args.window, min_requests=args.min_requests,
                               threshold=args.threshold, dry_run=args.dry_run)
        rows = [msgspec.structs.asdict(f) for f in factors]
        if args.json:
            print(json.dumps({"factors": rows}), flush=True)
        else:
            for f in factors:
                print(f"{f.model} {f.replica}#{f.dp_rank}: factor {f.factor:.4f} "
                      f"(credited {f.credited_tokens}, reused {f.reused_tokens}, {f.requests} requests)",
                      flush=True)
        if not args.every:
            return 0
        time.sleep(args.every)


def add_cli(subparsers) -> None:
    """Register `feedback`."""
    p = subparsers.add_parser(
        "feedback", help="cap the credit of replicas whose engines reuse less than the index credits",
        description="Joins the last --window seconds of routing decisions with engine usage reports and "
                    "publishes a credit factor per (model, replica, rank) to kvidx.feedback.v1; service "
                    "instances multiply that replica's resumable_tokens by it (feedback_capped: true).")
    add_kafka_args(p)
    p.add_argument("--window", type=float, default=900.0, metavar="S", help="seconds of history per round")
    p.add_argument("--every", type=float, default=0.0, metavar="S", help="repeat every S seconds")
    p.add_argument("--min-requests", type=int, default=20,
                   help="credited decisions needed to change a factor")
    p.add_argument("--threshold", type=float, default=0.8, help="factors at or above this are not applied")
    p.add_argument("--dry-run", action="store_true", help="compute and print, do not publish")
    p.add_argument("--simulate", type=int, metavar="N", help="no Kafka: measure the feedback on a simulated "
                   "fleet with one replica that silently drops its state, N requests")
    p.add_argument("--json", action="store_true", help="print JSON objects (with --simulate: every figure, "
                   "where the default is a short table)")
    p.set_defaults(func=cmd_feedback)
