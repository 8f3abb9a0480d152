"""The service's HTTP/1.1 protocol (index_service/http_protocol.py) over raw sockets: the lookups it
answers in the parser's callbacks get the same answers and errors as uvicorn's ASGI path, and the
connection behaves as uvicorn's does (keep-alive and its timeout, Connection: close, HTTP/1.0,
pipelining in order, Expect: 100-continue, chunked and oversized bodies, the bearer token)."""

from __future__ import annotations

import gc
import json
import socket

import httpx
import msgspec
import pytest

from index_service.app import create_app
from index_service.http_protocol import LookupProtocol, http_protocol
from tests.helpers import SEEDED_MODEL as MODEL
from tests.helpers import ServerThread, seeded_store

TOKENS = list(range(1000, 1000 + 10 * 16))
JSON_BODY = msgspec.json.encode({"model": MODEL, "token_ids": TOKENS})
PACKED = b"".join(t.to_bytes(4, "little") for t in TOKENS)


@pytest.fixture
def taken(monkeypatch):
    """How many requests LookupProtocol answered itself."""
    calls = []
    answer = LookupProtocol._answer

    def counted(self, handler, request):
        calls.append(self.scope["path"])
        return answer(self, handler, request)

    monkeypatch.setattr(LookupProtocol, "_answer", counted)
    return calls


def post(path: str, body: bytes, *headers: str, version: str = "1.1") -> bytes:
    head = [f"POST {path} HTTP/{version}", "Host: x", *headers]
    if not any(h.lower().startswith(("content-length", "transfer-encoding")) for h in headers):
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def read_responses(sock: socket.socket, n: int, timeout: float = 10) -> list[tuple[int, dict, bytes]]:
    """n HTTP responses (status, headers, body) off the socket; fewer if it closes."""
    sock.settimeout(timeout)
    buf, out = b"", []
    while len(out) < n:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                return out
            buf += chunk
        head, buf = buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        if status == 100:
            continue
        size = int(headers.get("content-length", 0))
        while len(buf) < size:
            chunk = sock.recv(65536)
            if not chunk:
                return out
            buf += chunk
        out.append((status, headers, buf[:size]))
        buf = buf[size:]
    return out


def credit(body: bytes) -> list:
    return [(r["replica"], r["cached_tokens"], r["resumable_tokens"], r["tiers"],
             r["price"]["prefill_tokens"]) for r in json.loads(body)["replicas"]]


def closed(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except (TimeoutError, ConnectionResetError):
        return False


@pytest.fixture
def served():
    app = create_app(seeded_store(), max_tokens=4096)
    with ServerThread(app, timeout_keep_alive=1) as url:
        yield app, int(url.rsplit(":", 1)[1])


def chunked(body: bytes, size: int = 50) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size])
                    for i in range(0, len(body), size)) + b"0\r\n\r\n"


def test_answers_and_errors_match_uvicorns_path(served, taken):
    """Each request twice: with a Content-Length (answered in the protocol) and chunked (uvicorn's
    path, then LookupApp's ASGI hot path)."""
    _, port = served
    cases = [("/v1/lookup", JSON_BODY), ("/v1/rank", JSON_BODY), (f"/v1/lookup/binary?model={MODEL}", PACKED),
             ("/v1/lookup", b'{"model": "nope", "token_ids": [1]}'), ("/v1/lookup", b"{"),
             ("/v1/lookup/binary?model=x&what=1", PACKED), ("/v1/lookup/binary", b"\x01\x02")]
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for path, body in cases:
            json_type = "Content-Type: application/json"
            sock.sendall(post(path, body, json_type))
            (status, headers, got), = read_responses(sock, 1)
            sock.sendall(post(path, chunked(body), json_type, "Transfer-Encoding: chunked"))
            (want_status, want_headers, want), = read_responses(sock, 1)
            assert status == want_status, (path, got)
            assert headers.keys() == want_headers.keys()
            assert headers["content-type"] == want_headers["content-type"]
            assert {"date", "server", "content-length"} <= set(headers)
            if status == 200:
                assert credit(got) == credit(want) and credit(got)
                assert json.loads(got).keys() == json.loads(want).keys()
            else:
                assert got == want and json.loads(got)["error"]
    assert len(taken) == len(cases)  # the first of each pair


def test_keep_alive_pipelining_and_close(served, taken):
    _, port = served
    health = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port)) as sock:
        # four requests in one write: answers in request order; the two behind the one uvicorn's
        # path answers wait for it there
        lookups = post("/v1/lookup", JSON_BODY) + post(f"/v1/lookup/binary?model={MODEL}", PACKED)
        sock.sendall(lookups + health + lookups)
        answers = read_responses(sock, 5)
        assert [s for s, _, _ in answers] == [200] * 5 and json.loads(answers[2][2])["status"] == "ok"
        assert len({str(credit(body)) for i, (_, _, body) in enumerate(answers) if i != 2}) == 1
        assert len(taken) == 2
        # still open: keep-alive
        sock.sendall(post("/v1/lookup", JSON_BODY, "Connection: close"))
        (status, headers, _), = read_responses(sock, 1)
        assert status == 200 and headers["connection"] == "close" and closed(sock, 5)
    with socket.create_connection(("127.0.0.1", port)) as sock:  # HTTP/1.0: one answer, then closed
        sock.sendall(post("/v1/lookup", JSON_BODY, version="1.0"))
        (status, headers, _), = read_responses(sock, 1)
        assert status == 200 and headers["connection"] == "close" and closed(sock, 5)
    with socket.create_connection(("127.0.0.1", port)) as sock:  # the keep-alive timeout (1 s here)
        sock.sendall(post("/v1/lookup", JSON_BODY))
        assert read_responses(sock, 1)[0][0] == 200
        assert closed(sock, 30)  # the server closes an idle connection (30 s: a bound, not a speed)
    assert len(taken) == 5


