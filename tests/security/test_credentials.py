"""The credentials file (index_service.auth): its format and the one-line errors of a bad one, the old
single token granting every scope, rotation without a restart (a rewritten file and a Kubernetes Secret's
symlink swap) over real HTTP and gRPC, the routers' lookups refused inside the HTTP protocol, the fan-out's
own token, and what the service says at start-up and on /healthz."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import grpc
import httpx
import pytest

from index_service.app import create_app
from index_service.auth import (
    ADMIN,
    READ,
    WRITE,
    Credentials,
    CredentialsError,
    log_auth_state,
    parse_credentials,
)
from index_service.fanout import Fanout, PeerDirectory
from index_service.http_protocol import LookupProtocol
from index_service.sglang_indexer import SglangIndexer, start_server
from index_service.sglang_pb import kv_indexer_pb2 as pb
from index_service.store import ShardStore
from kvidx.config import Config, ModelConfig
from tests.helpers import SEEDED_MODEL, ServerThread, SglangClient, random_fleet, seeded_store, wait_for

OLD, NEW = "old-router-token-0123456789", "new-router-token-9876543210"
OPS = "ops-token-abcdefghijklmnopqr"
LOOKUP = {"model": SEEDED_MODEL, "token_ids": list(range(1000, 1064))}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# ---- the format ----

def test_named_tokens_with_scopes_and_comments():
    entries = parse_credentials(f"""
        # name scopes token
        router  read         {OLD}
        ops     all          {OPS}
        feeder  write,read   {NEW}
    """)
    assert [(e.name, sorted(e.scopes)) for e in entries] == [
        ("router", [READ]), ("ops", [ADMIN, READ, WRITE]), ("feeder", [READ, WRITE])]


@pytest.mark.parametrize("text, error", [
    ("", "no token in it"),
    ("# only a comment\n", "no token in it"),
    (f"router read\nops admin {OPS}\n", "line 1: expected `name scope[,scope] token`, got 2 words"),
    (f"router reed {OLD}\n", "line 1: unknown scope 'reed'"),
    (f"router read,,admin {OLD}\n", "line 1: unknown scope ''"),
    ("router read short\n", "line 1: the token of 'router' must be at least 16"),
    (f"rou\x1bter read {OLD}\n", "line 1: name"),
    (f"router read {OLD}\nrouter admin {OPS}\n", "line 2: name 'router' is given twice"),
    (f"router read {OLD}\nops admin {OLD}\n", "line 2: the token of 'ops' is another entry's too"),
])
def test_a_bad_file_is_one_line_naming_the_line(text, error):
    with pytest.raises(CredentialsError) as e:
        parse_credentials(text, "creds")
    assert error in str(e.value) and "\n" not in str(e.value) and OLD not in str(e.value)


def test_a_missing_file_is_one_line():
    with pytest.raises(CredentialsError, match="/nonexistent/creds: No such file"):
        Credentials.from_file("/nonexistent/creds")


def test_one_bare_token_grants_every_scope(tmp_path):
    path = tmp_path / "token"
    path.write_text("s3cret\n")  # today's --auth-token-file
    creds = Credentials.from_file(str(path))
    for scope in (READ, WRITE, ADMIN):
        assert creds.refusal(b"Bearer s3cret", scope, "x") is None
    assert creds.refusal(b"Bearer s3cre", READ, "x").status == 401
    assert creds.peer_token() == "s3cret"  # the fan-out sends it as it is


def test_scopes_are_checked_per_token():
    creds = Credentials(parse_credentials(f"router read {OLD}\nops admin,write {OPS}\n"))
    assert creds.refusal(f"Bearer {OLD}", READ, "POST /v1/lookup") is None
    refused = creds.refusal(f"Bearer {OLD}", ADMIN, "POST /register")
    assert refused.status == 403
    assert refused.error == "token 'router' lacks scope 'admin', which POST /register needs"
    assert creds.refusal(f"Bearer {OPS}", READ, "x").status == 403
    for header in (None, b"", f"Bearer {OLD} ", f"bearer {OLD}", OLD, f"Bearer {OLD[:-1]}", "Bearer "):
        assert creds.refusal(header, READ, "x").status == 401, header
    assert creds.peer_token() is None  # no entry named peer


# ---- rotation ----

class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _replace(path: Path, text: str) -> None:
    """Write a new file over `path` at once (what an editor or a config tool does)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_the_file_is_read_again_at_most_once_a_second(tmp_path, caplog):
    path = tmp_path / "creds"
    path.write_text(f"router read {OLD}\n")
    clock = Clock()
    creds = Credentials.from_file(str(path), clock=clock)
    _replace(path, f"router read {NEW}\n")
    clock.now += 0.5
    assert creds.refusal(f"Bearer {OLD}", READ, "x") is None  # not looked at yet
    clock.now += 0.6
    assert creds.refusal(f"Bearer {OLD}", READ, "x").status == 401
    assert creds.refusal(f"Bearer {NEW}", READ, "x") is None
    # a file that does not parse: refused with one line, the tokens in force stay
    with caplog.at_level(logging.INFO, logger="kvidx.service"):
        _replace(path, f"router read {OLD}\nbroken line\n")
        clock.now += 1.1
        assert creds.refusal(f"Bearer {NEW}", READ, "x") is None
    lines = [r.getMessage() for r in caplog.records if "credentials_reload_failed" in r.getMessage()]
    assert len(lines) == 1 and "line 2" in lines[0] and "kept=router" in lines[0]
    assert OLD not in lines[0] and NEW not in lines[0]  # names are logged, never tokens
    # gone (mid-swap): the tokens in force stay; back: read again
    path.unlink()
    clock.now += 1.1
    assert creds.refusal(f"Bearer {NEW}", READ, "x") is None
    path.write_text(f"router read {OLD}\n")
    clock.now += 1.1
    assert creds.refusal(f"Bearer {OLD}", READ, "x") is None


