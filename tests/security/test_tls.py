"""TLS and mTLS (`kvidx serve --tls-cert/--tls-key/--tls-client-ca`) over real sockets, with a CA and
certificates made by openssl for the test: the HTTP API (the routers' lookups answered inside the HTTP
protocol included) and SGLang's gRPC API refuse a caller without a certificate the CA signed; the
fan-out between instances reaches an https:// peer, presenting its own certificate; bad files are one
line."""

from __future__ import annotations

import shutil
import ssl
from pathlib import Path

import grpc
import httpx
import pytest

from index_service.app import create_app
from index_service.auth import CredentialsError, TlsFiles
from index_service.fanout import Fanout, PeerDirectory
from index_service.http_protocol import LookupProtocol
from index_service.sglang_indexer import SERVICE, SglangIndexer, start_server
from index_service.sglang_pb import kv_indexer_pb2 as pb
from index_service.store import ShardStore
from kvidx.config import Config, ModelConfig
from tests.helpers import SEEDED_MODEL, ServerThread, make_pki, random_fleet, seeded_store

if shutil.which("openssl") is None:
    pytest.skip("no openssl binary to make the test's certificates", allow_module_level=True)

LOOKUP = {"model": SEEDED_MODEL, "token_ids": list(range(1000, 1064))}


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _tls(pki: Path, mtls: bool = True) -> TlsFiles:
    return TlsFiles(str(pki / "server.crt"), str(pki / "server.key"), str(pki / "ca.crt") if mtls else None)


def _client(pki: Path, cert: str | None) -> httpx.Client:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    if cert is not None:
        ctx.load_cert_chain(str(pki / f"{cert}.crt"), str(pki / f"{cert}.key"))
    return httpx.Client(verify=ctx, timeout=10)


def _https(url: str) -> str:
    return url.replace("http://", "https://")


def test_http_api_over_mtls(pki, monkeypatch):
    taken = []
    answer = LookupProtocol._answer

    def counted(self, handler, request):
        taken.append(self.scope["path"])
        return answer(self, handler, request)

    monkeypatch.setattr(LookupProtocol, "_answer", counted)
    with ServerThread(create_app(seeded_store()), **_tls(pki).uvicorn_options()) as url:
        with _client(pki, "client") as c:
            r = c.post(f"{_https(url)}/v1/lookup", json=LOOKUP)
            assert r.status_code == 200 and r.json()["replicas"]
            assert c.get(f"{_https(url)}/healthz").json()["ready"] is True
        assert taken == ["/v1/lookup"]  # answered inside the protocol, over TLS
        for cert in (None, "stranger"):  # no certificate, or one another CA signed: no TLS session
            with _client(pki, cert) as c, pytest.raises((httpx.ConnectError, httpx.ReadError,
                                                         httpx.RemoteProtocolError)):
                c.post(f"{_https(url)}/v1/lookup", json=LOOKUP)
        with pytest.raises(httpx.HTTPError):  # plaintext to a TLS port
            httpx.post(f"{url}/v1/lookup", json=LOOKUP, timeout=10)
        assert taken == ["/v1/lookup"]


def test_tls_without_a_client_ca_takes_any_client(pki):
    with ServerThread(create_app(seeded_store()), **_tls(pki, mtls=False).uvicorn_options()) as url:
        with _client(pki, None) as c:
            assert c.post(f"{_https(url)}/v1/lookup", json=LOOKUP).status_code == 200


def _grpc_code(port: int, pki: Path, cert: str | None) -> grpc.StatusCode:
    key = chain = None
    if cert is not None:
        key, chain = (pki / f"{cert}.key").read_bytes(), (pki / f"{cert}.crt").read_bytes()
    creds = grpc.ssl_channel_credentials((pki / "ca.crt").read_bytes(), key, chain)
    with grpc.secure_channel(f"localhost:{port}", creds) as channel:
        call = channel.unary_unary(f"/{SERVICE}/MatchExternalKv",
                                   request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=pb.MatchExternalKvResponse.FromString)
        try:
            call(pb.MatchExternalKvRequest(hashes=["1"]), timeout=10)
        except grpc.RpcError as e:
            return e.code()
        return grpc.StatusCode.OK


def test_grpc_api_over_mtls(pki):
    store = seeded_store()
    server, port = start_server(SglangIndexer(store, SEEDED_MODEL, store.apply), "127.0.0.1:0", workers=2,
                                tls=_tls(pki))
    try:
        assert _grpc_code(port, pki, "client") == grpc.StatusCode.OK
        assert _grpc_code(port, pki, None) == grpc.StatusCode.UNAVAILABLE  # the handshake is refused
        assert _grpc_code(port, pki, "stranger") == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


def test_fanout_reaches_an_https_peer_with_its_certificate(pki):
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
    with ServerThread(create_app(stores["b"]), **_tls(pki).uvicorn_options()) as b:
        stranger = TlsFiles(str(pki / "stranger.crt"), str(pki / "stranger.key"), str(pki / "ca.crt"))
        for tls, partial in ((_tls(pki), False), (stranger, True)):  # b refuses a certificate of another CA
            directory = PeerDirectory("a")
            directory.add_static(_https(b), frozenset({2, 3}))
            fanout = Fanout(directory, timeout_s=5.0, tls=tls.client_context())
            with ServerThread(create_app(stores["a"], fanout=fanout)) as a:
                got = httpx.post(f"{a}/v1/lookup", json=body, timeout=10)
                assert got.status_code == 200 and bool(got.json().get("partial")) is partial, got.text


def test_unusable_files_are_one_line(pki, tmp_path):
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    crt, key = str(pki / "server.crt"), str(pki / "server.key")
    for files, says in ((TlsFiles("/nonexistent/c.pem", key), "/nonexistent/c.pem"),
                        (TlsFiles(str(garbage), key), "not a certificate"),
                        (TlsFiles(crt, str(pki / "client.key")), "not a certificate"),
                        (TlsFiles(crt, key, str(garbage)), "not a CA certificate")):
        with pytest.raises(CredentialsError, match=says) as e:
            files.check()
        assert "\n" not in str(e.value)
    _tls(pki).check()


@pytest.mark.parametrize("args, says", [
    (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-client-ca", "ca.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-cert", "/nonexistent/c.pem", "--tls-key", "/nonexistent/k.pem"], "/nonexistent/c.pem"),
])
def test_serve_refuses_tls_flags_it_cannot_use_in_one_line(args, says):
    from tests.commands import DEAD, run

    out = run(["serve", "--bootstrap", DEAD, "--port", "18942", *args])
    errors = [ln for ln in out.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and errors[0].startswith("error:") and says in errors[0], out
