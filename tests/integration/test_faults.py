"""Faults on a real broker: a broker restart, a relay restart (new epoch) and an engine restart
(sequence back to 0). After each, nothing acknowledged is lost and the service's answers equal the
engine's cache."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from index_service.follower import KafkaFollower
from index_service.store import ShardStore
from kvidx.core import walk
from kvidx.core.hashing import prompt_hashes
from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.engines.vllm.sim import SimVllmEngine
from kvidx.kafka.local import LocalKafka
from kvidx.kafka.topics import ensure_topics
from kvidx.sim.prompts import workload_requests
from relays.run import Relay
from relays.sinks import KafkaSink
from relays.zmq_source import ZmqSource
from schemas.events import topic_names
from tests.helpers import ROOT, wait_for
from tests.integration.helpers import wait_snapshots

pytestmark = pytest.mark.kafka
BS = 16
MODEL = "sim"


class LiveRelay:
    def __init__(self, engine, bootstrap, names, replica="sim-0"):
        self.sink = KafkaSink(bootstrap, names["events"], names["dead_letters"])
        self.relay = Relay(VllmPublisherRelay(MODEL, replica, BS), self.sink,
                           ZmqSource(engine.endpoint, engine.replay_endpoint))
        self.relay.start_fresh()
        self.thread = threading.Thread(target=self.relay.run_live, args=(0.05,), daemon=True)
        self.thread.start()
        time.sleep(0.3)

    def stop(self):
        self.relay.close()
        self.thread.join(5)
        self.sink.close()


def follower_matches_engine(store, engine, live, replica="sim-0"):
    """The service has applied every batch the engine published, and its view of the replica is the
    relay's mirror, which is the engine's cache."""
    shard = store.shards.get(MODEL)
    st = shard.replicas.get((replica, 0)) if shard else None
    mirror = live.relay.core.mirror
    return (st is not None and st.seq == engine.next_seq - 1 and st.blocks == len(mirror.refs)
            and {eh for (eh, _, _) in mirror.live} == engine.cached_hashes())


def start_follower(bootstrap, names):
    store = ShardStore(BS)
    follower = KafkaFollower(store, bootstrap, names["events"], names["snapshots"]).start()
    wait_for(lambda: store.ready, what="follower ready")
    return store, follower


def test_broker_restart_loses_nothing(tmp_path):
    broker = LocalKafka(log=lambda m: None)
    bootstrap = broker.start(tmp_path / "kafka")
    names = topic_names("faults.")
    ensure_topics(bootstrap, names)
    engine = SimVllmEngine(num_blocks=40, block_size=32, endpoint="tcp://127.0.0.1:*",
                           replay_endpoint="tcp://127.0.0.1:*")
    live = LiveRelay(engine, bootstrap, names)
    worker = subprocess.Popen(
        [sys.executable, "-m", "kvidx.cli", "worker", "--bootstrap", bootstrap, "--topic-prefix", "faults.",
         "--data-dir", str(tmp_path / "worker"), "--snapshot-interval", "0.5", "--web-port", "0"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=open(tmp_path / "worker.log", "w"),
        stderr=subprocess.STDOUT, start_new_session=True)
    store, follower = start_follower(bootstrap, names)
    try:
        work = workload_requests(11, 80)
        for prompt, output in work[:40]:
            engine.serve(prompt, output)
        wait_for(lambda: follower_matches_engine(store, engine, live), what="follower before the restart")

        broker.restart(down_s=1.0)
        for prompt, output in work[40:]:  # the relay keeps publishing into librdkafka's queue
            engine.serve(prompt, output)
        wait_for(lambda: live.relay.core.next_seq == engine.next_seq, what="relay caught up")
        assert live.sink.flush(60) == 0 and live.sink.errors == 0
        wait_for(lambda: store.shards[MODEL].replicas[("sim-0", 0)].seq == engine.next_seq - 1,
                 timeout=60, what="follower to see every batch after the restart")
        assert follower_matches_engine(store, engine, live)
        shards = wait_snapshots(bootstrap, names["snapshots"], {MODEL: engine.next_seq + 1}, worker,
                                tmp_path / "worker.log")
        assert shards[MODEL].replicas[("sim-0", 0)].seq == engine.next_seq - 1
        want = store.shards[MODEL].replicas[("sim-0", 0)].blocks
        assert shards[MODEL].replicas[("sim-0", 0)].blocks == want
    finally:
        follower.stop()
        live.stop()
        engine.close()
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
        broker.stop()


def test_relay_restart_and_engine_restart(kafka_bootstrap, topics):
    engine = SimVllmEngine(num_blocks=40, block_size=32, endpoint="tcp://127.0.0.1:*",
                           replay_endpoint="tcp://127.0.0.1:*")
    endpoint = engine.endpoint
    live = LiveRelay(engine, kafka_bootstrap, topics)
    store, follower = start_follower(kafka_bootstrap, topics)
    work = workload_requests(21, 90)
    try:
        for prompt, output in work[:30]:
            engine.serve(prompt, output)
        wait_for(lambda: follower_matches_engine(store, engine, live), what="first relay's view")
        epoch1 = store.shards[MODEL].replicas[("sim-0", 0)].epoch

        # relay restart: the engine goes on while no relay listens; a new relay (new epoch) clears
        # the replica and rebuilds it from the engine's replay buffer
        live.stop()
        for prompt, output in work[30:60]:
            engine.serve(prompt, output)
        time.sleep(0.002)  # a new epoch is the wall clock in ms: make sure it moved
        live = LiveRelay(engine, kafka_bootstrap, topics)
        wait_for(lambda: live.relay.core.next_seq == engine.next_seq, what="replay after relay restart")
        wait_for(lambda: store.shards[MODEL].replicas[("sim-0", 0)].epoch > epoch1
                 and follower_matches_engine(store, engine, live), what="new relay's view")

        # engine restart: same endpoint, empty cache, sequence from 0
        port = int(endpoint.rsplit(":", 1)[1])
        engine.close()
        time.sleep(0.2)
        engine = SimVllmEngine(num_blocks=40, block_size=32, endpoint=f"tcp://127.0.0.1:{port}",
                               replay_endpoint="tcp://127.0.0.1:*")
        time.sleep(0.5)  # the relay's SUB reconnects to the new publisher
        for prompt, output in work[60:]:
            engine.serve(prompt, output)
        wait_for(lambda: live.relay.core.counters["restarts"] == 1, what="relay to see the restart")
        wait_for(lambda: follower_matches_engine(store, engine, live), what="view after engine restart")
        shard = store.shards[MODEL]
        for prompt, _ in work[:30]:  # the old engine's blocks are gone with it
            cached_before = walk.credited(shard, prompt_hashes(prompt, BS), len(prompt), "sim-0")
            assert cached_before == 0 or set(engine.engine_hashes(prompt)) & engine.cached_hashes()
    finally:
        follower.stop()
        live.stop()
        engine.close()


def test_worker_killed_mid_burst_loses_nothing(kafka_bootstrap, topics, tmp_path):
    from kvidx.engines.recording import read_frames
    from relays.run import play_recording
    from tests.helpers import LLAMA
    from tests.integration.helpers import answers, expected_shard, prompts, start_worker

    sink = KafkaSink(kafka_bootstrap, topics["events"], topics["dead_letters"])
    log1 = tmp_path / "w1.log"
    w1 = start_worker(kafka_bootstrap, topics["prefix"], tmp_path / "w1", log1)
    killed = threading.Event()
    rounds: list[int] = []

    def publish():  # replicas r0, r1, ... until two rounds after the kill: the kill lands mid-burst
        i = after = 0
        while after < 2:
            play_recording(LLAMA / "frames.jsonl", "tiny", sink, BS, replica=f"r{i}")
            i += 1
            after += killed.is_set()
            time.sleep(0.5)
        rounds.append(i)

    burst = threading.Thread(target=publish)
    burst.start()
    # kill the worker as soon as it folds: the burst is still arriving
    wait_for(lambda: "shard_loaded model=tiny" in log1.read_text(), timeout=60, what="worker folding")
    w1.send_signal(signal.SIGKILL)
    w1.wait()
    killed.set()
    burst.join()
    assert sink.drain(60) == 0
    sink.close()
    (published,) = rounds
    log2 = tmp_path / "w2.log"
    w2 = start_worker(kafka_bootstrap, topics["prefix"], tmp_path / "w1", log2)  # same disk, restarted
    try:
        n = sum(1 for _ in read_frames(LLAMA / "frames.jsonl")) + 1
        shards = wait_snapshots(kafka_bootstrap, topics["snapshots"], {"tiny": published * n}, w2, log2)
    finally:
        w2.terminate()
        w2.wait(30)
    ps = prompts(LLAMA / "requests.jsonl")[::5]
    single = [a[0][1:] for a in answers(expected_shard(LLAMA / "frames.jsonl", "tiny"), ps)]
    got = answers(shards["tiny"], ps)
    for i in range(published):
        assert [next(x[1:] for x in a if x[0] == f"r{i}") for a in got] == single
