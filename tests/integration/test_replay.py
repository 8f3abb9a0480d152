"""History replay on a real broker: the index rebuilt at a past moment from the events topic (from
the beginning, from a history checkpoint, or up to an offset) answers as the live index answered then;
a routing decision is explained from the history."""

import json
import random
import time

import msgspec
import pytest

from index_service.follower import KafkaFollower
from index_service.store import ShardStore
from kvidx.cli import main
from kvidx.core import walk
from kvidx.core.hashing import prompt_hashes
from kvidx.core.snapshot import encode_snapshot
from kvidx.kafka.log import iso
from kvidx.kafka.publish import Publisher
from kvidx.ops.replay import checkpoint, explain, replay
from relays.sinks import KafkaSink
from schemas.events import SCHEMA_VERSION, BlocksRemoved, BlocksStored, EventBatch, ReplicaCleared
from schemas.routes import ROUTES_VERSION, RouteDecision, encode_route
from schemas.usage import USAGE_VERSION, UsageReport, encode_usage
from streams.snapshots import SnapshotTopic, split
from tests.helpers import wait_for
from tests.integration.helpers import ready

MODEL = "m"


def core(answers):
    """The exact part of in-process answers or of their JSON (replay --json)."""
    answers = msgspec.to_builtins(answers)
    return [(a["replica"], a["dp_rank"], a["cached_tokens"], a["resumable_tokens"], a["pending_tokens"],
             [(t["tier"], t["tokens"]) for t in a["tiers"]]) for a in answers]


