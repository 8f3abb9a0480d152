"""What the lookup service answers, as msgspec structs, for the OpenAPI document: the lookup answer is
kvidx.core.answers (the very structs the handlers encode); the rest are the small answers of the
other routes. tests/unit/index_service/test_openapi.py checks real answers against these schemas.

Optional fields have defaults (not required in the schema); unknown fields are allowed, so an
additive change to an answer stays valid for routers generated from an older document.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from kvidx.core.answers import LookupAnswer

JSON = "application/json"


class Error(msgspec.Struct):
    """Every 4xx and 5xx: what is wrong, naming the field or the parameter."""
    error: str


class RouteAccepted(msgspec.Struct):
    accepted: bool
    duplicate: bool  # this request_id was already recorded
    expires_at: float  # epoch seconds: pending credit ends then unless the engine confirms it


class UsageAccepted(msgspec.Struct):
    accepted: bool
    published: bool  # False: no Kafka, kept in memory


class Peer(msgspec.Struct):
    name: str
    url: str
    groups: list[int] | None  # None: all


class Health(msgspec.Struct):
    status: Literal["ok", "not_ready"]
    ready: bool
    models: int
    batches_applied: int
    auth: Literal["on", "off"] = "off"  # whether every route but /healthz and /metrics needs a token
    reason: str | None = None  # while not ready: what it waits for (e.g. a broker that does not answer)
    groups: list[int] | None = None  # the replica groups this instance holds (absent: all)
    peers: list[Peer] | None = None  # with groups: the live instances it asks for the others


class ModelFreshness(msgspec.Struct):
    replicas_never_applied: int
    last_event_age_ms_min: float | None
    last_event_age_ms_max: float | None
    apply_lag_ms_max: float | None
    seq_gaps: int
    duplicates: int
    # the clock the ages start on: the events' own times, the engine's (a recording: its recorded
    # times, so its ages are the recording's age, not staleness)
    age_clock: str = "engine"


class ModelInfo(msgspec.Struct):
    model: str
    block_size: int
    # tokens after a block that its hash covers (vLLM 0.33 lookahead hashing; 0: none): routers that
    # send block_hashes hash with prompt_hashes(..., lookahead=lookahead_tokens)
    lookahead_tokens: int
    replicas: int
    groups: dict[str, dict[str, Any]]  # per group id: kind, blocks, entries
    blocks_applied: int
    # live partial-block keys (engines that resume inside blocks: SGLang small pages, TensorRT-LLM
    # partial reuse); lookups by token ids credit them to the token, by block hashes they cannot
    tail_keys: int
    freshness: ModelFreshness
    # a model split in replica groups, some held by other instances: those (a lookup here asks them)
    missing_groups: list[int] | None = None


class Models(msgspec.Struct):
    models: list[ModelInfo]


_TYPES = [Error, LookupAnswer, RouteAccepted, UsageAccepted, Health, Models]
_, COMPONENTS = msgspec.json.schema_components(_TYPES, ref_template="#/components/schemas/{name}")

ERRORS = {
    400: "malformed JSON or binary body",
    401: "missing or wrong bearer token",
    403: "the token lacks the scope this route needs",
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
