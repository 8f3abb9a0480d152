"""Issue #35 part 3, "every input bounded before it costs anything", over real HTTP and real gRPC, on a
service with every API on (kvidx's, Dynamo's, the conductor's, LMCache's lookup, SGLang's gRPC and its
peer route):

- every route of the app is in ROUTES (a route added without an entry fails test_every_route_is_listed);
- an oversize body on every route: 413 (or, where the route takes no body, an answer that did not
  read it), and a 150 MB body is refused before it is read whole (a raw socket counts what was sent);
- JSON and msgpack nested 1,000 deep on every route: a 4xx, and no traceback or error in the log;
- the issue's numbers: block_size 2^36 and 2^62, instance_id 2^64, `top_k=²`, usage of 2^64-1 tokens,
  garbage protobuf on every RPC, and more concurrent RPCs than the cap;
- names with a newline (log injection) refused at every API that takes names, no forged log line;
- 200 oversize or deep requests: RSS within 10 % and the lookups answer as before;
- a property-based fuzzer over the JSON (Dynamo), msgpack (conductor) and protobuf (SGLang) request
  schemas, which are not in /openapi.json (kvidx's own API is fuzzed by schemathesis from its
  OpenAPI document: tests/fuzz/test_api_schemathesis.py): never a 5xx or INTERNAL.
"""

from __future__ import annotations

import gc
import logging
import select
import socket
import threading

import grpc
import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from starlette.routing import Mount

from index_service.app import create_app
from index_service.conductor_api import ConductorRegistry
from index_service.dynamo_api import DynamoRegistry
from index_service.sglang_indexer import (
    MAX_CONCURRENT_RPCS,
    SERVICE,
    SglangIndexer,
    add_sglang_peer_route,
    start_server,
)
from index_service.sglang_pb import kv_indexer_pb2 as pb
from tests.helpers import SEEDED_MODEL as MODEL
from tests.helpers import ServerThread, SglangClient, seeded_store, sglang_action, wait_for

MAX_TOKENS = 4096
JSON = {"Content-Type": "application/json"}
MSGPACK = {"Content-Type": "application/msgpack"}
PROTOBUF = {"Content-Type": "application/x-protobuf"}
PEER = f"/internal/sglang/{MODEL}/match_prefix"
PROFILE = {"strategy": "vllm_v1", "algorithm": "sha256_cbor", "python_hash_seed": "0",
           "index_projection": "low64_be"}
MiB = 1 << 20

# (method, path as requested, content type) -> the largest body it reads (None: it takes no body)
ROUTES: dict[tuple[str, str, str], int | None] = {
    ("POST", "/v1/lookup", "json"): MAX_TOKENS * 12 + 65536,
    ("POST", "/v1/rank", "json"): MAX_TOKENS * 12 + 65536,
    ("POST", "/v1/routes", "json"): MAX_TOKENS * 12 + 65536,
    ("POST", "/v1/usage", "json"): 65536,
    ("POST", f"/v1/lookup/binary?model={MODEL}", "binary"): MAX_TOKENS * 4,
    ("POST", "/register", "json"): 64 << 10,
    ("POST", "/unregister", "json"): 64 << 10,
    ("POST", "/query", "json"): 8 * MiB,
    ("POST", "/query_by_hash", "json"): 8 * MiB,
    ("POST", "/register", "msgpack"): 64 << 10,
    ("POST", "/unregister", "msgpack"): 64 << 10,
    ("POST", "/query", "msgpack"): 8 * MiB,
    ("POST", "/lookup", "json"): MAX_TOKENS * 12 + 65536,
    ("POST", PEER, "protobuf"): 4 * MiB,
    ("GET", "/openapi.json", ""): None,
    ("GET", "/docs", ""): None,
    ("GET", "/docs/oauth2-redirect", ""): None,
    ("GET", "/redoc", ""): None,
    ("GET", "/healthz", ""): None,
    ("GET", "/v1/models", ""): None,
    ("GET", "/metrics", ""): None,
    ("GET", "/workers", ""): None,
    ("GET", "/dump", ""): None,
    ("GET", "/health", ""): None,
    ("GET", "/services", ""): None,  # the conductor's, a middleware's path
    ("GET", "/global_view", ""): None,
    ("GET", "/static-offline-docs/swagger-ui.css", ""): None,  # the docs' assets (a Mount)
}
POSTS = [k for k, limit in ROUTES.items() if limit is not None]
CTYPES = {"json": JSON, "msgpack": MSGPACK, "binary": {"Content-Type": "application/octet-stream"},
          "protobuf": PROTOBUF, "": {}}
