"""What the lookup service answers besides a lookup (schemas/answers.py): the small answers of its
other routes, as msgspec structs. Routers decode them (kvidx.client); the service encodes them and
documents them in its OpenAPI document (index_service/responses.py).

Optional fields have defaults (not required in the schema); unknown fields are allowed, so an
additive change to an answer stays valid for routers generated from an older document.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from schemas.answers import PrefetchHint


class Error(msgspec.Struct):
    """Every 4xx and 5xx: what is wrong, naming the field or the parameter."""
    error: str


class KvHintAction(msgspec.Struct):
    """One versioned action of a KvHint (Dynamo's dynamo_kv_router::kv_hints::KvHintAction)."""
    action_id: str
    action_type: str  # "kv.fetch"
    action_version: str  # "1.0"
    # kv.fetch@1.0: {"block_hashes": [u64, ...] (the source's engine block hashes, root-aligned),
    # "source_control_endpoint": "tcp://HOST:PORT"}
    payload: dict[str, Any]


class KvHint(msgspec.Struct):
    """Dynamo's KV hint (dynamo_kv_router::kv_hints::KvHint, protocol 0.1), as its serde JSON: a router
    puts it in the request it sends the chosen worker (PreprocessedRequest.kv_hint)."""
    protocol_version: str
    message_id: str
    actions: list[KvHintAction]


class RouteAccepted(msgspec.Struct):
    accepted: bool
    duplicate: bool  # this request_id was already recorded
    expires_at: float  # epoch seconds: pending credit ends then unless the engine confirms it
    prefetch: PrefetchHint | None = None  # hints.prefetch: the chosen replica's plan, if issued
    kv_hint: KvHint | None = None  # hints.fetch: fetch a longer prefix from another replica, if issued


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
    groups: dict[str, dict[str, Any]]  # per group id: kind, blocks, entries, tiers (the working set by tier)
    blocks_applied: int
    # live partial-block keys (engines that resume inside blocks: SGLang small pages, TensorRT-LLM
    # partial reuse); lookups by token ids credit them to the token, by block hashes they cannot
    tail_keys: int
    freshness: ModelFreshness
    # this instance's token counters since it started (the /metrics series of the same names):
    # lookup_prompt_tokens, lookup_best_resumable_tokens, lookup_below_gpu_tokens,
    # routes_credited_tokens, usage_prompt_tokens, usage_reused_tokens (absent: none yet)
    since_start: dict[str, int] = {}
    # a model split in replica groups, some held by other instances: those (a lookup here asks them)
    missing_groups: list[int] | None = None


class Models(msgspec.Struct):
    models: list[ModelInfo]
