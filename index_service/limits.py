"""Per-client rate limits on the routes that change the index or the service (scopes `write` and
`admin`, index_service.auth): a client that floods registrations, usage reports or routes gets 429
with Retry-After instead of costing every other client. The routers' lookups (`read`) are not limited:
they are answered before the middleware (index_service.hot_path) and cost no state.

A client is the name of its token where credentials are configured (one token, one budget, wherever
it connects from), else its address. Each (scope, client) has a token bucket: `rate` requests a second,
bursts of `2 x rate` (at least one request). The buckets are bounded (the least recently used are
dropped past MAX_CLIENTS), so clients that spread over many addresses cost no more memory than that.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from index_service.auth import Credentials, scope_needed
from index_service.context import json_response

MAX_CLIENTS = 10_000

class Buckets:
    """Token buckets per (scope, client); `take` returns 0 when a request may go on, else how many
    seconds until it could."""

    def __init__(self, rates: dict[str, float], max_clients: int = MAX_CLIENTS,
                 clock: Callable[[], float] = time.monotonic):
        self.rates = {s: r for s, r in rates.items() if r > 0}
        self.max_clients = max_clients
        self.clock = clock
        self.state: OrderedDict[tuple[str, str], list[float]] = OrderedDict()  # -> [tokens, at]

    def take(self, scope: str, client: str) -> float:
        rate = self.rates.get(scope)
        if rate is None:
            return 0.0
        now, key, burst = self.clock(), (scope, client), max(1.0, 2 * rate)
        bucket = self.state.get(key)
        if bucket is None:
            bucket = self.state[key] = [burst, now]
            if len(self.state) > self.max_clients:
                self.state.popitem(last=False)
        else:
            self.state.move_to_end(key)
            bucket[0] = min(burst, bucket[0] + (now - bucket[1]) * rate)
            bucket[1] = now
        if bucket[0] >= 1.0:
            bucket[0] -= 1.0
            return 0.0
        return (1.0 - bucket[0]) / rate


class RateLimits:
    """ASGI middleware, inside the token check (RequireScope): 429 past a client's budget."""

    paths: tuple[tuple[str, str], ...] = ()  # it answers no path itself: it refuses or passes on

    def __init__(self, app: ASGIApp, buckets: Buckets, credentials: Credentials | None = None,
                 refused=None):
        """`refused`: a Counter labelled by scope (ServiceMetrics.rate_limited), told every 429."""
        self.app = app
        self.buckets = buckets
        self.credentials = credentials
        self.refused = refused

    def client(self, scope: Scope) -> str:
        if self.credentials is not None:
            header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            entry = self.credentials.match(header) if header is not None else None
            if entry is not None:
                return "token:" + entry.name
        peer = scope.get("client")
        return "addr:" + (peer[0] if peer else "?")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            needed = scope_needed(scope["path"])
            if needed in self.buckets.rates:
                wait = self.buckets.take(needed, self.client(scope))
                if wait > 0:
                    if self.refused is not None:
                        self.refused.labels(needed).inc()
                    rate = self.buckets.rates[needed]
                    error = {"error": f"rate limit: {scope['method']} {scope['path']} (scope {needed!r}) "
                                      f"allows {rate:g} requests a second per client; retry in {wait:.2f} s"}
                    # in the caller's encoding: the conductor's msgpack clients read msgpack errors
                    ctype = next((v for k, v in scope["headers"] if k == b"content-type"), b"")
                    refusal = (Response(msgspec.msgpack.encode(error), 429, media_type="application/msgpack")
                               if b"msgpack" in ctype else json_response(error, 429))
                    refusal.headers["retry-after"] = str(max(1, math.ceil(wait)))
                    await refusal(scope, receive, send)
                    return
        await self.app(scope, receive, send)
