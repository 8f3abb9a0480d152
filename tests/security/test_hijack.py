"""Issue #35 part 2, "registrations cannot hijack", tried as an attacker would, over real HTTP, real gRPC
and real ZMQ: a simulated vLLM engine publishes real vLLM-format events, a kvidx relay (the same code a
`kvidx relay` runs) feeds its replica (named after its endpoint, as Dynamo's registrations name theirs),
and the service has no credentials configured: whatever refuses the hijacks here is the registration
logic itself, not authentication. Each hijack is checked against the lookup answers before and after.

- Dynamo's and the conductor's `/register` of the live replica's endpoint: 409, nothing started;
- SGLang's `ApplyExternalKvBatch` CLEAR_ALL_AT_TIER on the relay-fed replica's id: ALREADY_EXISTS;
- a batch stamped with a nanosecond (future) epoch: refused; a slot left with one: the relay goes on;
- `worker_address` rewritten to an address outside the allow-list: INVALID_ARGUMENT, the old one kept;
- a registration outside the endpoint allow-list: 403 naming the field and the list, and a listening
  socket at that endpoint sees no connection (while an allowed one does);
- a registration removed before a restart does not come back, not even for a moment: real Kafka, so in
  tests/integration/test_registration_tombstones.py.
"""

from __future__ import annotations

import select
import socket
import threading
import time

import grpc
import httpx
import msgspec
import pytest

from index_service.app import create_app
from index_service.conductor_api import ConductorRegistry
from index_service.dynamo_api import DynamoRegistry, Listener, RegisterRequest
from index_service.guard import EndpointAllowList
from index_service.sglang_indexer import SglangIndexer, start_server
from index_service.sglang_pb import kv_indexer_pb2 as pb
from index_service.store import ShardStore
from kvidx.core.shard import wall_epoch
from kvidx.engines.vllm.sim import SimVllmEngine
from kvidx.sim.prompts import workload_requests
from relays.managed import vllm_relay_starter
from relays.sinks import StoreSink
from schemas.events import SCHEMA_VERSION, EventBatch, ReplicaCleared
from tests.helpers import ServerThread, SglangClient, sglang_action, sglang_matches, wait_for

B = 32  # the engine's block size; kvidx indexes at 16
MSGPACK = {"Content-Type": "application/msgpack"}
PROFILE = {"strategy": "vllm_v1", "algorithm": "sha256_cbor", "python_hash_seed": "0",
           "index_projection": "low64_be"}


def conductor_registration(endpoint: str, **kw) -> bytes:
    return msgspec.msgpack.encode({"endpoint": endpoint, "type": "vLLM", "modelname": "m",
                                   "instance_id": "rogue", "block_size": B, "dp_rank": 0,
                                   "hash_profile": dict(PROFILE), **kw})


def answers(c: httpx.Client, prompts: list[list[int]]) -> list[list[tuple[str, int, int, int]]]:
    """Per prompt, what /v1/lookup credits: (replica, DP rank, cached tokens, resumable tokens)."""
    out = []
    for p in prompts:
        r = c.post("/v1/lookup", json={"model": "m", "token_ids": p})
        assert r.status_code == 200, r.text[:300]
        out.append([(a["replica"], a["dp_rank"], a["cached_tokens"], a["resumable_tokens"])
                    for a in r.json()["replicas"]])
    return out


def relay_threads(endpoint: str) -> int:
    return sum(t.name == f"relay-{endpoint}" for t in threading.enumerate())


class Fleet:
    """One engine, its kvidx relay feeding the store, the service (HTTP + SGLang's gRPC) over it."""

    def __init__(self):
        self.store = ShardStore(16)
        self.store.ready = True
        self.starter = vllm_relay_starter(StoreSink(self.store), lambda model: 16)
        self.engine = SimVllmEngine(num_blocks=60, block_size=B, endpoint="tcp://127.0.0.1:*",
                                    replay_endpoint="tcp://127.0.0.1:*")
        self.stop_relay = self.starter("m", self.engine.endpoint, 0, self.engine.endpoint,
                                       self.engine.replay_endpoint, Listener(self.engine.endpoint, None), B)
        self.dynamo = DynamoRegistry(self.starter, store=self.store)
        self.conductor = ConductorRegistry(self.starter, store=self.store)
        self.dynamo.others, self.conductor.others = [self.conductor], [self.dynamo]
        self.kept = []
        self.indexer = SglangIndexer(self.store, "m", self.store.apply, self.kept.append)
        self.app = create_app(self.store, dynamo=self.dynamo, conductor=self.conductor)
        self.work = workload_requests(3, 40, systems=2, sys_len=(40, 100))

    @property
    def replica(self):
        return self.store.shards["m"].replicas[(self.engine.endpoint, 0)]

    def serve(self, work) -> None:
        """The engine serves `work`; returns once the relay's batches of it are folded."""
        for prompt, output in work:
            self.engine.serve(prompt, output)
        last = self.engine.next_seq - 1
        wait_for(lambda: self.replica.seq == last, what="the relay's batches folded")

    def close(self) -> None:
        self.dynamo.stop_all()
        self.conductor.stop_all()
        self.stop_relay(False)
        self.engine.close()


