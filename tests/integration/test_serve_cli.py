"""`kvidx serve` as an operator runs it (real broker, real HTTP): it rebuilds from Kafka, reports
ready, answers lookups of what a relay published, records routes and usage, and stops on SIGTERM."""

import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from kvidx.shadow import load_requests
from relays.run import play_recording
from relays.sinks import KafkaSink
from tests.helpers import LLAMA, ROOT, wait_for

pytestmark = pytest.mark.kafka


def test_serve_cli(kafka_bootstrap, topics, tmp_path):
    sink = KafkaSink(kafka_bootstrap, topics["events"], topics["dead_letters"])
    play_recording(LLAMA / "frames.jsonl", "tiny", sink, 16)
    sink.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvidx.cli", "serve", "--bootstrap", kafka_bootstrap, "--topic-prefix",
         topics["prefix"], "--port", str(port), "--auth-token-file", str(token)],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=log, stderr=subprocess.STDOUT)
    auth = {"Authorization": "Bearer s3cret"}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            def ready():
                try:
                    return c.get("/healthz").status_code == 200
                except httpx.HTTPError:
                    return False
            wait_for(ready, timeout=60, what="kvidx serve ready")
            prompt = load_requests(LLAMA / "requests.jsonl")[150]["prompt_token_ids"]
            r = c.post("/v1/lookup", json={"model": "tiny", "token_ids": prompt}, headers=auth)
            assert r.status_code == 200 and r.json()["replicas"], r.text
            assert c.post("/v1/lookup", json={"model": "tiny", "token_ids": prompt}).status_code == 401
            route = {"request_id": "q1", "model": "tiny", "replica": "tcp://127.0.0.1:5557",
                     "token_ids": prompt}
            r = c.post("/v1/routes", headers=auth, json=route)
            assert r.status_code == 202, r.text
            r = c.post("/v1/usage", headers=auth, json={"request_id": "q1", "model": "tiny",
                                                        "replica": "tcp://127.0.0.1:5557",
                                                        "prompt_tokens": len(prompt), "cached_tokens": 96})
            assert r.status_code in (200, 202), r.text
            assert b"kvidx_lookup_latency_seconds" in c.get("/metrics").content
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    # uvicorn shuts down gracefully, then re-raises the signal: exit by SIGTERM is the clean stop
    assert code in (0, -signal.SIGTERM), (tmp_path / "serve.log").read_text()[-3000:]
