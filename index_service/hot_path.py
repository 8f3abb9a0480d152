"""The lookups routers make on every request (POST /v1/lookup, /v1/rank, /v1/lookup/binary), taken
straight to their handlers: an ASGI middleware in front of the FastAPI router, so a lookup skips route
matching and FastAPI's per-request dependency solving (about a quarter of a hashed lookup's CPU in
the app). The handlers are the very ones the FastAPI routes call (lookup_routes), so answers, errors,
metrics and logs are the same; the routes stay registered for the OpenAPI document and for any
method or path this does not take."""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from index_service.context import ServiceContext
from index_service.lookup_routes import binary_lookup, json_lookup


class HotPath:
    def __init__(self, app: ASGIApp, ctx: ServiceContext):
        self.app = app
        self.handlers = {
            "/v1/lookup": lambda request: json_lookup(ctx, request, "json", rank=False),
            "/v1/rank": lambda request: json_lookup(ctx, request, "rank", rank=True),
            "/v1/lookup/binary": lambda request: binary_lookup(ctx, request),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.handlers.get(scope["path"]) if scope["type"] == "http" else None
        if handler is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        response = await handler(Request(scope, receive))
        await response(scope, receive, send)