def _secret_dir(root: Path, version: int, text: str) -> None:
    """A Kubernetes Secret volume: root/credentials -> ..data/credentials, ..data -> ..<version>; an update
    writes a new ..<version> directory and swaps the ..data symlink at once (atomic rename)."""
    (root / f"..{version}").mkdir()
    (root / f"..{version}" / "credentials").write_text(text)
    (root / "..data_tmp").symlink_to(f"..{version}")
    os.replace(root / "..data_tmp", root / "..data")
    if not (root / "credentials").is_symlink():
        (root / "credentials").symlink_to("..data/credentials")


@pytest.mark.parametrize("swap", ["rewrite", "secret"])
def test_rotation_without_a_restart_over_http_and_grpc(tmp_path, swap):
    """The old token refused and the new one taken on a route behind the middleware, on the routers'
    lookup (answered inside the HTTP protocol) and on SGLang's gRPC API, without restarting anything."""
    first, second = f"router read {OLD}\nops admin {OPS}\n", f"router read {NEW}\nops admin {OPS}\n"
    if swap == "secret":
        _secret_dir(tmp_path, 1, first)
        path = tmp_path / "credentials"
    else:
        path = tmp_path / "creds"
        path.write_text(first)
    creds = Credentials.from_file(str(path))
    store = seeded_store()
    indexer = SglangIndexer(store, SEEDED_MODEL, store.apply)
    server, port = start_server(indexer, "127.0.0.1:0", workers=2, credentials=creds)
    rpc = SglangClient(port).channel.unary_unary(
        "/kv_indexer.v1.KVIndexer/MatchExternalKv", request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=pb.MatchExternalKvResponse.FromString)

    def grpc_code(token: str) -> grpc.StatusCode:
        try:
            rpc(pb.MatchExternalKvRequest(hashes=["1"]), metadata=[("authorization", f"Bearer {token}")],
                timeout=10)
        except grpc.RpcError as e:
            return e.code()
        return grpc.StatusCode.OK

    try:
        with ServerThread(create_app(store, credentials=creds)) as url, httpx.Client(base_url=url) as c:
            def statuses(token: str) -> tuple:
                return (c.get("/v1/models", headers=bearer(token)).status_code,
                        c.post("/v1/lookup", json=LOOKUP, headers=bearer(token)).status_code,
                        grpc_code(token))

            ok = (200, 200, grpc.StatusCode.OK)
            refused = (401, 401, grpc.StatusCode.UNAUTHENTICATED)
            assert statuses(OLD) == ok and statuses(NEW) == refused
            if swap == "secret":
                _secret_dir(tmp_path, 2, second)
            else:
                _replace(path, second)
            wait_for(lambda: statuses(NEW) == ok, timeout=30, what="the new token taken")
            assert statuses(OLD) == refused
            assert c.get("/dump", headers=bearer(OPS)).status_code == 404  # no Dynamo API on this app
    finally:
        server.stop(0)


