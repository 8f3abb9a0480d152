"""The lookup service: HTTP front of a ShardStore. Routers ask it, per prompt, how much of the prompt
each replica (DP rank) has cached and can resume from.

Endpoints
---------
POST /v1/lookup            JSON body, one of two forms:
    {"model": str, "token_ids": [u32, ...], "lora_name": str|null, "cache_salt": str|null}
        The service hashes the prompt (kvidx.core.hashing.prompt_hashes at the model's index block
        size, with the LoRA namespace and the cache salt).
    {"model": str, "block_hashes": [u64, ...], "prompt_tokens": int}
        The router hashed the prompt itself, the same way (prompt_hashes with the index block size
        this service reports as "block_size", its LoRA adapter and cache salt): block_hashes are the
        canonical hashes of the prompt's leading full blocks (at most prompt_tokens // block_size
        of them), prompt_tokens the prompt length. lora_name / cache_salt are accepted but ignored
        in this form (they are already in the hashes).
    Unknown fields are rejected.
POST /v1/lookup/binary?model=NAME[&lora_name=..][&cache_salt=..]
    Body: the prompt's token ids as packed little-endian uint32 (application/octet-stream). The
    fast form: no JSON parse, the bytes are hashed as they are.
Both answer 200:
    {"model": str, "prompt_tokens": int, "block_size": int (the index block size),
     "replicas": [{"replica", "dp_rank", "cached_tokens", "tiers": [{"tier", "tokens"}],
                   "resumable_tokens", "freshness": {"last_event_age_ms", "apply_lag_ms", "epoch",
                   "seq", "seq_gaps"}}, ...]}   (ModelShard.lookup: best resumable first)
    and errors as {"error": "what is wrong, naming the field"}:
    400 invalid JSON / binary body not a multiple of 4 bytes; 404 unknown model (the message lists
    known ones; 503 instead while the instance is still rebuilding its shards); 413 more than
    max_tokens tokens (or a body too large to hold them); 422 a field missing, of the wrong type or
    out of range (token ids must be 0..2^32-1), an empty prompt, both or neither of token_ids and
    block_hashes; with credentials, 401 without a token or with a wrong
    one and 403 with a token lacking the scope (`read` here), both naming the scope needed.
GET /healthz     200 {"status": "ok", "ready": true, "models": n, "batches_applied": n, "auth": "on"|"off"};
                 503 (status "not_ready") until the store was rebuilt. Open, like /metrics; every other
                 route needs a bearer token with its scope when credentials are set (index_service.auth).
GET /v1/models   {"models": [{"model", "block_size", "replicas", "groups" (per group: kind, blocks,
                 entries, tiers: the working set by tier), "blocks_applied", "freshness": {...summary
                 over replicas...}, "since_start": {this instance's token counters}}]}
GET /metrics     Prometheus text (index_service.metrics).
GET /openapi.json, /docs, /redoc: the API with every answer's schema (index_service.responses); the
                 docs pages' assets are served from here. Every error, FastAPI's own 404/405
                 included, is {"error": "..."}.

Handlers are thin on purpose (this is the routers' hot path): the body is decoded with msgspec, token
ids are packed to bytes in C (array) and hashed per block, never looped over per token in Python.
Lookups read the shards without the store lock (see ShardStore). Token ids are never logged.

Where things are: the request bodies and Reject in index_service.wire; the query pipeline (lookup ->
feedback caps -> price -> rank -> top_k, routing decisions as pending credit) in index_service.query,
usable without HTTP; the shared handler plumbing (body limits, error responses, metrics of an answer)
in index_service.context; the routes in lookup_routes, routing_routes and status_routes; the error
shape in errors, the bearer tokens and their scopes in auth, the OpenAPI additions in openapi.
"""

from __future__ import annotations

import os
from collections import deque

from fastapi import FastAPI

from index_service.auth import Credentials, RequireScope
from index_service.conductor_api import ConductorPaths, ConductorRegistry
from index_service.context import ServiceContext, kv, log
from index_service.dynamo_api import DynamoRegistry, add_dynamo_routes
from index_service.errors import one_error_shape
from index_service.guard import DEFAULT_RATES
from index_service.hot_path import HotPath, LookupApp
from index_service.limits import Buckets, RateLimits
from index_service.lmcache_api import add_lmcache_routes
from index_service.lookup_routes import add_binary_lookup, add_json_lookup
from index_service.metrics import ServiceMetrics
from index_service.openapi import document_responses
from index_service.routing_routes import add_routing_routes
from index_service.status_routes import add_status_routes
from index_service.store import ShardStore


