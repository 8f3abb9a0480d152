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
reads it (`FeedbackFollower`, passed as `create_app(feedback=...)`) and, in every lookup answer,
multiplies that replica's `resumable_tokens` by the factor of the prompt's prefix there, or, with no
evidence for that prefix, the replica's factor (rounded down to the index block size),
adding `"feedback_capped": true`, `"credit_factor"` and `"index_resumable_tokens"` (the uncapped
value); replicas are re-sorted and priced with the capped value. Routers should report the capped
value as `credited_tokens` (what they relied on): the multiplicative update above assumes it.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable

import msgspec
from confluent_kafka import OFFSET_BEGINNING, Producer, TopicPartition

from kvidx.core.answers import ReplicaAnswer
from kvidx.kafka.background import Background
from kvidx.kafka.config import client_config
from kvidx.kafka.delivery import require_delivered
from kvidx.kafka.topics import create_topics
from kvidx.ops.kafkalog import add_kafka_args, bootstrap_of, consumer, partitions, topic_prefix
from schemas.routes import RouteDecision
from schemas.usage import UsageReport

log = logging.getLogger("kvidx.ops.feedback")
FEEDBACK_TOPIC = "kvidx.feedback.v1"
FEEDBACK_VERSION = 1


class CreditFactor(msgspec.Struct, array_like=True):
    v: int
    model: str
    replica: str
    dp_rank: int
    factor: float  # multiply the replica's resumable tokens by this (1.0: no cap)
    credited_tokens: int  # the evidence: window sums
    reused_tokens: int
    requests: int
    window_s: float
    ts: float
    expires_at: float
    prefix: int = 0  # the first canonical block of the prompts it covers; 0: the whole replica

    @property
    def key(self) -> tuple[str, str, int, int]:
        return (self.model, self.replica, self.dp_rank, self.prefix)


def feedback_topic(names: dict[str, str]) -> str:
    return topic_prefix(names) + FEEDBACK_TOPIC


def ensure_feedback_topic(bootstrap: str, names: dict[str, str]) -> str:
    t = feedback_topic(names)
    create_topics(bootstrap, [], partitions=1, compacted=[t])
    return t


def _key(model: str, replica: str, dp_rank: int, prefix: int = 0) -> bytes:
    return msgspec.msgpack.encode([model, replica, dp_rank, prefix])


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


class FeedbackTable:
    """(model, replica, dp_rank, prefix) -> CreditFactor; applied to lookup answers by the service."""

    def __init__(self, clock=time.time):
        self.factors: dict[tuple[str, str, int, int], CreditFactor] = {}
        self.by_model: dict[str, dict[tuple[str, int, int], CreditFactor]] = {}
        self.clock = clock
        self.lock = threading.Lock()
        self.capped_answers = 0

    def put(self, f: CreditFactor) -> None:
        with self.lock:
            self.factors[f.key] = f
            self.by_model.setdefault(f.model, {})[f.key[1:]] = f

    def remove(self, key: tuple) -> None:
        key = (*key, 0) if len(key) == 3 else tuple(key)  # keys written before prefixes existed
        with self.lock:
            self.factors.pop(key, None)
            self.by_model.get(key[0], {}).pop(key[1:], None)

    def apply(self, model: str, replicas: list[ReplicaAnswer], block_size: int, now: float | None = None,
              prefix: int | None = None) -> list[ReplicaAnswer]:
        """Cap the resumable tokens of replicas with a factor < 1 (in place); re-sorted if any was."""
        table = self.by_model.get(model)
        if not table:
            return replicas
        now = self.clock() if now is None else now
        capped = False
        for r in replicas:
            # the prompt's prefix on that replica, where there is evidence for it, else the replica's
            f = table.get((r.replica, r.dp_rank, prefix)) if prefix else None
            if f is None or f.expires_at <= now:
                f = table.get((r.replica, r.dp_rank, 0))
            if f is None or f.factor >= 1.0 or f.expires_at <= now:
                continue
            orig = r.resumable_tokens
            new = int(orig * f.factor) // block_size * block_size
            if new < orig:
                r.index_resumable_tokens = orig
                r.resumable_tokens = new
                r.feedback_capped = True
                r.credit_factor = f.factor
                capped = True
        if capped:
            self.capped_answers += 1
            replicas.sort(key=lambda a: -a.resumable_tokens)
        return replicas


