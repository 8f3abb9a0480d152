"""The feedback measured on a simulated fleet (`kvidx feedback --simulate N`): one replica whose engine
silently drops its state, routed to by the router cost with and without the feedback's caps
(kvidx/ops/feedback.py), and what capping it gains."""

from __future__ import annotations

import random
from collections import OrderedDict

from index_service.feedback import FeedbackTable
from kvidx import index
from kvidx.core.hashing import prompt_hashes
from kvidx.core.price import PriceConfig, Pricer
from kvidx.core.shard import ModelShard
from kvidx.ops.audit import Tally
from kvidx.ops.feedback import compute_factors
from kvidx.sim.prompts import workload_requests
from schemas.events import SCHEMA_VERSION, BlocksRemoved, BlocksStored, EventBatch
from schemas.routes import ROUTES_VERSION, RouteDecision
from schemas.usage import USAGE_VERSION, UsageReport


class _LruEngine:
    """A replica's prefix cache (index blocks, LRU) that publishes its stores and evictions; a liar
    reuses only `reuse` of what it announces (state dropped silently)."""

    def __init__(self, name: str, capacity: int, reuse: float = 1.0):
        self.name, self.capacity, self.reuse = name, capacity, reuse
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.seq = 0

    def serve(self, hashes: list[int], n_tokens: int, bs: int):
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
    """A KV-aware router (the router cost: prefill left + its decaying load, one token a second) over
    `replicas` engines, the last of which reuses
    only `liar_reuse` of what its events announce; every `period` requests the feedback computes
    factors over the last `window` decisions (the same compute_factors as `kvidx feedback`).
    Returns per request (replica, prompt, reused, credited) and when the liar was capped."""
    bs = 16
    shard = ModelShard("m", bs)
    engines = [_LruEngine(f"r{i}", capacity_blocks, liar_reuse if i == replicas - 1 else 1.0)
               for i in range(replicas)]
    liar = engines[-1].name
    table = FeedbackTable(clock=lambda: 0.0)
    pricer = Pricer(PriceConfig(recompute_tokens_per_s=1.0))  # seconds are tokens; GPU loads are free
    load = {e.name: 0.0 for e in engines}
    rng = random.Random(seed)
    pairs: list[tuple[RouteDecision, UsageReport]] = []
    work = workload_requests(seed, requests, systems=8, sys_len=(200, 600), user_len=(20, 120), turns=6,
                             active_convs=24, max_prompt=2000, vocab=30000)
    capped_at = None
    for i, (prompt, output) in enumerate(work):
        t = float(i)
        hashes = prompt_hashes(prompt, bs)
        answers = index.lookup(shard, hashes, len(prompt), t)
        if feedback:
            table.apply("m", answers, bs, now=t)
        by_name = {a.replica: a for a in answers}
        res = {a.replica: a.resumable_tokens for a in answers}
        cost = {e.name: pricer.cost_s(by_name.get(e.name), len(prompt), load[e.name]) + rng.random()
                for e in engines}
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