@pytest.fixture()
def fleet():
    f = Fleet()
    server, port = start_server(f.indexer, "127.0.0.1:0", workers=2)
    try:
        wait_for(lambda: "m" in f.store.shards and (f.engine.endpoint, 0) in f.store.shards["m"].replicas,
                 what="the relay's start batch")
        f.serve(f.work)
        assert f.replica.blocks > 0
        with ServerThread(f.app) as url, httpx.Client(base_url=url, timeout=10) as c:
            f.grpc = SglangClient(port)
            yield f, c
            f.grpc.channel.close()
    finally:
        server.stop(0)
        f.close()


def prompts(f: Fleet) -> list[list[int]]:
    return [p for p, _ in f.work]


def test_register_of_a_live_replicas_endpoint_is_refused(fleet):
    f, c = fleet
    before = answers(c, prompts(f))
    assert sum(bool(a) for a in before) > 20 and any(a[0][2] > 0 for a in before if a)
    body = {"instance_id": 66, "endpoint": f.engine.endpoint, "model_name": "m", "block_size": B}
    r = c.post("/register", json=body)
    assert r.status_code == 409 and "fed by another source" in r.json()["error"], r.text
    r = c.post("/register", json={**body, "replay_endpoint": f.engine.replay_endpoint, "dp_rank": 3})
    assert r.status_code == 409, r.text
    r = c.post("/register", content=conductor_registration(f.engine.endpoint), headers=MSGPACK)
    assert r.status_code == 409, r.content
    assert msgspec.msgpack.decode(r.content)["field"] == "endpoint"
    # nothing registered, no second relay on the engine, the replica's credit as before
    assert c.get("/workers").json() == [] and f.conductor.services == {}
    assert relay_threads(f.engine.endpoint) == 1
    assert answers(c, prompts(f)) == before
    # the real relay goes on: new traffic is credited
    more = workload_requests(9, 4, systems=1, sys_len=(64, 65))
    f.serve(more)
    assert all(a and a[0][2] > 0 for a in answers(c, [p for p, _ in more]))


def test_one_registration_per_endpoint_across_both_apis(fleet):
    """An endpoint registered through Dynamo's API cannot be registered again through the conductor's
    (or under another instance id): the second would start a second relay clearing the first's replica."""
    f, c = fleet
    engine = SimVllmEngine(num_blocks=20, block_size=B, endpoint="tcp://127.0.0.1:*")
    try:
        body = {"instance_id": 1, "endpoint": engine.endpoint, "model_name": "m", "block_size": B}
        assert c.post("/register", json=body).status_code == 201
        r = c.post("/register", json={**body, "instance_id": 2})
        assert r.status_code == 409 and "registered already" in r.json()["error"], r.text
        r = c.post("/register", content=conductor_registration(engine.endpoint), headers=MSGPACK)
        assert r.status_code == 409 and "Dynamo registration of instance 1" in \
            msgspec.msgpack.decode(r.content)["error"]
        assert relay_threads(engine.endpoint) == 1
        assert c.post("/unregister", json={"instance_id": 1, "model_name": "m"}).status_code == 200
        assert relay_threads(engine.endpoint) == 0  # the relay's thread is reclaimed
        r = c.post("/register", content=conductor_registration(engine.endpoint), headers=MSGPACK)
        assert r.status_code == 200, msgspec.msgpack.decode(r.content)  # free again
    finally:
        engine.close()


def test_sglang_clear_all_on_a_relay_fed_replica_is_refused(fleet):
    f, c = fleet
    before = answers(c, prompts(f))
    for actions in ([sglang_action(pb.ACTION_CLEAR_ALL_AT_TIER, pb.TIER_HBM)],
                    [sglang_action(pb.ACTION_REVOKE, pb.TIER_HBM, ["1", "2"])], []):
        with pytest.raises(grpc.RpcError) as e:
            f.grpc.apply(f.engine.endpoint, actions, address="http://10.0.0.9:30000")
        assert e.value.code() is grpc.StatusCode.ALREADY_EXISTS, e.value.details()
        assert "fed by a kvidx relay" in e.value.details()
    assert answers(c, prompts(f)) == before
    assert f.kept == [] and f.indexer.addresses == {}  # no address kept for the replica either
    more = workload_requests(5, 4, systems=1, sys_len=(64, 65))
    f.serve(more)  # the relay's next batches are not stale
    assert all(a and a[0][2] > 0 for a in answers(c, [p for p, _ in more]))


