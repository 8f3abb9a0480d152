"""The service's HTTP/1.1 connections: uvicorn's httptools protocol, with the routers' lookups answered
inside the parser's callbacks (`LookupProtocol`). uvicorn's own path gives every request an ASGI
cycle: a scope, an asyncio Event, a Task, receive/send messages and the response's headers built
message by message, ~50 us of a hashed lookup's ~250 us of server CPU on the peers bench (a fifth).
A lookup needs none of it: its body is read in full here, the same handler LookupApp's hot path
calls (index_service.hot_path) runs to its answer without waiting for anything, and the answer is
written to the socket at once.

Taken here: POST /v1/lookup, /v1/rank and /v1/lookup/binary (and Dynamo's /query and /query_by_hash
where its API is on: index_service.hot_path) with a Content-Length within the form's limit, on a
connection with no earlier response still being written, when the service answers alone (no replica
groups split over instances: those lookups wait for the other instances' answers).
Everything else (other paths and methods, chunked or oversized bodies, Expect: 100-continue,
upgrades, a client not reading its answers) takes uvicorn's path unchanged, where LookupApp still
takes lookups before the middleware. Keep-alive, its timeout, Connection: close, pipelining and the
default headers (date, server) behave as on uvicorn's path; uvicorn's access log (off in `kvidx
serve`) does not list the lookups answered here: the service counts them (kvidx_lookups_total).

It subclasses uvicorn's httptools protocol (callbacks that are not a public API): pyproject.toml
bounds uvicorn's version, and tests/unit/index_service/test_http_protocol.py holds it to uvicorn's
behaviour over real sockets. Without httptools (uvicorn's h11 protocol) `http_protocol` returns "auto"."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import threading
import time

import uvicorn
from starlette.responses import Response

from index_service.context import json_response, kv
from index_service.hot_path import HotPath, LookupRequest

log = logging.getLogger("kvidx.index_service")

try:
    import httptools
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
except ImportError:  # no httptools wheel for this platform: uvicorn runs h11
    httptools = None
    HttpToolsProtocol = object


class LookupProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol answering the routers' lookups itself (module docstring). A
    subclass per app, made by `http_protocol`, carries its HotPath."""

    hot: HotPath
    _lookup = None  # the lookup being read on this connection: its handler
    _body: list[bytes]
    _keep_alive = True

    def on_headers_complete(self) -> None:
        handler = self._taken_here()
        if handler is None:
            self._lookup = None
            super().on_headers_complete()
            return
        self._unset_keepalive_if_required()  # a pipelined request can follow a response that armed it
        self._lookup = handler
        self._body = []
        self._keep_alive = self.parser.should_keep_alive() and self.scope["http_version"] == "1.1"

    def _taken_here(self):
        """The handler of a lookup this protocol answers, else None (uvicorn's path)."""
        if self.parser.get_method() != b"POST" or self.expect_100_continue or self.parser.should_upgrade():
            return None
        if self.cycle is not None and not self.cycle.response_complete or self.pipeline:
            return None  # answers go out in request order: behind the one being written
        if self.flow.write_paused or self.root_path or self.limit_concurrency is not None:
            return None
        hot = self.hot
        if not hot.synchronous:
            return None
        url = httptools.parse_url(self.url)
        path = url.path.decode("ascii", "replace")
        route = hot.routes.get(path)
        if route is None:
            return None
        handler, body_limit = route
        length = ctype = None
        for name, value in self.headers:
            if name == b"content-length":
                length = value
            elif name == b"content-type":
                ctype = value
            elif name == b"transfer-encoding":
                return None
        if hot.leaves(path, ctype):
            return None
        if length is None or not length.isdigit() or int(length) > body_limit:
            return None  # uvicorn's path streams it and refuses what is too large
        version = self.parser.get_http_version()
        self.scope.update(method="POST", http_version=version, path=path, raw_path=url.path,
                          query_string=url.query or b"")
        return handler

    def on_body(self, body: bytes) -> None:
        if self._lookup is None:
            super().on_body(body)
        else:
            self._body.append(body)

    def on_message_complete(self) -> None:
        handler = self._lookup
        if handler is None:
            super().on_message_complete()
            return
        self._lookup = None
        request = LookupRequest(self.scope, None, b"".join(self._body))
        self._body = []
        self._write(self._answer(handler, request))
        if not self._keep_alive:
            self.transport.close()
        self.on_response_complete()  # counts the request, arms the keep-alive timeout

    def _answer(self, handler, request: LookupRequest) -> Response:
        """The handler's answer: its coroutine runs to the end in one step (HotPath.synchronous)."""
        coro = self.hot.answer(handler, request)
        try:
            coro.send(None)
        except StopIteration as done:
            return done.value
        except Exception:  # noqa: BLE001 - the handlers answer their own errors; this is a bug
            log.exception("%s", kv(event="lookup_failed", path=self.scope["path"]))
            return json_response({"error": "internal error"}, 500)
        coro.close()  # it waited for something: a lookup that cannot be answered here
        log.error("%s", kv(event="lookup_failed", path=self.scope["path"], error="handler suspended"))
        return json_response({"error": "internal error"}, 500)

    def _write(self, response: Response) -> None:
        out = [STATUS_LINE[response.status_code]]
        for name, value in self.server_state.default_headers:
            out += (name, b": ", value, b"\r\n")
        for name, value in response.raw_headers:
            out += (name, b": ", value, b"\r\n")
        if not self._keep_alive:
            out.append(b"connection: close\r\n")
        out += (b"\r\n", response.body)
        self.transport.write(b"".join(out))


