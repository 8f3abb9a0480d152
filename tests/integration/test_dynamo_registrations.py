"""Dynamo's API on `kvidx serve` over a real broker: a worker registered on one instance is known to
every instance (the compacted registrations topic) and answered alike, survives the restart of the
instance that runs its relay (the relay starts again and follows the engine), and an /unregister on
any instance stops the relay where it runs and retracts the replica. Instance b also answers Dynamo's
queries on --lookup-port (the compiled threads), alike."""

import os
import signal
import socket
import subprocess
import sys

import httpx
import msgspec
import pytest

from kvidx.engines.vllm.sim import SimVllmEngine
from kvidx.sim.prompts import workload_requests
from tests.helpers import ROOT, wait_for

pytestmark = pytest.mark.kafka


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(bootstrap, prefix, port, name, log_path, *extra):
    return subprocess.Popen(
        [sys.executable, "-m", "kvidx.cli", "serve", "--bootstrap", bootstrap, "--topic-prefix", prefix,
         "--port", str(port), "--instance-name", name, *extra],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=open(log_path, "a"),
        stderr=subprocess.STDOUT)


def healthy(c: httpx.Client) -> bool:
    try:
        return c.get("/healthz").status_code == 200
    except httpx.HTTPError:
        return False


def scores(c: httpx.Client, prompt) -> dict:
    r = c.post("/query", json={"token_ids": prompt, "model_name": "m"})
    return r.json().get("scores", {}) if r.status_code == 200 else {"status": r.status_code}


def front_answered(c: httpx.Client, route: str) -> float:
    """Queries of `route` the lookup port's compiled threads answered (the instance's /metrics)."""
    key = f'kvidx_lookup_front_requests_total{{answered="{route}"}} '
    lines = c.get("/metrics").text.splitlines()
    return next(float(line[len(key):]) for line in lines if line.startswith(key))


def retracted(c: httpx.Client, prompt) -> bool:
    """No replica credits any of `prompt` any more (kvidx's own lookup)."""
    replicas = c.post("/v1/lookup", json={"model": "m", "token_ids": prompt}).json()["replicas"]
    return all(r["cached_tokens"] == 0 for r in replicas)


def stop(a, b, engine) -> None:
    for p in (a, b):
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.wait(30)
    engine.close()


def start(kafka_bootstrap, topics, tmp_path):
    """A simulated vLLM engine, its workload, two free ports, the log, and instance a serving."""
    engine = SimVllmEngine(num_blocks=64, block_size=16, endpoint="tcp://127.0.0.1:*",
                           replay_endpoint="tcp://127.0.0.1:*")
    pa, pb = free_port(), free_port()
    log = tmp_path / "serve.log"
    return (engine, workload_requests(9, 40, systems=2), pa, pb, log,
            serve(kafka_bootstrap, topics["prefix"], pa, "a", log))


def test_registrations_reach_every_instance_and_survive_a_restart(kafka_bootstrap, topics, tmp_path):
    engine, work, pa, pb, log, a = start(kafka_bootstrap, topics, tmp_path)
    b = None
    pl = free_port()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{pa}", timeout=10) as ca, \
                httpx.Client(base_url=f"http://127.0.0.1:{pb}", timeout=10) as cb, \
                httpx.Client(base_url=f"http://127.0.0.1:{pl}", timeout=10) as cl:
            wait_for(lambda: healthy(ca), 60, "instance a ready")
            r = ca.post("/register", json={"instance_id": 1, "endpoint": engine.endpoint, "model_name": "m",
                                           "block_size": 16, "replay_endpoint": engine.replay_endpoint})
            assert r.status_code == 201, r.text
            for p, o in work[:20]:
                engine.serve(p, o)
            wait_for(lambda: "1" in scores(ca, work[19][0]), 30, "a's relay folded through Kafka")
            # another instance learns the registration from the topic and answers alike
            b = serve(kafka_bootstrap, topics["prefix"], pb, "b", log, "--lookup-port", str(pl))
            wait_for(lambda: healthy(cb) and [w["instance_id"] for w in cb.get("/workers").json()] == [1], 60,
                     "b knows the registration")
            wait_for(lambda: all(scores(cb, p) == scores(ca, p) for p, _ in work[:20]), 30, "b answers as a")
            # b's --lookup-port too (the same store: alike once no batch is in flight)
            wait_for(lambda: all(scores(cl, p) == scores(cb, p) for p, _ in work[:20]), 30,
                     "--lookup-port alike")
            assert front_answered(cb, "query") >= 20  # by the compiled threads, not the fallback
            # a restarts: it takes its registration up again, and its relay follows the engine again
            a.send_signal(signal.SIGTERM)
            a.wait(30)
            a = serve(kafka_bootstrap, topics["prefix"], pa, "a", log)
            wait_for(lambda: healthy(ca), 60, "a ready again")
            wait_for(lambda: [(w["instance_id"], w["status"]) for w in ca.get("/workers").json()]
                     == [(1, "active")], 30, "a took its registration up again")
            for p, o in work[20:]:
                engine.serve(p, o)
            wait_for(lambda: "1" in scores(cb, work[-1][0]) and "1" in scores(ca, work[-1][0]), 30,
                     "the restarted relay's events")
            wait_for(lambda: all(scores(cl, p) == scores(cb, p) for p, _ in work), 30, "--lookup-port alike")
            # an /unregister on b (not the owner): a stops its relay and retracts the replica
            assert cb.post("/unregister", json={"instance_id": 1, "model_name": "m"}).status_code == 200
            wait_for(lambda: ca.get("/workers").json() == [] and cb.get("/workers").json() == [], 30,
                     "both instances forgot it")
            gone = [scores(c, work[-1][0]) for c in (ca, cb, cl)]
            assert gone == [{"status": 404}] * 3
            wait_for(lambda: retracted(ca, work[-1][0]), 30, "the replica retracted from the index")
    finally:
        stop(a, b, engine)