def test_one_epoch_clock_no_writer_makes_real_events_stale(fleet):
    f, c = fleet
    before = answers(c, prompts(f))
    shard = f.store.shards["m"]
    now = time.time()
    forged = EventBatch(SCHEMA_VERSION, "m", f.engine.endpoint, 0, time.time_ns(), 0, now, now, 0,
                        [ReplicaCleared("forged")])
    assert f.store.apply(forged) is False and shard.future_epochs == 1
    assert answers(c, prompts(f)) == before
    # a slot an older feed left with a nanosecond epoch: it no longer orders the relay's batches
    f.replica.epoch = time.time_ns()
    more = workload_requests(7, 4, systems=1, sys_len=(64, 65))
    f.serve(more)
    assert all(a and a[0][2] > 0 for a in answers(c, [p for p, _ in more]))
    # the SGLang feed's epochs are the relays' clock: milliseconds
    t0 = wall_epoch()
    f.grpc.apply("bridge-w", [sglang_action(pb.ACTION_REPORT, pb.TIER_HBM, ["11", "12"])],
                 address="http://10.0.0.3:30000")
    st = shard.replicas[("bridge-w", 0)]
    assert t0 <= st.epoch <= wall_epoch() and st.router_keys == 2


def test_worker_address_rewrite_outside_the_allow_list_is_refused(fleet):
    f, _c = fleet
    f.grpc.apply("w1", [sglang_action(pb.ACTION_REPORT, pb.TIER_HBM, ["5", "6"])], address="http://10.0.0.1:8000")
    assert sglang_matches(f.grpc.prefix(["5", "6"])) == [("w1", 2, "http://10.0.0.1:8000")]
    for address in ("http://203.0.113.7:8000", "http://evil.example.com:8000", "http://169.254.169.254/"):
        with pytest.raises(grpc.RpcError) as e:
            f.grpc.apply("w1", [], address=address)
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "worker_address" in e.value.details() and "allow-list" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        f.grpc.apply("w1\nevent=forged", [], address="http://10.0.0.1:8000")
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "worker_id" in e.value.details()
    assert sglang_matches(f.grpc.prefix(["5", "6"])) == [("w1", 2, "http://10.0.0.1:8000")]
    assert [(w.worker_id, w.address) for w in f.kept] == [("w1", "http://10.0.0.1:8000")]


def _listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


def test_registration_outside_the_allow_list_makes_no_connection():
    store = ShardStore(16)
    store.ready = True
    starter = vllm_relay_starter(StoreSink(store), lambda model: 16)
    allow = EndpointAllowList.parse("10.0.0.0/8,*.svc.cluster.local")  # loopback not allowed here
    dynamo = DynamoRegistry(starter, allow=allow)
    conductor = ConductorRegistry(starter, allow=allow)
    control = DynamoRegistry(starter)  # the default allow-list: loopback is in it
    refused, allowed = _listener(), _listener()
    ep = f"tcp://127.0.0.1:{refused.getsockname()[1]}"
    try:
        with ServerThread(create_app(store, dynamo=dynamo, conductor=conductor)) as url, \
                httpx.Client(base_url=url, timeout=10) as c:
            r = c.post("/register", json={"instance_id": 1, "endpoint": ep, "model_name": "m",
                                          "block_size": B})
            assert r.status_code == 403, r.text
            assert "endpoint" in r.json()["error"] and "10.0.0.0/8,*.svc.cluster.local" in r.json()["error"]
            r = c.post("/register", json={"instance_id": 2, "endpoint": "tcp://10.1.2.3:5557",
                                          "model_name": "m", "block_size": B, "replay_endpoint": ep})
            assert r.status_code == 403 and "replay_endpoint" in r.json()["error"], r.text
            r = c.post("/register", content=conductor_registration(ep), headers=MSGPACK)
            body = msgspec.msgpack.decode(r.content)
            assert r.status_code == 403 and body["field"] == "endpoint", body
            for public in ("tcp://8.8.8.8:5557", "tcp://[2001:4860::8888]:5557", "tcp://169.254.169.254:80",
                           "tcp://attacker.example.com:5557", "tcp://127.0.0.1.nip.io:5557"):
                r = c.post("/register", json={"instance_id": 3, "endpoint": public, "model_name": "m",
                                              "block_size": B})
                assert r.status_code == 403, (public, r.text)
            assert dynamo.workers == {} and conductor.services == {}
        # the control: an allowed endpoint's relay does connect (so a connection would have been seen)
        ok = f"tcp://127.0.0.1:{allowed.getsockname()[1]}"
        assert control.register(RegisterRequest(9, ok, "m", B))[0] == 201
        assert select.select([allowed], [], [], 30)[0] == [allowed], "the allowed relay never connected"
        assert select.select([refused], [], [], 0)[0] == [], "a refused endpoint was connected to"
    finally:
        control.stop_all()
        refused.close()
        allowed.close()