def _telemetry() -> dict:
    """FastAPI's OpenTelemetry spans and metrics where an operator configured OpenTelemetry (an
    OTEL_* variable is set); off otherwise: its per-request check of the providers cost 11 us of a
    ~80 us lookup, for nothing (the service's metrics are Prometheus's)."""
    on = any(k.startswith("OTEL_") for k in os.environ)
    return {"tracing": on, "metrics": on, "logs": on}


def create_app(store: ShardStore, *, max_tokens: int = 1_000_000, auth_token: str | None = None,
               credentials: Credentials | None = None, publish_usage=None, feedback=None,
               dynamo: DynamoRegistry | None = None, conductor: ConductorRegistry | None = None, fanout=None,
               lmcache_lookup: str | None = None, probes_open: bool = True,
               rate_limits: dict[str, float] | None = None) -> FastAPI:
    """`credentials` (index_service.auth.Credentials): when set, every request but GET /healthz and
    /metrics must carry `Authorization: Bearer <token>` of a token with the path's scope (401 without or
    with a wrong one, 403 without the scope); `auth_token`: one token granting every scope.
    `publish_usage(UsageReport)`: where POST /v1/usage sends reports (kvidx.kafka.publish.Publisher: the
    usage topic). `feedback`: an object whose `apply(model, replicas, block_size)` caps the credit of
    replicas whose engines reuse less than the index credits (index_service.feedback.FeedbackFollower). Both
    may be set later on `app.state`. `dynamo`: Dynamo's indexer API at its own paths
    (index_service/dynamo_api.py), its registrations starting relays; `conductor`: Mooncake conductor's
    msgpack API on the same paths (index_service/conductor_api.py), told apart by the content type.
    `fanout` (index_service.fanout.Fanout): how an instance holding some replica groups asks for the
    others. `lmcache_lookup`: the model LMCache's controller lookup (POST /lookup) answers for
    (index_service/lmcache_api.py). `probes_open` False: /healthz and /metrics need a token too (they
    are served open on an ops port: index_service.status_routes.ops_app). `rate_limits`: requests a
    second per client on the `write` and `admin` routes (index_service.limits; default DEFAULT_RATES,
    0 for a scope: unlimited)."""
    # /docs and /redoc with their JavaScript and CSS served by the service itself (fastapi-offline
    # ships them): the default pages load them from a CDN, which a cluster without internet lacks
    app = LookupApp.of(title="kvidx lookup service", version="1", telemetry=_telemetry())
    one_error_shape(app)
    document_responses(app)
    if credentials is None and auth_token:
        credentials = Credentials.from_token(auth_token)
    app.state.credentials = credentials
    auth = (401, 403) if credentials is not None else ()  # documented only where it can happen
    app.state.publish_usage = publish_usage
    app.state.usage_recent = deque(maxlen=10_000)
    app.state.feedback = feedback
    metrics = ServiceMetrics(store)
    app.state.store = store
    app.state.metrics = metrics
    ctx = ServiceContext(app, store, metrics, max_tokens)
    app.state.pipeline = ctx.pipeline  # the query pipeline, for code that embeds the app (and tests)
    ctx.fanout = fanout
    # registered in this order because it is the OpenAPI document's path order
    add_json_lookup(app, ctx, auth)
    add_routing_routes(app, ctx, auth)
    add_binary_lookup(app, ctx, auth)
    add_status_routes(app, ctx, auth)
    if dynamo is not None:
        add_dynamo_routes(app, store, dynamo, fanout, metrics)
    if lmcache_lookup is not None:
        add_lmcache_routes(app, ctx, lmcache_lookup)
    app.hot = HotPath(ctx, credentials, dynamo)  # the routers' lookups, before the middleware below
    if conductor is not None:  # its msgpack /query (HotPath leaves it)
        app.add_middleware(ConductorPaths, store=store, registry=conductor, fanout=fanout, metrics=metrics)
    app.add_middleware(RateLimits, buckets=Buckets(DEFAULT_RATES if rate_limits is None else rate_limits),
                       credentials=credentials, refused=metrics.rate_limited)
    if credentials is not None:  # added last: outermost, so it guards every other route and middleware
        app.add_middleware(RequireScope, credentials=credentials, probes_open=probes_open)
    log.info("%s", kv(event="lookup_service_created", models=len(store.shards), max_tokens=max_tokens))
    return app
