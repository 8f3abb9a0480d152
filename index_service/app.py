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
    known ones); 413 more than max_tokens tokens (or a body too large to hold them); 422 a field
    missing, of the wrong type or out of range (token ids must be 0..2^32-1), an empty prompt, both
    or neither of token_ids and block_hashes.
GET /healthz     200 {"status": "ok", "ready": true, "models": n, "batches_applied": n}; 503 (status
                 "not_ready") until the store was rebuilt.
GET /v1/models   {"models": [{"model", "block_size", "replicas", "groups", "blocks_applied",
                 "freshness": {...summary over replicas...}}]}
GET /metrics     Prometheus text (index_service.metrics).
GET /openapi.json, /docs, /redoc: the API with every answer's schema (index_service.responses); the
                 docs pages' assets are served from here. Every error, FastAPI's own 404/405
                 included, is {"error": "..."}.

Handlers are thin on purpose (this is the routers' hot path): the body is decoded with msgspec, token
ids are packed to bytes in C (array) and hashed per block, never looped over per token in Python.
Lookups read the shards without the store lock (see ShardStore). Token ids are never logged.
"""

from __future__ import annotations

import hmac
import logging
import sys
import time
from array import array
from collections import deque

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException

from index_service.metrics import ServiceMetrics
from index_service.responses import COMPONENTS, errors, ok
from index_service.store import ShardStore
from kvidx.core.hashing import prompt_hashes
from kvidx.core.price import Pricer
from kvidx.core.shard import ModelShard
from schemas.routes import ROUTES_VERSION, RouteDecision
from schemas.usage import USAGE_VERSION, UsageReport

log = logging.getLogger("kvidx.index_service")

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
JSON = "application/json"
_MAX_MODELS_LISTED = 10
_BINARY_PARAMS = frozenset({"model", "lora_name", "cache_salt", "top_k"})
MAX_TOP_K = 4096

# Token ids as packed little-endian uint32, converted in C (array range-checks every id).
_U32_CODE = next(c for c in ("I", "L") if array(c).itemsize == 4)
_SWAP = sys.byteorder != "little"


class LookupRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    # Range-checked in C by array("I") / array("Q"): a msgspec constraint per item costs more (and
    # msgspec bounds cannot express u64).
    token_ids: list[int] | None = None
    block_hashes: list[int] | None = None
    prompt_tokens: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    top_k: int | None = None  # only the best k replicas (by resumable tokens; /v1/rank: by price)


class RouteRequest(msgspec.Struct, forbid_unknown_fields=True):
    """A routing decision: the prompt (as in a lookup), where it went, and what the index credited."""
    request_id: str
    model: str
    replica: str
    dp_rank: int = 0
    credited_tokens: int = 0
    ttl_s: float | None = None
    router: str = ""
    token_ids: list[int] | None = None
    block_hashes: list[int] | None = None
    prompt_tokens: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None


class UsageRequest(msgspec.Struct, forbid_unknown_fields=True):
    """What an engine reused for a routed request (vLLM: usage.prompt_tokens_details.cached_tokens)."""
    request_id: str
    model: str
    replica: str
    prompt_tokens: int
    cached_tokens: int
    dp_rank: int = 0
    engine: str = ""
    tier: str = ""
    router: str = ""


_decoder = msgspec.json.Decoder(LookupRequest)
_route_decoder = msgspec.json.Decoder(RouteRequest)
_usage_decoder = msgspec.json.Decoder(UsageRequest)
_USAGE_SCHEMA = msgspec.json.schema_components([UsageRequest])[1]["UsageRequest"]
_REQUEST_SCHEMA = msgspec.json.schema_components([LookupRequest])[1]["LookupRequest"]  # inline, no $ref
_ROUTE_SCHEMA = msgspec.json.schema_components([RouteRequest])[1]["RouteRequest"]
_encode = msgspec.json.Encoder().encode


class Reject(Exception):
    def __init__(self, status: int, error: str):
        super().__init__(error)
        self.status = status
        self.error = error


def _by_price(answer: dict) -> float:
    return answer["price"]["total_s"]


def _json(obj: object, status: int = 200) -> Response:
    return Response(_encode(obj), status_code=status, media_type=JSON)


def _one_error_shape(app: FastAPI) -> None:
    """The errors FastAPI and Starlette raise themselves (no such path, wrong method, a validation
    FastAPI would do) answer {"error": "..."} like the handlers' own, not {"detail": ...}."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        where = f"{request.method} {request.url.path[:200]}"
        if exc.status_code == 404:
            error = f"no such path: {where} (the API is listed at /docs and /openapi.json)"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("allow") or (exc.headers or {}).get("Allow") or "?"
            error = f"method not allowed: {where} (allowed: {allowed})"
        else:
            error = f"{exc.detail} ({where})"
        r = _json({"error": error}, exc.status_code)
        r.headers.update(exc.headers or {})  # 405's Allow
        return r

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        problems = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in exc.errors())
        return _json({"error": f"invalid request: {problems[:1000]}"}, 422)


