"""Prefix price: what it costs a replica to serve a prompt, so a router can compare a GPU hit on a
busy replica with a pool hit on an idle one. The one router cost: the service prices its answers with
it, the simulator's routers choose by it (their own load signal passed in as the queue).

total = queue (prefill of the requests routed to it and not yet confirmed) + loading the cached part
from its tiers + recomputing the rest. Seconds, from per-model rates (PriceConfig, read from the
deployment configuration by kvidx.config).
Computed for every replica of every lookup: kept to a few operations per replica.
"""

from __future__ import annotations

import msgspec

from schemas.answers import Price, ReplicaAnswer


class PriceConfig(msgspec.Struct, forbid_unknown_fields=True):
    """A model's rates: how fast a replica prefills, and loads cached tokens from each tier."""
    recompute_tokens_per_s: float = 8000.0
    load_tokens_per_s: dict[str, float] = msgspec.field(default_factory=lambda: {
        "GPU": 0.0, "CPU": 150_000.0, "DISK": 40_000.0, "NODE_SHARED": 100_000.0, "POOL": 25_000.0})


class Pricer:
    def __init__(self, cfg: PriceConfig):
        self.per_token = 1.0 / cfg.recompute_tokens_per_s
        # seconds per token loaded from each tier (0: free, where the engine computes from)
        self.load_cost = {t: (1.0 / r if r > 0 else 0.0) for t, r in cfg.load_tokens_per_s.items()}

    def __call__(self, answer: ReplicaAnswer, n_tokens: int) -> Price:
        """`answer`'s price, its queue the prefill routed to its replica and not yet confirmed."""
        resumable = answer.resumable_tokens
        load_s = 0.0
        if resumable:
            left = resumable
            cost = self.load_cost
            for run in answer.tiers:
                take = run.tokens if run.tokens < left else left
                load_s += take * cost.get(run.tier, 0.0)
                left -= take
                if left <= 0:
                    break
        prefill = n_tokens - resumable
        prefill_s = prefill * self.per_token
        queue_s = answer.inflight_prefill_tokens * self.per_token
        return Price(prefill, prefill_s, load_s, queue_s, total_s(prefill_s, load_s, queue_s))

    def cost_s(self, answer: ReplicaAnswer | None, n_tokens: int, queue_s: float, queue_weight: float = 1.0
               ) -> float:
        """The router's cost, in seconds, of sending an `n_tokens` prompt to `answer`'s replica (None:
        nothing cached there) whose queue the caller measured (`queue_s`, weighed by `queue_weight`)."""
        if answer is None or not answer.resumable_tokens:
            return total_s(n_tokens * self.per_token, 0.0, queue_s, queue_weight)
        p = self(answer, n_tokens)
        return total_s(p.prefill_s, p.load_s, queue_s, queue_weight)


def total_s(prefill_s: float, load_s: float, queue_s: float, queue_weight: float = 1.0) -> float:
    """A replica's total: its weighed queue, the load of its cached tokens and the prefill of the rest."""
    return queue_weight * queue_s + load_s + prefill_s


def price(answer: ReplicaAnswer, n_tokens: int, cfg: PriceConfig) -> Price:
    """One answer's price (routers and tests; the service keeps a Pricer per model)."""
    return Pricer(cfg)(answer, n_tokens)