def http_protocol(app) -> type | str:
    """uvicorn's `http` setting for the service's app: its LookupProtocol, or "auto" without httptools
    or for an app without the routers' hot path."""
    hot = getattr(app, "hot", None)
    if httptools is None or hot is None:
        return "auto"
    return type("LookupProtocol", (LookupProtocol,), {"hot": hot})


def server_config(app, host: str, port: int, **kwargs) -> uvicorn.Config:
    """uvicorn's Config for serving the service's app (LookupProtocol where httptools is installed); no
    access log unless asked for: the service counts and logs lookups itself (kvidx_lookups_total,
    debug lines)."""
    kwargs.setdefault("access_log", False)
    return uvicorn.Config(app, host=host, port=port, http=http_protocol(app), **kwargs)


def serve(app, host: str, port: int, ops: tuple[object, int] | None = None, **kwargs) -> None:
    """Serve the app until stopped. What exists by now (modules, the app, its routes) is frozen out of
    the garbage collector's full collections first: one over it stalls the event loop ~40 ms on this
    machine, which at 2,000 lookups/s was the service's p99 (index_service.follower freezes what its
    rebuild made, likewise). Requests leave no garbage cycles (tests/unit/index_service/
    test_http_protocol.py), so collections are rare. `ops`: (an app, its port) served beside, on the
    same host and event loop (index_service.status_routes.ops_app: probes and scrapers), started and
    stopped with the app."""
    if ops is not None:
        serve_beside(app, uvicorn.Server(uvicorn.Config(ops[0], host=host, port=ops[1], access_log=False,
                                                        lifespan="off", log_level=kwargs.get("log_level"))))
    gc.freeze()
    uvicorn.Server(server_config(app, host, port, **kwargs)).run()


class InProcessServer:
    """The app on a loopback port (0: a free one) in a daemon thread: the demo, the simulator's --http
    runs, tests. `start()` returns its base URL once it listens; `stop()` ends it."""

    def __init__(self, app, port: int = 0, name: str = "http", **kwargs) -> None:
        if not port:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.port = port
        kwargs.setdefault("log_level", "warning")
        self.server = uvicorn.Server(server_config(app, "127.0.0.1", port, **kwargs))
        self.thread = threading.Thread(target=self.server.run, daemon=True, name=name)

    def start(self, timeout_s: float = 30.0) -> str:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the lookup service did not start on 127.0.0.1:{self.port}")
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.port}"

    def stop(self, join_s: float = 10.0) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(join_s)


def serve_beside(app, other: uvicorn.Server) -> None:
    """Run `other` in `app`'s event loop from its start-up to its shutdown."""
    running = []

    async def start() -> None:
        running.append(asyncio.create_task(other.serve()))

    async def stop() -> None:
        other.should_exit = True
        await asyncio.gather(*running)

    app.router.on_startup.append(start)
    app.router.on_shutdown.append(stop)
