"""A live relay on a real ZMQ stream and a real broker: gaps filled through the engine's replay
endpoint, malformed messages dead-lettered while the relay goes on."""

import threading
import time

import msgspec
import pytest
from confluent_kafka import Consumer

from index_service.follower import KafkaFollower
from index_service.store import ShardStore
from kvidx.core import walk
from kvidx.core.hashing import prompt_hashes
from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.engines.vllm.sim import SimVllmEngine
from kvidx.sim.prompts import workload_requests
from relays.run import GAPS, Relay
from relays.sinks import KafkaSink
from relays.zmq_source import ZmqSource
from tests.helpers import wait_for

pytestmark = pytest.mark.kafka
BS = 16


@pytest.fixture
def live(kafka_bootstrap, topics):
    engine = SimVllmEngine(num_blocks=40, block_size=32, endpoint="tcp://127.0.0.1:*",
                           replay_endpoint="tcp://127.0.0.1:*")
    sink = KafkaSink(kafka_bootstrap, topics["events"], topics["dead_letters"])
    core = VllmPublisherRelay("sim", "sim-0", BS)
    relay = Relay(core, sink, ZmqSource(engine.endpoint, engine.replay_endpoint))
    relay.start_fresh()
    t = threading.Thread(target=relay.run_live, args=(0.05,), daemon=True)
    t.start()
    time.sleep(0.3)  # subscription reaches the publisher
    yield engine, relay, sink
    relay.close()
    t.join(5)
    sink.close()
    engine.close()


def caught_up(engine, relay):
    return relay.core.next_seq == engine.next_seq


def test_dropped_message_is_recovered_through_replay(live, kafka_bootstrap, topics):
    engine, relay, _ = live
    work = workload_requests(3, 60)
    filled_before = GAPS.labels("sim-0", "filled")._value.get()
    for i, (prompt, output) in enumerate(work):
        if i in (10, 30, 31):
            engine.drop_next(1)  # published with a seq and buffered for replay, but never sent
        engine.serve(prompt, output)
    wait_for(lambda: caught_up(engine, relay), what="relay to reach the engine's last seq")
    assert engine.dropped >= 3
    assert GAPS.labels("sim-0", "filled")._value.get() > filled_before
    # the mirror holds exactly what the engine holds: nothing was lost with the dropped messages
    assert {eh for (eh, _, _) in relay.core.mirror.live} == engine.cached_hashes()

    # and so does a service instance fed from Kafka
    store = ShardStore(BS)
    follower = KafkaFollower(store, kafka_bootstrap, topics["events"], topics["snapshots"]).start()
    try:
        wait_for(lambda: store.ready and "sim" in store.shards
                 and store.shards["sim"].replicas[("sim-0", 0)].seq == engine.next_seq - 1,
                 what="follower to apply every batch")
        shard = store.shards["sim"]
        assert len(shard.groups[0].any) == len(relay.core.mirror.refs)
        for prompt, _ in work[-10:]:
            want = len(prompt) - 1  # upper bound; the engine's own answer is checked by serving
            credited = walk.credited(shard, prompt_hashes(prompt, BS), len(prompt), "sim-0")
            assert credited == engine.serve(prompt) and credited <= want
            wait_for(lambda: caught_up(engine, relay))
            wait_for(lambda: shard.replicas[("sim-0", 0)].seq == engine.next_seq - 1)
    finally:
        follower.stop()


def test_malformed_frame_goes_to_dead_letters_and_the_relay_goes_on(live, kafka_bootstrap, topics):
    engine, relay, sink = live
    prompt, output = workload_requests(5, 1)[0]
    engine.serve(prompt, output)
    bad_seq = engine.send_garbage(b"\xc1 not msgpack")
    engine.serve(prompt, output)  # served again: a hit, and maybe new output blocks
    second = workload_requests(9, 1)[0]
    engine.serve(*second)
    wait_for(lambda: caught_up(engine, relay), what="relay to pass the bad frame")
    sink.flush()
    assert {eh for (eh, _, _) in relay.core.mirror.live} == engine.cached_hashes()

    c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "dlq-check",
                  "auto.offset.reset": "earliest"})
    c.subscribe([topics["dead_letters"]])
    msgs = []
    deadline = time.monotonic() + 30
    while not msgs and time.monotonic() < deadline:
        msgs = [m for m in c.consume(10, 1.0) if not m.error()]
    c.close()
    assert len(msgs) == 1
    headers = dict(msgs[0].headers())
    assert headers["reason"] == b"malformed_payload"
    assert headers["seq"] == str(bad_seq).encode()
    # not msgpack: kept as its first bytes, length and digest (never a whole payload: it could hold tokens)
    kept = msgspec.msgpack.decode(msgs[0].value())
    assert kept["head"] == b"\xc1 not msgpack" and kept["len"] == 13 and headers["redaction"] == b"truncated"
