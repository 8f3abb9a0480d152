"""Prefetch hints (issue #16): what a replica chosen for a prompt could load back to GPU
memory while the request waits in its queue, so the load overlaps the wait instead of adding to it.

Pure, no I/O: built from one replica's lookup answer (its tier runs) and the model's price rates. A
prefetch is worth issuing only for the resumable tokens held below GPU memory; its benefit is the part
of their load time the queue can hide (min(load, queue wait)); its cost the bytes it moves.
"""

from __future__ import annotations

from kvidx.core.price import Pricer
from schemas.answers import PrefetchHint, PrefetchRun, ReplicaAnswer

__all__ = ["PrefetchHint", "PrefetchRun", "prefetch_hint"]


def prefetch_hint(answer: ReplicaAnswer, pricer: Pricer, queue_s: float,
                  bytes_per_token: int = 0) -> PrefetchHint | None:
    """The prefetch plan for `answer`'s replica, expected to start the request in `queue_s` seconds:
    its resumable tokens held outside GPU memory, in prompt order, or None when there are none (or
    none whose tier costs anything to load). Load costs are the model's `Pricer`'s (the service keeps one
    per model), so a plan and the price it came with agree; the walk mirrors Pricer.__call__'s, kept
    inline there because the price runs for every replica of every lookup."""
    left = answer.resumable_tokens
    pos = 0
    runs: list[PrefetchRun] = []
    for run in answer.tiers:
        if left <= 0:
            break
        take = min(run.tokens, left)
        per_token = pricer.load_cost.get(run.tier, 0.0)
        if run.tier != "GPU" and per_token > 0:
            runs.append(PrefetchRun(run.tier, pos, pos + take, take * per_token))
        pos += take
        left -= take
    if not runs:
        return None
    tokens = sum(r.end - r.start for r in runs)
    load_s = sum(r.load_s for r in runs)
    wait = max(0.0, queue_s)
    return PrefetchHint(answer.replica, answer.dp_rank, runs, tokens, load_s, wait, min(load_s, wait),
                        tokens * bytes_per_token)
