"""The lookup service's OpenAPI document: the answers' schemas (index_service.responses) in its
components, the request bodies the handlers read themselves (they take the raw Request, so FastAPI
cannot infer them), and the routes of the other APIs the service serves on the same port (Dynamo's,
Mooncake conductor's, LMCache's, the instances' SGLang route: OPERATIONS), described where an app serves
them. `undocumented_routes(app)` names any route the document misses (tests keep it empty)."""

from __future__ import annotations

from fastapi import FastAPI

from index_service.context import JSON
from index_service.responses import COMPONENTS
from index_service.wire import MAX_TOP_K


def document_responses(app: FastAPI) -> None:
    """The answers' schemas in the OpenAPI document's components, which the routes' `responses=` refer
    to."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(COMPONENTS)
            document_other_apis(app, schema)  # built on the first request: every route is there by then
        return app.openapi_schema

    app.openapi = openapi


def json_body(schema: dict) -> dict:
    """openapi_extra of a route whose body is JSON of this schema."""
    return {"requestBody": {"required": True, "content": {JSON: {"schema": schema}}}}


def binary_lookup_extra() -> dict:
    """openapi_extra of POST /v1/lookup/binary: its query parameters and the packed body (a new dict
    per app: FastAPI keeps references to it in the document)."""
    return {
        "parameters": [
            {"name": "model", "in": "query", "required": True, "schema": {"type": "string"}},
            {"name": "lora_name", "in": "query", "required": False, "schema": {"type": "string"}},
            {"name": "cache_salt", "in": "query", "required": False, "schema": {"type": "string"}},
            {"name": "top_k", "in": "query", "required": False,
             "schema": {"type": "integer", "minimum": 1, "maximum": MAX_TOP_K}},
        ], "requestBody": {
            "required": True, "content": {"application/octet-stream": {
                "schema": {"type": "string", "format": "binary",
                           "description": "token ids as packed little-endian uint32"}}}}}


# ---- the routes other APIs serve on the same port (their handlers read raw bodies, some in middleware,
# so FastAPI does not see them): described here, in the document of an app that serves them -----------
MSGPACK = "application/msgpack"
PROTOBUF = "application/x-protobuf"
_OBJECT = {"type": "object"}
# the API each handler's module or middleware class belongs to, and where docs/routers.md describes it
APIS = {"dynamo": ("Dynamo's standalone KV indexer API", "dynamos-indexer-api"),
        "conductor": ("Mooncake conductor's indexer API (msgpack: `Content-Type: application/msgpack`)",
                      "mooncake-conductors-api"),
        "lmcache": ("LMCache controller's lookup (kvidx serve --lmcache-lookup MODEL)",
                    "lmcaches-controller-lookup"),
        "sglang": ("SGLang's external indexer, between instances holding a split model's replica groups",
                   "sglangs-external-indexer-grpc")}
_API_OF_MODULE = {"index_service.dynamo_api": "dynamo", "index_service.lmcache_api": "lmcache",
                  "index_service.sglang_indexer": "sglang"}
_API_OF_MIDDLEWARE = {"ConductorPaths": "conductor"}
# (api, METHOD, path) -> (what it does, request content type or None, {status: answer})
OPERATIONS: dict[tuple[str, str, str], tuple[str, str | None, dict[str, str]]] = {
    ("dynamo", "POST", "/register"): (
        "register a vLLM worker's KV-event publisher {instance_id, endpoint, model_name, block_size, "
        "dp_rank?, replay_endpoint?, routing_group?}: a relay in the service follows it", JSON,
        {"201": '{"status": "ok"}', "400": "a bad endpoint", "409": "a duplicate (instance, rank), another "
         "model or block size"}),
    ("dynamo", "POST", "/unregister"): (
        "unregister a worker {instance_id, model_name, routing_group?, dp_rank?}: its relay stops, its "
        "replica is retracted", JSON, {"200": "unregistered", "404": "no such worker"}),
    ("dynamo", "GET", "/workers"): ("the registered workers (Dynamo's WorkerInfo list); query: model_name?, "
                                    "routing_group?", None, {"200": "a JSON list"}),
    ("dynamo", "GET", "/dump"): ("the registered workers' stored blocks as Dynamo RouterEvents, per "
                                 "model:routing_group", None, {"200": "Dynamo's dump"}),
    ("dynamo", "POST", "/query"): (
        "Dynamo's ScoreResponse for a prompt {token_ids, model_name, routing_group?, lora_name?, "
        "cache_salt?}", JSON,
        {"200": "per worker and DP rank: scores, instances (gpu, cpu, disk), frequencies",
         "400": "malformed JSON", "413": "body too large", "415": "not JSON", "422": "a wrong field"}),
    ("dynamo", "POST", "/query_by_hash"): (
        "the same answer from Dynamo's own block hashes {block_hashes, model_name, routing_group?}", JSON,
        {"200": "as /query", "400": "malformed JSON or cache_salt given", "422": "a wrong field"}),
    ("dynamo", "GET", "/health"): ("Dynamo's liveness probe", None, {"200": "empty"}),
    ("conductor", "POST", "/register"): (
        "register a vLLM engine's or a Mooncake Store master's publisher {endpoint, type, modelname, "
        "instance_id, block_size, dp_rank, hash_profile, ...}", MSGPACK,
        {"200": "{status, instance_id}", "400": "{error, reason, field?, index?}"}),
    ("conductor", "POST", "/unregister"): ("unregister {instance_id, dp_rank, tenant_id?}", MSGPACK,
                                           {"200": "{status, removed_instances}",
                                            "404": "service not found"}),
    ("conductor", "POST", "/query"): (
        "per instance and DP rank of the context, the tokens held on GPU, then in host memory (cpu), then "
        "on disk {model, block_size, token_ids, tenant_id?, lora_name?, cache_salt?, instance_id?}",
        MSGPACK, {"200": "{instances: {...}}", "400": "{error, reason}"}),
    ("conductor", "GET", "/services"): ("the registrations (PascalCase keys, as the conductor's)", None,
                                        {"200": "msgpack"}),
    ("conductor", "GET", "/global_view"): ("the contexts with their hash profile and its root digest", None,
                                           {"200": "msgpack"}),
    ("lmcache", "POST", "/lookup"): (
        "where a prompt is cached, in LMCache's shape {tokens: [...]}", JSON,
        {"200": '{"event_id": "Lookup<uuid>", "layout_info": {instance_id: [location, matched_tokens]}}',
         "400": "malformed JSON", "422": "a wrong field"}),
    ("sglang", "POST", "/internal/sglang/{model}/match_prefix"): (
        "a MatchExternalKvPrefixRequest answered from this instance's workers of the groups asked "
        "(?local=1&groups=G,G): what another instance's fan-out asks", PROTOBUF,
        {"200": "MatchExternalKvPrefixResponse", "404": "no indexer for the model", "413": "body too large",
         "422": "undecodable request"}),
}
# the documents' own routes: /openapi.json, /docs, /redoc and the pages' assets
DOCUMENT_PATHS = ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")


def served_routes(app: FastAPI) -> dict[tuple[str, str], set[str]]:
    """Every (METHOD, path) the app answers, FastAPI's routes, the hot path's and the middleware's, with
    the APIs serving it ("kvidx" for the service's own), the documents' own routes left out."""
    served: dict[tuple[str, str], set[str]] = {}
    for route in app.routes:
        path, methods = getattr(route, "path", None), getattr(route, "methods", None)
        if path is None or not methods or path in DOCUMENT_PATHS or path.startswith("/static"):
            continue
        api = _API_OF_MODULE.get(getattr(getattr(route, "endpoint", None), "__module__", ""), "kvidx")
        for method in methods - {"HEAD"}:
            served.setdefault((method, path), set()).add(api)
    hot = getattr(app, "hot", None)
    for method, path in getattr(hot, "paths", ()):  # Dynamo's lookups too, where its API is on
        api = "dynamo" if (method, path) in hot.dynamo_paths else "kvidx"
        served.setdefault((method, path), set()).add(api)
    for middleware in app.user_middleware:
        cls = getattr(middleware, "cls", None)
        for method, path in getattr(cls, "paths", ()):
            served.setdefault((method, path), set()).add(_API_OF_MIDDLEWARE.get(cls.__name__, "kvidx"))
    return served


def _operation(method: str, path: str, apis: set[str]) -> dict | None:
    """The OpenAPI operation of a route the APIs `apis` serve, merged where several share it (Dynamo's
    JSON and the conductor's msgpack on POST /query); None if OPERATIONS lacks it."""
    known = [(api, OPERATIONS[(api, method, path)]) for api in sorted(apis)
             if (api, method, path) in OPERATIONS]
    if not known:
        return None
    op: dict = {"summary": "; ".join(APIS[api][0] for api, _ in known),
                "description": "\n\n".join(f"{APIS[api][0]}: {what} (docs/routers.md#{APIS[api][1]})"
                                           for api, (what, _, _) in known),
                "tags": sorted({APIS[api][0].split(" (")[0] for api, _ in known}), "responses": {}}
    bodies = {ctype: {"schema": _OBJECT if ctype == JSON else {"type": "string", "format": "binary"}}
              for _, (_, ctype, _) in known if ctype}
    if bodies:
        op["requestBody"] = {"required": True, "content": bodies}
    for api, (_, _, answers) in known:
        for status, text in answers.items():
            prior = op["responses"].get(status)
            label = f"{APIS[api][0].split(' (')[0]}: {text}" if len(known) > 1 else text
            op["responses"][status] = {"description": f"{prior['description']}; {label}" if prior else label}
    if "{model}" in path:
        op["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
    return op


def document_other_apis(app: FastAPI, schema: dict) -> None:
    """Add to `schema` the routes the app serves that FastAPI's document lacks (Dynamo's, the
    conductor's, LMCache's, the instances' SGLang route)."""
    paths = schema.setdefault("paths", {})
    for (method, path), apis in sorted(served_routes(app).items()):
        if method.lower() in paths.get(path, {}):
            continue
        op = _operation(method, path, apis)
        if op is not None:
            paths.setdefault(path, {})[method.lower()] = op


def undocumented_routes(app: FastAPI) -> list[tuple[str, str]]:
    """(METHOD, path) the app serves that its OpenAPI document does not describe (a test keeps it [])."""
    paths = app.openapi().get("paths", {})
    return sorted(r for r in served_routes(app) if r[0].lower() not in paths.get(r[1], {}))
