"""Re-grouping a live model (`kvidx resync --replica-groups G`) over a real broker: four live relays
of simulated vLLM engines publish with one replica group; the request moves every replica whose group
changes among 4 (a clear in the old group, its mirror replayed into the new one) while traffic goes on.
Folded per shard key as the workers fold, and merged as a service instance merges, the index holds
every replica whole, in its new group only, and answers like a single shard of everything."""

import threading
import time

import pytest
from confluent_kafka import Consumer

from kvidx.config import Config, ModelConfig
from kvidx.core import walk
from kvidx.core.groups import hashed_group, shard_key
from kvidx.core.hashing import prompt_hashes
from kvidx.core.shard import ModelShard
from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.engines.vllm.sim import SimVllmEngine
from kvidx.sim.prompts import workload_requests
from relays.control import ControlListener, send_resync
from relays.run import Relay
from relays.sinks import KafkaSink
from relays.zmq_source import ZmqSource
from schemas.events import decode_batch

BS = 16
G = 4


def _folded(bootstrap, topic, want_parts: int):
    """Every batch of the events topic, folded per shard key in partition order (as the workers
    fold), and all of them into one shard (as a service instance that follows every group)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"regroup-check-{time.time_ns()}",
                  "auto.offset.reset": "earliest"})
    c.subscribe([topic])
    msgs, deadline = [], time.monotonic() + 60
    while time.monotonic() < deadline:
        got = [m for m in c.consume(500, 0.5) if not m.error()]
        msgs += got
        if msgs and not got and sum(1 for m in msgs if decode_batch(m.value()).part) >= want_parts:
            break
    c.close()
    per_key: dict[str, ModelShard] = {}
    whole = ModelShard("sim", BS)
    for m in msgs:
        b = decode_batch(m.value())
        key = m.key().decode()
        assert key == shard_key(b.model, b.replica_group)
        per_key.setdefault(key, ModelShard("sim", BS)).apply(b, 0.0)
        whole.apply(b, 0.0)
    return per_key, whole


@pytest.mark.timeout(300)
def test_regroup_moves_every_replica_whole_while_traffic_flows(kafka_bootstrap, topics):
    names = [f"sim-{i}" for i in range(6)]
    moving = [n for n in names if hashed_group(n, G) != 0]
    assert moving and len(moving) < len(names)  # some move, some stay in group 0
    config = Config(models={"sim": ModelConfig(replica_groups=1)})
    sink = KafkaSink(kafka_bootstrap, topics["events"], topics["dead_letters"],
                     replica_group=config.replica_group)
    engines, relays, cores, controls, threads = {}, {}, {}, [], []
    for n in names:
        e = engines[n] = SimVllmEngine(num_blocks=60, block_size=32, endpoint="tcp://127.0.0.1:*",
                                       replay_endpoint="tcp://127.0.0.1:*")
        cores[n] = VllmPublisherRelay("sim", n, BS)
        r = relays[n] = Relay(cores[n], sink, ZmqSource(e.endpoint, e.replay_endpoint),
                              resync_blocks_per_s=2000, resync_jitter_s=0.2)
        controls.append(ControlListener(kafka_bootstrap, topics["control"], "sim", n,
                                        lambda req, r=r: r.request_resync(req.replica_groups)).start())
        r.start_fresh()
        t = threading.Thread(target=r.run_live, args=(0.02,), daemon=True)
        t.start()
        threads.append(t)
    time.sleep(1.0)  # subscriptions
    work = workload_requests(11, 120)
    try:
        for i, (prompt, output) in enumerate(work[:60]):
            engines[names[i % len(names)]].serve(prompt, output)
        send_resync(kafka_bootstrap, topics["control"], "sim", "*", reason="test", replica_groups=G)
        for i, (prompt, output) in enumerate(work[60:]):  # traffic while the replicas move
            engines[names[i % len(names)]].serve(prompt, output)
            time.sleep(0.01)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(
                r._resync is not None or r._resync_wanted.is_set()
                or cores[n].next_seq != engines[n].next_seq for n, r in relays.items()):
            time.sleep(0.05)
        assert all(cores[n].resync_part > 0 for n in names), "every relay replays its mirror"
        sink.flush()
    finally:
        for c in controls:
            c.stop()
        for r in relays.values():
            r.close()
        for t in threads:
            t.join(5)
    per_key, whole = _folded(kafka_bootstrap, topics["events"], sum(c.resync_part for c in cores.values()))
    sink.close()
    for e in engines.values():
        e.close()
    assert sorted(per_key) == sorted({shard_key("sim", hashed_group(n, G)) for n in names} | {"sim"})
    for n in names:
        g = hashed_group(n, G)
        live = cores[n].mirror
        assert {eh for (eh, _, _) in live.live} == engines[n].cached_hashes()  # the relay saw it all
        held = per_key[shard_key("sim", g)].replicas[(n, 0)]
        assert held.blocks == len(live.refs), n  # whole in its new group
        if g != 0:  # and nothing left where it was
            assert per_key["sim"].replicas[(n, 0)].blocks == 0, n
    merged = per_key["sim"]
    for key in sorted(per_key):
        if key != "sim":
            merged.absorb(per_key[key])
    def seen(shard, prompt):
        hashes = prompt_hashes(prompt, BS)
        return sorted((a.replica, a.cached_tokens, a.resumable_tokens)
                      for a in walk.lookup(shard, hashes, len(prompt), 0.0))

    assert any(r[1] for p, _ in work for r in seen(whole, p))
    for prompt, _ in work:
        assert seen(merged, prompt) == seen(whole, prompt)
