"""The lookups routers make on every request (POST /v1/lookup, /v1/rank, /v1/lookup/binary, and
Dynamo's POST /query where its API is on), taken
straight to their handlers: an ASGI middleware in front of the FastAPI router, so a lookup skips route
matching and FastAPI's per-request dependency solving (about a quarter of a hashed lookup's CPU in
the app). The handlers are the very ones the FastAPI routes call (lookup_routes), so answers, errors,
metrics and logs are the same; the routes stay registered for the OpenAPI document and for any
method or path this does not take."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.datastructures import QueryParams
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from index_service.context import ServiceContext
from index_service.dynamo_api import query_handler
from index_service.lookup_routes import binary_lookup, json_lookup


class LookupRequest:
    """What the lookup handlers read of a request (a Starlette Request's `headers.get`, `body`,
    `stream`, `query_params`), read straight off the ASGI scope and messages: a Request builds its
    Headers and streams the body through an async generator, ~10 us of a hashed lookup."""

    __slots__ = ("scope", "receive", "headers")

    def __init__(self, scope: Scope, receive: Receive):
        self.scope = scope
        self.receive = receive
        self.headers = self  # .headers.get(name): only content-length is read

    def get(self, name: str, default: str | None = None) -> str | None:
        key = name.encode()
        for k, v in self.scope["headers"]:
            if k == key:
                return v.decode("latin-1")
        return default

    @property
    def query_params(self) -> QueryParams:
        return QueryParams(self.scope["query_string"])

    async def stream(self) -> AsyncIterator[bytes]:
        while True:
            msg = await self.receive()
            if msg["type"] == "http.disconnect":
                raise ClientDisconnect()
            yield msg.get("body", b"")
            if not msg.get("more_body", False):
                return

    async def body(self) -> bytes:
        msg = await self.receive()  # most bodies come in one message
        if msg["type"] == "http.disconnect":
            raise ClientDisconnect()
        body = msg.get("body", b"")
        if not msg.get("more_body", False):
            return body
        chunks = [body]
        async for chunk in self.stream():
            chunks.append(chunk)
        return b"".join(chunks)


class HotPath:
    def __init__(self, app: ASGIApp, ctx: ServiceContext, dynamo=None):
        self.app = app
        self.handlers = {
            "/v1/lookup": lambda request: json_lookup(ctx, request, "json", rank=False),
            "/v1/rank": lambda request: json_lookup(ctx, request, "rank", rank=True),
            "/v1/lookup/binary": lambda request: binary_lookup(ctx, request),
        }
        if dynamo is not None:  # Dynamo's POST /query (index_service/dynamo_api.py)
            self.handlers["/query"] = lambda request: query_handler(ctx.store, dynamo, request, ctx.fanout,
                                                                    metrics=ctx.metrics)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.handlers.get(scope["path"]) if scope["type"] == "http" else None
        if handler is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        response = await handler(LookupRequest(scope, receive))
        await response(scope, receive, send)
