"""What the lookup service answers, as msgspec structs: only for the OpenAPI document (the handlers
build plain dicts on the hot path). tests/unit/index_service/test_openapi.py checks real answers against these
schemas, so a field added to an answer and not here (or the reverse) fails there.

Optional fields have defaults (not required in the schema); unknown fields are allowed, so an
additive change to an answer stays valid for routers generated from an older document.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

JSON = "application/json"


class Error(msgspec.Struct):
    """Every 4xx and 5xx: what is wrong, naming the field or the parameter."""
    error: str


class Tier(msgspec.Struct):
    tier: str  # GPU, CPU, DISK, NODE_SHARED ...
    tokens: int


class Group(msgspec.Struct):
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
    last_event_age_ms: float | None  # None: no engine event applied yet
    apply_lag_ms: float | None
    epoch: int
    seq: int
    seq_gaps: int


class ReplicaAnswer(msgspec.Struct):
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
    price: Price
    freshness: Freshness
    # with audit feedback (kvidx feedback): the replica's credit is capped
    feedback_capped: bool = False
    credit_factor: float | None = None
    index_resumable_tokens: int | None = None


class LookupAnswer(msgspec.Struct):
    """Replicas best first: by resumable tokens (/v1/lookup), by price (/v1/rank)."""
    model: str
    prompt_tokens: int
    block_size: int  # the index block size the prompt was hashed with
    replicas: list[ReplicaAnswer]


class RouteAccepted(msgspec.Struct):
    accepted: bool
    duplicate: bool  # this request_id was already recorded
    expires_at: float  # epoch seconds: pending credit ends then unless the engine confirms it


class UsageAccepted(msgspec.Struct):
    accepted: bool
    published: bool  # False: no Kafka, kept in memory


class Health(msgspec.Struct):
    status: Literal["ok", "not_ready"]
    ready: bool
    models: int
    batches_applied: int
    reason: str | None = None  # while not ready: what it waits for (e.g. a broker that does not answer)


class ModelFreshness(msgspec.Struct):
    replicas_never_applied: int
    last_event_age_ms_min: float | None
    last_event_age_ms_max: float | None
    apply_lag_ms_max: float | None
    seq_gaps: int
    duplicates: int


class ModelInfo(msgspec.Struct):
    model: str
    block_size: int
    replicas: int
    groups: dict[str, dict[str, Any]]  # per group id: kind, blocks, entries
    blocks_applied: int
    freshness: ModelFreshness


class Models(msgspec.Struct):
    models: list[ModelInfo]


_TYPES = [Error, LookupAnswer, RouteAccepted, UsageAccepted, Health, Models]
_, COMPONENTS = msgspec.json.schema_components(_TYPES, ref_template="#/components/schemas/{name}")

ERRORS = {
    400: "malformed JSON or binary body",
    401: "missing or wrong bearer token",
    404: "unknown model, or no such path",
    405: "method not allowed on this path",
    413: "prompt or body larger than max_tokens allows",
    422: "a field missing, of the wrong type or out of range",
}


def ok(name: str, what: str, status: int = 200) -> dict[int, dict]:
    return {status: {"description": what, "content": {JSON: {"schema": ref(name)}}}}


def errors(*statuses: int) -> dict[int, dict]:
    return {s: {"description": ERRORS[s], "content": {JSON: {"schema": ref("Error")}}} for s in statuses}


def ref(name: str) -> dict[str, str]:
    assert name in COMPONENTS, name
    return {"$ref": f"#/components/schemas/{name}"}
