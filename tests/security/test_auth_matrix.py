"""The auth matrix of `kvidx serve` with every API on (kvidx's, Dynamo's, the conductor's, LMCache's, SGLang's
gRPC and the instances' internal route), over real HTTP and a real gRPC channel: every route, every path a
middleware takes and every RPC of the service descriptor answers 401 / UNAUTHENTICATED without a token or
with a wrong one, 403 / PERMISSION_DENIED with a token of another scope, and lets the right scope through.

The tables below are the contract: a route, middleware path or RPC the service answers that is missing
from them fails the test (a new route cannot be added without deciding its scope), and so does an entry
the service no longer has."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import msgspec
import pytest

from index_service.app import create_app
from index_service.auth import ADMIN, READ, WRITE, Credentials, RequireScope, parse_credentials
from index_service.conductor_api import ConductorPaths, ConductorRegistry
from index_service.dynamo_api import DynamoRegistry
from index_service.sglang_indexer import SERVICE, SglangIndexer, add_sglang_peer_route, start_server
from index_service.sglang_pb import kv_indexer_pb2 as pb
from tests.helpers import SEEDED_BS, SEEDED_MODEL, ServerThread, seeded_store

# (method, path) -> the scope it needs (None: open). Path parameters as the app declares them.
HTTP_SCOPES: dict[tuple[str, str], str | None] = {
    ("GET", "/healthz"): None,
    ("GET", "/metrics"): None,
    ("POST", "/v1/lookup"): READ,
    ("POST", "/v1/rank"): READ,
    ("POST", "/v1/lookup/binary"): READ,
    ("GET", "/v1/models"): READ,
    ("POST", "/v1/routes"): WRITE,
    ("POST", "/v1/usage"): WRITE,
    ("GET", "/openapi.json"): READ,
    ("HEAD", "/openapi.json"): READ,
    ("GET", "/docs"): READ,
    ("GET", "/docs/oauth2-redirect"): READ,
    ("GET", "/redoc"): READ,
    ("GET", "/static-offline-docs/{path}"): READ,
    # Dynamo's indexer API (JSON) and Mooncake conductor's (msgpack, the same paths)
    ("POST", "/register"): ADMIN,
    ("POST", "/unregister"): ADMIN,
    ("GET", "/workers"): ADMIN,
    ("GET", "/dump"): ADMIN,
    ("POST", "/query"): READ,
    ("POST", "/query_by_hash"): READ,
    ("GET", "/health"): READ,
    ("GET", "/services"): ADMIN,
    ("GET", "/global_view"): ADMIN,
    # LMCache's controller lookup
    ("POST", "/lookup"): READ,
    # instance to instance: a split model's SGLang prefix query
    ("POST", "/internal/sglang/{model}/match_prefix"): ADMIN,
}
RPC_SCOPES: dict[str, str] = {
    "ApplyExternalKvBatch": WRITE,
    "MatchExternalKv": READ,
    "MatchExternalKvPrefix": READ,
    "GetExternalKvHitCounts": READ,
}
TOKENS = {READ: "router-token-0123456789abcdef", WRITE: "bridge-token-0123456789abcdef",
          ADMIN: "ops-token-0123456789abcdef0123"}
CREDENTIALS = f"""# name  scopes  token
router  read   {TOKENS[READ]}
bridge  write  {TOKENS[WRITE]}
ops     admin  {TOKENS[ADMIN]}
"""
WRONG = "not-a-token-of-this-service-0000"
MSGPACK = "application/msgpack"
PROMPT = list(range(1000, 1000 + 20 * SEEDED_BS))  # seeded_store's replicas hold prefixes of this


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@dataclass
class Service:
    url: str
    grpc_port: int
    dynamo: DynamoRegistry
    conductor: ConductorRegistry
    started: list  # the relays registrations started
    published: list  # the SGLang feed's batches


@contextmanager
def serve(credentials: Credentials | None) -> Iterator[tuple[Service, object]]:
    """The service as `kvidx serve` assembles it (index_service/main.py serve) with every API on, its relays
    and the feed's topic replaced by lists: (the service, the app)."""
    store = seeded_store(prompt=PROMPT)
    started, published = [], []

    def starter(model, replica, dp_rank, endpoint, replay, listener, block_size):
        started.append((model, replica))
        return lambda clear=True: None  # a relay's stop(clear)

    dynamo = DynamoRegistry(starter, owner="me")
    conductor = ConductorRegistry(starter, owner="me", start_pool_relay=starter)
    app = create_app(store, credentials=credentials, dynamo=dynamo, conductor=conductor,
                     lmcache_lookup=SEEDED_MODEL)
    indexer = SglangIndexer(store, SEEDED_MODEL, lambda batch: published.append(batch) or (lambda: None),
                            None, lambda method, code: app.state.metrics.lookups.labels(f"sglang_{method}",
                                                                                        code).inc())
    grpc_server, grpc_port = start_server(indexer, "127.0.0.1:0", workers=2, credentials=credentials)
    add_sglang_peer_route(app, {SEEDED_MODEL: indexer})
    try:
        with ServerThread(app) as url:
            yield Service(url, grpc_port, dynamo, conductor, started, published), app
    finally:
        grpc_server.stop(0)
        dynamo.stop_all()
        conductor.stop_all()


