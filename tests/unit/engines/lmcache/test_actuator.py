"""The LMCache controller actuator (kvidx/engines/lmcache/actuator.py): a prefetch hint becomes exactly
the controller messages LMCache 0.5.6's own classes encode (tests/fixtures/lmcache-0.5.6/
controller_msgs.json, recorded with them), pushed to a real ZMQ PULL socket as the controller's; and
through the service, only for a model whose configuration names a controller."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import httpx
import msgspec
import numpy as np
import zmq

from index_service.app import create_app
from index_service.store import ShardStore
from kvidx.config import Config, HintsConfig, ModelConfig
from kvidx.core.hashing import prompt_hashes
from kvidx.engines.lmcache.actuator import HintActuators, LmcacheActuator, encode, prefetch_messages
from schemas.answers import PrefetchHint, PrefetchRun
from schemas.events import SCHEMA_VERSION, BlocksStored, EventBatch
from tests.helpers import ServerThread

FIXTURE = json.loads((Path(__file__).resolve().parents[3] / "fixtures" / "lmcache-0.5.6"
                      / "controller_msgs.json").read_text())
TOKENS = FIXTURE["tokens"]
WANT = {k: base64.b64decode(v["msgpack_b64"]) for k, v in FIXTURE["messages"].items()}


def disk_hint(replica: str = "vllm-0") -> PrefetchHint:
    return PrefetchHint(replica, 0, [PrefetchRun("DISK", 32, 96, 0.0016)], 64, 0.0016, 0.01, 0.0016, 0)


def test_a_disk_prefetch_is_a_copy_to_the_cpu_backend_and_a_pin_as_lmcache_encodes_them():
    msgs = prefetch_messages(disk_hint(), TOKENS, "vllm-0", "kvidx-test-0")
    assert [encode(m) for m in msgs] == [WANT["move"], WANT["pin"]]
    # the tag and field names LMCache's controller decodes (the map LMCache's classes wrote)
    fields = msgspec.msgpack.decode(WANT["move"])
    assert fields["type"] == "MoveMsg" and fields["copy"] is True and fields["tokens"] == TOKENS


def test_runs_already_in_host_memory_are_pinned_only_and_gpu_or_pool_runs_need_nothing():
    cpu = PrefetchHint("r", 0, [PrefetchRun("CPU", 0, 48, 0.0003)], 48, 0.0003, 0.0, 0.0, 0)
    msgs = prefetch_messages(cpu, TOKENS, "r", "e")
    assert [type(m).__name__ for m in msgs] == ["PinMsg"] and msgs[0].tokens == TOKENS[:48]
    pool = PrefetchHint("r", 0, [PrefetchRun("NODE_SHARED", 0, 48, 0.0005)], 48, 0.0005, 0.0, 0.0, 0)
    assert prefetch_messages(pool, TOKENS, "r", "e") == []


def pull_socket() -> tuple[zmq.Context, zmq.Socket, str]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    return ctx, sock, f"tcp://127.0.0.1:{port}"


def test_the_actuator_pushes_them_to_the_controllers_pull_socket():
    ctx, sock, url = pull_socket()
    a = LmcacheActuator(url, instances={"r0": "vllm-0"})
    try:
        assert a.act("r0", disk_hint("r0"), TOKENS) == 2
        got = [msgspec.msgpack.decode(sock.recv()) for _ in range(2)]
        want = [msgspec.msgpack.decode(WANT[k]) for k in ("move", "pin")]
        for g, w in zip(got, want, strict=True):  # event ids are the actuator's own
            assert g.pop("event_id").startswith("kvidx-") and w.pop("event_id")
            assert g == w
        assert a.counters["hints"] == 1
    finally:
        a.close()
        sock.close()
        ctx.term()
    assert a.counters["sent"] == 2


def test_the_service_acts_only_for_a_model_that_names_a_controller():
    ctx, sock, url = pull_socket()
    cfg = Config(default=ModelConfig(hints=HintsConfig(prefetch=True)),
                 models={"acted": ModelConfig(hints=HintsConfig(prefetch=True, lmcache_controller=url))})
    store = ShardStore(16, config=cfg)
    actuators = store.act_on_hint = HintActuators(cfg)
    h = prompt_hashes(np.asarray(TOKENS + [1], dtype="<u4").tobytes(), 16)
    now = time.time()
    for model in ("acted", "hinted-only"):
        held = [BlocksStored("GPU", 0, h[:2], None, 0), BlocksStored("DISK", 0, h[2:6], h[1], 2)]
        store.apply(EventBatch(SCHEMA_VERSION, model, "r0", 0, 1, 0, now, now, 16, held))
    try:
        with ServerThread(create_app(store)) as base, httpx.Client(base_url=base) as c:
            for model in ("hinted-only", "acted"):
                # a prompt with nothing cached queues its prefill on r0 first: a plan is issued only
                # where the request waits long enough to hide its load (the prefetch gate)
                c.post("/v1/routes", json={"request_id": f"fill-{model}", "model": model, "replica": "r0",
                                           "token_ids": list(range(50_000, 50_097))})
                r = c.post("/v1/routes", json={"request_id": f"q-{model}", "model": model, "replica": "r0",
                                               "token_ids": TOKENS + [1]})
                assert r.json()["prefetch"]["tokens"] == 64
            # block hashes only: nothing to build LMCache's token-keyed messages from
            c.post("/v1/routes", json={"request_id": "q2", "model": "acted", "replica": "r0",
                                       "block_hashes": h, "prompt_tokens": 97})
        got = msgspec.msgpack.decode(sock.recv())
        assert got["type"] == "MoveMsg" and got["old_position"] == ["r0", "LocalDiskBackend"]
        assert msgspec.msgpack.decode(sock.recv())["type"] == "PinMsg"
        sock.setsockopt(zmq.RCVTIMEO, 300)
        try:
            sock.recv()
            raise AssertionError("a message for the model without a controller, or without tokens")
        except zmq.Again:
            pass
        assert list(actuators.by_model) == ["acted"]
    finally:
        actuators.close()
        sock.close()
        ctx.term()


def test_a_malformed_controller_address_turns_acting_off_without_failing_routing():
    a = LmcacheActuator("controller-without-scheme:8300")
    assert a.broken and a.act("r0", disk_hint("r0"), TOKENS) == 0
    a.close()  # returns at once
