"""The HTTP API fuzzed from its own OpenAPI spec (schemathesis), over real HTTP: uvicorn on
127.0.0.1, the spec read from /openapi.json.

Every operation gets positive (schema-valid) and negative (schema-violating) requests; each request is
sent as generated and, where it names a model, once more with a model the service knows (otherwise
nearly every lookup would stop at 404 and the hashing, lookup and pricing paths would go untested).
Checks on every response:
- no 5xx (schemathesis' not_a_server_error);
- every 4xx is JSON with an `error` string that names the problem (not empty, not a bare "bad
  request"), and the service's own 4xx use the statuses the README documents.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode

from index_service.app import create_app
from tests.helpers import SEEDED_MODEL as MODEL
from tests.helpers import ServerThread, seeded_store

MAX_TOKENS = 4096
EXAMPLES = 100  # per operation; the whole file runs in well under a minute
DOCUMENTED_4XX = {400, 401, 404, 405, 413, 415, 422}


@pytest.fixture(scope="module")
def service():
    app = create_app(seeded_store(), max_tokens=MAX_TOKENS)
    with ServerThread(app) as url:
        yield url


@pytest.fixture(scope="module")
def api_schema(service):
    return schemathesis.openapi.from_url(f"{service}/openapi.json")


def check_error_body(response, case) -> None:
    status = response.status_code
    assert status < 500, f"{case.method} {case.path}: {status} {response.text[:300]}"
    if 400 <= status < 500:
        assert status in DOCUMENTED_4XX, f"undocumented status {status}: {response.text[:300]}"
        ctype = response.headers.get("content-type") or ""
        ctype = ctype[0] if isinstance(ctype, list) else ctype  # schemathesis: header -> [values]
        assert ctype.startswith("application/json"), f"{status} is not JSON: {ctype} {response.text[:200]}"
        body = json.loads(response.content)
        assert isinstance(body, dict) and isinstance(body.get("error"), str), body
        err = body["error"]
        assert len(err) >= 10 and err.lower() not in {"bad request", "invalid request", "error"}, err


def _with_known_model(case):
    """A copy of the case asking for the model the service holds, if the case names a model."""
    if isinstance(case.body, dict) and "model" in case.body:
        case.body = {**case.body, "model": MODEL}
        return case
    if isinstance(case.query, dict) and "model" in case.query:
        case.query = {**case.query, "model": MODEL}
        return case
    return None


OPERATIONS = ["POST /v1/lookup", "POST /v1/rank", "POST /v1/routes", "POST /v1/lookup/binary",
              "GET /healthz", "GET /v1/models", "GET /metrics"]


def test_spec_covers_the_api(api_schema):
    """The fuzzed operations are the spec's (a new endpoint is fuzzed once it is listed above)."""
    labels = {r.ok().label for r in api_schema.get_all_operations()}
    assert set(OPERATIONS) <= labels, labels
    binary = api_schema.find_operation_by_label("POST /v1/lookup/binary")
    assert "model" in {p.name for p in binary.query}, "the binary form's query parameters are in the spec"


def _fuzz(service: str, api_schema, label: str, mode: GenerationMode) -> None:
    op = api_schema.find_operation_by_label(label)
    assert op is not None, label

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case):
        for c in (case, _with_known_model(case)):
            if c is None:
                continue
            response = c.call(base_url=service)
            c.validate_response(response, checks=[not_a_server_error])
            check_error_body(response, c)

    run()
    with httpx.Client(base_url=service, timeout=30) as client:  # still answering
        assert client.get("/healthz").status_code == 200


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
@pytest.mark.parametrize("label", OPERATIONS)
def test_api_fuzz(service, api_schema, label, mode):
    if mode is GenerationMode.NEGATIVE and label.startswith("GET"):
        pytest.skip("no parameters to violate")
    _fuzz(service, api_schema, label, mode)


def test_api_fuzz_other_operations(service, api_schema):
    """Operations added since OPERATIONS was written (e.g. by other features) are fuzzed too."""
    for r in api_schema.get_all_operations():
        label = r.ok().label
        if label not in OPERATIONS and label not in ("GET /openapi.json", "GET /docs"):
            for mode in GenerationMode:
                if mode is GenerationMode.POSITIVE or not label.startswith("GET"):
                    _fuzz(service, api_schema, label, mode)


