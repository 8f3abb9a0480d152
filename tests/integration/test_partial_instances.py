"""Done-when of issue #15 items 1-2 over a real broker: one model in 4 replica groups, folded by 2
workers, served by partial instances that find each other on the instances topic (A holds groups 0-1,
B and C hold 2-3) and answer every lookup like a full instance; then a worker is killed and an
instance (B) stops answering: A passes B over for C, a new instance D rebuilds groups 2-3 from the
surviving worker's snapshots, and the answers stay the full instance's."""

import contextlib
import signal

import httpx
import msgspec
import pytest

from index_service.app import create_app
from index_service.fanout import Announcer, Fanout, PeerDirectory
from index_service.follower import KafkaFollower
from index_service.store import ShardStore
from kvidx.config import Config, ModelConfig
from kvidx.core.hashing import prompt_hashes
from relays.run import play_recording
from relays.sinks import KafkaSink
from schemas.answers import LOOKUP_ANSWER_DECODER
from tests.helpers import LLAMA, ServerThread, wait_for
from tests.integration.helpers import both_assigned, group_worker, prompts, stop_workers

G = 4
MODEL = "m"
CONFIG = Config(models={MODEL: ModelConfig(replica_groups=G)})


@contextlib.contextmanager
def instance(name: str, groups, bootstrap: str, topics: dict, crash: list | None = None,
             announce: bool = True):
    """A service instance in process: its follower (snapshots, then events), its announcer, and the
    HTTP app on a loopback port. Appends its server to `crash` so a test can stop answering without
    saying goodbye (the announcer goes on: a hung instance). `announce=False`: a reference the
    others do not know of."""
    store = ShardStore(16, config=CONFIG, groups=groups)
    directory = PeerDirectory(name)
    follower = KafkaFollower(store, bootstrap, topics["events"], topics["snapshots"]).start()
    fanout = Fanout(directory, timeout_s=2.0) if groups is not None else None
    server = ServerThread(create_app(store, fanout=fanout))
    url = server.__enter__()
    announcer = Announcer(directory, bootstrap, topics["instances"], url, groups, interval_s=0.5)
    if announce:
        announcer.start()
    if crash is not None:
        crash.append(server)
    try:
        wait_for(lambda: store.ready or follower.error, 60, f"{name} caught up")
        assert follower.error is None, follower.error
        yield url, directory
    finally:
        if announce:
            announcer.stop()
        follower.stop()
        server.__exit__()


def _canon(raw: bytes) -> list:
    ans = LOOKUP_ANSWER_DECODER.decode(raw)
    assert not ans.partial, ans.missing_groups
    out = []
    for r in ans.replicas:
        r.freshness = None
        out.append(msgspec.to_builtins(r))
    return sorted(out, key=lambda r: (-r["resumable_tokens"], r["replica"], r["dp_rank"]))


def _same(c: httpx.Client, url: str, full: str, ps: list) -> bool:
    for p in ps:
        body = {"model": MODEL, "block_hashes": prompt_hashes(p, 16), "prompt_tokens": len(p)}
        a, f = c.post(f"{url}/v1/lookup", json=body), c.post(f"{full}/v1/lookup", json=body)
        if a.status_code != 200 or f.status_code != 200:
            return False
        try:
            if _canon(a.content) != _canon(f.content):
                return False
        except AssertionError:
            return False
    return True


@pytest.mark.timeout(600)
def test_partial_instances_and_failover(kafka_bootstrap, topics, tmp_path):
    sink = KafkaSink(kafka_bootstrap, topics["events"], topics["dead_letters"],
                     replica_group=CONFIG.replica_group)
    lines = (LLAMA / "frames.jsonl").read_text().splitlines(keepends=True)
    recs = []
    for k in (3, 2, 1):  # replicas that hold different blocks: the recording cut at a third, half, whole
        path = tmp_path / f"llama_{k}.jsonl"
        path.write_text("".join(lines[:len(lines) // k]))
        recs.append(path)
    replicas = [f"node-{i}:5557" for i in range(10)]
    ps = prompts(LLAMA / "requests.jsonl")
    logs = [tmp_path / "w1.log", tmp_path / "w2.log"]
    w1 = group_worker(kafka_bootstrap, topics["prefix"], tmp_path / "w1", logs[0])
    w2 = group_worker(kafka_bootstrap, topics["prefix"], tmp_path / "w2", logs[1])
    crashed: list = []
    try:
        both_assigned(kafka_bootstrap, topics["prefix"] + "kvidx-worker", [w1, w2], logs)
        for i, r in enumerate(replicas):
            play_recording(recs[i % 3], MODEL, sink, 16, replica=r)
        with contextlib.ExitStack() as stack, httpx.Client(timeout=10) as c:
            full, _ = stack.enter_context(instance("full", None, kafka_bootstrap, topics, announce=False))
            a, a_dir = stack.enter_context(instance("a", frozenset({0, 1}), kafka_bootstrap, topics))
            b, _ = stack.enter_context(instance("b", frozenset({2, 3}), kafka_bootstrap, topics, crashed))
            wait_for(lambda: {p.name for p in a_dir.alive()} == {"b"}, 30, "A sees B")
            wait_for(lambda: _same(c, a, full, ps) and _same(c, b, full, ps), 60, "A and B answer as full")
            assert any(r["resumable_tokens"] for p in ps[:20] for r in c.post(
                f"{a}/v1/lookup", json={"model": MODEL, "block_hashes": prompt_hashes(p, 16),
                                        "prompt_tokens": len(p)}).json()["replicas"])

            # a worker dies; B stops answering but its announcer goes on (hung); C holds 2-3 too
            w1.send_signal(signal.SIGKILL)
            w1.wait()
            crashed[0].server.should_exit = True
            crashed[0].thread.join(10)
            stack.enter_context(instance("c", frozenset({2, 3}), kafka_bootstrap, topics))
            wait_for(lambda: {p.name for p in a_dir.alive()} == {"b", "c"}, 30, "A sees C")
            for i, r in enumerate(reversed(replicas)):  # more events: every relay restarts
                play_recording(recs[i % 3], MODEL, sink, 16, replica=r)
            wait_for(lambda: _same(c, a, full, ps), 60, "A answers as full, with C for B")

            # a new instance rebuilt from the surviving worker's snapshots answers the same (it asks
            # A for groups 0-1)
            d, _ = stack.enter_context(instance("d", frozenset({2, 3}), kafka_bootstrap, topics))
            wait_for(lambda: _same(c, d, full, ps), 60, "D answers as full")
            assert w2.poll() is None, open(logs[1]).read()[-3000:]
            assert "shard_loaded" in open(logs[1]).read()
    finally:
        stop_workers(w1, w2)
        sink.close()