@pytest.mark.kafka
def test_replay_answers_as_the_index_did_then(kafka_bootstrap, topics, tmp_path, capsys):
    b = kafka_bootstrap
    rng = random.Random(5)
    sizes = (("p1", 170), ("p2", 100), ("p3", 90))
    prompts = {k: [rng.randrange(50_000) for _ in range(n)] for k, n in sizes}
    hashes = {k: prompt_hashes(v, 16) for k, v in prompts.items()}
    ready(b, topics)  # leaders elected (the follower's first offsets_for_times is not retried)
    store = ShardStore(16)
    follower = KafkaFollower(store, b, topics["events"], topics["snapshots"], topics["routes"]).start()
    sink = KafkaSink(b, topics["events"], topics["dead_letters"])
    routes = Publisher(b, topics["routes"], encode_route)
    usage = Publisher(b, topics["usage"], encode_usage, linger_ms=5)
    seqs: dict[tuple[str, str], int] = {}

    def send(replica, events, model=MODEL):
        seq = seqs.get((model, replica), -1) + 1
        seqs[(model, replica)] = seq
        now = time.time()
        sink.publish(EventBatch(SCHEMA_VERSION, model, replica, 0, 1, seq, now, now, 16, events))

    def settle():
        sink.flush()
        routes.producer.flush(10)

        def caught_up():
            shard = store.shards.get(MODEL)
            return shard is not None and all(
                shard.replicas.get((r, 0)) is not None and shard.replicas[(r, 0)].seq == s
                for (m, r), s in seqs.items() if m == MODEL)
        wait_for(caught_up, what="the live index to fold every batch")
        time.sleep(0.02)
        t = time.time()
        shard = store.shards[MODEL]
        answers = {k: core(walk.lookup(shard, hashes[k], len(prompts[k]), t)) for k in prompts}
        time.sleep(0.02)
        return t, answers

    h1, h2, h3 = hashes["p1"], hashes["p2"], hashes["p3"]
    moments = []
    try:
        # 1: a holds p1 on GPU; b the first 4 blocks of p1 and p2 on CPU
        send("a", [BlocksStored("GPU", 0, h1, None, 0)])
        send("b", [BlocksStored("GPU", 0, h1[:4], None, 0), BlocksStored("CPU", 0, h2, None, 0)])
        send("x", [BlocksStored("GPU", 0, h3, None, 0)], model="other")
        moments.append(settle())
        # 2: a evicts the tail of p1; b extends its p1 prefix; p2 moves to GPU on b
        send("a", [BlocksRemoved("GPU", 0, h1[6:])])
        send("b", [BlocksStored("GPU", 0, h1[4:8], h1[3], 4), BlocksStored("GPU", 0, h2[:3], None, 0),
                   BlocksRemoved("CPU", 0, h2[:3])])
        moments.append(settle())
        # 3: a restarts (cleared) and caches p3; b evicts p1 from block 2
        send("a", [ReplicaCleared("engine_restart"), BlocksStored("GPU", 0, h3, None, 0)])
        send("b", [BlocksRemoved("GPU", 0, h1[2:8])])
        moments.append(settle())
        # 4: a router sends p2 to a (pending credit there) and the engine reports what it reused
        n2 = len(prompts["p2"])
        d = RouteDecision(ROUTES_VERSION, "req-7", MODEL, "a", 0, h2, n2, 0, time.time(), 60.0)
        assert store.apply_route(d)
        routes(d)
        usage(UsageReport(USAGE_VERSION, "req-7", MODEL, "a", 0, len(prompts["p2"]), 0, time.time(), "vllm"))
        usage.close()
        moments.append(settle())
        assert moments[3][1]["p2"][0][4] > 0  # the live index credited the pending prompt
        assert len({json.dumps(a) for _, a in moments}) == 4  # every moment answers differently

        # from the beginning of the topic: every moment as the live index answered it
        for t, answers in moments:
            r = replay(b, topics, MODEL, until=t, progress=False)
            assert r.start == "beginning" and r.exact
            got = {k: core(walk.lookup(r.shard, hashes[k], len(prompts[k]), t)) for k in prompts}
            assert got == answers, f"replay at {iso(t)}"
        assert r.other_models >= 1 and r.routes_applied == 1

        # a history checkpoint (a worker snapshot of moment 2) shortens later replays, not earlier ones
        r2 = replay(b, topics, MODEL, until=moments[1][0], progress=False)
        SnapshotTopic(b, topics["snapshots"]).publish(
            split(MODEL, encode_snapshot(r2.shard), 1, 0), r2.shard.events_partition)
        written = checkpoint(b, topics)
        assert [(c.model, c.events_offset) for c in written] == [(MODEL, r2.shard.events_offset)]
        assert checkpoint(b, topics) == []  # nothing new since
        r3 = replay(b, topics, MODEL, until=moments[2][0], progress=False)
        assert r3.start == "checkpoint" and r3.batches == 2
        assert {k: core(walk.lookup(r3.shard, hashes[k], len(prompts[k]), moments[2][0])) for k in prompts} \
            == moments[2][1]
        r1 = replay(b, topics, MODEL, until=moments[0][0], progress=False)
        assert r1.start == "beginning"
        # up to an offset instead of a time
        p = r3.shard.events_partition
        ro = replay(b, topics, MODEL, at_offset=(p, r3.stop_offsets[p]), progress=False, pending=False)
        assert {k: core(walk.lookup(ro.shard, hashes[k], len(prompts[k]), moments[2][0])) for k in prompts} \
            == moments[2][1]

        # explain the routing decision: the index at its time, without its own pending credit
        ex = explain(b, topics, "req-7", progress=False)
        assert ex["routed_to"] == {"replica": "a", "dp_rank": 0} and ex["engine_reused_tokens"] == 0
        by = {x["replica"]: x for x in ex["replicas"]}
        assert by["b"]["blocks"] == len(h2) and by["b"]["blocks_by_tier"] == {"GPU": 3, "CPU": len(h2) - 3}
        assert by["a"]["blocks"] == 0 and by["a"]["pending_tokens"] == 0 and by["a"]["chosen"]
        assert "b (rank 0) had 6 blocks" in ex["text"] and "the engine reported 0 reused" in ex["text"]

        # the command: ISO time, prompts from a JSON file, --json
        pf = tmp_path / "prompts.json"
        pf.write_text(json.dumps([{"name": "p1", "token_ids": prompts["p1"]}]))
        t1 = moments[0][0]
        capsys.readouterr()
        assert main(["replay", "--bootstrap", b, "--topic-prefix", topics["prefix"], "--model", MODEL,
                     "--until", repr(t1), "--prompts", str(pf), "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert core(out["lookups"][0]["replicas"]) == moments[0][1]["p1"]
        assert {x["replica"] for x in out["replicas"]} == {"a", "b"}
        # text forms: an ISO time, and a decision explained by request id
        common = ["--bootstrap", b, "--topic-prefix", topics["prefix"]]
        assert main(["replay", *common, "--model", MODEL, "--until", iso(moments[2][0] + 0.001),
                     "--prompts", str(pf)]) == 0
        text = capsys.readouterr().out
        assert "batches folded from the checkpoint" in text and "prompt p1 (170 tokens)" in text
        assert main(["replay", *common, "--request-id", "req-7"]) == 0
        text = capsys.readouterr().out
        assert text.startswith("At ") and "* a rank 0: 0 blocks" in text
    finally:
        follower.stop()
        routes.close()
        sink.close()


@pytest.mark.kafka
def test_replay_of_a_model_split_in_replica_groups(kafka_bootstrap, topics):
    """Every group's key is replayed (each on its own partition), and the shard answers as the fold of
    everything did."""
    from kvidx.config import Config, ModelConfig, ShardSettings
    from kvidx.core.shard import ModelShard
    from tests.helpers import random_fleet

    config = Config(models={"m": ModelConfig(replica_groups=4)})
    batches, docs = random_fleet(24, seed=9, groups=4)
    sink = KafkaSink(kafka_bootstrap, topics["events"], topics["dead_letters"],
                     replica_group=config.replica_group)
    whole = ModelShard("m", 16)
    for batch in batches:
        whole.apply(batch, 1.0)
        sink.publish(batch)
    sink.flush()
    sink.close()
    time.sleep(0.5)
    r = replay(kafka_bootstrap, topics, "m", until=time.time(), settings=ShardSettings(config),
               progress=False)
    assert r.other_models == 0  # the groups' keys are the model's

    def seen(shard):
        return [sorted((a.replica, a.dp_rank, a.cached_tokens, a.resumable_tokens)
                       for a in walk.lookup(shard, d, len(d) * 16 + 1, 100.0)) for d in docs]

    assert sorted(r.shard.replicas) == sorted(whole.replicas) and seen(r.shard) == seen(whole)