def test_what_uvicorns_path_takes(served, taken):
    _, port = served
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(post("/v1/lookup", b"", "Expect: 100-continue", f"Content-Length: {len(JSON_BODY)}"))
        sock.settimeout(10)
        assert sock.recv(100).startswith(b"HTTP/1.1 100")
        sock.sendall(JSON_BODY)
        (status, _, expect), = read_responses(sock, 1)
        sock.sendall(post("/v1/lookup", chunked(JSON_BODY), "Transfer-Encoding: chunked"))
        (status2, _, streamed), = read_responses(sock, 1)
        assert status == status2 == 200 and credit(expect) == credit(streamed) and credit(expect)
        sock.sendall(post("/v1/lookup", b"", "Content-Length: 99999999"))  # over max_tokens' limit
        (status, _, body), = read_responses(sock, 1)
        assert status == 413 and "too large" in json.loads(body)["error"]
    assert taken == []


def test_bearer_token_is_checked_in_the_protocol(taken):
    app = create_app(seeded_store(), auth_token="s3cret")
    with ServerThread(app) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            tokens = ([], ["Authorization: Bearer s3cret"], ["Authorization: Bearer no"])
            sock.sendall(b"".join(post("/v1/lookup", JSON_BODY, *t) for t in tokens))
            statuses = [s for s, _, _ in read_responses(sock, 3)]
    assert statuses == [401, 200, 401] and len(taken) == 3


def test_split_groups_leave_lookups_to_uvicorns_path(taken):
    app = create_app(seeded_store(), fanout=object())  # a Fanout: lookups may wait for other instances
    assert http_protocol(app) != "auto" and not app.hot.synchronous
    with ServerThread(app) as url:
        r = httpx.post(f"{url}/v1/lookup", content=JSON_BODY)
    assert r.status_code == 200 and credit(r.content) and taken == []


def test_lookups_leave_no_garbage_cycles(served):
    """Every object a lookup makes is freed by its reference count: cycles would be left to the
    collector, whose full collections stall the event loop for tens of ms (the p99 at 2,000/s)."""
    _, port = served
    requests = (post("/v1/lookup", JSON_BODY), post("/v1/rank", JSON_BODY), post("/v1/lookup", b"{"),
                post(f"/v1/lookup/binary?model={MODEL}", PACKED), post("/v1/lookup/binary", PACKED))
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for request in requests:  # warm: first-use caches are not garbage
            sock.sendall(request)
            read_responses(sock, 1)
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(20):
                for request in requests:
                    sock.sendall(request)
                    assert read_responses(sock, 1)[0][0] in (200, 400, 422)
            gc.collect()
            garbage = [type(o).__name__ for o in gc.garbage]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    assert garbage == []


def test_dynamos_queries_are_taken_and_the_conductors_msgpack_query_is_not(taken):
    """Dynamo's POST /query and /query_by_hash are answered in the protocol, as on uvicorn's path; a
    msgpack /query is Mooncake conductor's (its middleware), never taken here."""
    from index_service.conductor_api import ConductorRegistry
    from index_service.dynamo_api import DynamoRegistry
    from relays.managed import vllm_relay_starter
    from relays.sinks import StoreSink

    store = seeded_store()
    starter = vllm_relay_starter(StoreSink(store), lambda model: 16)
    dynamo, conductor = DynamoRegistry(starter), ConductorRegistry(starter)
    app = create_app(store, dynamo=dynamo, conductor=conductor, max_tokens=4096)
    cases = [("/query", msgspec.json.encode({"token_ids": TOKENS, "model_name": MODEL})),
             ("/query_by_hash", msgspec.json.encode({"block_hashes": [1, -2, 3], "model_name": MODEL})),
             ("/query", b'{"token_ids": [1]}'), ("/query", b"{")]
    try:
        with ServerThread(app) as url:
            port = int(url.rsplit(":", 1)[1])
            register = {"instance_id": 1, "endpoint": "tcp://127.0.0.1:9", "model_name": MODEL,
                        "block_size": 16}
            assert httpx.post(f"{url}/register", json=register).status_code == 201
            with socket.create_connection(("127.0.0.1", port)) as sock:
                for path, body in cases:
                    sock.sendall(post(path, body, "Content-Type: application/json"))
                    (status, _, got), = read_responses(sock, 1)
                    sock.sendall(post(path, chunked(body), "Content-Type: application/json",
                                      "Transfer-Encoding: chunked"))
                    (want_status, _, want), = read_responses(sock, 1)
                    assert (status, got) == (want_status, want), path
                assert taken == [p for p, _ in cases]  # the first of each pair
                msgpack_query = {"model": MODEL, "block_size": 16, "token_ids": TOKENS}
                sock.sendall(post("/query", msgspec.msgpack.encode(msgpack_query),
                                  "Content-Type: application/msgpack"))
                (status, headers, got), = read_responses(sock, 1)
                assert status == 200 and headers["content-type"] == "application/msgpack"
                assert "instances" in msgspec.msgpack.decode(got)
                assert len(taken) == len(cases)  # the conductor's was left to its middleware
    finally:
        dynamo.stop_all()
        conductor.stop_all()
