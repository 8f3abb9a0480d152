"""Prefix price: what it costs a replica to serve a prompt, so a router can compare a GPU hit on a
busy replica with a pool hit on an idle one.

total = queue (prefill of the requests routed to it and not yet confirmed) + loading the cached part
from its tiers + recomputing the rest. Seconds, from per-model rates (kvidx.config.PriceConfig).
"""

from __future__ import annotations

from kvidx.config import PriceConfig


def price(answer: dict, n_tokens: int, cfg: PriceConfig) -> dict:
    compute = cfg.recompute_tokens_per_s
    left = answer["resumable_tokens"]
    load_s = 0.0
    for run in answer["tiers"]:
        take = min(run["tokens"], left)
        left -= take
        rate = cfg.load_tokens_per_s.get(run["tier"], 0.0)
        if rate > 0:
            load_s += take / rate
        if left <= 0:
            break
    prefill_tokens = n_tokens - answer["resumable_tokens"]
    prefill_s = prefill_tokens / compute
    queue_s = answer.get("inflight_prefill_tokens", 0) / compute
    return {"prefill_tokens": prefill_tokens, "prefill_s": round(prefill_s, 6), "load_s": round(load_s, 6),
            "queue_s": round(queue_s, 6), "total_s": round(queue_s + load_s + prefill_s, 6)}
