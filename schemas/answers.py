"""What a lookup answers, as msgspec structs: the one type the walk builds, the query pipeline prices
and ranks, the HTTP service encodes (no intermediate dicts), routers decode, and the demo, simulator,
replay and audit read by attribute. The OpenAPI document is generated from these too
(index_service/responses.py).

Optional fields default to None or False and are left out of the encoded answer (omit_defaults): an
answer carries the hybrid, pool and feedback fields only where they apply, and unknown fields are
allowed on decode, so an additive change stays readable by routers built against an older version.
"""

from __future__ import annotations

import msgspec


class Tier(msgspec.Struct):
    tier: str  # GPU, CPU, DISK, NODE_SHARED ...
    tokens: int


class Group(msgspec.Struct, omit_defaults=True):
    """One KV-cache group of the model (hybrid models have several)."""
    group: int
    kind: str
    hit_tokens: int
    blocks: int
    window: int | None = None  # sliding-window groups
    prompt_blocks: int | None = None  # hybrid models: this prompt's index blocks the group holds


class Price(msgspec.Struct):
    """The prefix price: queue + load from the tiers + prefill of what is left, in seconds."""
    prefill_tokens: int
    prefill_s: float
    load_s: float
    queue_s: float
    total_s: float


class Freshness(msgspec.Struct):
    """The replica's last applied event. Its ages are measured from the event's own timestamp, on the
    engine's clock (or its relay's, for engines whose events carry none), to this service's: a skew
    between the clocks is in them, and a played recording keeps its recorded times, so its ages are the
    recording's age, not the index's staleness (consumer lag and /healthz say that: docs/routers.md)."""
    last_event_age_ms: float | None  # None: no engine event applied yet
    apply_lag_ms: float | None
    epoch: int
    seq: int
    seq_gaps: int
    age_clock: str = "engine"  # the clock the ages above start on (every answer says so)


class ReplicaAnswer(msgspec.Struct, omit_defaults=True):
    replica: str
    dp_rank: int
    cached_tokens: int
    tiers: list[Tier]
    resumable_tokens: int
    full_attention_hit_tokens: int
    groups: list[Group]
    pending_tokens: int
    inflight_prefill_tokens: int
    upper_bound: bool
    upper_bound_groups: list[str]
    freshness: Freshness
    price: Price | None = None  # set by the query pipeline (a bare shard lookup has none)
    # tiers whose evictions go unreported that the credit relies on (LMCache through vLLM)
    upper_bound_tiers: list[str] | None = None
    # with audit feedback (kvidx feedback): the replica's credit is capped
    feedback_capped: bool = False
    credit_factor: float | None = None
    index_resumable_tokens: int | None = None
    # eviction foresight: resumable tokens not credited because prefills routed to this replica and
    # not yet reported will evict blocks they need first (kvidx.core.foresight), or the request's own
    # host loads will (a TensorRT-LLM host tier: kvidx.core.walk.onboard_cut)
    evicting_tokens: int = 0


class PrefetchRun(msgspec.Struct):
    """Tokens [start, end) of the prompt, held in `tier`, to load to GPU memory."""
    tier: str
    start: int
    end: int
    load_s: float


class PrefetchHint(msgspec.Struct):
    """What a replica chosen for a prompt could load back to GPU memory while the request waits in its
    queue (kvidx.core.hints)."""
    replica: str
    dp_rank: int
    runs: list[PrefetchRun]
    tokens: int  # tokens to load, all runs
    load_s: float  # their load time, all runs, at the model's rates
    deadline_s: float  # seconds from now when the request is expected to start its prefill
    benefit_s: float  # load time the wait hides: min(load_s, deadline_s)
    bytes: int  # bytes moved (tokens x bytes_per_token; 0 when the model's KV size is not configured)


class LookupAnswer(msgspec.Struct, omit_defaults=True):
    """Replicas best first: by resumable tokens (/v1/lookup), by price (/v1/rank)."""
    model: str
    prompt_tokens: int
    block_size: int  # the index block size the prompt was hashed with
    replicas: list[ReplicaAnswer]
    # a model split in replica groups, answered with the instances holding the others (fan-out):
    # the groups no instance answered for in time (their replicas are missing from `replicas`)
    partial: bool = False
    missing_groups: list[int] = []
    # /v1/rank, for a model whose hints are on (its `hints.prefetch`): the first replica's prefetch plan
    prefetch: PrefetchHint | None = None


LOOKUP_ANSWER_DECODER = msgspec.json.Decoder(LookupAnswer)  # what a router in Python decodes with