# ---- the routers' lookups, inside the HTTP protocol ----

def test_lookup_scopes_are_checked_in_the_http_protocol(monkeypatch):
    """POST /v1/lookup with a Content-Length is answered by LookupProtocol itself (before the app): it
    must refuse as the app does. Counted to be sure the protocol took them."""
    taken = []
    answer = LookupProtocol._answer

    def counted(self, handler, request):
        taken.append(self.scope["path"])
        return answer(self, handler, request)

    monkeypatch.setattr(LookupProtocol, "_answer", counted)
    creds = Credentials(parse_credentials(f"router read {OLD}\nbridge write {NEW}\n"))
    body = httpx.Request("POST", "http://x", json=LOOKUP).read()
    with ServerThread(create_app(seeded_store(), credentials=creds)) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            for headers in ("", f"Authorization: Bearer {NEW}\r\n", f"Authorization: Bearer {OLD}\r\n",
                            "Authorization: Bearer nope\r\n"):
                sock.sendall(b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n%s"
                             % (len(body), headers.encode(), body))
            statuses = _statuses(sock, 4)
    assert statuses == [401, 403, 200, 401] and taken == ["/v1/lookup"] * 4


def _statuses(sock: socket.socket, n: int) -> list[int]:
    sock.settimeout(10)
    buf, out = b"", []
    while len(out) < n:
        while b"\r\n\r\n" not in buf:
            buf += sock.recv(65536)
        head, buf = buf.split(b"\r\n\r\n", 1)
        length = next(int(ln.split(b":")[1]) for ln in head.split(b"\r\n")
                      if ln.lower().startswith(b"content-length"))
        while len(buf) < length:
            buf += sock.recv(65536)
        buf = buf[length:]
        out.append(int(head.split(b" ", 2)[1]))
    return out


# ---- instances authenticate each other ----

def test_the_fanout_sends_its_own_token_and_needs_its_scope(tmp_path):
    """Instance a holds groups 0, 1 and asks b for 2, 3 with the token of its `peer` entry (read again
    per request): b refuses a peer entry of scope write (a's answer is partial) and answers one of read."""
    config = Config(models={"m": ModelConfig(replica_groups=4)})
    stores = {"a": ShardStore(16, config=config, groups=frozenset({0, 1})),
              "b": ShardStore(16, config=config, groups=frozenset({2, 3}))}
    batches, docs = random_fleet(40, seed=5, groups=4)
    for batch in batches:
        for store in stores.values():
            store.apply(batch, 2.0)
    for store in stores.values():
        store.ready = True
    body = {"model": "m", "block_hashes": docs[2], "prompt_tokens": len(docs[2]) * 16 + 1}
    for scope, partial in (("write", True), ("read", False)):
        path = tmp_path / f"creds-{scope}"
        path.write_text(f"router read {OLD}\npeer {scope} {NEW}\n")
        creds = Credentials.from_file(str(path))
        with ServerThread(create_app(stores["b"], credentials=creds)) as b:
            directory = PeerDirectory("a")
            directory.add_static(b, frozenset({2, 3}))
            fanout = Fanout(directory, timeout_s=5.0, auth_token=creds.peer_token)
            with ServerThread(create_app(stores["a"], credentials=creds, fanout=fanout)) as a:
                got = httpx.post(f"{a}/v1/lookup", json=body, headers=bearer(OLD))
                assert got.status_code == 200, got.text
                assert bool(got.json().get("partial")) is partial, (scope, got.text)


