"""LMCache's controller lookup (`POST /lookup`, the standalone controller's API server in lmcache 0.5.6,
lmcache/v1/api_server/__main__.py), served by `kvidx serve --lmcache-lookup MODEL` over the same index.

`POST /lookup {"tokens": [...]}` -> `{"event_id": "Lookup<uuid4>", "layout_info": {instance_id:
[location, matched_tokens]}}`. LMCache's controller walks the prompt's chunks (256 tokens, the last one
partial), takes one instance per chunk from its registry and stops at the first chunk none holds, so its
first key is the instance of the first chunk (production-stack's KV-aware router routes to that key).
kvidx answers from its walk instead: every replica holding a prefix of the prompt, longest first (the
first key is the best replica), with its cached tokens in kvidx's blocks (a replica's vLLM GPU prefix
cache counts: LMCache's controller does not see it) and, as its location, the LMCache backend of the
tier holding the end of that prefix ("LocalCPUBackend", "LocalDiskBackend"; "GPU" for vLLM's own
cache, "RemoteBackend" for shared pools). Instance ids come from the model's
`hints.lmcache_instances` (replica -> LMCache instance id; default: the replica name); replicas with
several DP ranks answer with their best rank.

LMCache's message has no model field: one model per service. Malformed bodies get 422 with what is
wrong, as `{"detail": "..."}` (LMCache's API server is FastAPI: its error shape, not kvidx's `{"error"}`);
LMCache's controller answers 500 on errors. A model split in replica groups is answered whole: the groups
other instances hold are asked of them, as for /v1/lookup (index_service/fanout.py).
LMCache 0.5.6 takes `LookupMsg` over ZMQ only in process (its reply socket serves worker requests), so
there is no ZMQ lookup to serve: docs/routers.md.
"""

from __future__ import annotations

import time
import uuid

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from index_service.context import ServiceContext
from index_service.guard import bounded
from index_service.lookup_routes import answer_lookup
from index_service.wire import Reject
from kvidx.core.hashing import pack_tokens, prompt_hashes
from schemas.answers import LOOKUP_ANSWER_DECODER

LOCATIONS = {"GPU": "GPU", "CPU": "LocalCPUBackend", "DISK": "LocalDiskBackend",
             "NODE_SHARED": "LocalCPUBackend", "POOL": "RemoteBackend"}


class _Lookup(msgspec.Struct):
    tokens: list[int]


_decoder = msgspec.json.Decoder(_Lookup)


async def layout_info(ctx: ServiceContext, model: str, tokens: list[int]) -> dict[str, tuple[str, int]]:
    """Per LMCache instance (its replica), the location and tokens of the prompt's prefix it holds:
    kvidx's lookup answer (with the replica groups other instances hold, asked of them) in LMCache's
    terms."""
    if model not in ctx.store.shards and not ctx.store.holds_part_of(model):
        return {}  # no events of the model yet: LMCache's empty registry answers alike
    shard = ctx.pipeline.shard(model)
    hashes = prompt_hashes(pack_tokens(tokens), shard.block_size, lookahead=shard.lookahead,
                           tails=bool(shard.tail_keys))
    try:
        raw = (await answer_lookup(ctx, shard, hashes, len(tokens), rank=False, top_k=None))[0]
    except Reject as e:
        if e.status == 404:  # no instance has events of the model yet: an empty registry's answer
            return {}
        raise
    instances = ctx.store.config.model(model).hints.lmcache_instances
    out: dict[str, tuple[str, int]] = {}
    for r in sorted(LOOKUP_ANSWER_DECODER.decode(raw).replicas, key=lambda a: -a.cached_tokens):
        iid = instances.get(r.replica, r.replica)
        if r.cached_tokens <= 0 or iid in out:
            continue
        tier = r.tiers[-1].tier if r.tiers else "GPU"
        out[iid] = (LOCATIONS.get(tier, tier), r.cached_tokens)
    return out


def add_lmcache_routes(app: FastAPI, ctx: ServiceContext, model: str) -> None:
    @app.post("/lookup", include_in_schema=False)
    async def lookup(request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            body = await ctx.read_body(request, ctx.max_json_bytes, "JSON body")
            try:
                req = bounded(_decoder.decode, body)
            except msgspec.DecodeError as e:
                raise Reject(422, f"a lookup is {{\"tokens\": [token ids]}}: {e}") from None
            if not req.tokens:
                raise Reject(422, "tokens is empty: a prompt has at least one token")
            if len(req.tokens) > ctx.max_tokens:
                raise Reject(413, f"tokens has {len(req.tokens)} ids, more than max_tokens={ctx.max_tokens}")
            if min(req.tokens) < 0 or max(req.tokens) > 0xFFFF_FFFF:
                raise Reject(422, "a token id outside 0..2^32-1")
            info = await layout_info(ctx, model, req.tokens)
        except Reject as e:
            ctx.metrics.observe("lmcache", e.status)
            return Response(msgspec.json.encode({"detail": e.error}), status_code=e.status,
                            media_type="application/json")
        ctx.metrics.observe("lmcache", 200, time.perf_counter() - t0)
        return Response(msgspec.json.encode({"event_id": f"Lookup{uuid.uuid4()}", "layout_info": info}),
                        media_type="application/json")