def _document_responses(app: FastAPI) -> None:
    """The answers' schemas (index_service.responses) in the OpenAPI document's components, which the
    routes' `responses=` refer to."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(COMPONENTS)
        return app.openapi_schema

    app.openapi = openapi


def _pack(token_ids: list[int]) -> bytes:
    try:
        a = array(_U32_CODE, token_ids)
    except (OverflowError, TypeError):
        i = next((i for i, t in enumerate(token_ids) if not 0 <= t <= U32_MAX), None)
        raise Reject(422, f"token_ids[{i}] is out of range: token ids are uint32 (0..{U32_MAX})"
                     ) from None
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def _check_u64(hashes: list[int]) -> None:
    try:
        array("Q", hashes)
    except (OverflowError, TypeError):
        i = next((i for i, h in enumerate(hashes) if not 0 <= h <= U64_MAX), None)
        raise Reject(422, f"block_hashes[{i}] is out of range: hashes are uint64 (0..{U64_MAX})"
                     ) from None


def _kv(**fields: object) -> str:
    """key=value pairs for log lines; strings with spaces or quotes are JSON-quoted."""
    out = []
    for k, v in fields.items():
        if isinstance(v, str) and (not v or any(c in v for c in ' "=\n')):
            v = _encode(v).decode()
        out.append(f"{k}={v}")
    return " ".join(out)


class _RejectLog:
    """Client errors logged at most once per second (with how many were left out), so a broken
    router cannot flood the log."""

    def __init__(self, interval: float = 1.0):
        self.interval = interval
        self.next_at = 0.0
        self.suppressed = 0

    def __call__(self, **fields: object) -> None:
        now = time.monotonic()
        if now < self.next_at:
            self.suppressed += 1
            return
        self.next_at = now + self.interval
        if self.suppressed:
            fields["suppressed"] = self.suppressed
            self.suppressed = 0
        log.info("%s", _kv(event="lookup_rejected", **fields))


def _freshness(shard: ModelShard, now: float) -> dict:
    states = list(shard.replicas.values())
    live = [st for st in states if st.batches]
    ages = [(now - st.engine_ts) * 1000 for st in live]
    lags = [(st.applied_ts - st.engine_ts) * 1000 for st in live]
    return {
        "replicas_never_applied": len(states) - len(live),
        "last_event_age_ms_min": round(min(ages), 3) if ages else None,
        "last_event_age_ms_max": round(max(ages), 3) if ages else None,
        "apply_lag_ms_max": round(max(lags), 3) if lags else None,
        "seq_gaps": sum(st.seq_gaps for st in states),
        "duplicates": sum(st.duplicates for st in states),
    }


def create_app(store: ShardStore, *, max_tokens: int = 1_000_000, auth_token: str | None = None,
               publish_usage=None, feedback=None) -> FastAPI:
    """`auth_token`: when set, every /v1/ request must carry `Authorization: Bearer <token>`
    (/healthz and /metrics stay open for probes and scrapers). `publish_usage(UsageReport)`: where
    POST /v1/usage sends reports (kvidx.ops.audit.UsagePublisher: the usage topic). `feedback`: an
    object whose `apply(model, replicas, block_size)` caps the credit of replicas whose engines reuse
    less than the index credits (kvidx.ops.feedback.FeedbackFollower). Both may be set later on
    `app.state`."""
    # /docs and /redoc with their JavaScript and CSS served by the service itself (fastapi-offline
    # ships them): the default pages load them from a CDN, which a cluster without internet lacks
    app: FastAPI = FastAPIOffline(title="kvidx lookup service", version="1")
    _one_error_shape(app)
    _document_responses(app)
    auth = (401,) if auth_token else ()  # documented only where it can happen
    app.state.publish_usage = publish_usage
    app.state.usage_recent = deque(maxlen=10_000)
    app.state.feedback = feedback
    if auth_token:
        expected = f"Bearer {auth_token}".encode()

        @app.middleware("http")
        async def require_token(request: Request, call_next):
            if request.url.path.startswith("/v1/"):
                given = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(given, expected):
                    return _json({"error": "missing or wrong bearer token (Authorization: Bearer ...)"}, 401)
            return await call_next(request)

    metrics = ServiceMetrics(store)
    app.state.store = store
    app.state.metrics = metrics
    reject_log = _RejectLog()
    pricers: dict[str, Pricer] = {}  # per model, from the configuration
    # The largest JSON body that can hold max_tokens ids (10 digits, a comma and a space each) plus
    # the other fields; anything larger is refused before it is read in full.
    max_json_bytes = max_tokens * 12 + 65536
    max_binary_bytes = max_tokens * 4

    async def read_body(request: Request, limit: int, what: str) -> bytes:
        cl = request.headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > limit:
            raise Reject(413, f"{what} too large: {int(cl)} bytes, at most {limit} "
                              f"(max_tokens={max_tokens})")
        if cl is not None:
            return await request.body()
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise Reject(413, f"{what} too large: over {limit} bytes (max_tokens={max_tokens})")
            chunks.append(chunk)
        return b"".join(chunks)

    def find_shard(model: str) -> ModelShard:
        shard = store.shards.get(model)
        if shard is None:
            known = sorted(store.shards)
            listed = ", ".join(repr(m) for m in known[:_MAX_MODELS_LISTED]) or "none"
            more = f" (and {len(known) - _MAX_MODELS_LISTED} more)" if len(known) > _MAX_MODELS_LISTED else ""
            raise Reject(404, f"unknown model {model[:200]!r}: known models are {listed}{more}")
        return shard

    def answer(form: str, t0: float, shard: ModelShard, hashes: list[int], n_tokens: int,
               rank: bool = False, top_k: int | None = None) -> Response:
        if top_k is not None and not 1 <= top_k <= MAX_TOP_K:
            raise Reject(422, f"top_k must be in 1..{MAX_TOP_K}, got {top_k}")
        # ranking by price or applying feedback needs every replica first; otherwise only the best
        # k are described at all
        feedback = app.state.feedback
        whole = rank or (feedback is not None and bool(feedback.by_model.get(shard.model)))
        replicas = shard.lookup(hashes, n_tokens, time.time(), None if whole else top_k)
        if feedback is not None:  # audit feedback: cap replicas whose engines reuse less
            replicas = feedback.apply(shard.model, replicas, shard.block_size,
                                      prefix=hashes[0] if hashes else None)
        if top_k is not None and not rank:
            del replicas[top_k:]  # ranked by resumable tokens: the rest need no price
        pricer = pricers.get(shard.model)
        if pricer is None:
            pricer = pricers[shard.model] = Pricer(store.config.model(shard.model).price)
        for r in replicas:
            r["price"] = pricer(r, n_tokens)
        if rank:
            replicas.sort(key=_by_price)
        if top_k is not None:
            del replicas[top_k:]
        body = _encode({"model": shard.model, "prompt_tokens": n_tokens,
                        "block_size": shard.block_size, "replicas": replicas})
        dt = time.perf_counter() - t0
        best = replicas[0]["resumable_tokens"] if replicas else 0
        metrics.observe(form, 200, dt)
        metrics.answered(shard.model, n_tokens, best)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s", _kv(event="lookup", form=form, model=shard.model, prompt_tokens=n_tokens,
                                blocks=len(hashes), replicas=len(replicas), best_resumable=best,
                                us=round(dt * 1e6)))
        return Response(body, media_type=JSON)

    def rejected(form: str, e: Exception, model: str | None) -> Response:
        if isinstance(e, Reject):
            status, error = e.status, e.error
            reject_log(form=form, status=status, model=model or "-", error=error)
        else:
            status, error = 500, "internal error"
            log.exception("%s", _kv(event="lookup_failed", form=form, model=model or "-"))
        metrics.observe(form, status)
        return _json({"error": error}, status)

    def prompt(req: LookupRequest | RouteRequest) -> tuple[ModelShard, list[int], int]:
        """The shard, canonical block hashes and prompt length of a JSON request's prompt."""
        model = req.model
        if req.token_ids is not None:
            if req.block_hashes is not None:
                raise Reject(422, "give either token_ids or block_hashes (+ prompt_tokens), not both")
            n = len(req.token_ids)
            if n == 0:
                raise Reject(422, "token_ids is empty: a prompt has at least one token")
            if n > max_tokens:
                raise Reject(413, f"token_ids has {n} tokens, more than max_tokens={max_tokens}")
            if req.prompt_tokens is not None and req.prompt_tokens != n:
                raise Reject(422, f"prompt_tokens={req.prompt_tokens} differs from the {n} token_ids")
            packed = _pack(req.token_ids)
            shard = find_shard(model)
            return shard, prompt_hashes(packed, shard.block_size, req.lora_name, req.cache_salt), n
        if req.block_hashes is not None:
            n = req.prompt_tokens
            if n is None:
                raise Reject(422, "block_hashes needs prompt_tokens (the prompt's length in tokens)")
            if n <= 0:
                raise Reject(422, f"prompt_tokens must be positive, got {n}")
            if n > max_tokens:
                raise Reject(413, f"prompt_tokens={n} is more than max_tokens={max_tokens}")
            shard = find_shard(model)
            hashes = req.block_hashes
            _check_u64(hashes)
            bs = shard.block_size
            if len(hashes) > n // bs:
                raise Reject(422, f"block_hashes has {len(hashes)} hashes but prompt_tokens={n} holds "
                                  f"only {n // bs} full blocks of {bs} tokens")
            return shard, hashes, n
        raise Reject(422, "give token_ids, or block_hashes and prompt_tokens")

    async def read_json(request: Request, decoder: msgspec.json.Decoder):
        body = await read_body(request, max_json_bytes, "JSON body")
        try:
            return decoder.decode(body)
        except msgspec.ValidationError as e:
            raise Reject(422, f"invalid request: {e}") from None
        except msgspec.DecodeError as e:
            raise Reject(400, f"invalid JSON: {e}") from None

    async def json_lookup(request: Request, form: str, rank: bool) -> Response:
        t0 = time.perf_counter()
        model = None
        try:
            req = await read_json(request, _decoder)
            model = req.model
            shard, hashes, n = prompt(req)
            return answer(form, t0, shard, hashes, n, rank, req.top_k)
        except Exception as e:  # noqa: BLE001 - every failure becomes a JSON error response
            return rejected(form, e, model)

    lookup_responses = {**ok("LookupAnswer", "replicas by resumable tokens, best first"),
                        **errors(400, *auth, 404, 413, 422)}

    @app.post("/v1/lookup", response_class=Response, responses=lookup_responses, openapi_extra={
        "requestBody": {"required": True, "content": {JSON: {"schema": _REQUEST_SCHEMA}}}})
    async def lookup(request: Request) -> Response:
        """Prompt lookup, JSON form: token_ids (hashed here) or block_hashes + prompt_tokens. Replicas
        by resumable tokens, best first, each with its prefix price."""
        return await json_lookup(request, "json", rank=False)

    @app.post("/v1/rank", response_class=Response, openapi_extra={"requestBody": {
        "required": True, "content": {JSON: {"schema": _REQUEST_SCHEMA}}}},
              responses={**ok("LookupAnswer", "replicas by prefix price, cheapest first"),
                         **errors(400, *auth, 404, 413, 422)})
    async def rank(request: Request) -> Response:
        """The lookup ranked by prefix price (queue + load from tiers + prefill left), cheapest first."""
        return await json_lookup(request, "rank", rank=True)

    @app.post("/v1/routes", response_class=Response, status_code=202, openapi_extra={"requestBody": {
        "required": True, "content": {JSON: {"schema": _ROUTE_SCHEMA}}}},
              responses={**ok("RouteAccepted", "the decision is recorded (pending credit)", 202),
                         **errors(400, *auth, 404, 413, 422)})
    async def routes(request: Request) -> Response:
        """Record a routing decision: the prompt counts as cached on that replica, for every router
        of every instance, until the engine's events confirm it or ttl_s passes."""
        t0 = time.perf_counter()
        model = None
        try:
            req = await read_json(request, _route_decoder)
            model = req.model
            if not req.request_id or not req.replica:
                raise Reject(422, "request_id and replica must not be empty")
            ttl = store.config.pending_ttl_s if req.ttl_s is None else req.ttl_s
            if not 0 < ttl <= 3600:
                raise Reject(422, f"ttl_s must be in (0, 3600], got {ttl}")
            if req.dp_rank < 0 or req.credited_tokens < 0:
                raise Reject(422, "dp_rank and credited_tokens must not be negative")
            shard, hashes, n = prompt(req)
            if (req.replica, req.dp_rank) not in shard.replicas:
                # a relay announces its replica when it starts: an unknown name is a router's mistake,
                # and must not become a slot in every answer
                raise Reject(422, f"unknown replica {req.replica[:200]!r} (dp_rank {req.dp_rank}) for model "
                                  f"{model!r}: the index has no events from it")
            d = RouteDecision(ROUTES_VERSION, req.request_id[:200], model, req.replica[:500], req.dp_rank,
                              list(hashes), n, req.credited_tokens, time.time(), ttl, req.router[:200])
            applied = store.apply_route(d)
            if applied and store.publish_route is not None:
                store.publish_route(d)
            if applied:
                metrics.routed(shard.model, req.credited_tokens)
            metrics.observe("routes", 202, time.perf_counter() - t0)
            return _json({"accepted": True, "duplicate": not applied, "expires_at": d.ts + ttl}, 202)
        except Exception as e:  # noqa: BLE001
            return rejected("routes", e, model)

    @app.post("/v1/usage", response_class=Response, status_code=202, openapi_extra={"requestBody": {
        "required": True, "content": {JSON: {"schema": _USAGE_SCHEMA}}}},
              responses={**ok("UsageAccepted", "the report is recorded", 202),
                         **errors(400, *auth, 413, 422)})
    async def usage(request: Request) -> Response:
        """Record what an engine reused for a routed request (the router forwards the engine's
        usage.prompt_tokens_details.cached_tokens): the audit joins it with the routing decision."""
        model = None
        try:
            body = await read_body(request, 65536, "JSON body")
            try:
                req = _usage_decoder.decode(body)
            except msgspec.ValidationError as e:
                raise Reject(422, f"invalid request: {e}") from None
            except msgspec.DecodeError as e:
                raise Reject(400, f"invalid JSON: {e}") from None
            model = req.model
            if not req.request_id or not req.replica or not req.model:
                raise Reject(422, "request_id, model and replica must not be empty")
            if req.prompt_tokens <= 0 or req.dp_rank < 0 or not 0 <= req.cached_tokens <= req.prompt_tokens:
                raise Reject(422, "need prompt_tokens > 0, dp_rank >= 0 and "
                                  "0 <= cached_tokens <= prompt_tokens")
            u = UsageReport(USAGE_VERSION, req.request_id[:200], model[:500], req.replica[:500], req.dp_rank,
                            req.prompt_tokens, req.cached_tokens, time.time(), req.engine[:100],
                            req.tier[:20], req.router[:200])
            publish = app.state.publish_usage
            if publish is not None:
                publish(u)
            else:  # no Kafka (in-process service): kept in memory, the last 10,000
                app.state.usage_recent.append(u)
            metrics.usage(model, req.prompt_tokens, req.cached_tokens)
            metrics.observe("usage", 202)  # counted; no latency histogram for this form
            return _json({"accepted": True, "published": publish is not None}, 202)
        except Exception as e:  # noqa: BLE001
            return rejected("usage", e, model)

    @app.post("/v1/lookup/binary", response_class=Response, responses=lookup_responses, openapi_extra={
        "parameters": [
            {"name": "model", "in": "query", "required": True, "schema": {"type": "string"}},
            {"name": "lora_name", "in": "query", "required": False, "schema": {"type": "string"}},
            {"name": "cache_salt", "in": "query", "required": False, "schema": {"type": "string"}},
            {"name": "top_k", "in": "query", "required": False,
             "schema": {"type": "integer", "minimum": 1, "maximum": MAX_TOP_K}},
        ], "requestBody": {
            "required": True, "content": {"application/octet-stream": {
                "schema": {"type": "string", "format": "binary",
                           "description": "token ids as packed little-endian uint32"}}}}})
    async def lookup_binary(request: Request) -> Response:
        """Prompt lookup, binary form: ?model=NAME[&lora_name=..][&cache_salt=..], body = packed
        little-endian uint32 token ids."""
        t0 = time.perf_counter()
        model = None
        try:
            q = request.query_params
            for key in q:
                if key not in _BINARY_PARAMS:
                    raise Reject(422, f"unknown query parameter {key[:100]!r} (known: model, lora_name, "
                                      "cache_salt, top_k)")
                if len(q.getlist(key)) > 1:
                    raise Reject(422, f"query parameter {key!r} given more than once")
            model = q.get("model")
            if not model:
                raise Reject(422, "query parameter 'model' is required")
            body = await read_body(request, max_binary_bytes, "binary body")
            if len(body) % 4:
                raise Reject(400, f"binary body is {len(body)} bytes, not a multiple of 4: token ids "
                                  "are packed little-endian uint32")
            if not body:
                raise Reject(422, "binary body is empty: a prompt has at least one token")
            shard = find_shard(model)
            top_k = q.get("top_k")
            if top_k is not None and not top_k.isdigit():
                raise Reject(422, f"query parameter 'top_k' must be a positive integer, got {top_k[:20]!r}")
            hashes = prompt_hashes(body, shard.block_size, q.get("lora_name"), q.get("cache_salt"))
            return answer("binary", t0, shard, hashes, len(body) // 4, top_k=int(top_k) if top_k else None)
        except Exception as e:  # noqa: BLE001
            return rejected("binary", e, model)

    @app.get("/healthz", response_class=Response, responses={
        **ok("Health", "ready: the shards are rebuilt"),
        **ok("Health", "not ready: the shards are being rebuilt", 503)})
    async def healthz() -> Response:
        ready = bool(store.ready)
        body = {"status": "ok" if ready else "not_ready", "ready": ready,
                "models": len(store.shards), "batches_applied": store.batches_applied}
        if not ready and getattr(store, "not_ready_reason", None):
            body["reason"] = store.not_ready_reason  # e.g. which broker address does not answer
        return _json(body, 200 if ready else 503)

    @app.get("/v1/models", response_class=Response, responses={**ok("Models", "the models indexed"),
                                                                 **errors(*auth)})
    async def models() -> Response:
        now = time.time()
        out = []
        with store.lock:  # stats iterate the shards' dicts: not while a batch is folded
            for model, shard in sorted(store.shards.items()):
                out.append({"model": model, "block_size": shard.block_size, **shard.stats(),
                            "freshness": _freshness(shard, now)})
        return _json({"models": out})

    @app.get("/metrics", response_class=Response, responses={200: {
        "description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    log.info("%s", _kv(event="lookup_service_created", models=len(store.shards), max_tokens=max_tokens))
    return app
