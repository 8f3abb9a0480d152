"""The lookup front (`kvidx serve --lookup-port`, index_service/lookup_front.py, native/src/front.rs):
Dynamo's POST /query and /query_by_hash answered by the compiled core's threads must give, byte for
byte, the answer of the service's own handler (dynamo_api.answer_query) on the same state, through
every fold, registration and eviction; what they do not answer themselves (errors, unknown tokens,
other bodies) goes to that handler. Over real sockets: keep-alive, pipelining, Expect, bad heads."""

from __future__ import annotations

import json
import random
import socket

import httpx
import pytest

from index_service.auth import Credentials, parse_credentials
from index_service.dynamo_api import (
    DynamoRegistry,
    QueryByHashRequest,
    QueryRequest,
    RegisterRequest,
    UnregisterRequest,
    answer_query,
)
from index_service.lookup_front import LookupFront, native_front
from index_service.store import ShardStore
from kvidx.core.hashing import dynamo_keys, prompt_hashes
from schemas.events import SCHEMA_VERSION, BlocksRemoved, BlocksStored, EventBatch, ReplicaCleared

pytestmark = pytest.mark.skipif(native_front() is None, reason="needs the compiled core")

B = 32  # Dynamo's registered block size; kvidx indexes at 16
TIERS = ("GPU", "GPU", "GPU", "CPU", "DISK", "NODE_SHARED", "POOL")


def _endpoint(i: int) -> str:
    return f"tcp://10.0.0.{i // 200}:{5000 + i % 200}"


