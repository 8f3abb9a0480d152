"""A relay replays its mirror on request (control topic), shallowest blocks first, paced, while live
events keep flowing: an index that had lost the replica's state is whole again from the replay on.
The resync parts themselves, without a broker: tests/unit/engines/vllm/test_resync.py."""

import threading
import time

import pytest
from confluent_kafka import Consumer

from kvidx.core.shard import ModelShard
from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.engines.vllm.sim import SimVllmEngine
from kvidx.sim.prompts import workload_requests
from relays.control import ControlListener, send_resync
from relays.run import Relay
from relays.sinks import KafkaSink
from relays.zmq_source import ZmqSource
from schemas.events import BlocksStored, decode_batch

BS = 16


@pytest.mark.kafka
def test_resync_on_request_over_kafka_with_live_traffic(kafka_bootstrap, topics):
    engine = SimVllmEngine(num_blocks=80, block_size=32, endpoint="tcp://127.0.0.1:*",
                           replay_endpoint="tcp://127.0.0.1:*")
    sink = KafkaSink(kafka_bootstrap, topics["events"], topics["dead_letters"])
    core = VllmPublisherRelay("sim", "sim-0", BS)
    relay = Relay(core, sink, ZmqSource(engine.endpoint, engine.replay_endpoint),
                  resync_blocks_per_s=400, resync_jitter_s=0.2)
    control = ControlListener(kafka_bootstrap, topics["control"], "sim", "sim-0",
                              lambda req: relay.request_resync(req.replica_groups)).start()
    relay.start_fresh()
    t = threading.Thread(target=relay.run_live, args=(0.02,), daemon=True)
    t.start()
    time.sleep(1.0)  # subscriptions
    work = workload_requests(9, 80)
    try:
        for prompt, output in work[:40]:
            engine.serve(prompt, output)
        send_resync(kafka_bootstrap, topics["control"], "sim", "*", reason="test")
        deadline = time.monotonic() + 20
        while core.resync_part == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core.resync_part > 0, "the relay did not start the replay"
        for prompt, output in work[40:]:  # live traffic while the replay is paced out
            engine.serve(prompt, output)
            time.sleep(0.01)
        deadline = time.monotonic() + 30
        while (relay._resync is not None or core.next_seq != engine.next_seq) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert relay._resync is None and core.next_seq == engine.next_seq
        sink.flush()
    finally:
        control.stop()
        relay.close()
        t.join(5)
    parts = core.resync_part
    assert parts > 2  # paced: several parts

    c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "resync-check",
                  "auto.offset.reset": "earliest"})
    c.subscribe([topics["events"]])
    batches, deadline = [], time.monotonic() + 30
    while time.monotonic() < deadline:
        got = [m for m in c.consume(500, 0.5) if not m.error()]
        batches += [decode_batch(m.value()) for m in got]
        if batches and not got and sum(1 for b in batches if b.part) == parts:
            break
    c.close()
    # an index that knows nothing before the replay: fold from its first part on
    first = next(i for i, b in enumerate(batches) if b.part)
    fresh = ModelShard("sim", BS)
    for b in batches[first:]:
        fresh.apply(b, 0.0)
    assert fresh.replicas[("sim-0", 0)].blocks == len(core.mirror.refs)
    assert {eh for (eh, _, _) in core.mirror.live} == engine.cached_hashes()
    stored_in_parts = [e for b in batches if b.part for e in b.events if isinstance(e, BlocksStored)]
    assert stored_in_parts and all(e.parent is None for e in stored_in_parts)
    sink.close()
    engine.close()