# ---- hand-written hostile requests the generator is unlikely to produce ---------------------------

HOSTILE = [
    ("post", "/v1/lookup", {"content": b"\xff\xfe\x00garbage"}, 400),
    ("post", "/v1/lookup", {"content": b"[" * 100_000}, None),
    ("post", "/v1/lookup", {"content": b'{"model": "m", "lora_name": ' + b"[" * 100_000}, None),
    ("post", "/v1/lookup", {"content": b'{"model": "x"' + b", " * 10}, 400),
    ("post", "/v1/lookup", {"json": {"model": MODEL, "token_ids": [2**64]}}, 422),
    ("post", "/v1/lookup", {"json": {"model": MODEL, "token_ids": [-1, 2]}}, 422),
    ("post", "/v1/lookup", {"json": {"model": MODEL, "token_ids": [1.5]}}, 422),
    ("post", "/v1/lookup", {"json": {"model": MODEL, "token_ids": list(range(MAX_TOKENS + 1))}}, 413),
    ("post", "/v1/lookup", {"json": {"model": MODEL, "block_hashes": [2**64], "prompt_tokens": 64}}, 422),
    ("post", "/v1/lookup", {"json": {"model": MODEL, "block_hashes": [1] * 9, "prompt_tokens": 64}}, 422),
    # bounded by the schema (2^31 - 1) before the size check: a 422 naming the field
    ("post", "/v1/lookup", {"json": {"model": MODEL, "block_hashes": [], "prompt_tokens": 2**70}}, 422),
    ("post", "/v1/lookup", {"json": {"model": "\x00" * 10_000, "token_ids": [1]}}, 404),
    ("post", "/v1/rank", {"json": {"model": MODEL, "token_ids": [1], "extra": 1}}, 422),
    ("post", "/v1/routes", {"content": b'{"request_id":"r","model":"%s","replica":"x","token_ids":[1],'
                                       b'"ttl_s":NaN}' % MODEL.encode()}, 400),
    ("post", "/v1/routes", {"json": {"request_id": "r", "model": MODEL, "replica": "x", "token_ids": [1],
                                     "ttl_s": -1}}, 422),
    ("post", "/v1/routes", {"content": b'{"request_id":"r","model":"%s","replica":"x","token_ids":[1],'
                                       b'"ttl_s":1e999}' % MODEL.encode()}, 422),
    ("post", "/v1/lookup/binary?model=" + MODEL, {"content": b"\x01\x02\x03"}, 400),
    ("post", "/v1/lookup/binary?model=" + MODEL, {"content": b""}, 422),
    ("post", "/v1/lookup/binary?model=" + MODEL, {"content": bytes(4 * MAX_TOKENS + 4)}, 413),
    ("post", "/v1/lookup/binary?model=" + MODEL + "&model=y", {"content": bytes(8)}, 422),
    ("post", "/v1/lookup/binary?nope=1", {"content": bytes(8)}, 422),
    ("post", "/v1/lookup/binary", {"content": bytes(8)}, 422),
    ("post", "/v1/lookup/binary?model=%ff%fe", {"content": bytes(8)}, 404),
    ("post", f"/v1/lookup/binary?model={MODEL}&cache_salt={'s' * 30_000}", {"content": bytes(64)}, None),
]


@pytest.mark.parametrize("method,path,kwargs,status", HOSTILE, ids=[f"{i}" for i in range(len(HOSTILE))])
def test_hostile_requests(service, method, path, kwargs, status):
    with httpx.Client(base_url=service, timeout=30) as client:
        r = client.request(method.upper(), path, **kwargs)
        check_error_body(r, type("C", (), {"method": method, "path": path})())
        if status is not None:
            assert r.status_code == status, r.text[:300]


def test_chunked_body_over_the_limit(service):
    """No Content-Length: the limit holds while the body streams in."""
    def chunks():
        for _ in range(64):
            yield bytes(4 * 1024)

    with httpx.Client(base_url=service, timeout=30) as client:
        r = client.post(f"/v1/lookup/binary?model={MODEL}", content=chunks())
        assert r.status_code == 413 and "too large" in r.json()["error"], r.text[:300]
        ok = client.post(f"/v1/lookup/binary?model={MODEL}",
                         content=np.arange(1000, 1064, dtype="<u4").tobytes())
        assert ok.status_code == 200 and ok.json()["replicas"], ok.text[:300]
