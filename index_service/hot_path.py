"""The lookups routers make on every request, taken straight to their handlers: POST /v1/lookup,
/v1/rank and /v1/lookup/binary, and Dynamo's POST /query and /query_by_hash where its API is on,
before the app's middleware stack (`LookupApp`: no route matching, dependency solving, error and
body-limit middleware, about a quarter of a hashed lookup's CPU in the app), the bearer token checked
here. A msgpack /query is Mooncake conductor's (index_service.conductor_api.ConductorPaths, a
middleware): left to it. The handlers are the very ones
the FastAPI routes call (lookup_routes), so answers, errors, metrics and logs are the same; the
routes stay registered for the OpenAPI document and for any method or path this does not take.
Each class that takes paths before the app's routes lists them in `paths` ((method, path) pairs), so
the auth matrix (tests/security/test_auth_matrix.py) sees every path the service answers."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline
from starlette.datastructures import QueryParams
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from index_service.auth import READ, Credentials
from index_service.conductor_api import is_msgpack
from index_service.context import ServiceContext
from index_service.dynamo_api import MAX_QUERY_BODY, QueryByHashRequest, QueryRequest, query_handler
from index_service.lookup_routes import binary_lookup, json_lookup

_NO_PARAMS = QueryParams(b"")  # immutable: one for every request without a query string


class LookupRequest:
    """What the lookup handlers read of a request (a Starlette Request's `headers.get`, `body`,
    `stream`, `query_params`), read straight off the ASGI scope and messages: a Request builds its
    Headers and streams the body through an async generator, ~10 us of a hashed lookup."""

    __slots__ = ("scope", "receive", "whole_body")

    def __init__(self, scope: Scope, receive: Receive | None, whole_body: bytes | None = None):
        self.scope = scope
        self.receive = receive
        self.whole_body = whole_body  # the body already read in full (LookupProtocol), else None

    @property
    def headers(self) -> LookupRequest:
        """Itself (.headers.get(name)); not an attribute: a reference to itself would be a cycle per
        request, left to the garbage collector, whose full collections stall the loop (~40 ms)."""
        return self

    def get(self, name: str, default: str | None = None) -> str | None:
        key = name.encode()
        for k, v in self.scope["headers"]:
            if k == key:
                return v.decode("latin-1")
        return default

    @property
    def query_params(self) -> QueryParams:
        query = self.scope["query_string"]
        return QueryParams(query) if query else _NO_PARAMS

    async def stream(self) -> AsyncIterator[bytes]:
        if self.whole_body is not None:
            yield self.whole_body
            return
        while True:
            msg = await self.receive()
            if msg["type"] == "http.disconnect":
                raise ClientDisconnect()
            yield msg.get("body", b"")
            if not msg.get("more_body", False):
                return

    async def body(self) -> bytes:
        if self.whole_body is not None:
            return self.whole_body
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
    """The routers' lookups (and their bearer token, scope `read`), taken before the app's middleware.
    `dynamo`: Dynamo's indexer API (index_service.dynamo_api.DynamoRegistry), when it is on."""

    paths = (("POST", "/v1/lookup"), ("POST", "/v1/rank"), ("POST", "/v1/lookup/binary"))
    dynamo_paths = (("POST", "/query"), ("POST", "/query_by_hash"))

    def __init__(self, ctx: ServiceContext, credentials: Credentials | None, dynamo=None):
        self.ctx = ctx
        self.credentials = credentials
        # path -> (its handler, the largest body it reads: the handler refuses more, 413)
        self.routes = {
            "/v1/lookup": (lambda request: json_lookup(ctx, request, "json", rank=False), ctx.max_json_bytes),
            "/v1/rank": (lambda request: json_lookup(ctx, request, "rank", rank=True), ctx.max_json_bytes),
            "/v1/lookup/binary": (lambda request: binary_lookup(ctx, request), ctx.max_binary_bytes),
        }
        if dynamo is not None:
            self.paths = self.paths + self.dynamo_paths
            for path, typ in (("/query", QueryRequest), ("/query_by_hash", QueryByHashRequest)):
                self.routes[path] = (lambda request, typ=typ: query_handler(
                    ctx.store, dynamo, request, ctx.fanout, typ, ctx.metrics), MAX_QUERY_BODY)

    @staticmethod
    def leaves(path: str, content_type: bytes | None) -> bool:
        """Whether a request on a path taken here is left to the app all the same: a msgpack /query is
        Mooncake conductor's."""
        return path == "/query" and content_type is not None and is_msgpack(content_type.decode("latin-1"))

    @property
    def synchronous(self) -> bool:
        """Whether a lookup runs to its answer without waiting for anything once its body is read:
        true unless the model's replica groups are split over instances (index_service.fanout asks
        the others over HTTP). LookupProtocol answers such lookups inside the parser's callback."""
        return self.ctx.fanout is None

    async def answer(self, handler, request: LookupRequest) -> Response:
        """The handler's answer, or 401/403 without a token of scope `read`."""
        if self.credentials is not None:
            refused = self.credentials.refusal(request.get("authorization"), READ,
                                               "POST " + request.scope["path"])
            if refused is not None:
                return refused.response()
        return await handler(request)

    async def take(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """Answer the request if it is a lookup: True once answered, False for the app to answer."""
        route = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if route is None or scope["method"] != "POST":
            return False
        if self.leaves(scope["path"], next((v for k, v in scope["headers"] if k == b"content-type"), None)):
            return False
        response = await self.answer(route[0], LookupRequest(scope, receive))
        await response(scope, receive, send)
        return True


class LookupApp(FastAPI):
    """The service's FastAPI app, with the routers' lookups taken before its middleware (`hot`).
    Made by `LookupApp.of`: fastapi-offline builds a plain FastAPI (its docs pages served locally)."""

    hot: HotPath | None = None

    @classmethod
    def of(cls, **kwargs) -> LookupApp:
        app = FastAPIOffline(**kwargs)
        app.__class__ = cls  # the same object and state; only __call__ differs
        return app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.hot is not None and await self.hot.take(scope, receive, send):
            return
        await super().__call__(scope, receive, send)
