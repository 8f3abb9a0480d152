"""`kvidx relay` as an operator runs it: a live vLLM engine with data parallelism 2 (one publisher
per rank on port + rank), relayed to a real broker, stopped with SIGTERM; resync on request."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from index_service.follower import KafkaFollower
from index_service.store import ShardStore
from kvidx.engines.vllm.sim import SimVllmEngine
from kvidx.sim.prompts import workload_requests
from relays.control import send_resync
from tests.helpers import ROOT, wait_for

pytestmark = pytest.mark.kafka


def free_port_pair() -> int:
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        try:
            with socket.socket() as s2:
                s2.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def test_live_relay_cli_with_data_parallel_ranks(kafka_bootstrap, topics, tmp_path):
    ev, rp = free_port_pair(), free_port_pair()
    engines = [SimVllmEngine(num_blocks=64, block_size=32, endpoint=f"tcp://127.0.0.1:{ev + r}",
                             replay_endpoint=f"tcp://127.0.0.1:{rp + r}", dp_rank=r) for r in range(2)]
    log = open(tmp_path / "relay.log", "w")
    relay = subprocess.Popen(
        [sys.executable, "-m", "kvidx.cli", "relay", "--bootstrap", kafka_bootstrap, "--topic-prefix",
         topics["prefix"], "--model", "sim", "--replica", "node-1", "--endpoint", f"tcp://127.0.0.1:{ev}",
         "--replay-endpoint", f"tcp://127.0.0.1:{rp}", "--dp-size", "2", "--engine-version", "0.32.0",
         "--resync-jitter", "0"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=log, stderr=subprocess.STDOUT)
    store = ShardStore(16)
    follower = KafkaFollower(store, kafka_bootstrap, topics["events"], topics["snapshots"]).start()
    try:
        wait_for(lambda: "relay_start" in (tmp_path / "relay.log").read_text(), what="relay start")
        time.sleep(1.5)  # the SUB sockets reach both publishers
        work = workload_requests(2, 40)
        for i, (prompt, output) in enumerate(work):
            engines[i % 2].serve(prompt, output)

        def ranks_caught_up():
            shard = store.shards.get("sim")
            return shard is not None and all(
                (st := shard.replicas.get(("node-1", r))) is not None and st.seq == engines[r].next_seq - 1
                for r in range(2))
        wait_for(ranks_caught_up, what="both DP ranks in the index")
        shard = store.shards["sim"]
        assert {k for k in shard.replicas} == {("node-1", 0), ("node-1", 1)}
        batches = {r: shard.replicas[("node-1", r)].batches for r in range(2)}
        send_resync(kafka_bootstrap, topics["control"], "sim", "node-1", reason="test")
        wait_for(lambda: all(shard.replicas[("node-1", r)].part > 0 for r in range(2)), timeout=30,
                 what="both ranks replayed their mirrors")
        assert all(shard.replicas[("node-1", r)].batches > batches[r] for r in range(2))
    finally:
        relay.send_signal(signal.SIGTERM)
        code = relay.wait(30)
        follower.stop()
        for e in engines:
            e.close()
    assert code == 0, (tmp_path / "relay.log").read_text()[-3000:]
