"""The lookup answer, made here only: a prompt's canonical block hashes against a model's shard ->
per replica its cached and resumable tokens (the walk, kvidx.core.walk), the audit's caps, its price
(kvidx.core.price, the one router cost), ranked and cut to the best k, with the first replica's
prefetch plan; or that answer's JSON as the compiled core writes it; or the parts of a model split over
instances merged into one (the fan-out).

The service's routes, the routers' APIs, the simulator, replay, shadow, audit and feedback all call
these. Callers hold the store's lock as for any read; `now` is the caller's clock (seconds).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec

from kvidx.core import walk
from kvidx.core.hints import prefetch_hint
from kvidx.core.price import Pricer
from kvidx.core.shard import ModelShard
from schemas.answers import LOOKUP_ANSWER_DECODER, LookupAnswer, PrefetchHint, ReplicaAnswer

_encode = msgspec.json.Encoder().encode

__all__ = ["Feedback", "answer", "answer_json", "credited", "lookup", "merge", "merge_answer",
           "prefetch_plan", "queues", "replica_plan"]


class Feedback(Protocol):
    """The audit's caps (index_service.feedback.FeedbackTable): `by_model` holds a model's factors; `apply`
    caps the replicas whose engines reuse less than the index credits, re-sorted."""
    by_model: dict

    def apply(self, model: str, replicas: list[ReplicaAnswer], block_size: int, now: float | None = None,
              prefix: int | None = None) -> list[ReplicaAnswer]: ...


def lookup(shard: ModelShard, hashes: list[int], n_tokens: int, now: float, top_k: int | None = None
           ) -> list[ReplicaAnswer]:
    """Per replica and DP rank, unpriced: the tokens cached along the prefix (by tier), the tokens its
    engine can resume from and how fresh the view is; by resumable tokens, best first, the best
    `top_k` only if given (kvidx.core.walk.lookup). For the common shard the compiled core writes
    the answers (kvidx.core.walk.lookup_json) and msgspec makes the structs from them, the same
    answers (tests/unit/core/test_lookup_compiled.py): 88 us against the Python walk's 155 at 64
    replicas and 512 blocks (bench/bench_lookup.py (b))."""
    fast = walk.lookup_json(shard, hashes, n_tokens, now, 0.0, {}, top_k=top_k, priced=False)
    if fast is not None:
        return LOOKUP_ANSWER_DECODER.decode(fast[0]).replicas
    return walk.lookup(shard, hashes, n_tokens, now, top_k)



def credited(shard: ModelShard, hashes: list[int], n_tokens: int, replica: str | None = None,
             dp_rank: int | None = None, now: float | None = None) -> int:
    """The resumable tokens a lookup credits one replica and DP rank with (None: the best of any),
    pending routed credit included: what the shadow audit and the replay compare with the engine."""
    return walk.credited(shard, hashes, n_tokens, replica, dp_rank, now)


def _feedback_on(feedback: Feedback | None, model: str) -> bool:
    return feedback is not None and bool(feedback.by_model.get(model))


def answer(shard: ModelShard, hashes: list[int], n_tokens: int, pricer: Pricer, now: float, *,
           rank: bool = False, top_k: int | None = None, feedback: Feedback | None = None,
           groups: frozenset[int] | None = None, prefetch_bytes: int | None = None) -> LookupAnswer:
    """The answer: replicas by resumable tokens (`rank`: by price), each priced, the best `top_k` only
    if given. `feedback`: the audit's caps. `groups`: only the replicas of these replica groups (an
    instance answering another's fan-out). `prefetch_bytes`: the model's KV bytes per token when its
    prefetch hints are on (a ranked answer then carries its first replica's plan); None: off."""
    # ranking by price, applying feedback or keeping some groups needs every replica first;
    # otherwise only the best k are described at all
    whole = rank or groups is not None or _feedback_on(feedback, shard.model)
    replicas = lookup(shard, hashes, n_tokens, now, None if whole else top_k)
    if groups is not None:
        states = shard.replicas
        replicas = [a for a in replicas if states[(a.replica, a.dp_rank)].group in groups]
    if feedback is not None:  # audit feedback: cap replicas whose engines reuse less
        replicas = feedback.apply(shard.model, replicas, shard.block_size,
                                  prefix=hashes[0] if hashes else None)
    if top_k is not None and not rank:
        del replicas[top_k:]  # ranked by resumable tokens: the rest need no price
    for r in replicas:
        r.price = pricer(r, n_tokens)
    if rank:
        replicas.sort(key=_cheapest)
    if top_k is not None:
        del replicas[top_k:]
    out = LookupAnswer(shard.model, n_tokens, shard.block_size, replicas)
    if rank and replicas and prefetch_bytes is not None:
        out.prefetch = prefetch_plan(replicas[0], pricer, prefetch_bytes)
    return out


def answer_json(shard: ModelShard, hashes: list[int], n_tokens: int, pricer: Pricer, now: float, *,
                rank: bool = False, top_k: int | None = None, feedback: Feedback | None = None,
                prefetch_bytes: int | None = None) -> tuple[bytes, int, int, int]:
    """`answer` as JSON: (bytes, the first replica's resumable tokens, how many replicas, its tokens
    below GPU memory: `below_gpu`). Written by the compiled core where the shard allows
    (kvidx.core.walk.lookup_json), else the typed answer encoded; the same answer either way
    (tests/unit/index_service/test_answer_json.py)."""
    # feedback caps, and a rank's prefetch plan, need the structs
    if not _feedback_on(feedback, shard.model) and not (rank and prefetch_bytes is not None):
        fast = walk.lookup_json(shard, hashes, n_tokens, now, pricer.per_token, pricer.load_cost, rank,
                                top_k)
        if fast is not None:
            return fast
    out = answer(shard, hashes, n_tokens, pricer, now, rank=rank, top_k=top_k, feedback=feedback,
                 prefetch_bytes=prefetch_bytes)
    replicas = out.replicas
    return _encode(out), replicas[0].resumable_tokens if replicas else 0, len(replicas), below_gpu(replicas)


def below_gpu(replicas: Sequence[ReplicaAnswer]) -> int:
    """The prompt's tokens cached below GPU memory only, among the replicas answered: the longest
    prefix cached in any tier minus the longest one in GPU memory (a replica's first tier run). A
    signal for capacity: reuse the fleet serves from host memory, disk or a shared cache."""
    cached = max((r.cached_tokens for r in replicas), default=0)
    gpu = max((r.tiers[0].tokens for r in replicas if r.tiers and r.tiers[0].tier == "GPU"), default=0)
    return max(0, cached - gpu)


def merge(parts: list[list[ReplicaAnswer]], rank: bool = False, top_k: int | None = None
          ) -> list[ReplicaAnswer]:
    """Per-replica answers of several replica groups (disjoint replicas) as one answer's: by resumable
    tokens, best first (by price, cheapest first, with `rank`), the best `top_k` if given. A replica
    in two parts (one group held by two instances) is kept once, from the first part; ties keep the
    parts' order."""
    seen: set[tuple[str, int]] = set()
    out = []
    for part in parts:
        for a in part:
            key = (a.replica, a.dp_rank)
            if key not in seen:
                seen.add(key)
                out.append(a)
    out.sort(key=_cheapest if rank else _best_resumable)
    return out if top_k is None else out[:top_k]


def merge_answer(out: LookupAnswer, parts: list[list[ReplicaAnswer]], gone: list[int], pricer: Pricer, *,
                 rank: bool = False, top_k: int | None = None, prefetch_bytes: int | None = None) -> None:
    """This instance's answer `out` completed with the other instances' `parts` of a split model, in
    place; `gone`: the groups no instance answered for (the answer is then partial)."""
    out.replicas = merge([out.replicas, *parts], rank, top_k)
    out.partial, out.missing_groups = bool(gone), gone
    if rank and out.replicas and prefetch_bytes is not None:
        out.prefetch = prefetch_plan(out.replicas[0], pricer, prefetch_bytes)


def prefetch_plan(replica: ReplicaAnswer, pricer: Pricer, bytes_per_token: int) -> PrefetchHint | None:
    """A priced replica's prefetch plan (kvidx.core.hints), expected to start the request after the
    prefill already routed there (its price's queue); None with nothing below GPU memory."""
    queue_s = replica.price.queue_s if replica.price is not None else 0.0
    return prefetch_hint(replica, pricer, queue_s, bytes_per_token)


def replica_plan(answers: list[ReplicaAnswer], n_tokens: int, replica: str, dp_rank: int, pricer: Pricer,
                 bytes_per_token: int) -> PrefetchHint | None:
    """The prefetch plan of the replica a router chose for a prompt (`answers`: the prompt's `lookup`):
    its answer's tier runs, priced."""
    for a in answers:
        if a.replica == replica and a.dp_rank == dp_rank:
            a.price = pricer(a, n_tokens)
            return prefetch_plan(a, pricer, bytes_per_token)
    return None


def queues(shard: ModelShard, now: float, pricer: Pricer) -> dict[str, float]:
    """Seconds of prefill routed to each replica (DP rank 0) and not yet confirmed: the price's queue,
    read from the pending credit without a lookup."""
    pending = shard.pending
    if len(pending):
        pending.expire(now)
    inflight, per_token = pending.inflight, pricer.per_token
    return {st.replica: inflight.get(st.slot, 0) * per_token
            for st in shard.by_slot if st is not None and st.dp_rank == 0}


def _best_resumable(a: ReplicaAnswer) -> int:
    return -a.resumable_tokens


def _cheapest(a: ReplicaAnswer) -> float:
    return a.price.total_s if a.price is not None else float("inf")

