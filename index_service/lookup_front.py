"""`kvidx serve --lookup-port PORT`: Dynamo's POST /query and /query_by_hash, and Mooncake conductor's
msgpack POST /query (a model without shared pools), answered on PORT by the compiled core's own HTTP
threads (kvidx_native.LookupFront, native/src/front.rs, conductor.rs), one per connection,
reading the service's mask maps without the GIL: one instance answers from all its cores, on one copy
of the index (a readers-writer lock per map; the fold takes it for its writes).

What a query reads besides the maps is pushed here when it changes: a model's block size, its lookup
group's tier maps and its slots' (replica, DP rank), after every batch that changed them
(ShardStore.on_change, a few attribute reads a batch); Dynamo's registrations (DynamoRegistry.on_change)
and the conductor's prefix contexts (ConductorRegistry.on_change);
the tokens of scope `read`, when the credentials file changes. A request the threads do not answer
themselves (an error, a token they do not hold, a model or group they were not told of, another body
form) is answered by `fallback`, the service's own handler, with the GIL: every answer and error is
the one --port gives. Any other path on PORT is a 404 that names --port.

Plain HTTP/1.1 with Content-Length bodies (keep-alive, pipelining); not with --tls-cert or --groups
(cli refuses both: the fan-out to other instances and TLS are --port's)."""

from __future__ import annotations

import logging
import threading
from urllib.parse import parse_qsl, urlsplit

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.datastructures import QueryParams
from starlette.responses import Response

from index_service.auth import READ, Credentials
from index_service.conductor_api import MAX_BODY as CONDUCTOR_MAX_BODY
from index_service.conductor_api import ConductorPaths, is_msgpack, reply
from index_service.dynamo_api import (
    LOWER_LEVELS,
    MAX_QUERY_BODY,
    DynamoRegistry,
    QueryByHashRequest,
    QueryRequest,
    answer_query,
)
from index_service.store import ShardStore
from kvidx import index
from kvidx.core.maskmap import native_module

log = logging.getLogger("kvidx.index_service")

ROUTES = {"/query": QueryRequest, "/query_by_hash": QueryByHashRequest}  # and the conductor's /query


def native_front():
    """kvidx_native.LookupFront, None where the compiled core is not built or not used (KVIDX_NATIVE=0:
    the maps are then the pure-Python reference's, which its threads cannot read)."""
    return getattr(native_module(), "LookupFront", None)