@pytest.fixture(scope="module")
def credentials_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "credentials"
    path.write_text(CREDENTIALS)
    return path


@pytest.fixture(scope="module")
def service(credentials_file):
    with serve(Credentials.from_file(str(credentials_file))) as (svc, app):
        yield svc, app


def http_routes(app) -> set[tuple[str, str, str]]:
    """Every (method, path, content type) the app answers: its routes, the lookups its hot path takes
    before them and the paths each middleware takes (`paths`; the conductor's in msgpack)."""
    out = set()
    for route in app.routes:
        methods = getattr(route, "methods", None)
        if methods is None:  # a Mount: the API documents' assets
            out.add(("GET", route.path + "/{path}", "application/json"))
        else:
            out |= {(m, route.path, "application/json") for m in methods}
    out |= {(m, p, "application/json") for m, p in app.hot.paths}
    for mw in app.user_middleware:
        if mw.cls is RequireScope:
            continue
        assert hasattr(mw.cls, "paths"), f"middleware {mw.cls.__name__} must list the paths it takes"
        ctype = MSGPACK if mw.cls is ConductorPaths else "application/json"
        out |= {(m, p, ctype) for m, p in mw.cls.paths}
    return out


def rpc_methods() -> list[str]:
    return [m.name for m in pb.DESCRIPTOR.services_by_name[SERVICE.rsplit(".", 1)[-1]].methods]


def test_every_route_and_rpc_has_a_scope(service):
    _, app = service
    answered = {(m, p) for m, p, _ in http_routes(app)}
    assert answered - HTTP_SCOPES.keys() == set(), "routes without an entry in HTTP_SCOPES"
    assert HTTP_SCOPES.keys() - answered == set(), "HTTP_SCOPES entries the service no longer has"
    assert set(rpc_methods()) == RPC_SCOPES.keys()
    assert ("POST", "/register", MSGPACK) in http_routes(app)  # the conductor's paths are enumerated too


def _request(c: httpx.Client, method: str, path: str, ctype: str, headers: dict) -> httpx.Response:
    url = path.replace("{model}", SEEDED_MODEL).replace("{path}", "swagger-ui.css")
    if method != "POST":
        return c.request(method, url, headers=headers)
    body = msgspec.msgpack.encode({}) if ctype == MSGPACK else b"{}"
    return c.post(url, content=body, headers={**headers, "Content-Type": ctype})


@pytest.mark.parametrize("route", sorted(HTTP_SCOPES), ids=lambda r: f"{r[0]} {r[1]}")
def test_http_matrix(service, route):
    svc, app = service
    forms = [(m, p, ct) for m, p, ct in http_routes(app) if (m, p) == route]
    with httpx.Client(base_url=svc.url, timeout=10) as c:
        for method, path, ctype in forms:
            needed = HTTP_SCOPES[route]
            what = f"{method} {path} ({ctype})"
            if needed is None:
                for headers in ({}, bearer(WRONG)):
                    assert _request(c, method, path, ctype, headers).status_code == 200, what
                continue
            for headers in ({}, bearer(WRONG), {"Authorization": TOKENS[needed]},
                            {"Authorization": f"Basic {TOKENS[needed]}"}):
                r = _request(c, method, path, ctype, headers)
                assert r.status_code == 401, (what, headers, r.status_code)
                assert r.headers["www-authenticate"] == f'Bearer scope="{needed}"', what
                if method != "HEAD":
                    assert r.json()["error"].startswith("missing or wrong bearer token") and needed in r.text
            for scope, token in TOKENS.items():
                r = _request(c, method, path, ctype, bearer(token))
                if scope == needed:
                    assert r.status_code not in (401, 403), (what, r.status_code, r.text[:200])
                else:
                    assert r.status_code == 403, (what, scope, r.status_code)
                    if method != "HEAD":
                        assert f"lacks scope '{needed}'" in r.json()["error"], r.text


