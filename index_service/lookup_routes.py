"""The lookup routes: POST /v1/lookup (JSON: token_ids, or block_hashes + prompt_tokens) and POST
/v1/lookup/binary (packed uint32 token ids). Thin on purpose: read the body, run the query pipeline,
encode its answer (ServiceContext.respond)."""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.datastructures import QueryParams

from index_service.context import ServiceContext, encode
from index_service.fanout import LOCAL_ONLY, local_groups
from index_service.openapi import binary_lookup_extra, json_body
from index_service.responses import errors, ok
from index_service.wire import LOOKUP_SCHEMA, Reject, read_lookup
from kvidx import index
from kvidx.core.shard import ModelShard
from schemas.answers import LOOKUP_ANSWER_DECODER

_BINARY_PARAMS = frozenset({"model", "lora_name", "cache_salt", "top_k"})


def lookup_responses(auth: tuple[int, ...]) -> dict:
    return {**ok("LookupAnswer", "replicas by resumable tokens, best first"),
            **errors(400, *auth, 404, 413, 422)}


async def answer_lookup(ctx: ServiceContext, shard: ModelShard, hashes: list[int], n: int, rank: bool,
                        top_k: int | None, only: frozenset[int] | None = None) -> tuple[bytes, int, int, int]:
    """The answer's JSON (bytes, best resumable tokens, replicas, tokens below GPU memory: the
    `index.answer_json` tuple): from this instance's shard, with
    the replicas of the replica groups it does not hold asked of the instances that hold them
    (index_service.fanout) when the model is split; `only`: those groups' replicas of this shard."""
    feedback = ctx.app.state.feedback
    if only is not None:
        if only is LOCAL_ONLY or all(st.group in only for st in index.replicas(shard)):
            return ctx.pipeline.answer_json(shard, hashes, n, rank, top_k, feedback)  # no filter needed
        answer = ctx.pipeline.answer(shard, hashes, n, rank, top_k, feedback, groups=only)
    else:
        missing = ctx.store.missing_groups(shard.model) if ctx.fanout is not None else []
        if not missing:
            return ctx.pipeline.answer_json(shard, hashes, n, rank, top_k, feedback)
        # the other instances asked first, so that they walk their shards while this one walks its own
        t0 = time.perf_counter()
        asked = asyncio.ensure_future(ctx.fanout.gather(shard.model, missing, hashes, n, rank, top_k))
        for _ in range(3):  # the gather, then its requests, until they are written to the sockets
            await asyncio.sleep(0)
        # this shard's part as the compiled core writes it, decoded (cheaper than the typed answer)
        raw = ctx.pipeline.answer_json(shard, hashes, n, rank, top_k, feedback)[0]
        answer = LOOKUP_ANSWER_DECODER.decode(raw)
        parts, gone, knew = await asked
        ctx.metrics.fanout(time.perf_counter() - t0, len(gone))
        if not knew and not gone and shard.model not in ctx.store.shards:
            ctx.pipeline.unknown_model(shard.model)  # known to no instance
        index.merge_answer(answer, parts, gone, ctx.pipeline.pricer(shard.model), rank=rank, top_k=top_k,
                           prefetch_bytes=ctx.pipeline.prefetch_bytes(shard.model))
    replicas = answer.replicas
    return (encode(answer), replicas[0].resumable_tokens if replicas else 0, len(replicas),
            index.below_gpu(replicas))


async def json_lookup(ctx: ServiceContext, request: Request, form: str, rank: bool) -> Response:
    """A JSON lookup (/v1/lookup; /v1/rank with `rank`) answered, or its error."""
    t0 = time.perf_counter()
    model = None
    try:
        only = local_groups(request.query_params)
        req = read_lookup(await ctx.read_body(request, ctx.max_json_bytes, "JSON body"))
        model = req.model
        shard, hashes, n = ctx.pipeline.prompt(req)
        answer = await answer_lookup(ctx, shard, hashes, n, rank, req.top_k, only)
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
        if top_k is not None and not (top_k.isascii() and top_k.isdigit() and len(top_k) <= 9):
            raise Reject(422, f"query parameter 'top_k' must be a positive integer, got {top_k[:20]!r}")
        answer = await answer_lookup(ctx, shard, hashes, n, False, int(top_k) if top_k else None)
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
