"""The routers' routes: POST /v1/rank (the lookup by prefix price), POST /v1/routes (a routing
decision, applied as pending credit) and POST /v1/usage (what the engine reused, for the audit)."""

from __future__ import annotations

import time

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from index_service.context import ServiceContext, json_response
from index_service.lookup_routes import json_lookup
from index_service.openapi import json_body
from index_service.query import usage_report
from index_service.responses import errors, ok
from index_service.wire import LOOKUP_SCHEMA, ROUTE_DECODER, ROUTE_SCHEMA, USAGE_DECODER, USAGE_SCHEMA

USAGE_MAX_BYTES = 65536  # a usage report holds no prompt


async def record_route(ctx: ServiceContext, request: Request) -> Response:
    t0 = time.perf_counter()
    model = None
    try:
        req = await ctx.read_json(request, ROUTE_DECODER)
        model = req.model
        d, applied, hint, kv_hint = ctx.pipeline.route(req)
        if applied:
            ctx.metrics.routed(d.model, req.credited_tokens)
        ctx.metrics.observe("routes", 202, time.perf_counter() - t0)
        body = {"accepted": True, "duplicate": not applied, "expires_at": d.ts + d.ttl_s}
        if hint is not None:
            body["prefetch"] = msgspec.to_builtins(hint)
        if kv_hint is not None:
            body["kv_hint"] = msgspec.to_builtins(kv_hint)  # Dynamo's KvHint (kvidx.core.fetch)
        return json_response(body, 202)
    except Exception as e:  # noqa: BLE001
        return ctx.rejected("routes", e, model)


async def record_usage(ctx: ServiceContext, request: Request) -> Response:
    model = None
    try:
        req = await ctx.read_json(request, USAGE_DECODER, USAGE_MAX_BYTES)
        model = req.model
        u = usage_report(req)
        ctx.pipeline.hint_outcome(u)
        publish = ctx.app.state.publish_usage
        if publish is not None:
            publish(u)
        else:  # no Kafka (in-process service): kept in memory, the last 10,000
            ctx.app.state.usage_recent.append(u)
        ctx.metrics.usage(model, req.prompt_tokens, req.cached_tokens)
        ctx.metrics.observe("usage", 202)  # counted; no latency histogram for this form
        return json_response({"accepted": True, "published": publish is not None}, 202)
    except Exception as e:  # noqa: BLE001
        return ctx.rejected("usage", e, model)


def add_routing_routes(app: FastAPI, ctx: ServiceContext, auth: tuple[int, ...]) -> None:
    @app.post("/v1/rank", response_class=Response, openapi_extra=json_body(LOOKUP_SCHEMA),
              responses={**ok("LookupAnswer", "replicas by prefix price, cheapest first"),
                         **errors(400, *auth, 404, 413, 422)})
    async def rank(request: Request) -> Response:
        """The lookup ranked by prefix price (queue + load from tiers + prefill left), cheapest first."""
        return await json_lookup(ctx, request, "rank", rank=True)

    @app.post("/v1/routes", response_class=Response, status_code=202, openapi_extra=json_body(ROUTE_SCHEMA),
              responses={**ok("RouteAccepted", "the decision is recorded (pending credit)", 202),
                         **errors(400, *auth, 404, 413, 422)})
    async def routes(request: Request) -> Response:
        """Record a routing decision: the prompt counts as cached on that replica, for every router
        of every instance, until the engine's events confirm it or ttl_s passes."""
        return await record_route(ctx, request)

    @app.post("/v1/usage", response_class=Response, status_code=202, openapi_extra=json_body(USAGE_SCHEMA),
              responses={**ok("UsageAccepted", "the report is recorded", 202),
                         **errors(400, *auth, 413, 422)})
    async def usage(request: Request) -> Response:
        """Record what an engine reused for a routed request (the router forwards the engine's
        usage.prompt_tokens_details.cached_tokens): the audit joins it with the routing decision."""
        return await record_usage(ctx, request)
