"""SGLang's external-indexer API on `kvidx serve --sglang-indexer` over a real broker: the bridges' feed
is acknowledged only once on the events topic, so a service killed (SIGKILL) right after answering
rebuilds the same index; the workers' addresses are kept on the registrations topic, so the restarted
instance, and a second one, answer the router alike."""

import os
import signal
import socket
import subprocess
import sys

import grpc
import httpx
import pytest

from index_service.sglang_pb import kv_indexer_pb2 as pb
from tests.helpers import ROOT, SglangClient, wait_for
from tests.helpers import sglang_action as act
from tests.helpers import sglang_matches as matches

pytestmark = pytest.mark.kafka
CHAIN = [str(h) for h in (978178666101069530, -895308556211281782, -8033692805846017938, 835415944263129316)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(bootstrap, prefix, port, grpc_port, name, log_path):
    return subprocess.Popen(
        [sys.executable, "-m", "kvidx.cli", "serve", "--bootstrap", bootstrap, "--topic-prefix", prefix,
         "--port", str(port), "--instance-name", name, "--sglang-indexer", f"qwen={grpc_port}"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=open(log_path, "a"),
        stderr=subprocess.STDOUT)


def healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def answer(c: SglangClient):
    try:
        return matches(c.prefix(CHAIN))
    except grpc.RpcError as e:
        return e.code()


def test_feed_survives_a_kill_and_reaches_every_instance(kafka_bootstrap, topics, tmp_path):
    log = tmp_path / "serve.log"
    pa, ga, pb_, gb = free_port(), free_port(), free_port(), free_port()
    a = serve(kafka_bootstrap, topics["prefix"], pa, ga, "a", log)
    b = None
    ca, cb = SglangClient(ga), SglangClient(gb)
    try:
        wait_for(lambda: healthy(pa), 60, "instance a ready")
        ca.apply("w1", [act(pb.ACTION_REPORT, pb.TIER_HBM, CHAIN)], address="http://10.0.0.1:30000")
        ca.apply("w2", [act(pb.ACTION_REPORT, pb.TIER_HBM, CHAIN[:2]),
                        act(pb.ACTION_REPORT, pb.TIER_DRAM, CHAIN[2:3])], address="http://10.0.0.2:30000")
        ca.apply("w1", [act(pb.ACTION_REVOKE, pb.TIER_HBM, CHAIN[3:])], address="http://10.0.0.1:30000",
                 seq=2)
        want = [("w2", 3, "http://10.0.0.2:30000"), ("w1", 3, "http://10.0.0.1:30000")]
        wait_for(lambda: sorted(answer(ca)) == sorted(want), 30, "a folded its feed through Kafka")
        # killed right after acknowledging: nothing acknowledged is lost, the addresses neither
        a.send_signal(signal.SIGKILL)
        a.wait(30)
        a = serve(kafka_bootstrap, topics["prefix"], pa, ga, "a", log)
        wait_for(lambda: healthy(pa), 60, "a ready again")
        wait_for(lambda: sorted(answer(ca)) == sorted(want), 30, "a rebuilt the same index")
        b = serve(kafka_bootstrap, topics["prefix"], pb_, gb, "b", log)
        wait_for(lambda: healthy(pb_), 60, "b ready")
        wait_for(lambda: sorted(answer(cb)) == sorted(want), 30, "b answers as a")
        # a feed batch on b reaches a
        cb.apply("w2", [act(pb.ACTION_CLEAR_ALL_AT_TIER, pb.TIER_DRAM)], address="http://10.0.0.2:30000")
        want = [("w1", 3, "http://10.0.0.1:30000"), ("w2", 2, "http://10.0.0.2:30000")]
        wait_for(lambda: answer(ca) == want and answer(cb) == want, 30, "b's feed reaches a")
    finally:
        ca.channel.close()
        cb.channel.close()
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(30)
