"""Several routers, several service instances, one index (real broker, real HTTP): two instances
answer alike, a route recorded through one is pending credit on the other, moves between tiers
never lose a block, pool blocks credit every attached replica, and /v1/rank orders by price."""

import threading
import time

import httpx
import pytest

from index_service.app import create_app
from index_service.follower import KafkaFollower
from index_service.store import ShardStore
from kvidx.config import Config, PoolConfig
from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.engines.vllm.sim import SimVllmEngine
from kvidx.kafka.publish import Publisher
from kvidx.sim.prompts import workload_requests
from relays.run import Relay
from relays.sinks import KafkaSink
from relays.zmq_source import ZmqSource
from schemas.events import SCHEMA_VERSION, BlocksRemoved, BlocksStored, EventBatch
from schemas.routes import encode_route
from tests.helpers import ServerThread, wait_for

pytestmark = pytest.mark.kafka
MODEL = "sim"


def core(answer):
    return [(r["replica"], r["cached_tokens"], r["resumable_tokens"], r["pending_tokens"],
             [(t["tier"], t["tokens"]) for t in r["tiers"]]) for r in answer["replicas"]]


@pytest.fixture
def fleet(kafka_bootstrap, topics):
    config = Config(pools={"pool-1": PoolConfig(replicas=["sim-0", "sim-1"], tier="POOL")})
    engines = [SimVllmEngine(num_blocks=60, block_size=32, endpoint="tcp://127.0.0.1:*",
                             replay_endpoint="tcp://127.0.0.1:*") for _ in range(2)]
    sinks, relays, threads = [], [], []
    for i, e in enumerate(engines):
        sink = KafkaSink(kafka_bootstrap, topics["events"], topics["dead_letters"])
        relay = Relay(VllmPublisherRelay(MODEL, f"sim-{i}", 16), sink,
                      ZmqSource(e.endpoint, e.replay_endpoint))
        relay.start_fresh()
        t = threading.Thread(target=relay.run_live, args=(0.05,), daemon=True)
        t.start()
        sinks.append(sink)
        relays.append(relay)
        threads.append(t)
    instances = []
    for _ in range(2):
        store = ShardStore(config=config)
        store.publish_route = Publisher(kafka_bootstrap, topics["routes"], encode_route)
        follower = KafkaFollower(store, kafka_bootstrap, topics["events"], topics["snapshots"],
                                 topics["routes"]).start()
        server = ServerThread(create_app(store))
        url = server.__enter__()
        instances.append((store, follower, server, httpx.Client(base_url=url, timeout=10)))
    time.sleep(0.3)
    yield engines, relays, sinks, instances
    for store, follower, server, client in instances:
        client.close()
        server.__exit__(None, None, None)
        follower.stop()
        store.publish_route.close()
    for r, t in zip(relays, threads, strict=True):
        r.close()
        t.join(5)
    for s in sinks:
        s.close()
    for e in engines:
        e.close()


def caught_up(instances, engines):
    for store, *_ in instances:
        shard = store.shards.get(MODEL)
        for i, e in enumerate(engines):
            st = shard.replicas.get((f"sim-{i}", 0)) if shard else None
            if st is None or st.seq != e.next_seq - 1:
                return False
    return True


def test_two_instances_pending_credit_tiers_and_pools(fleet):
    engines, relays, sinks, instances = fleet
    (_, _, _, a), (_, _, _, b) = instances[0], instances[1]
    work = workload_requests(4, 40)
    for i, (prompt, output) in enumerate(work):
        engines[i % 2].serve(prompt, output)
    wait_for(lambda: caught_up(instances, engines), what="both instances to see every batch")

    # the same lookup, the same answer, through either instance
    for prompt, _ in work[::5]:
        ra = a.post("/v1/lookup", json={"model": MODEL, "token_ids": prompt}).json()
        rb = b.post("/v1/lookup", json={"model": MODEL, "token_ids": prompt}).json()
        assert core(ra) == core(rb)
    assert any(r["cached_tokens"] for prompt, _ in work[::5]
               for r in a.post("/v1/lookup", json={"model": MODEL, "token_ids": prompt}).json()["replicas"])

    # a route recorded through instance A is pending credit on instance B
    fresh = list(range(3000, 3000 + 200))
    r = a.post("/v1/routes", json={"request_id": "req-1", "model": MODEL, "replica": "sim-1",
                                   "token_ids": fresh, "credited_tokens": 0})
    assert r.status_code == 202 and r.json()["duplicate"] is False

    def pending_on_b():
        ans = b.post("/v1/lookup", json={"model": MODEL, "token_ids": fresh}).json()["replicas"]
        s1 = next(x for x in ans if x["replica"] == "sim-1")
        return s1["pending_tokens"] == 192 and s1["resumable_tokens"] == 192 and s1["cached_tokens"] == 0
    wait_for(pending_on_b, timeout=10, what="instance B to apply A's route")
    assert a.post("/v1/routes", json={"request_id": "req-1", "model": MODEL, "replica": "sim-1",
                                      "token_ids": fresh}).json()["duplicate"] is True
    # the busy replica's queue shows in the price, and /v1/rank puts the idle one first for this prompt
    ranked = b.post("/v1/rank", json={"model": MODEL, "token_ids": list(range(5000, 5100))}).json()
    assert ranked["replicas"][0]["replica"] == "sim-0"
    assert ranked["replicas"][1]["price"]["queue_s"] > 0

    # moves between tiers never lose a block; pool blocks credit every attached replica
    blocks = [11, 12, 13, 14]
    sink = sinks[0]

    def publish(replica, seq, events):
        now = time.time()
        sink.publish(EventBatch(SCHEMA_VERSION, MODEL, replica, 0, 1, seq, now, now, 16, events))
        sink.flush()

    publish("tiered", 0, [BlocksStored("GPU", 0, blocks, None, 0)])
    publish("tiered", 1, [BlocksStored("CPU", 0, blocks[2:], blocks[1], 2),
                          BlocksRemoved("GPU", 0, blocks[2:])])
    publish("pool-1", 0, [BlocksStored("POOL", 0, blocks, None, 0)])
    hashes_req = {"model": MODEL, "block_hashes": blocks, "prompt_tokens": 65}

    def tiers_ok():
        ans = {x["replica"]: x for x in b.post("/v1/lookup", json=hashes_req).json()["replicas"]}
        t = ans.get("tiered")
        return (t is not None and t["cached_tokens"] == 64
                and [(x["tier"], x["tokens"]) for x in t["tiers"]] == [("GPU", 32), ("CPU", 32)]
                and ans["sim-0"]["tiers"] == [{"tier": "POOL", "tokens": 64}]
                and ans["sim-1"]["cached_tokens"] == 64 and "pool-1" not in ans)
    wait_for(tiers_ok, timeout=10, what="tiers and pool credit on instance B")

    def tiered_on_a():  # instance A follows the topic on its own: it may fold these batches a moment later
        ans = {x["replica"]: x for x in a.post("/v1/lookup", json=hashes_req).json()["replicas"]}
        return "tiered" in ans and [x["tier"] for x in ans["tiered"]["tiers"]] == ["GPU", "CPU"]
    wait_for(tiered_on_a, timeout=10, what="the tiered replica on instance A")
    ans = a.post("/v1/lookup", json=hashes_req).json()["replicas"]
    assert next(x for x in ans if x["replica"] == "tiered")["price"]["load_s"] > 0  # CPU part costs a load