class FeedbackFollower(FeedbackTable, Background):
    """A FeedbackTable kept current from the compacted feedback topic (read from its beginning)."""

    thread_name = "kvidx-feedback"

    def __init__(self, bootstrap: str, topic: str):
        FeedbackTable.__init__(self)
        Background.__init__(self)
        self.bootstrap = bootstrap
        self.topic = topic
        self.applied = 0

    def run(self) -> None:
        # a waiting fetch returns as soon as a report arrives: the long wait only saves idle CPU
        c = consumer(self.bootstrap, "feedback", **{"fetch.wait.max.ms": 500})
        try:
            parts = partitions(c, self.topic, timeout_s=60)
            c.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in parts])
            while not self.stop_event.is_set():
                for m in c.consume(500, 0.2):
                    if m.error():
                        continue
                    if m.value() is None:
                        try:
                            self.remove(tuple(msgspec.msgpack.decode(m.key())))
                        except (msgspec.DecodeError, TypeError):
                            pass
                        continue
                    try:
                        self.put(msgspec.msgpack.decode(m.value(), type=CreditFactor))
                        self.applied += 1
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        log.warning("event=feedback_undecodable offset=%d", m.offset())
        finally:
            c.close()


def publish_factors(bootstrap: str, topic: str, factors: list[CreditFactor]) -> None:
    p = Producer({**client_config(), "bootstrap.servers": bootstrap, "enable.idempotence": True})
    refused: list[str] = []
    for f in factors:
        p.produce(topic, key=_key(*f.key), value=msgspec.msgpack.encode(f),
                  on_delivery=lambda err, _msg: err is not None and refused.append(str(err)))
    require_delivered(p, f"credit factor(s) on {topic}", refused=len(refused), bootstrap=bootstrap)


def read_factors(bootstrap: str, topic: str) -> dict[tuple[str, str, int, int], CreditFactor]:
    from kvidx.ops.kafkalog import read_range

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


