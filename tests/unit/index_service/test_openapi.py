"""The service's OpenAPI document describes its answers, and the answers match it (real HTTP): every
main route names its 2xx schema and its 4xx error shape; real answers decode as those schemas (the
same msgspec structs) with no undocumented field; every error, FastAPI's own 404/405 included, is
{"error": "..."}; /docs loads no asset from outside the service."""

from __future__ import annotations

import re
import struct
import time

import httpx
import msgspec
import pytest

from index_service import responses as R
from index_service.app import create_app
from index_service.store import ShardStore
from kvidx.core.hashing import prompt_hashes
from schemas.events import BlocksStored, EventBatch
from tests.helpers import ServerThread

MODEL, BS = "m", 16
PROMPT = list(range(100, 100 + 10 * BS + 3))


def _store(ready: bool = True) -> ShardStore:
    store = ShardStore(BS)
    hashes = prompt_hashes(PROMPT, BS)
    now = time.time()
    for r, (gpu, cpu) in enumerate([(4, 3), (2, 0)]):
        events = [BlocksStored("GPU", 0, hashes[:gpu], None, 0)]
        if cpu:
            events.append(BlocksStored("CPU", 0, hashes[gpu:gpu + cpu], hashes[gpu - 1], gpu))
        store.apply(EventBatch(1, MODEL, f"r{r}", 0, 1, 0, now, now, BS, events))
    store.ready = ready
    return store


@pytest.fixture(scope="module")
def url():
    with ServerThread(create_app(_store())) as u:
        yield u


def undocumented(obj, t, path: str = "") -> list[str]:
    """Keys of the JSON `obj` that the struct type `t` (recursively) does not name."""
    info = t if isinstance(t, msgspec.inspect.Type) else msgspec.inspect.type_info(t)
    if isinstance(info, msgspec.inspect.StructType) and isinstance(obj, dict):
        fields = {f.encode_name: f.type for f in info.fields}
        out = [f"{path}.{k}" for k in obj if k not in fields]
        for k, v in obj.items():
            if k in fields:
                out += undocumented(v, fields[k], f"{path}.{k}")
        return out
    if isinstance(info, msgspec.inspect.ListType) and isinstance(obj, list):
        return [x for i, v in enumerate(obj) for x in undocumented(v, info.item_type, f"{path}[{i}]")]
    if isinstance(info, msgspec.inspect.UnionType) and obj is not None:
        return [x for u in info.types if not isinstance(u, msgspec.inspect.NoneType)
                for x in undocumented(obj, u, path)]
    return []


def conforms(r: httpx.Response, t: type) -> None:
    assert r.headers["content-type"].startswith("application/json"), r.headers
    msgspec.json.decode(r.content, type=t)  # raises naming the field that does not match
    assert undocumented(r.json(), t) == [], r.text[:500]


def is_error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text[:300]
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert list(body) == ["error"] and isinstance(body["error"], str) and len(body["error"]) >= 10, body
    return body["error"]


def test_document_names_every_answer(url):
    spec = httpx.get(f"{url}/openapi.json").json()
    assert set(R.COMPONENTS) <= set(spec["components"]["schemas"])
    want = {("/v1/lookup", "post"): ("200", "LookupAnswer"), ("/v1/rank", "post"): ("200", "LookupAnswer"),
            ("/v1/lookup/binary", "post"): ("200", "LookupAnswer"),
            ("/v1/routes", "post"): ("202", "RouteAccepted"), ("/v1/usage", "post"): ("202", "UsageAccepted"),
            ("/healthz", "get"): ("200", "Health"), ("/v1/models", "get"): ("200", "Models")}
    for (path, method), (status, name) in want.items():
        responses = spec["paths"][path][method]["responses"]
        assert responses[status]["content"]["application/json"]["schema"] == R.ref(name), path
        for s, resp in responses.items():
            if s.startswith("4"):
                assert resp["content"]["application/json"]["schema"] == R.ref("Error"), (path, s)
    lookup = spec["paths"]["/v1/lookup"]["post"]["responses"]
    assert {"400", "404", "413", "422"} <= set(lookup) and "401" not in lookup  # no token configured


def test_answers_match_the_document(url):
    with httpx.Client(base_url=url, timeout=10) as c:
        for path in ("/v1/lookup", "/v1/rank"):
            r = c.post(path, json={"model": MODEL, "token_ids": PROMPT})
            assert r.status_code == 200 and len(r.json()["replicas"]) == 2
            conforms(r, R.LookupAnswer)
        r = c.post(f"/v1/lookup/binary?model={MODEL}", content=struct.pack(f"<{len(PROMPT)}I", *PROMPT))
        conforms(r, R.LookupAnswer)
        r = c.post("/v1/routes", json={"request_id": "q1", "model": MODEL, "replica": "r1",
                                       "token_ids": PROMPT, "credited_tokens": 32})
        assert r.status_code == 202
        conforms(r, R.RouteAccepted)
        r = c.post("/v1/usage", json={"request_id": "q1", "model": MODEL, "replica": "r1",
                                      "prompt_tokens": len(PROMPT), "cached_tokens": 32})
        assert r.status_code == 202
        conforms(r, R.UsageAccepted)
        conforms(c.get("/healthz"), R.Health)
        conforms(c.get("/v1/models"), R.Models)
        # with the routed decision pending on r1, the lookup still matches
        conforms(c.post("/v1/lookup", json={"model": MODEL, "token_ids": PROMPT}), R.LookupAnswer)


