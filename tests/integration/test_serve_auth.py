"""`kvidx serve` with scoped credentials as an operator deploys it (real broker, real HTTP and gRPC, the
CLI's own flags): every API refuses a call without the token's scope, probes and scrapers are answered
open on --ops-port, a rewritten credentials file is taken without a restart, and a service started
without credentials says so in its log and on /healthz."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import msgspec
import pytest

from index_service.sglang_indexer import SERVICE
from index_service.sglang_pb import kv_indexer_pb2 as pb
from tests.helpers import ROOT, wait_for

pytestmark = pytest.mark.kafka

READ_T, WRITE_T = "router-token-0123456789ab", "bridge-token-0123456789ab"
ADMIN_T = "ops-token-0123456789abcd"
NEW_READ = "router-token-rotated-0123456"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _serve(kafka_bootstrap: str, topics: dict, log: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kvidx.cli", "serve", "--bootstrap", kafka_bootstrap, "--topic-prefix",
         topics["prefix"], *args], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdout=log.open("w"), stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen, log: Path) -> None:
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(30)
    assert code in (0, -signal.SIGTERM), log.read_text()[-3000:]


def _up(url: str, headers: dict | None = None) -> bool:
    try:
        return httpx.get(f"{url}/healthz", headers=headers, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _rpc(port: int, method: str, request, token: str | None) -> grpc.StatusCode:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=lambda raw: raw)
        try:
            call(request, timeout=10, metadata=[("authorization", f"Bearer {token}")] if token else None)
        except grpc.RpcError as e:
            return e.code()
        return grpc.StatusCode.OK


def test_serve_with_scoped_credentials(kafka_bootstrap, topics, tmp_path):
    port, ops_port, grpc_port = _free_ports(3)
    creds = tmp_path / "credentials"
    creds.write_text(f"router read {READ_T}\nbridge write {WRITE_T}\nops admin {ADMIN_T}\n")
    log = tmp_path / "serve.log"
    proc = _serve(kafka_bootstrap, topics, log, "--port", str(port), "--ops-port", str(ops_port),
                  "--auth-token-file", str(creds), "--sglang-indexer", f"tiny={grpc_port}")
    url, ops = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{ops_port}"
    try:
        wait_for(lambda: _up(ops), timeout=60, what="kvidx serve ready on its ops port")
        assert httpx.get(f"{ops}/healthz").json()["auth"] == "on"
        assert b"kvidx_ready 1.0" in httpx.get(f"{ops}/metrics").content
        with httpx.Client(base_url=url, timeout=10) as c:
            assert c.get("/healthz").status_code == 401  # on the API's port: a token, like the rest
            assert c.get("/healthz", headers={"Authorization": f"Bearer {READ_T}"}).status_code == 200
            register = {"instance_id": 1, "endpoint": "tcp://127.0.0.1:5999", "model_name": "tiny",
                        "block_size": 16}
            conductor = msgspec.msgpack.encode({"endpoint": "tcp://127.0.0.1:5998", "type": "vLLM",
                                                "modelname": "tiny", "instance_id": "e", "block_size": 16})
            for token, status in ((None, 401), ("wrong-token-0000000000000", 401), (READ_T, 403),
                                  (WRITE_T, 403)):
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                assert c.post("/register", json=register, headers=headers).status_code == status
                msgpack = {**headers, "Content-Type": "application/msgpack"}
                assert c.post("/register", content=conductor, headers=msgpack).status_code == status
                assert c.get("/dump", headers=headers).status_code == status
                assert c.post("/internal/sglang/tiny/match_prefix", content=b"",
                              headers=headers).status_code == status
            assert c.get("/dump", headers={"Authorization": f"Bearer {ADMIN_T}"}).json() == {}
            lookup = {"model": "tiny", "token_ids": list(range(64))}
            assert c.post("/v1/lookup", json=lookup).status_code == 401
            assert c.post("/v1/lookup", json=lookup, headers={"Authorization": f"Bearer {WRITE_T}"}
                          ).status_code == 403
            assert c.post("/v1/lookup", json=lookup, headers={"Authorization": f"Bearer {READ_T}"}
                          ).status_code not in (401, 403)
            feed = pb.ApplyExternalKvBatchRequest(worker_id="w", seq=1, actions=[
                pb.ExternalKvAction(type=pb.ACTION_CLEAR_ALL_AT_TIER, tier=pb.TIER_HBM)])
            assert _rpc(grpc_port, "ApplyExternalKvBatch", feed, None) == grpc.StatusCode.UNAUTHENTICATED
            assert _rpc(grpc_port, "ApplyExternalKvBatch", feed, READ_T) == grpc.StatusCode.PERMISSION_DENIED
            query = pb.MatchExternalKvPrefixRequest(hashes=["1"])
            assert _rpc(grpc_port, "MatchExternalKvPrefix", query, READ_T) == grpc.StatusCode.OK
            # rotation: the file rewritten, no restart
            tmp = creds.with_name("credentials.new")
            tmp.write_text(f"router read {NEW_READ}\nops admin {ADMIN_T}\n")
            os.replace(tmp, creds)
            rotated = {"Authorization": f"Bearer {NEW_READ}"}
            wait_for(lambda: c.post("/v1/lookup", json=lookup, headers=rotated).status_code not in (401, 403),
                     timeout=30, what="the rotated token taken")
            assert c.post("/v1/lookup", json=lookup, headers={"Authorization": f"Bearer {READ_T}"}
                          ).status_code == 401
            assert _rpc(grpc_port, "MatchExternalKvPrefix", query, READ_T) == grpc.StatusCode.UNAUTHENTICATED
            assert _rpc(grpc_port, "MatchExternalKvPrefix", query, NEW_READ) == grpc.StatusCode.OK
    finally:
        _stop(proc, log)
    text = log.read_text()
    assert "event=auth_enabled" in text and "names=router,bridge,ops" in text
    assert "event=credentials_reloaded" in text
    for token in (READ_T, WRITE_T, ADMIN_T, NEW_READ):
        assert token not in text  # names are logged, never tokens


def test_serve_without_credentials_says_so(kafka_bootstrap, topics, tmp_path):
    port, = _free_ports(1)
    log = tmp_path / "serve.log"
    env_token = os.environ.pop("KVIDX_API_TOKEN", None)
    try:
        proc = _serve(kafka_bootstrap, topics, log, "--port", str(port))
    finally:
        if env_token is not None:
            os.environ["KVIDX_API_TOKEN"] = env_token
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _up(url), timeout=60, what="kvidx serve ready")
        assert httpx.get(f"{url}/healthz").json()["auth"] == "off"
    finally:
        _stop(proc, log)
    lines = [ln for ln in log.read_text().splitlines() if "event=auth_disabled" in ln]
    assert len(lines) == 1 and "WARNING" in lines[0] and "apis=kvidx,dynamo,conductor" in lines[0], lines


def test_serve_over_mtls(kafka_bootstrap, topics, tmp_path):
    """--tls-cert/--tls-key/--tls-client-ca: the HTTP API and SGLang's gRPC API over mTLS (and the token
    still checked inside), the ops port plain for probes."""
    import shutil
    import ssl

    from tests.helpers import make_pki

    if shutil.which("openssl") is None:
        pytest.skip("no openssl binary to make the test's certificates")
    pki = make_pki(tmp_path)
    port, ops_port, grpc_port = _free_ports(3)
    creds = tmp_path / "credentials"
    creds.write_text(f"router read {READ_T}\n")
    log = tmp_path / "serve.log"
    proc = _serve(kafka_bootstrap, topics, log, "--port", str(port), "--ops-port", str(ops_port),
                  "--auth-token-file", str(creds), "--sglang-indexer", f"tiny={grpc_port}",
                  "--tls-cert", str(pki / "server.crt"), "--tls-key", str(pki / "server.key"),
                  "--tls-client-ca", str(pki / "ca.crt"))
    try:
        wait_for(lambda: _up(f"http://127.0.0.1:{ops_port}"), timeout=60, what="kvidx serve ready")
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        ctx.load_cert_chain(str(pki / "client.crt"), str(pki / "client.key"))
        lookup = {"model": "tiny", "token_ids": list(range(64))}
        with httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=ctx, timeout=10) as c:
            assert c.post("/v1/lookup", json=lookup).status_code == 401  # mTLS, and the token too
            r = c.post("/v1/lookup", json=lookup, headers={"Authorization": f"Bearer {READ_T}"})
            assert r.status_code not in (401, 403), r.text
        with httpx.Client(base_url=f"https://127.0.0.1:{port}", timeout=10,
                          verify=ssl.create_default_context(cafile=str(pki / "ca.crt"))) as c, \
                pytest.raises(httpx.HTTPError):
            c.post("/v1/lookup", json=lookup, headers={"Authorization": f"Bearer {READ_T}"})  # no certificate
        channel_creds = grpc.ssl_channel_credentials((pki / "ca.crt").read_bytes(),
                                                     (pki / "client.key").read_bytes(),
                                                     (pki / "client.crt").read_bytes())
        with grpc.secure_channel(f"localhost:{grpc_port}", channel_creds) as channel:
            call = channel.unary_unary(f"/{SERVICE}/MatchExternalKvPrefix",
                                       request_serializer=lambda m: m.SerializeToString(),
                                       response_deserializer=lambda raw: raw)
            call(pb.MatchExternalKvPrefixRequest(hashes=["1"]), timeout=10,
                 metadata=[("authorization", f"Bearer {READ_T}")])
            with pytest.raises(grpc.RpcError) as refused:
                call(pb.MatchExternalKvPrefixRequest(hashes=["1"]), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        _stop(proc, log)
    assert f"url=https://127.0.0.1:{port}" in log.read_text()