# ---- a measured case: one replica whose engine silently drops its state ---------------------------
class _LruEngine:
    """A replica's prefix cache (index blocks, LRU) that publishes its stores and evictions; a liar
    reuses only `reuse` of what it announces (state dropped silently)."""

    def __init__(self, name: str, capacity: int, reuse: float = 1.0):
        self.name, self.capacity, self.reuse = name, capacity, reuse
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.seq = 0

    def serve(self, hashes: list[int], n_tokens: int, bs: int):
        from schemas.events import SCHEMA_VERSION, BlocksRemoved, BlocksStored, EventBatch

        hit = 0
        for h in hashes[:(n_tokens - 1) // bs]:
            if h not in self.cache:
                break
            hit += 1
        for h in hashes[:hit]:
            self.cache.move_to_end(h)
        new = [h for h in hashes[hit:] if h not in self.cache]
        gone = []
        for h in new:
            self.cache[h] = None
        while len(self.cache) > self.capacity:
            h, _ = self.cache.popitem(last=False)
            gone.append(h)
        events = []
        if gone:
            events.append(BlocksRemoved("GPU", 0, gone))
        if new:
            first = hashes.index(new[0])
            events.append(BlocksStored("GPU", 0, hashes[first:], hashes[first - 1] if first else None, first))
        batch = EventBatch(SCHEMA_VERSION, "m", self.name, 0, 1, self.seq, 0.0, 0.0, bs, events)
        self.seq += 1
        return int(hit * bs * self.reuse), batch


def simulate_lying_replica(requests: int = 3000, replicas: int = 4, liar_reuse: float = 0.0,
                           capacity_blocks: int = 1500, feedback: bool = True, period: int = 100,
                           window: int = 400, min_requests: int = 20, seed: int = 3) -> dict:
    """A KV-aware router (cost = prefill left + load) over `replicas` engines, the last of which reuses
    only `liar_reuse` of what its events announce; every `period` requests the feedback computes
    factors over the last `window` decisions (the same compute_factors as `kvidx feedback`).
    Returns per request (replica, prompt, reused, credited) and when the liar was capped."""
    from kvidx.core.hashing import prompt_hashes
    from kvidx.core.shard import ModelShard
    from kvidx.sim.vllm_engine import workload_requests
    from schemas.routes import ROUTES_VERSION
    from schemas.usage import USAGE_VERSION

    bs = 16
    shard = ModelShard("m", bs)
    engines = [_LruEngine(f"r{i}", capacity_blocks, liar_reuse if i == replicas - 1 else 1.0)
               for i in range(replicas)]
    liar = engines[-1].name
    table = FeedbackTable(clock=lambda: 0.0)
    load = {e.name: 0.0 for e in engines}
    rng = random.Random(seed)
    pairs: list[tuple[RouteDecision, UsageReport]] = []
    work = workload_requests(seed, requests, systems=8, sys_len=(200, 600), user_len=(20, 120), turns=6,
                             active_convs=24, max_prompt=2000, vocab=30000)
    capped_at = None
    for i, (prompt, output) in enumerate(work):
        t = float(i)
        hashes = prompt_hashes(prompt, bs)
        answers = shard.lookup(hashes, len(prompt), t)
        if feedback:
            table.apply("m", answers, bs, now=t)
        res = {a.replica: a.resumable_tokens for a in answers}
        cost = {e.name: len(prompt) - res.get(e.name, 0) + load[e.name] + rng.random() for e in engines}
        name = min(cost, key=cost.get)
        eng = next(e for e in engines if e.name == name)
        reused, batch = eng.serve(prompt_hashes(prompt + output[:-1], bs), len(prompt), bs)
        shard.apply(batch, t)
        for k in load:
            load[k] *= 0.8
        load[name] += len(prompt) - reused
        pairs.append((RouteDecision(ROUTES_VERSION, f"q{i}", "m", name, 0, [], len(prompt), res.get(name, 0),
                                    t, 10.0),
                      UsageReport(USAGE_VERSION, f"q{i}", "m", name, 0, len(prompt), reused, t, "sim")))
        if feedback and (i + 1) % period == 0:
            for f in compute_factors(pairs[-window:], t, float(window), table.factors, min_requests):
                table.put(f)
                if f.replica == liar and f.factor < 1 and capped_at is None:
                    capped_at = i + 1
    f = table.factors.get(("m", liar, 0, 0))
    return {"pairs": pairs, "liar": liar, "capped_at": capped_at, "liar_factor": f.factor if f else 1.0}


def measure_feedback(requests: int = 3000, **kw) -> dict:
    """The same fleet and workload with and without feedback; figures before and after the moment the
    feedback capped the lying replica (the same boundary for both runs)."""
    from kvidx.ops.audit import Tally

    on = simulate_lying_replica(requests, feedback=True, **kw)
    off = simulate_lying_replica(requests, feedback=False, **kw)
    cut = on["capped_at"] or requests
    out = {"requests": requests, "liar": on["liar"], "liar_capped_after_requests": on["capped_at"],
           "liar_factor": on["liar_factor"]}
    for label, run in (("with_feedback", on), ("without_feedback", off)):
        res = {}
        for phase, sl in (("before_cap", slice(0, cut)), ("after_cap", slice(cut, None))):
            fleet, lie = Tally(), Tally()
            for d, u in run["pairs"][sl]:
                fleet.add(u.prompt_tokens, u.cached_tokens, d.credited_tokens)
                if d.replica == run["liar"]:
                    lie.add(u.prompt_tokens, u.cached_tokens, d.credited_tokens)
            res[phase] = {"fleet": fleet.summary(), "liar": lie.summary(),
                          "liar_traffic_share": round(lie.requests / max(1, fleet.requests), 4)}
        out[label] = res
    return out


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f} %"


def feedback_table(result: dict) -> str:
    """measure_feedback's result for a person: the fleet's over-credit, precision and reuse, and the
    lying replica's share of the traffic, with and without feedback, before and after the cap."""
    capped = result["liar_capped_after_requests"]
    cap = f"capped (factor {result['liar_factor']}) after {capped} requests" if capped else "never capped"
    head = (f"feedback on a simulated fleet, {result['requests']} requests: replica {result['liar']} drops "
            f"its state without telling; {cap}")
    rows = [("run", "requests", "over-credit", "precision", "reuse rate", f"{result['liar']}'s traffic")]
    for label in ("with_feedback", "without_feedback"):
        for phase in ("before_cap", "after_cap"):
            r = result[label][phase]
            fleet = r["fleet"]
            rows.append((f"{label.replace('_', ' ')}, {phase.replace('_', ' ')}", str(fleet["requests"]),
                         _percent(fleet["over_credit"]), _percent(fleet["precision"]),
                         _percent(fleet["reuse_rate"]), _percent(r["liar_traffic_share"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths, strict=True))) for row in rows]
    return "\n".join([head, "", *lines, "", "(over-credit: tokens credited but not reused, per token reused; "
                       "--json: every figure)"])


# ---- CLI -------------------------------------------------------------------------------------------
def cmd_feedback(args) -> int:
    from schemas.events import topic_names

    if args.simulate:
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