def test_not_ready_health_matches_too():
    with ServerThread(create_app(_store(ready=False))) as u:
        r = httpx.get(f"{u}/healthz")
        assert r.status_code == 503
        conforms(r, R.Health)


def test_every_error_has_one_shape(url):
    with httpx.Client(base_url=url, timeout=10) as c:
        assert "no such path" in is_error(c.get("/nope"), 404)
        assert "no such path" in is_error(c.post("/v1/nope", json={}), 404)
        r = c.delete("/v1/lookup")
        assert "POST" in is_error(r, 405) and r.headers["allow"] == "POST"
        assert "GET" in is_error(c.post("/healthz"), 405)
        assert "unknown model" in is_error(c.post("/v1/lookup", json={"model": "x", "token_ids": [1]}), 404)
        is_error(c.post("/v1/lookup", content=b"{"), 400)
        is_error(c.post("/v1/lookup", json={"model": MODEL}), 422)
        is_error(c.post("/v1/lookup", json={"model": MODEL, "token_ids": [1], "nope": 1}), 422)


def test_errors_with_a_token_are_documented_and_shaped():
    with ServerThread(create_app(_store(), auth_token="s3cret")) as u:
        assert httpx.get(f"{u}/openapi.json").status_code == 401  # the documents need a token too
        spec = httpx.get(f"{u}/openapi.json", headers={"Authorization": "Bearer s3cret"}).json()
        assert {"401", "403"} <= set(spec["paths"]["/v1/lookup"]["post"]["responses"])
        assert "401" not in spec["paths"]["/healthz"]["get"]["responses"]
        r = httpx.post(f"{u}/v1/lookup", json={"model": MODEL, "token_ids": [1]})
        assert "bearer" in is_error(r, 401)


def test_docs_are_served_offline(url):
    with httpx.Client(base_url=url, timeout=10) as c:
        page = c.get("/docs")
        assert page.status_code == 200
        assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assert assets and all(a.startswith("/") for a in assets), assets  # nothing from a CDN
        for a in assets:
            r = c.get(a)
            assert r.status_code == 200 and len(r.content) > 1000, a
        redoc = c.get("/redoc")
        assert redoc.status_code == 200 and "cdn." not in redoc.text


def _every_api_app():
    """A service serving every API kvidx serve can: its own, Dynamo's, the conductor's (middleware),
    LMCache's lookup and the instances' SGLang route."""
    from index_service.conductor_api import ConductorRegistry
    from index_service.dynamo_api import DynamoRegistry
    from index_service.sglang_indexer import SglangIndexer, add_sglang_peer_route
    from relays.managed import vllm_relay_starter
    from relays.sinks import StoreSink

    store = _store()
    starter = vllm_relay_starter(StoreSink(store), lambda model: 16)
    app = create_app(store, dynamo=DynamoRegistry(starter), conductor=ConductorRegistry(starter),
                     lmcache_lookup=MODEL)
    add_sglang_peer_route(app, {MODEL: SglangIndexer(store, MODEL, store.apply)})
    return app


def test_the_document_describes_every_route_the_service_serves():
    """Every (method, path) the app answers, FastAPI's routes, the hot path's and the middleware's
    (enumerated from the app, not listed here), is in /openapi.json; a path two APIs share names both
    bodies."""
    from index_service.openapi import served_routes, undocumented_routes

    app = _every_api_app()
    served = served_routes(app)
    # the enumeration reaches the middleware's and the hot path's routes
    assert {("GET", "/global_view"), ("POST", "/query"), ("POST", "/v1/lookup"), ("POST", "/lookup"),
            ("POST", "/internal/sglang/{model}/match_prefix")} <= set(served)
    assert served[("POST", "/query")] == {"dynamo", "conductor"}
    assert undocumented_routes(app) == []
    with ServerThread(app) as u:
        spec = httpx.get(f"{u}/openapi.json").json()
    for method, path in served:
        assert method.lower() in spec["paths"].get(path, {}), (method, path)
    query = spec["paths"]["/query"]["post"]
    assert set(query["requestBody"]["content"]) == {"application/json", "application/msgpack"}
    assert "Dynamo" in query["summary"] and "conductor" in query["summary"]


def test_a_route_left_out_of_the_document_is_named():
    from fastapi import Request

    from index_service.openapi import undocumented_routes

    app = create_app(_store())

    @app.post("/v1/secret", include_in_schema=False)
    async def secret(request: Request) -> dict:
        return {}

    assert undocumented_routes(app) == [("POST", "/v1/secret")]
