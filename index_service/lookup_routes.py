"""The lookup routes: POST /v1/lookup (JSON: token_ids, or block_hashes + prompt_tokens) and POST
/v1/lookup/binary (packed uint32 token ids). Thin on purpose: read the body, run the query pipeline,
encode its answer (ServiceContext.respond)."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.datastructures import QueryParams

from index_service.context import ServiceContext
from index_service.openapi import binary_lookup_extra, json_body
from index_service.responses import errors, ok
from index_service.wire import LOOKUP_SCHEMA, Reject, read_lookup

_BINARY_PARAMS = frozenset({"model", "lora_name", "cache_salt", "top_k"})


def lookup_responses(auth: tuple[int, ...]) -> dict:
    return {**ok("LookupAnswer", "replicas by resumable tokens, best first"),
            **errors(400, *auth, 404, 413, 422)}


async def json_lookup(ctx: ServiceContext, request: Request, form: str, rank: bool) -> Response:
    """A JSON lookup (/v1/lookup; /v1/rank with `rank`) answered, or its error."""
    t0 = time.perf_counter()
    model = None
    try:
        req = read_lookup(await ctx.read_body(request, ctx.max_json_bytes, "JSON body"))
        model = req.model
        shard, hashes, n = ctx.pipeline.prompt(req)
        answer = ctx.pipeline.answer_json(shard, hashes, n, rank, req.top_k, ctx.app.state.feedback)
        return ctx.respond(form, t0, shard.model, n, answer, len(hashes))
    except Exception as e:  # noqa: BLE001 - every failure becomes a JSON error response
        return ctx.rejected(form, e, model)


def _check_binary_params(q: QueryParams) -> None:
    for key in q:
        if key not in _BINARY_PARAMS:
            raise Reject(422, f"unknown query parameter {key[:100]!r} (known: model, lora_name, "
                              "cache_salt, top_k)")
        if len(q.getlist(key)) > 1:
            raise Reject(422, f"query parameter {key!r} given more than once")


async def binary_lookup(ctx: ServiceContext, request: Request) -> Response:
    t0 = time.perf_counter()
    model = None
    try:
        q = request.query_params
        _check_binary_params(q)
        model = q.get("model")
        if not model:
            raise Reject(422, "query parameter 'model' is required")
        body = await ctx.read_body(request, ctx.max_binary_bytes, "binary body")
        shard, hashes, n = ctx.pipeline.binary_prompt(model, body, q.get("lora_name"), q.get("cache_salt"))
        top_k = q.get("top_k")
        if top_k is not None and not top_k.isdigit():
            raise Reject(422, f"query parameter 'top_k' must be a positive integer, got {top_k[:20]!r}")
        answer = ctx.pipeline.answer_json(shard, hashes, n, top_k=int(top_k) if top_k else None,
                                          feedback=ctx.app.state.feedback)
        return ctx.respond("binary", t0, shard.model, n, answer, len(hashes))
    except Exception as e:  # noqa: BLE001
        return ctx.rejected("binary", e, model)


def add_json_lookup(app: FastAPI, ctx: ServiceContext, auth: tuple[int, ...]) -> None:
    @app.post("/v1/lookup", response_class=Response, responses=lookup_responses(auth),
              openapi_extra=json_body(LOOKUP_SCHEMA))
    async def lookup(request: Request) -> Response:
        """Prompt lookup, JSON form: token_ids (hashed here) or block_hashes + prompt_tokens. Replicas
        by resumable tokens, best first, each with its prefix price."""
        return await json_lookup(ctx, request, "json", rank=False)


def add_binary_lookup(app: FastAPI, ctx: ServiceContext, auth: tuple[int, ...]) -> None:
    @app.post("/v1/lookup/binary", response_class=Response, responses=lookup_responses(auth),
              openapi_extra=binary_lookup_extra())
    async def lookup_binary(request: Request) -> Response:
        """Prompt lookup, binary form: ?model=NAME[&lora_name=..][&cache_salt=..], body = packed
        little-endian uint32 token ids."""
        return await binary_lookup(ctx, request)