# (a binary lookup's body is packed token ids: nothing nests)
DEEP = {"json": b"[" * 1000 + b"]" * 1000, "msgpack": b"\x91" * 1000 + b"\x90",
        "protobuf": b"\x0a\xff\xff\xff\xff\x0f" + b"\x0a\x05" * 1000}
DEEP_IN_FIELD = {"json": b'{"model_name": ' + b"[" * 1000 + b"]" * 1000 + b"}",
                 "msgpack": b"\x81\xa9modelname" + b"\x91" * 1000 + b"\x90"}


def build_app(store, conductor=None, dynamo=None):
    # no rate limits: every request here must reach the handler whose bounds it tests
    # (tests/security/test_rate_limits.py tests the limits)
    app = create_app(store, max_tokens=MAX_TOKENS, dynamo=dynamo or DynamoRegistry(),
                     conductor=conductor or ConductorRegistry(), lmcache_lookup=MODEL, rate_limits={})
    add_sglang_peer_route(app, {MODEL: SglangIndexer(store, MODEL)})
    return app


class LogWatch(logging.Handler):
    """Every record of every logger while the service runs (at INFO and above): none may carry a
    traceback, be an error, or hold a line that starts like one of the service's own (a forged one).
    Only those are kept (the 200-request test measures this process's memory)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.found: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info or record.levelno >= logging.ERROR or "Traceback" in text or any(
                line.startswith(FORGED) for line in text.splitlines()[1:]):
            self.found.append(f"{record.name} {record.levelname} {text[:300]}")

    def bad(self) -> list[str]:
        return self.found


@pytest.fixture(scope="module")
def service():
    store = seeded_store()
    app = build_app(store)
    watch = LogWatch()
    root = logging.getLogger()
    root.addHandler(watch)
    level = root.level
    root.setLevel(logging.INFO)
    quiet = {q: q.level for q in map(logging.getLogger, ("httpx", "httpcore"))}  # a line a request
    for q in quiet:
        q.setLevel(logging.WARNING)
    try:
        with ServerThread(app) as url, httpx.Client(base_url=url, timeout=60) as c:
            yield app, url, c, watch
    finally:
        root.removeHandler(watch)
        root.setLevel(level)
        for q, was in quiet.items():
            q.setLevel(was)


def lookup_answers(c: httpx.Client) -> list:
    out = []
    for n in (64, 160, 640):
        r = c.post("/v1/lookup", json={"model": MODEL, "token_ids": list(range(1000, 1000 + n))})
        assert r.status_code == 200, r.text[:300]
        out.append([(a["replica"], a["cached_tokens"]) for a in r.json()["replicas"]])
    assert any(out), "the seeded store answers something"
    return out


def send(c: httpx.Client, method: str, path: str, ctype: str, body: bytes) -> httpx.Response:
    return c.request(method, path, content=body, headers=CTYPES[ctype])


def test_every_route_is_listed(service):
    app, *_ = service
    served = set()
    for r in app.routes:
        if isinstance(r, Mount):
            served.add(("GET", r.path))
        else:
            served |= {(m, r.path) for m in r.methods if m != "HEAD"}
    listed = {(m, p.split("?")[0].replace(f"/{MODEL}/", "/{model}/")) for m, p, _ in ROUTES}
    docs = "/static-offline-docs"
    listed = {(m, docs) if p.startswith(docs) else (m, p) for m, p in listed}
    assert served - listed == set(), f"routes without an entry in ROUTES: {sorted(served - listed)}"
    assert {("GET", "/services"), ("GET", "/global_view")} <= listed  # ConductorPaths' own


@pytest.mark.parametrize("method,path,ctype", list(ROUTES), ids=lambda x: str(x))
def test_oversize_body(service, method, path, ctype):
    _app, _url, c, watch = service
    limit = ROUTES[(method, path, ctype)]
    size = (limit or MiB) + 4096
    r = send(c, method, path, ctype, b"1" * size)
    if limit is None:  # a route that takes no body: answered without it
        assert r.status_code < 500, r.text[:300]
    else:
        assert r.status_code == 413, (path, ctype, r.status_code, r.text[:300])
    assert watch.bad() == []


@pytest.mark.parametrize("method,path,ctype", [k for k in POSTS if k[2] in DEEP], ids=lambda x: str(x))
def test_deep_nesting(service, method, path, ctype):
    _app, _url, c, watch = service
    for body in (DEEP[ctype], DEEP_IN_FIELD.get(ctype)):
        if body is None:
            continue
        r = send(c, method, path, ctype, body)
        assert 400 <= r.status_code < 500, (path, ctype, r.status_code, r.text[:300])
        assert r.content, "a refusal says what is wrong"
    assert watch.bad() == []


def _answered_after(url: str, path: str, headers: dict[str, str], total: int,
                    content_length: bool) -> tuple[bytes, int]:
    """POST `total` bytes of body on a raw socket, 64 KiB at a time, until the server answers: (the
    answer's status line, the bytes of body sent by then)."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    head = [f"POST {path} HTTP/1.1", f"Host: {host}", "Connection: close"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    head.append(f"Content-Length: {total}" if content_length else "Transfer-Encoding: chunked")
    s.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
    chunk, sent = b"7" * 65536, 0
    try:
        while sent < total:
            if select.select([s], [], [], 0)[0]:
                break  # answered
            s.sendall(chunk if content_length else b"10000\r\n" + chunk + b"\r\n")
            sent += len(chunk)
        s.settimeout(30)
        status = s.recv(4096).split(b"\r\n", 1)[0]
    except (BrokenPipeError, ConnectionResetError):
        status = s.recv(4096).split(b"\r\n", 1)[0] if select.select([s], [], [], 5)[0] else b""
    finally:
        s.close()
    return status, sent


@pytest.mark.parametrize("content_length", [True, False], ids=["content-length", "chunked"])
@pytest.mark.parametrize("method,path,ctype", [
    ("POST", PEER, "protobuf"), ("POST", "/query", "json"), ("POST", "/register", "msgpack"),
    ("POST", "/v1/lookup", "json"), ("POST", "/lookup", "json")], ids=str)
def test_150_mb_body_refused_before_it_is_read_whole(service, method, path, ctype, content_length):
    _app, url, _c, watch = service
    status, sent = _answered_after(url, path, CTYPES[ctype], 150 * MiB, content_length)
    assert b" 413 " in status, (path, status, sent)
    assert sent <= ROUTES[(method, path, ctype)] + 16 * MiB, f"{sent} bytes were taken before the answer"
    assert watch.bad() == []


# ---- the issue's numbers ---------------------------------------------------------------------------
def _mp(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


def _conductor_reg(**kw) -> bytes:
    return _mp({"endpoint": "tcp://127.0.0.1:7", "type": "vLLM", "modelname": "llama", "instance_id": "a",
                "block_size": 32, "dp_rank": 0, "hash_profile": dict(PROFILE), **kw})


def _dynamo_reg(**kw) -> bytes:
    return msgspec.json.encode({"instance_id": 1, "endpoint": "tcp://127.0.0.1:7", "model_name": "llama",
                                "block_size": 32, **kw})


def _usage(**kw) -> bytes:
    return msgspec.json.encode({"request_id": "r", "model": MODEL, "replica": "r0", "prompt_tokens": 64,
                                "cached_tokens": 16, **kw})


NUMBERS = [
    ("conductor block_size 2^36", "/register", "msgpack", _conductor_reg(block_size=1 << 36), 422,
     "block_size"),
    ("conductor block_size 2^62", "/register", "msgpack", _conductor_reg(block_size=1 << 62), 422,
     "block_size"),
    ("conductor query block_size 2^36", "/query", "msgpack",
     _mp({"model": MODEL, "block_size": 1 << 36, "token_ids": list(range(64))}), 422, "block_size"),
    ("dynamo block_size 2^36", "/register", "json", _dynamo_reg(block_size=1 << 36), 422, "block_size"),
    ("dynamo block_size 2^62", "/register", "json", _dynamo_reg(block_size=1 << 62), 422, "block_size"),
    ("dynamo instance_id 2^64", "/register", "json", _dynamo_reg(instance_id=1 << 64), 422, "instance_id"),
    ("dynamo unregister instance_id 2^64", "/unregister", "json",
     msgspec.json.encode({"instance_id": 1 << 64, "model_name": "llama"}), 422, "instance_id"),
    ("dynamo dp_rank 2^40", "/register", "json", _dynamo_reg(dp_rank=1 << 40), 422, "dp_rank"),
    ("usage 2^64-1 prompt tokens", "/v1/usage", "json", _usage(prompt_tokens=(1 << 64) - 1), 422,
     "prompt_tokens"),
    ("usage 2^64-1 cached tokens", "/v1/usage", "json", _usage(cached_tokens=(1 << 64) - 1), 422,
     "cached_tokens"),
    ("route credited 2^64", "/v1/routes", "json",
     msgspec.json.encode({"request_id": "r", "model": MODEL, "replica": "r0", "token_ids": [1, 2],
                          "credited_tokens": 1 << 64}), 422, "credited_tokens"),
]


@pytest.mark.parametrize("what,path,ctype,body,status,field", NUMBERS, ids=[n[0] for n in NUMBERS])
def test_the_issues_numbers(service, what, path, ctype, body, status, field):
    _app, _url, c, watch = service
    r = send(c, "POST", path, ctype, body)
    text = str(msgspec.msgpack.decode(r.content)) if ctype == "msgpack" else r.text
    assert r.status_code == status and field in text, (what, r.status_code, text[:300])
    assert watch.bad() == []


@pytest.mark.parametrize("top_k", ["²", "１", "1e3", "-1", "99999999999999999999", "0x10"])
def test_top_k_not_an_ascii_number(service, top_k):
    _app, _url, c, watch = service
    r = c.post(f"/v1/lookup/binary?model={MODEL}&top_k={top_k}", content=bytes(64))
    assert r.status_code == 422 and "top_k" in r.json()["error"], r.text[:300]
    assert watch.bad() == []


# ---- log injection ---------------------------------------------------------------------------------
FORGED = "event=lookup_service_created forged=1"
INJECTIONS = [
    ("/register", "json", _dynamo_reg(model_name=f"m\n{FORGED}"), "model_name"),
    ("/register", "json", _dynamo_reg(endpoint=f"tcp://127.0.0.1:7\n{FORGED}"), "endpoint"),
    ("/register", "json", _dynamo_reg(routing_group=f"g\r{FORGED}"), "routing_group"),
    ("/register", "msgpack", _conductor_reg(modelname=f"m\n{FORGED}"), "modelname"),
    ("/register", "msgpack", _conductor_reg(instance_id=f"a\u2028{FORGED}"), "instance_id"),
    ("/register", "msgpack", _conductor_reg(endpoint="tcp://127.0.0.1:7\x1b[2K" + FORGED), "endpoint"),
    ("/v1/usage", "json", _usage(model=f"m\n{FORGED}"), "model"),
    ("/v1/usage", "json", _usage(replica=f"r\n{FORGED}"), "replica"),
    ("/v1/usage", "json", _usage(request_id="r" * 5000), "request_id"),
    ("/v1/routes", "json", msgspec.json.encode({"request_id": "r", "model": MODEL, "replica": f"x\n{FORGED}",
                                                "token_ids": [1]}), "replica"),
]


@pytest.mark.parametrize("path,ctype,body,field", INJECTIONS, ids=[f"{p}-{f}" for p, _, _, f in INJECTIONS])
def test_log_injection_refused(service, path, ctype, body, field):
    _app, _url, c, watch = service
    r = send(c, "POST", path, ctype, body)
    text = str(msgspec.msgpack.decode(r.content)) if ctype == "msgpack" else r.text
    assert 400 <= r.status_code < 500 and field in text, (r.status_code, text[:300])
    assert watch.bad() == []  # no error, and no line forged


# ---- gRPC ------------------------------------------------------------------------------------------
@pytest.fixture()
def grpc_service():
    store = seeded_store()
    release = threading.Event()
    entered = []

    def publish(batch):  # blocks until released: calls stay in flight
        entered.append(batch.replica)
        release.wait(60)
        return store.apply(batch)

    indexer = SglangIndexer(store, MODEL, publish)
    server, port = start_server(indexer, "127.0.0.1:0", workers=4)
    client = SglangClient(port)
    try:
        yield client, release, entered
    finally:
        release.set()
        client.channel.close()
        server.stop(0)


METHODS = ["ApplyExternalKvBatch", "MatchExternalKv", "MatchExternalKvPrefix", "GetExternalKvHitCounts"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("raw", [b"\xff\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x0a\x05" * 1000,
                                 b"\x12\x05\x08\x01"], ids=["garbage", "huge-length", "deep", "truncated"])
def test_garbage_protobuf_is_invalid_argument(grpc_service, method, raw):
    client, release, _ = grpc_service
    release.set()
    rpc = client.channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=lambda b: b,
                                     response_deserializer=lambda b: b)
    try:
        rpc(raw, timeout=10)
    except grpc.RpcError as e:
        assert e.code() is grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
    # (a message that happens to parse is answered: then no error at all)


def test_concurrent_rpcs_capped(grpc_service):
    client, release, entered = grpc_service
    extra = 6
    rpc = client.channel.unary_unary(f"/{SERVICE}/ApplyExternalKvBatch",
                                     request_serializer=lambda m: m.SerializeToString(),
                                     response_deserializer=pb.ApplyExternalKvBatchResponse.FromString)
    calls = [rpc.future(pb.ApplyExternalKvBatchRequest(
        worker_id=f"w{i}", worker_address="http://10.0.0.1:1",
        actions=[sglang_action(pb.ACTION_REPORT, pb.TIER_HBM, [str(i + 1)])]), timeout=120)
        for i in range(MAX_CONCURRENT_RPCS + extra)]
    # the calls past the cap are refused at once; the others stay in flight until released
    wait_for(lambda: sum(f.done() for f in calls) >= extra, what="the refused calls")
    refused = [f for f in calls if f.done()]
    assert all(f.code() is grpc.StatusCode.RESOURCE_EXHAUSTED for f in refused), [f.code() for f in refused]
    release.set()
    wait_for(lambda: all(f.done() for f in calls), what="every call answered")
    codes = [f.code() for f in calls]
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == extra, codes
    assert codes.count(grpc.StatusCode.OK) == MAX_CONCURRENT_RPCS and len(entered) == MAX_CONCURRENT_RPCS


# ---- 200 hostile requests: RSS and the lookups --------------------------------------------------------
def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def hostile(i: int):
    """Request i of a round: each POST route in turn, deep (where anything nests), oversize with a
    Content-Length, oversize streamed (chunked: read until the limit)."""
    method, path, ctype = POSTS[i % len(POSTS)]
    kind = i // len(POSTS) % 3
    if kind == 0 and ctype in DEEP:
        return method, path, ctype, DEEP[ctype]
    size = ROUTES[(method, path, ctype)] + 4096
    if kind == 1:
        return method, path, ctype, b"1" * size
    return method, path, ctype, (b"1" * 65536 for _ in range(size // 65536 + 1))


def test_200_oversize_or_deep_requests_keep_rss_and_lookups(service):
    _app, _url, c, watch = service
    before_answers = lookup_answers(c)
    for i in range(200):  # a first round: what the allocator keeps once (its heap's high-water mark)
        send(c, *hostile(i))
    gc.collect()
    before = rss_bytes()
    metrics_before = len(c.get("/metrics").content)
    for i in range(200):
        r = send(c, *hostile(i))
        assert 400 <= r.status_code < 500, (hostile(i)[:3], r.status_code)
    gc.collect()
    after = rss_bytes()
    print(f"RSS before {before / MiB:.1f} MiB, after 200 oversize/deep requests {after / MiB:.1f} MiB "
          f"({(after - before) / before * 100:+.1f} %)")
    assert after <= before * 1.10, (before, after)
    assert lookup_answers(c) == before_answers
    # no series per request: only the counters' values moved (a digit or so each)
    assert len(c.get("/metrics").content) <= metrics_before + 2048
    assert watch.bad() == []


# ---- property-based: the schemas that are not in /openapi.json -----------------------------------------
_scalars = (st.none() | st.booleans() | st.integers(min_value=-(1 << 70), max_value=1 << 70)
            | st.floats(allow_nan=False) | st.text(max_size=40))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
_names = st.sampled_from(["llama", MODEL, "m\nevent=x", "x" * 300, "", "tcp://127.0.0.1:9", "tcp://8.8.8.8:1"])
_numbers = st.sampled_from([0, 1, 16, 32, -1, 1 << 16, 1 << 36, 1 << 62, (1 << 64) - 1, 1 << 64])


def _fields(names: list[str]):
    """Bodies with the schema's own field names, values typed right or wrong."""
    return st.fixed_dictionaries({}, optional={n: st.one_of(_names, _numbers, _values) for n in names})


DYNAMO_FIELDS = ["instance_id", "endpoint", "model_name", "block_size", "routing_group", "tenant_id",
                 "dp_rank", "replay_endpoint", "token_ids", "block_hashes", "lora_name", "cache_salt"]
CONDUCTOR_FIELDS = ["endpoint", "type", "modelname", "model", "instance_id", "block_size", "dp_rank",
                    "hash_profile", "replay_endpoint", "lora_name", "tenant_id", "cache_group", "token_ids",
                    "cache_salt"]


@pytest.fixture(scope="module")
def fuzz_service():
    store = seeded_store()
    with ServerThread(build_app(store)) as url, httpx.Client(base_url=url, timeout=30) as c:
        yield c


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz_dynamo_and_conductor_schemas(fuzz_service, data):
    c = fuzz_service
    path = data.draw(st.sampled_from(["/register", "/unregister", "/query", "/query_by_hash"]))
    if data.draw(st.booleans()) and path != "/query_by_hash":
        try:
            body = _mp(data.draw(st.one_of(_fields(CONDUCTOR_FIELDS), _values)))
        except OverflowError:  # msgpack has no integer beyond 64 bits: no such request exists
            assume(False)
        r = c.post(path, content=body, headers=MSGPACK)
        assert r.status_code < 500, (path, body[:200], r.content[:300])
        if r.status_code >= 400:
            assert isinstance(msgspec.msgpack.decode(r.content).get("error"), str)
    else:
        body = msgspec.json.encode(data.draw(st.one_of(_fields(DYNAMO_FIELDS), _values)))
        r = c.post(path, content=body, headers=JSON)
        assert r.status_code < 500, (path, body[:200], r.text[:300])
        if r.status_code >= 400:
            assert r.text


_actions = st.lists(st.builds(pb.ExternalKvAction, type=st.integers(0, 5), tier=st.integers(0, 5),
                              hashes=st.lists(st.text(max_size=24), max_size=6)), max_size=6)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(method=st.sampled_from(METHODS), raw=st.binary(max_size=200), structured=st.booleans(),
       worker=st.text(max_size=30),
       address=st.sampled_from(["", "http://10.0.0.1:1", "http://8.8.8.8:1", "x"]),
       actions=_actions, hashes=st.lists(st.text(max_size=24), max_size=8))
def test_fuzz_sglang_protobuf(grpc_service, method, raw, structured, worker, address, actions, hashes):
    client, release, _ = grpc_service
    release.set()
    if structured:
        message = {"ApplyExternalKvBatch": pb.ApplyExternalKvBatchRequest(
                       worker_id=worker, worker_address=address, actions=actions),
                   "MatchExternalKv": pb.MatchExternalKvRequest(hashes=hashes),
                   "MatchExternalKvPrefix": pb.MatchExternalKvPrefixRequest(hashes=hashes),
                   "GetExternalKvHitCounts": pb.GetExternalKvHitCountsRequest(hashes=hashes)}[method]
        raw = message.SerializeToString()
    rpc = client.channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=lambda b: b,
                                     response_deserializer=lambda b: b)
    try:
        rpc(raw, timeout=10)
    except grpc.RpcError as e:
        assert e.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (method, raw[:80],
                                                                                      e.details())


# ---- created objects: bounded ------------------------------------------------------------------------
def test_registrations_workers_and_models_are_bounded(monkeypatch):
    """Every registration costs a relay thread and may bring a model (and its metrics): capped, 409 naming
    the cap; a feed's workers likewise (RESOURCE_EXHAUSTED). The threads go with their unregistration
    (tests/security/test_hijack.py::test_one_registration_per_endpoint_across_both_apis)."""
    from index_service import sglang_indexer
    from index_service.conductor_api import Invalid
    from index_service.dynamo_api import RegisterRequest

    store = seeded_store()
    dynamo = DynamoRegistry(store=store, max_registrations=2, max_models=len(store.shards) + 1)
    assert dynamo.register(RegisterRequest(1, "tcp://127.0.0.1:1", "new-model", 16))[0] == 201
    status, body = dynamo.register(RegisterRequest(2, "tcp://127.0.0.1:2", "another-model", 16))
    assert status == 409 and "model_name" in body["error"], body  # the index may hold one model more only
    assert dynamo.register(RegisterRequest(2, "tcp://127.0.0.1:2", "new-model", 16))[0] == 201
    status, body = dynamo.register(RegisterRequest(3, "tcp://127.0.0.1:3", "new-model", 16))
    assert status == 409 and "at most 2 registrations" in body["error"], body
    conductor = ConductorRegistry(store=store, max_registrations=1)
    assert conductor.register(_conductor_reg(endpoint="tcp://127.0.0.1:4", modelname=MODEL))[0] == 200
    with pytest.raises(Invalid) as e:
        conductor.register(_conductor_reg(endpoint="tcp://127.0.0.1:5", modelname=MODEL, instance_id="b"))
    assert e.value.status == 409 and "at most 1 registrations" in e.value.body["error"]

    monkeypatch.setattr(sglang_indexer, "MAX_WORKERS", 3)
    indexer = SglangIndexer(store, MODEL, store.apply)
    for i in range(3):
        indexer.apply(pb.ApplyExternalKvBatchRequest(worker_id=f"w{i}", worker_address="http://10.0.0.1:1"))
    with pytest.raises(sglang_indexer.Refused) as e:
        indexer.apply(pb.ApplyExternalKvBatchRequest(worker_id="w3", worker_address="http://10.0.0.1:1"))
    assert e.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "worker_id" in str(e.value)
    indexer.apply(pb.ApplyExternalKvBatchRequest(worker_id="w1", worker_address="http://10.0.0.1:1"))  # known


def test_conductor_query_model_name_checked(service):
    _app, _url, c, watch = service
    body = _mp({"model": f"m\n{FORGED}", "block_size": 16, "token_ids": [1]})
    r = send(c, "POST", "/query", "msgpack", body)
    assert r.status_code == 400 and msgspec.msgpack.decode(r.content)["field"] == "model"
    assert watch.bad() == []