class LookupFront:
    """The front on `port` over `store` and Dynamo's `registry` (module docstring)."""

    def __init__(self, host: str, port: int, store: ShardStore, registry: DynamoRegistry,
                 credentials: Credentials | None = None, max_connections: int = 1024,
                 conductor: ConductorPaths | None = None):
        native = native_front()
        if native is None:
            raise RuntimeError("--lookup-port needs the compiled core (native/: scripts/setup.sh builds it)")
        self.store, self.registry, self.credentials = store, registry, credentials
        self.conductor = conductor  # Mooncake conductor's msgpack /query, where its API is on
        self._seen: dict[str, tuple] = {}  # model -> the view_signature pushed
        self._tokens: tuple[bytes, ...] | None = None
        self._stop = threading.Event()
        self.native = native(host, port, self.fallback, MAX_QUERY_BODY, max_connections)
        self.port = self.native.port
        with registry.lock:
            registry.on_change = self.sync_registry
            self.sync_registry()
        if conductor is not None:
            with conductor.registry.lock:
                conductor.registry.on_change = self.sync_contexts
                self.sync_contexts()
        with store.lock:
            store.on_change = self.sync_store
            self.sync_store()
        self.sync_tokens()
        if credentials is not None and credentials.path is not None:
            threading.Thread(target=self._watch_tokens, name="kvidx-lookup-tokens", daemon=True).start()

    # ---- what the threads read ---------------------------------------------------------------------
    def sync_store(self) -> None:
        """Pushes the view of every model whose maps or slots changed (under the store's lock)."""
        seen = self._seen
        for model, shard in self.store.shards.items():
            sig = index.view_signature(shard)
            old = seen.get(model)
            if old is not None and _same(old, sig):
                continue
            seen[model] = sig
            maps = index.tier_maps(shard, LOWER_LEVELS)
            if maps is None:
                self.native.drop_model(model)
            else:  # the conductor's levels: host memory, then disk (conductor_api.Reach)
                self.native.set_model(model, shard.block_size, maps[0], maps[1], index.tier_maps(shard)[1],
                                      index.slot_table(shard), index.has_pools(shard))
        for model in [m for m in seen if m not in self.store.shards]:
            del seen[model]
            self.native.drop_model(model)

    def sync_registry(self) -> None:
        """Pushes Dynamo's registrations (under the registry's lock)."""
        self.native.set_groups(self.registry.groups())

    def sync_contexts(self) -> None:
        """Pushes the conductor's prefix contexts (under its registry's lock)."""
        self.native.set_contexts(self.conductor.registry.context_table())

    def sync_tokens(self) -> None:
        """Pushes the Authorization values of the tokens with scope read (all when there are no
        credentials: None)."""
        c = self.credentials
        if c is not None:
            c.refresh()
        tokens = None if c is None else tuple(e.expected for e in c.entries if READ in e.scopes)
        if tokens != self._tokens:
            self._tokens = tokens
            self.native.set_tokens(list(tokens) if tokens is not None else None)

    def _watch_tokens(self) -> None:
        while not self._stop.wait(Credentials.RECHECK_S):
            self.sync_tokens()

    # ---- what they do not answer ---------------------------------------------------------------------
    def fallback(self, method: str, target: str, headers: list[tuple[bytes, bytes]], body: bytes
                 ) -> tuple[int, list[tuple[str, str]], bytes]:
        """The service's answer to a request the threads left: (status, headers, body)."""
        try:
            response = self._answer(method, target, dict(headers), body)
        except Exception:  # noqa: BLE001 - a bug must not take the connection's thread with it
            log.exception("event=lookup_front_error method=%s", method)
            response = Response("Internal Server Error", 500, media_type="text/plain; charset=utf-8")
        hs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in response.raw_headers
              if k != b"content-length"]
        return response.status_code, hs, bytes(response.body)

    def _answer(self, method: str, target: str, headers: dict[bytes, bytes], body: bytes) -> Response:
        url = urlsplit(target)
        typ = ROUTES.get(url.path)
        if typ is None:
            return Response(f"the lookup port answers POST /query and /query_by_hash; {url.path[:200]} is "
                            "on the service's --port", 404, media_type="text/plain; charset=utf-8")
        if method != "POST":
            return Response(status_code=405, headers={"allow": "POST"})
        if self.credentials is not None:
            refused = self.credentials.refusal(headers.get(b"authorization"), READ, f"POST {url.path}")
            if refused is not None:
                return refused.response()
            self.sync_tokens()  # a token the threads do not hold yet: added to the file since
        content_type = headers.get(b"content-type", b"").decode("latin-1")
        if self.conductor is not None and url.path == "/query" and is_msgpack(content_type):
            if len(body) > CONDUCTOR_MAX_BODY:
                return reply(413, {"error": "request body too large"})
            return self.conductor.query_here(body, dict(parse_qsl(url.query)))
        return answer_query(self.store, self.registry, typ, content_type, body, QueryParams(url.query))

    def stats(self) -> dict[str, int]:
        return self.native.stats()

    def close(self) -> None:
        self._stop.set()
        self.native.close()
        self.store.on_change = None
        self.registry.on_change = None
        if self.conductor is not None:
            self.conductor.registry.on_change = None


def _same(old: tuple, new: tuple) -> bool:
    """Two view signatures alike: the same objects (`is`), equal sizes."""
    (g0, maps0, slots0, pools0, *sizes0), (g1, maps1, slots1, pools1, *sizes1) = old, new
    return (g0 is g1 and slots0 is slots1 and pools0 is pools1 and sizes0 == sizes1
            and len(maps0) == len(maps1) and all(a is b for a, b in zip(maps0, maps1, strict=True)))


class FrontCollector:
    """The front's counters on /metrics (read at scrape time)."""

    def __init__(self, front: LookupFront):
        self.front = front

    def collect(self):
        s = self.front.stats()
        answered = CounterMetricFamily("kvidx_lookup_front_requests", "Requests on --lookup-port, by who "
                                       "answered: the compiled threads (per route) or the Python handler",
                                       labels=["answered"])
        answered.add_metric(["query"], s["fast_query"])
        answered.add_metric(["query_by_hash"], s["fast_query_by_hash"])
        answered.add_metric(["conductor_query"], s["fast_conductor_query"])
        answered.add_metric(["fallback"], s["fallback"])
        yield answered
        yield GaugeMetricFamily("kvidx_lookup_front_connections", "Open connections on --lookup-port",
                                value=s["connections"])
        yield CounterMetricFamily("kvidx_lookup_front_refused_connections", "Connections refused on "
                                  "--lookup-port (over its limit)", value=s["refused_connections"])
