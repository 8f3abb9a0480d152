"""One configuration source: `kvidx relay`, `kvidx worker` and `kvidx serve` read the same --config, so a
per-model index block size reaches the relay that hashes, the worker that writes the snapshots and
the service that rebuilds from them (the worker used to build every shard with the default)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from index_service.store import ShardStore
from kvidx.config import load_config
from kvidx.core import walk
from kvidx.core.hashing import prompt_hashes
from kvidx.engines.recording import read_frames
from kvidx.kafka.snapshots import read_snapshots
from kvidx.shadow import InProcessIndex, load_requests
from tests.helpers import LLAMA, ROOT
from tests.integration.helpers import fresh_service

pytestmark = pytest.mark.kafka
SIZES = {"small-blocks": 16, "big-blocks": 32}  # the recording's engine block is 32: both divide it


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "kvidx.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120, **kw)


def answers(shard, prompts, bs=None):
    bs = bs or shard.block_size
    return [sorted((a.replica, a.cached_tokens, a.resumable_tokens)
                   for a in walk.lookup(shard, prompt_hashes(p, bs), len(p), time.time())) for p in prompts]


def test_worker_config_per_model_block_size(kafka_bootstrap, topics, tmp_path):
    cfg = tmp_path / "kvidx.toml"
    cfg.write_text("".join(f'[models."{m}"]\nindex_block_size = {bs}\n' for m, bs in SIZES.items()))
    for model in SIZES:
        p = cli("relay", "--bootstrap", kafka_bootstrap, "--topic-prefix", topics["prefix"], "--model", model,
                "--config", str(cfg), "--play", str(LLAMA / "frames.jsonl"))
        assert p.returncode == 0, p.stdout + p.stderr
    batches = sum(1 for _ in read_frames(LLAMA / "frames.jsonl")) + 1

    log = open(tmp_path / "worker.log", "w")
    w = subprocess.Popen([sys.executable, "-m", "kvidx.cli", "worker", "--bootstrap", kafka_bootstrap,
                          "--topic-prefix", topics["prefix"], "--data-dir", str(tmp_path / "w"),
                          "--config", str(cfg), "--snapshot-interval", "0.5", "--web-port", "0",
                          "--no-supervise"],
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=log,
                         stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        shards = {}
        while time.monotonic() < deadline:
            assert w.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
            shards = read_snapshots(kafka_bootstrap, topics["snapshots"])
            if all(m in shards and sum(st.batches for st in shards[m].replicas.values()) >= batches
                   for m in SIZES):
                break
            time.sleep(0.5)
    finally:
        w.send_signal(signal.SIGKILL)
        w.wait()
        log.close()
    assert {m: shards[m].block_size for m in SIZES} == SIZES

    prompts = [r["prompt_token_ids"] for r in load_requests(LLAMA / "requests.jsonl")]
    want = {}
    for model, bs in SIZES.items():
        index = InProcessIndex(model, bs)
        for f in sorted(read_frames(LLAMA / "frames.jsonl"), key=lambda f: f.recv_ns):
            index.feed(f)
        want[model] = answers(index.shard, prompts)
        assert answers(shards[model], prompts) == want[model], model
    # the block size matters: the big-block shard asked with 16-token block hashes finds nothing
    assert answers(shards["big-blocks"], prompts, bs=16) != want["big-blocks"]

    store = ShardStore(config=load_config(cfg))  # a fresh service instance with the same file
    with fresh_service(store, kafka_bootstrap, topics):
        for model in SIZES:
            assert store.shards[model].block_size == SIZES[model]
            assert answers(store.shards[model], prompts) == want[model]