class Fleet:
    """A store fed batches of random prompts' blocks (canonical and Dynamo keys), over many tiers and
    more than 64 replicas, and a registry of most of them."""

    def __init__(self, replicas: int, seed: int):
        self.rng = random.Random(seed)
        self.store = ShardStore(16)
        self.registry = DynamoRegistry(None)
        self.replicas = [_endpoint(i) for i in range(replicas)]
        self.prompts = [self._prompt() for _ in range(40)]
        self.seq: dict[str, int] = {}

    def _prompt(self) -> list[int]:
        base = [7] * 64 if self.rng.random() < 0.5 else []
        return base + [self.rng.randrange(50_000) for _ in range(self.rng.randrange(16, 400))]

    def register(self, i: int, rank: int = 0, group: str = "default") -> None:
        status, body = self.registry.register(RegisterRequest(
            instance_id=1000 + i, endpoint=self.replicas[i], model_name="m", block_size=B,
            dp_rank=rank, routing_group=group))
        assert status == 201, body

    def batch(self, replica: str, events: list, dp_rank: int = 0) -> None:
        seq = self.seq[replica] = self.seq.get(replica, 0) + 1
        self.store.apply(EventBatch(SCHEMA_VERSION, "m", replica, dp_rank, 1, seq, 0.0, 0.0, B, events))

    def store_prompt(self, replica: str, prompt: list[int], upto: int | None = None) -> None:
        tier = self.rng.choice(TIERS)
        canon = prompt_hashes(prompt, 16)
        n = len(canon) if upto is None else min(upto, len(canon))
        keys = dynamo_keys(_local_hashes(prompt))[: n // 2]
        self.batch(replica, [BlocksStored(tier, 0, canon[:n], None, 0),
                             BlocksStored(tier, 0, keys, None, 0, router_keys=True)])

    def evict(self, replica: str, prompt: list[int]) -> None:
        canon = prompt_hashes(prompt, 16)
        k = self.rng.randrange(len(canon))
        self.batch(replica, [BlocksRemoved(t, 0, canon[k:]) for t in set(TIERS)])


def _local_hashes(prompt: list[int]) -> list[int]:
    from kvidx.core.hashing import dynamo_local_hashes, pack_tokens

    return dynamo_local_hashes(pack_tokens(prompt), B)


def _i64(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def _bodies(fleet: Fleet, rng: random.Random) -> list[tuple[str, bytes]]:
    out = []
    for p in fleet.prompts:
        cut = p[: rng.randrange(len(p) + 1)] + [rng.randrange(50_000)] * rng.randrange(3)
        out.append(("/query", json.dumps({"token_ids": cut, "model_name": "m"}).encode()))
        out.append(("/query_by_hash", json.dumps({"block_hashes": [_i64(h) for h in _local_hashes(cut)],
                                                  "model_name": "m"}).encode()))
    p = fleet.prompts[0]
    out += [
        ("/query", json.dumps({"token_ids": p, "model_name": "m", "lora_name": "ad"}).encode()),
        ("/query", json.dumps({"token_ids": p, "model_name": "m", "cache_salt": "s" * 40}).encode()),
        ("/query", json.dumps({"token_ids": p, "model_name": "m", "lora_name": "", "cache_salt": None,
                               "tenant_id": "t", "routing_group": "default"}).encode()),
        ("/query", b'{"model_name":"m","token_ids":[]}'),
        ("/query", json.dumps({"token_ids": p, "model_name": "m", "routing_group": "other"}).encode()),
        ("/query", json.dumps({"token_ids": p, "model_name": "nope"}).encode()),
    ]
    return out


def _python(fleet: Fleet, path: str, body: bytes) -> tuple[int, bytes]:
    typ = QueryRequest if path == "/query" else QueryByHashRequest
    r = answer_query(fleet.store, fleet.registry, typ, "application/json", body, {})
    return r.status_code, bytes(r.body)


def _check(front: LookupFront, fleet: Fleet, rng: random.Random) -> int:
    """Every body's fast answer (where made) equals the handler's; how many were made fast."""
    fast = 0
    for path, body in _bodies(fleet, rng):
        mine = front.native.answer(path, body, None)
        status, theirs = _python(fleet, path, body)
        if mine is None:
            assert status != 200 or b'"instances":{}' in theirs or b"routing_group" in body, (path, body[:80])
            continue
        fast += 1
        assert (200, mine) == (status, theirs), (path, body[:120])
    return fast


@pytest.mark.parametrize("replicas,seed", [(6, 1), (90, 2), (140, 3)])
def test_fast_answers_are_the_handlers_through_folds(replicas, seed):
    fleet = Fleet(replicas, seed)
    front = LookupFront("127.0.0.1", 0, fleet.store, fleet.registry)
    rng = random.Random(seed)
    try:
        assert _check(front, fleet, rng) == 0  # no registration: every query is the handler's 404
        for i in range(replicas - 2):  # two replicas stay unregistered: left out of the answer
            fleet.register(i, rank=i % 3 if i % 5 == 0 else 0)
        fast = 0
        for step in range(6):
            for _ in range(replicas * 3):
                r = rng.choice(fleet.replicas)
                fleet.store_prompt(r, rng.choice(fleet.prompts), upto=rng.randrange(1, 30))
            for _ in range(replicas):
                fleet.evict(rng.choice(fleet.replicas), rng.choice(fleet.prompts))
            if step == 3:
                fleet.batch(fleet.replicas[1], [ReplicaCleared("restart")])
                fleet.registry.unregister(UnregisterRequest(instance_id=1002, model_name="m"))
            fast += _check(front, fleet, rng)
        assert fast > 200
    finally:
        front.close()


@pytest.fixture
def served():
    fleet = Fleet(4, 7)
    for i in range(4):
        fleet.register(i)
    for p in fleet.prompts[:10]:
        fleet.store_prompt(fleet.replicas[0], p)
    creds = Credentials(parse_credentials("router read rrrrrrrrrrrrrrrrrrrr\n"
                                          "writer write wwwwwwwwwwwwwwwwwwww\n"))
    front = LookupFront("127.0.0.1", 0, fleet.store, fleet.registry, creds)
    try:
        yield fleet, front, f"http://127.0.0.1:{front.port}"
    finally:
        front.close()


def test_http_answers_errors_and_tokens(served):
    fleet, front, url = served
    ok = {"Authorization": "Bearer rrrrrrrrrrrrrrrrrrrr"}
    body = {"token_ids": fleet.prompts[0], "model_name": "m"}
    with httpx.Client(base_url=url, timeout=10) as c:
        r = c.post("/query", json=body, headers=ok)
        assert r.status_code == 200 and r.json()["scores"], r.text
        assert r.content == _python(fleet, "/query", json.dumps(body).encode())[1]
        before = front.stats()
        for _ in range(3):  # keep-alive: one connection, answered by the threads
            assert c.post("/query", json=body, headers=ok).status_code == 200
        assert front.stats()["fast_query"] == before["fast_query"] + 3
        assert front.stats()["fallback"] == before["fallback"]
        # the handler's errors, word for word
        r = c.post("/query", json=body)
        assert r.status_code == 401 and "scope 'read'" in r.json()["error"]
        assert r.headers["www-authenticate"].startswith("Bearer")
        r = c.post("/query", json=body, headers={"Authorization": "Bearer wwwwwwwwwwwwwwwwwwww"})
        assert r.status_code == 403
        r = c.post("/query", content=b"{", headers={**ok, "content-type": "application/json"})
        assert r.status_code == 400 and r.text.startswith("Failed to parse the request body as JSON")
        r = c.post("/query", content=b"{}", headers={**ok, "content-type": "text/plain"})
        assert r.status_code == 415
        r = c.post("/query", json={"token_ids": [-1], "model_name": "m"}, headers=ok)
        assert r.status_code == 422
        salted = {"block_hashes": [1], "model_name": "m", "cache_salt": "x"}
        r = c.post("/query_by_hash", json=salted, headers=ok)
        assert r.status_code == 400 and "cache_salt" in r.json()["error"]
        r = c.post("/query", json={**body, "model_name": "other"}, headers=ok)
        assert r.status_code == 404
        assert r.json() == {"error": "no indexer for model=other routing_group=default"}
        r = c.get("/query", headers=ok)
        assert r.status_code == 405
        r = c.get("/workers", headers=ok)
        assert r.status_code == 404 and "--port" in r.text
        r = c.post("/query", content=b"x" * (8 << 20 | 1), headers={**ok, "content-type": "application/json"})
        assert r.status_code == 413


def _raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_pipelining_expect_and_bad_heads(served):
    fleet, front, _ = served
    body = json.dumps({"token_ids": fleet.prompts[1], "model_name": "m"}).encode()
    req = (b"POST /query HTTP/1.1\r\nhost: x\r\nauthorization: Bearer rrrrrrrrrrrrrrrrrrrr\r\n"
           b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)) + body
    out = _raw(front.port, req * 3)
    assert out.count(b"HTTP/1.1 200 OK") == 3 and out.count(_python(fleet, "/query", body)[1]) == 3
    with socket.create_connection(("127.0.0.1", front.port), timeout=10) as s:  # the body once asked for
        s.sendall(req[: -len(body)].replace(b"host: x\r\n", b"host: x\r\nexpect: 100-continue\r\n"))
        assert s.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(body)
        assert s.recv(100).startswith(b"HTTP/1.1 200 OK")
    assert _raw(front.port, b"NOT HTTP\r\n\r\n").startswith(b"HTTP/1.1 400")
    chunked = req.replace(b"content-length: %d" % len(body), b"transfer-encoding: chunked")
    assert _raw(front.port, chunked).startswith(b"HTTP/1.1 411")
    huge = b"POST /query HTTP/1.1\r\n" + b"x-a: b\r\n" * 2000 + b"\r\n"
    assert _raw(front.port, huge).startswith(b"HTTP/1.1 431")
    closing = req.replace(b"host: x\r\n", b"host: x\r\nconnection: close\r\n")
    out = _raw(front.port, closing * 2)  # answered once, then closed
    assert out.count(b"HTTP/1.1 200") == 1 and b"connection: close" in out


def test_views_are_pushed_only_when_they_change(monkeypatch):
    fleet = Fleet(300, 5)  # slot counts above the small ints Python caches
    front = LookupFront("127.0.0.1", 0, fleet.store, fleet.registry)
    pushed = []
    try:
        for r in fleet.replicas:
            fleet.store_prompt(r, fleet.prompts[0])
        monkeypatch.setattr(front, "native", _Spy(front.native, pushed))
        fleet.store_prompt(fleet.replicas[5], fleet.prompts[1])  # same slots, same maps
        assert pushed == []
        fleet.batch("tcp://new:1", [BlocksStored("GPU", 0, prompt_hashes(fleet.prompts[2], 16), None, 0)])
        assert pushed == ["set_model"]  # a new slot
    finally:
        front.close()


class _Spy:
    def __init__(self, native, calls: list):
        self.native, self.calls = native, calls

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self.native, name)