@pytest.mark.parametrize("entries,endpoint,allowed", [
    ("", "tcp://127.0.0.1:5557", True),  # the default
    ("", "tcp://10.2.3.4:5557", True),
    ("", "tcp://[::1]:5557", True),
    ("", "tcp://[::ffff:8.8.8.8]:5557", False),  # a v4-mapped public address
    ("", "tcp://169.254.169.254:80", False),
    ("", "tcp://vllm-0:5557", False),  # a host name no pattern names
    ("", "tcp://localhost:5557", True),
    ("", "ipc:///tmp/vllm.sock", True),  # this machine's: allowed where loopback is
    ("", "inproc://x", False),
    ("", "http://10.0.0.1:8000/v1", True),
    ("10.0.0.0/8,*.svc.cluster.local", "tcp://vllm-0.vllm.ns.svc.cluster.local:5557", True),
    ("10.0.0.0/8,*.svc.cluster.local", "tcp://evil.svc.cluster.local.attacker.com:5557", False),
    ("10.0.0.0/8,*.svc.cluster.local", "tcp://127.0.0.1:5557", False),
    ("10.0.0.0/8,*.svc.cluster.local", "ipc:///tmp/vllm.sock", False),
    ("any", "tcp://8.8.8.8:5557", True),
])
def test_allow_list(entries, endpoint, allowed):
    allow = EndpointAllowList.parse(entries) if entries else EndpointAllowList()
    assert (allow.error("endpoint", endpoint) is None) is allowed, allow.error("endpoint", endpoint)


def test_allow_list_from_flag_config_or_default(tmp_path):
    from types import SimpleNamespace

    from index_service.guard import DEFAULT_ALLOW
    from index_service.main import allow_list as _allow_list
    from kvidx.config import load_config

    config = tmp_path / "c.toml"
    config.write_text('allow_endpoints = ["10.9.0.0/16"]\n')
    default = _allow_list(SimpleNamespace(allow_endpoints=None), load_config(None))
    assert default.text == ",".join(DEFAULT_ALLOW)
    assert _allow_list(SimpleNamespace(allow_endpoints=None), load_config(config)).text == "10.9.0.0/16"
    assert _allow_list(SimpleNamespace(allow_endpoints="any"), load_config(config)).any
    with pytest.raises(SystemExit) as e:
        _allow_list(SimpleNamespace(allow_endpoints="10.0.0.0/8,http://x/y"), load_config(None))
    assert "'http://x/y' is neither a CIDR nor a host pattern" in str(e.value)


def test_a_kept_registration_outside_a_narrowed_allow_list_is_not_connected_to():
    """Registrations read back from the registrations topic (taken before the allow-list was narrowed)
    are listed as failed, naming the allow-list, and their endpoints are never connected to."""
    from index_service.conductor_api import Service
    from schemas.registrations import REGISTRATIONS_VERSION, Registration
    from schemas.registrations import registration_key as key

    refused = _listener()
    ep = f"tcp://127.0.0.1:{refused.getsockname()[1]}"
    started = []
    allow = EndpointAllowList.parse("10.0.0.0/8")
    dynamo = DynamoRegistry(lambda *a: started.append(a), owner="a", allow=allow)
    conductor = ConductorRegistry(lambda *a: started.append(a), owner="a", allow=allow)
    try:
        dynamo.apply_record(key(4, 0), Registration(REGISTRATIONS_VERSION, 4, 0, "m", "default", 16, ep, None,
                                                     "a"))
        svc = Service(ep, "", "vLLM", "m", "", "default", "c", 16, 0, None, {}, "a").record()
        conductor.apply_record("c|default|0", svc)
        info = dynamo.worker_infos(None, None)[0]["listeners"]["0"]
        assert info["status"] == "failed" and "allow-list" in info["last_error"], info
        assert conductor.services["c|default|0"].listener.status == "failed"
        assert started == [] and select.select([refused], [], [], 0)[0] == []
    finally:
        refused.close()