def _rpc(port: int, method: str, request, token: str | None):
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=lambda raw: raw)
        metadata = [("authorization", f"Bearer {token}")] if token is not None else None
        try:
            call(request, timeout=10, metadata=metadata)
        except grpc.RpcError as e:
            return e.code(), e.details()
        return grpc.StatusCode.OK, ""


def _rpc_request(method: str):
    service = pb.DESCRIPTOR.services_by_name[SERVICE.rsplit(".", 1)[-1]]
    typ = getattr(pb, service.methods_by_name[method].input_type.name)
    if method == "ApplyExternalKvBatch":
        return typ(worker_id="matrix-worker", seq=1)
    return typ()


@pytest.mark.parametrize("method", sorted(RPC_SCOPES))
def test_grpc_matrix(service, method):
    svc, _ = service
    needed, request = RPC_SCOPES[method], _rpc_request(method)
    for token in (None, WRONG):
        code, details = _rpc(svc.grpc_port, method, request, token)
        assert code == grpc.StatusCode.UNAUTHENTICATED and needed in details, (method, token, code)
    for scope, token in TOKENS.items():
        code, details = _rpc(svc.grpc_port, method, request, token)
        if scope == needed:
            assert code not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED), details
        else:
            assert code == grpc.StatusCode.PERMISSION_DENIED and f"lacks scope '{needed}'" in details


def _lookup_credit(c: httpx.Client) -> list:
    r = c.post("/v1/lookup", json={"model": SEEDED_MODEL, "token_ids": PROMPT}, headers=bearer(TOKENS[READ]))
    assert r.status_code == 200
    return [(x["replica"], x["dp_rank"], x["cached_tokens"]) for x in r.json()["replicas"]]


def test_calls_without_the_scope_change_nothing():
    """Registrations, unregistrations and a feed's clear sent without a token, with a wrong one or with
    a read token: no relay starts, nothing is published, and every later lookup answers as before."""
    with serve(Credentials(parse_credentials(CREDENTIALS))) as (svc, _), \
            httpx.Client(base_url=svc.url, timeout=10) as c:
        before = _lookup_credit(c)
        assert before and any(credit for *_, credit in before)
        replica = before[0][0]
        dynamo = {"instance_id": 7, "endpoint": "tcp://127.0.0.1:5999", "model_name": SEEDED_MODEL,
                  "block_size": SEEDED_BS}
        conductor = {"endpoint": "tcp://127.0.0.1:5998", "type": "vLLM", "modelname": SEEDED_MODEL,
                     "instance_id": "engine-x", "block_size": SEEDED_BS, "dp_rank": 0}
        clear = pb.ApplyExternalKvBatchRequest(worker_id=replica, seq=1, actions=[
            pb.ExternalKvAction(type=pb.ACTION_CLEAR_ALL_AT_TIER, tier=pb.TIER_HBM)])
        for headers, token in (({}, None), (bearer(WRONG), WRONG), (bearer(TOKENS[READ]), TOKENS[READ])):
            assert c.post("/register", json=dynamo, headers=headers).status_code in (401, 403)
            assert c.post("/register", content=msgspec.msgpack.encode(conductor),
                          headers={**headers, "Content-Type": MSGPACK}).status_code in (401, 403)
            assert c.post("/unregister", json={"instance_id": 7, "model_name": SEEDED_MODEL},
                          headers=headers).status_code in (401, 403)
            assert c.post("/unregister", content=msgspec.msgpack.encode({"instance_id": "engine-x"}),
                          headers={**headers, "Content-Type": MSGPACK}).status_code in (401, 403)
            code, _ = _rpc(svc.grpc_port, "ApplyExternalKvBatch", clear, token)
            assert code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
        assert svc.started == [] and svc.published == []
        assert svc.dynamo.dump() == {} and svc.conductor.services_view()["services"] == []
        assert _lookup_credit(c) == before
        metrics = c.get("/metrics").text
        # as label values (a bare "5999" can be any counter's value in a process that ran other tests)
        assert '"engine-x"' not in metrics
        assert "127.0.0.1:5999" not in metrics and "127.0.0.1:5998" not in metrics
        # the same registration with the admin token goes through: the refusals above were the scope's
        assert c.post("/register", json=dynamo, headers=bearer(TOKENS[ADMIN])).status_code in (200, 201)
        assert svc.started
