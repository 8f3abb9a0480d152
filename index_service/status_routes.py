"""The read-only routes: GET /healthz (readiness and whether tokens are required, open to probes),
GET /v1/models (the models indexed, with a freshness summary) and GET /metrics (Prometheus text, open
to scrapers; or, with `kvidx serve --ops-port`, on an app of their own there: `ops_app`)."""

from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi.responses import Response

from index_service.context import ServiceContext, json_response
from index_service.errors import one_error_shape
from index_service.responses import errors, ok
from kvidx import index
from kvidx.core.shard import ModelShard


def freshness(shard: ModelShard, now: float) -> dict:
    """How recent the shard's engine events are, summarized over its replicas."""
    states = list(index.replicas(shard))
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
        "age_clock": "engine",  # the ages start on the events' own times (schemas.answers.Freshness)
    }


def add_status_routes(app: FastAPI, ctx: ServiceContext, auth: tuple[int, ...]) -> None:
    store, metrics = ctx.store, ctx.metrics

    @app.get("/healthz", response_class=Response, responses={
        **ok("Health", "ready: the shards are rebuilt"),
        **ok("Health", "not ready: the shards are being rebuilt", 503)})
    async def healthz() -> Response:
        ready = bool(store.ready)
        body = {"status": "ok" if ready else "not_ready", "ready": ready,
                "models": len(store.shards), "batches_applied": store.batches_applied,
                "auth": "off" if getattr(app.state, "credentials", None) is None else "on"}
        if not ready and getattr(store, "not_ready_reason", None):
            body["reason"] = store.not_ready_reason  # e.g. which broker address does not answer
        if getattr(store, "events_lost", 0):
            body["events_lost"] = store.events_lost  # retention outran the snapshots: relays must resync
        if store.groups is not None:  # a partial instance: what it holds, whom it asks for the rest
            body["groups"] = sorted(store.groups)
            if ctx.fanout is not None:
                body["peers"] = [{"name": p.name, "url": p.url,
                                  "groups": None if p.groups is None else sorted(p.groups)}
                                 for p in ctx.fanout.directory.alive()]
        return json_response(body, 200 if ready else 503)

    @app.get("/v1/models", response_class=Response, responses={**ok("Models", "the models indexed"),
                                                                 **errors(*auth)})
    async def models() -> Response:
        """Every model a lookup answers for: the shards held here, and the models split in replica
        groups some of which other instances hold (a lookup asks them), with no event here yet."""
        now = time.time()
        out = []
        totals = metrics.model_totals()  # this instance's lookups, routes and usage reports, per model
        with store.lock:  # stats iterate the shards' dicts: not while a batch is folded
            names = set(store.shards) | {m for m in store.config.models if store.holds_part_of(m)}
            for model in sorted(names):
                shard = store.shards.get(model) or store.settings.new_shard(model)
                info = {"model": model, "block_size": shard.block_size, "lookahead_tokens": shard.lookahead,
                        **shard.stats(), "freshness": freshness(shard, now),
                        "since_start": totals.get(model, {})}
                if store.holds_part_of(model):
                    info["missing_groups"] = store.missing_groups(model)  # a lookup asks their holders
                out.append(info)
        return json_response({"models": out})

    @app.get("/metrics", response_class=Response, responses={200: {
        "description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def ops_app(app: FastAPI) -> FastAPI:
    """GET /healthz and /metrics of `app` (the same routes), alone: what an ops port serves, open, to
    probes and scrapers, while the API's port asks a token for them too."""
    ops = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    one_error_shape(ops)
    ops.router.routes.extend(r for r in app.routes if getattr(r, "path", None) in ("/healthz", "/metrics"))
    return ops