# ---- what the service says ----

def test_start_up_says_loudly_when_every_api_is_open(caplog):
    with caplog.at_level(logging.INFO, logger="kvidx.service"):
        log_auth_state(None, ["kvidx", "dynamo", "sglang-grpc"])
        log_auth_state(Credentials(parse_credentials(f"router read {OLD}\n")), ["kvidx"])
    (open_line, on_line) = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert open_line[0] == logging.WARNING
    assert open_line[1].startswith("event=auth_disabled apis=kvidx,dynamo,sglang-grpc ")
    assert on_line[0] == logging.INFO and "event=auth_enabled" in on_line[1] and "names=router" in on_line[1]
    assert OLD not in on_line[1]


def test_healthz_says_whether_auth_is_on():
    store = seeded_store()
    with ServerThread(create_app(store)) as url:
        assert httpx.get(f"{url}/healthz").json()["auth"] == "off"
    with ServerThread(create_app(store, auth_token="s3cret")) as url:
        r = httpx.get(f"{url}/healthz")  # open without a token, like /metrics
        assert r.status_code == 200 and r.json()["auth"] == "on"
        assert httpx.get(f"{url}/metrics").status_code == 200


def test_an_ops_port_serves_probes_open_and_the_api_port_asks_a_token():
    """`kvidx serve --ops-port`: /healthz and /metrics open on their own port (served in the API's
    event loop, started and stopped with it), and behind the token on the API's."""
    import uvicorn

    from index_service.http_protocol import serve_beside
    from index_service.status_routes import ops_app

    store = seeded_store()
    app = create_app(store, credentials=Credentials(parse_credentials(f"router read {OLD}\n")),
                     probes_open=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        ops_port = s.getsockname()[1]
    serve_beside(app, uvicorn.Server(uvicorn.Config(ops_app(app), host="127.0.0.1", port=ops_port,
                                                    lifespan="off", log_level="warning")))
    ops = f"http://127.0.0.1:{ops_port}"
    with ServerThread(app) as url:
        wait_for(lambda: _answers(f"{ops}/healthz"), timeout=30, what="the ops port")
        health = httpx.get(f"{ops}/healthz")
        assert health.status_code == 200 and health.json()["auth"] == "on"
        assert b"kvidx_ready 1.0" in httpx.get(f"{ops}/metrics").content
        missing = httpx.get(f"{ops}/v1/models")  # nothing else there
        assert missing.status_code == 404 and "error" in missing.json()
        for path in ("/healthz", "/metrics"):
            assert httpx.get(f"{url}{path}").status_code == 401
            assert httpx.get(f"{url}{path}", headers=bearer(OLD)).status_code == 200
    assert not _answers(f"{ops}/healthz")  # stopped with the API


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_peer_token_needs_its_scopes():
    creds = Credentials(parse_credentials(f"router read {OLD}\npeer read {NEW}\n"))
    assert creds.peer_lacks([READ]) == [] and creds.peer_lacks([READ, ADMIN]) == [ADMIN]
    assert Credentials(parse_credentials(f"router read {OLD}\n")).peer_lacks([READ]) == [READ]
    assert Credentials.from_token("s3cret").peer_lacks([READ, ADMIN]) == []


@pytest.mark.parametrize("text, says", [
    (f"router read {OLD}\n", "needs a token of its own with scope read: give the entry named 'peer'"),
    (f"router read {OLD}\npeer write {NEW}\n", "with scope read:"),
    (f"router read {OLD}\nrouter2 reed {NEW}\n", "line 2: unknown scope 'reed'"),
])
def test_serve_refuses_credentials_it_cannot_work_with_in_one_line(tmp_path, text, says):
    from tests.commands import DEAD, run

    path = tmp_path / "creds"
    path.write_text(text)
    out = run(["serve", "--bootstrap", DEAD, "--port", "18941", "--groups", "0",
               "--auth-token-file", str(path)])
    errors = [ln for ln in out.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and errors[0].startswith("error:") and says in errors[0], out
    assert OLD not in out and NEW not in out