@pytest.mark.parametrize("kw,error", [
    ({"lookup_port": 8080}, "other than --port"),
    ({"lookup_port": 9090, "ops_port": 9090}, "other than --port"),
    ({"tls": True}, "plain HTTP"),
    ({"groups": "0,1"}, "--groups"),
])
def test_the_operators_mistakes_are_one_line(kw, error):
    from types import SimpleNamespace

    from index_service.main import _check_lookup_port

    args = SimpleNamespace(lookup_port=kw.get("lookup_port", 0), port=8080, ops_port=kw.get("ops_port"),
                           groups=kw.get("groups"), host="127.0.0.1")
    with pytest.raises(SystemExit) as e:
        _check_lookup_port(args, object() if kw.get("tls") else None)
    assert str(e.value).startswith("error: --lookup-port") and error in str(e.value)
    with socket.socket() as s:  # a port in use
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = SimpleNamespace(lookup_port=s.getsockname()[1], port=8080, ops_port=None, groups=None,
                               host="127.0.0.1")
        with pytest.raises(SystemExit, match="is in use"):
            _check_lookup_port(busy, None)


def test_queries_from_threads_while_the_fold_writes():
    """The threads read the maps while the fold writes them (no GIL on the readers' side): no crash,
    no deadlock, every answer well-formed, and once the writes stop the answers are the handler's."""
    import threading

    fleet = Fleet(90, 11)
    for i in range(80):
        fleet.register(i)
    front = LookupFront("127.0.0.1", 0, fleet.store, fleet.registry)
    rng = random.Random(11)
    bodies = _bodies(fleet, rng)
    stop, answered, bad = threading.Event(), [0], []

    def ask(k: int) -> None:
        i = k
        while not stop.is_set():
            path, body = bodies[i % len(bodies)]
            out = front.native.answer(path, body, None)  # the GIL released while it walks
            if out is not None:
                try:
                    assert set(json.loads(out)) == {"frequencies", "instances", "scores"}
                except (ValueError, AssertionError) as e:
                    bad.append(e)
                answered[0] += 1
            i += 3

    readers = [threading.Thread(target=ask, args=(k,)) for k in range(3)]
    try:
        for t in readers:
            t.start()
        step = 0
        while step < 300 or (answered[0] < 200 and step < 100_000):  # folds until the readers ran a while
            step += 1
            fleet.store_prompt(rng.choice(fleet.replicas), rng.choice(fleet.prompts),
                               upto=rng.randrange(1, 30))
            if step % 3 == 0:
                fleet.evict(rng.choice(fleet.replicas), rng.choice(fleet.prompts))
            if step % 100 == 50 and step < 1000:
                fleet.batch(rng.choice(fleet.replicas), [ReplicaCleared("restart")])
                fleet.register(80 + step // 100)
    finally:
        stop.set()
        for t in readers:
            t.join(30)
        front.close()
    assert not any(t.is_alive() for t in readers) and not bad and answered[0] >= 200, answered
    assert _check(front, fleet, rng) > 0  # settled: the handler's answers


def _conductor_bodies(fleet: Fleet, rng: random.Random) -> list[bytes]:
    import msgspec
    import numpy as np

    def body(tokens, **kw) -> bytes:
        return msgspec.msgpack.encode({"model": "m", "block_size": 32,
                                       "token_ids": np.asarray(tokens, "<i4").tobytes(), **kw})

    def array(tokens) -> bytes:  # token ids as a msgpack array, not a bin
        return msgspec.msgpack.encode({"model": "m", "block_size": 32, "token_ids": tokens})

    out = [body(p[: rng.randrange(len(p) + 1)]) for p in fleet.prompts]
    p = fleet.prompts[0]
    out += [body(p, lora_name="", tenant_id="", cache_salt=None), body(p, cache_salt="s" * 40),
            body(p, instance_id="engine-3"), body(p, instance_id="nobody"), body(p, block_size=48),
            body(p, block_size=40), body(p, block_size=64), body(p, tenant_id="other"), body([]),
            array(p[:64]), array([-5, (1 << 31) - 1] * 40), array([1 << 31] * 40), array([[1]] * 40),
            b"\x83\xa5model\xa1m\xaablock_size\x20\xa9token_ids" + b"\x91" * 100_000 + b"\x01"]  # deep
    out += [array(p[: rng.randrange(len(p) + 1)]) for p in fleet.prompts[:10]]
    return out


def test_the_conductors_query_is_the_handlers(monkeypatch):
    """Mooncake conductor's msgpack /query on the lookup port: byte for byte the handler's
    (ConductorPaths.query_here), through folds and registrations, several DP ranks an instance."""
    import msgspec

    from index_service.conductor_api import ConductorPaths, ConductorRegistry

    fleet = Fleet(70, 13)
    reg = ConductorRegistry(None)
    paths = ConductorPaths(None, fleet.store, reg)
    front = LookupFront("127.0.0.1", 0, fleet.store, fleet.registry, conductor=paths)
    rng = random.Random(13)

    def register(i: int, **kw) -> None:
        profile = {"strategy": "vllm_v1", "algorithm": "sha256_cbor", "python_hash_seed": "0",
                   "index_projection": "low64_be"}
        body = {"endpoint": fleet.replicas[i], "type": "vLLM", "modelname": "m",
                "instance_id": f"engine-{i % 9}", "block_size": 32, "dp_rank": i // 9,
                "hash_profile": profile, **kw}
        status, out = reg.register(msgspec.msgpack.encode(body))
        assert status == 200, out

    seen = {"gpu": 0, "below": 0}  # answers with a GPU hit, and with more in lower tiers

    def check() -> int:
        fast = 0
        for body in _conductor_bodies(fleet, rng):
            mine = front.native.answer("/query", body, None, "application/msgpack")
            theirs = paths.query_here(body, {})
            if mine is None:
                continue
            fast += 1
            assert (200, mine) == (theirs.status_code, bytes(theirs.body)), msgspec.msgpack.decode(body)
            for inst in msgspec.msgpack.decode(mine)["instances"].values():
                seen["gpu"] += inst["gpu"] > 0
                seen["below"] += inst["disk"] > inst["gpu"]
        return fast

    try:
        assert check() > 0  # no context yet: the empty answer, made here
        for i in range(60):
            register(i, **({"block_size": 48} if i % 11 == 0 else {}))
        fast = 0
        for step in range(4):
            for _ in range(150):
                fleet.store_prompt(rng.choice(fleet.replicas), rng.choice(fleet.prompts),
                                   upto=rng.randrange(1, 30))
            for _ in range(40):
                fleet.evict(rng.choice(fleet.replicas), rng.choice(fleet.prompts))
            if step == 2:
                fleet.batch(fleet.replicas[4], [ReplicaCleared("restart")])
                reg.unregister(msgspec.msgpack.encode({"instance_id": "engine-4", "dp_rank": 0}))
            fast += check()
        assert fast > 100 and seen["gpu"] > 10 and seen["below"] > 10, seen
    finally:
        front.close()


def test_the_conductors_query_over_http():
    """Told apart from Dynamo's /query by its content type, as on --port; its errors are the
    conductor's (msgpack), a body over the limit its 413."""
    import msgspec
    import numpy as np

    from index_service.conductor_api import ConductorPaths, ConductorRegistry

    fleet = Fleet(3, 17)
    reg = ConductorRegistry(None)
    paths = ConductorPaths(None, fleet.store, reg)
    front = LookupFront("127.0.0.1", 0, fleet.store, fleet.registry, conductor=paths)
    mp = {"content-type": "application/msgpack"}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{front.port}", timeout=10) as c:
            q = {"model": "m", "block_size": 32, "token_ids": np.asarray(fleet.prompts[0], "<i4").tobytes()}
            r = c.post("/query", content=msgspec.msgpack.encode(q), headers=mp)
            assert (r.status_code, r.headers["content-type"]) == (200, "application/msgpack")
            assert msgspec.msgpack.decode(r.content) == {"instances": {}}
            assert front.stats()["fast_conductor_query"] == 1
            r = c.post("/query", content=msgspec.msgpack.encode({"model": "m"}), headers=mp)
            assert r.status_code == 400 and msgspec.msgpack.decode(r.content)["reason"] == "missing"
            r = c.post("/query", content=b"\x80" * ((8 << 20) + 1), headers=mp)
            assert r.status_code == 413
            assert msgspec.msgpack.decode(r.content) == {"error": "request body too large"}
    finally:
        front.close()