MP = {"Content-Type": "application/msgpack"}
PROFILE = {"strategy": "vllm_v1", "algorithm": "sha256_cbor", "python_hash_seed": "0",
           "index_projection": "low64_be"}


def conductor(c: httpx.Client, path: str, body=None) -> tuple[int, dict]:
    r = c.post(path, content=msgspec.msgpack.encode(body), headers=MP) if body is not None else c.get(path)
    assert r.headers.get("content-type") == "application/msgpack", (r.status_code, r.text[:300])
    return r.status_code, msgspec.msgpack.decode(r.content) if r.content else {}


def conductor_gpu(c: httpx.Client, prompt) -> int:
    code, body = conductor(c, "/query", {"model": "m", "block_size": 16, "token_ids": prompt})
    return body["instances"].get("engine-a", {}).get("gpu", 0) if code == 200 else -code


def test_conductor_registrations_survive_a_restart_and_reach_every_instance(kafka_bootstrap, topics,
                                                                            tmp_path):
    engine, work, pa, pb, log, a = start(kafka_bootstrap, topics, tmp_path)
    b = None
    reg = {"endpoint": engine.endpoint, "replay_endpoint": engine.replay_endpoint, "type": "vLLM",
           "modelname": "m", "instance_id": "engine-a", "block_size": 16, "dp_rank": 0,
           "hash_profile": PROFILE}
    pl = free_port()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{pa}", timeout=10) as ca, \
                httpx.Client(base_url=f"http://127.0.0.1:{pb}", timeout=10) as cb, \
                httpx.Client(base_url=f"http://127.0.0.1:{pl}", timeout=10) as cl:
            wait_for(lambda: healthy(ca), 60, "instance a ready")
            assert conductor(ca, "/register", reg)[0] == 200
            for p, o in work[:20]:
                engine.serve(p, o)
            wait_for(lambda: conductor_gpu(ca, work[19][0]) > 0, 30, "a's relay folded through Kafka")
            a.send_signal(signal.SIGKILL)  # the registration was kept before /register answered
            a.wait(30)
            a = serve(kafka_bootstrap, topics["prefix"], pa, "a", log)
            b = serve(kafka_bootstrap, topics["prefix"], pb, "b", log, "--lookup-port", str(pl))
            wait_for(lambda: healthy(ca) and healthy(cb), 60, "a and b ready")
            for c in (ca, cb):
                wait_for(lambda c=c: [s["InstanceID"] for s in conductor(c, "/services")[1]["services"]]
                         == ["engine-a"], 30, "the registration known")
            for p, o in work[20:]:
                engine.serve(p, o)  # followed again by a's restarted relay
            wait_for(lambda: conductor_gpu(ca, work[-1][0]) > 0 and
                     conductor_gpu(cb, work[-1][0]) == conductor_gpu(ca, work[-1][0]), 30,
                     "the restarted relay's events, on both")
            wait_for(lambda: all(conductor_gpu(cl, p) == conductor_gpu(cb, p) for p, _ in work), 30,
                     "b's --lookup-port answers as b")
            assert front_answered(cb, "conductor_query") >= len(work)
            code, body = conductor(cb, "/unregister", {"instance_id": "engine-a", "dp_rank": 0})
            assert code == 200 and body["removed_instances"] == ["engine-a|default|0"]
            wait_for(lambda: conductor(ca, "/services")[1]["services"] == [], 30, "a forgot it")
            wait_for(lambda: retracted(ca, work[-1][0]), 30, "a stopped its relay and retracted the replica")
    finally:
        stop(a, b, engine)
