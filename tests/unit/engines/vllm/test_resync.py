"""The vLLM relay's resync (kvidx/engines/vllm/relay.py, no broker): the parts of a mirror's replay
rebuild a fresh index, shallowest blocks first. On request over Kafka, with live traffic:
tests/integration/test_resync.py."""

import time

from kvidx.core import walk
from kvidx.core.hashing import prompt_hashes
from kvidx.core.shard import ModelShard
from kvidx.engines.contract import Frame
from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.engines.vllm.sim import SimVllmEngine
from kvidx.sim.prompts import workload_requests
from schemas.events import BlocksStored, ReplicaCleared

BS = 16


def test_resync_parts_rebuild_a_fresh_index_shallowest_first():
    engine = SimVllmEngine(num_blocks=64, block_size=32, endpoint="inproc://resync-unit")
    core = VllmPublisherRelay("sim", "sim-0", BS)
    full = ModelShard("sim", BS)  # what the live batches built
    work = workload_requests(8, 40)
    sent = 0
    for prompt, output in work:
        engine.serve(prompt, output)
        for seq, payload in list(engine._buffer)[sent:]:
            for b in core.on_frame(Frame(b"kv", seq, payload, time.time_ns())).batches:
                full.apply(b, 0.0)
        sent = len(engine._buffer)
    parts = list(core.resync(max_blocks=10))
    assert len(parts) > 3 and isinstance(parts[0].events[0], ReplicaCleared)
    assert [p.part for p in parts] == list(range(1, len(parts) + 1))
    depth = {h: core.mirror.memo[eh][1] for (eh, _, _), (_, sub) in core.mirror.live.items() for h in sub}
    spans = [[depth[h] for e in p.events if isinstance(e, BlocksStored) for h in e.hashes] for p in parts]
    spans = [s for s in spans if s]
    assert all(max(a) <= min(b) for a, b in zip(spans, spans[1:], strict=False)), "shallowest first"
    fresh = ModelShard("sim", BS)
    for p in parts:
        assert fresh.apply(p, 0.0)
    assert fresh.replicas[("sim-0", 0)].blocks == len(core.mirror.refs) == full.replicas[("sim-0", 0)].blocks
    for prompt, _ in work:
        h = prompt_hashes(prompt, BS)
        assert walk.credited(fresh, h, len(prompt)) == walk.credited(full, h, len(prompt))
    assert any(walk.credited(fresh, prompt_hashes(p, BS), len(p)) for p, _ in work)
    engine.close()


def test_resync_replays_the_dynamo_keys_too():
    """A relay started by Dynamo's /register publishes Dynamo keys beside the blocks: its mirror's
    replay carries them, so a fresh index answers /query_by_hash's walk as the live one."""
    from kvidx.core.hashing import dynamo_keys, dynamo_local_hashes, pack_tokens

    engine = SimVllmEngine(num_blocks=64, block_size=32, endpoint="inproc://resync-dynamo")
    core = VllmPublisherRelay("sim", "sim-0", BS, dynamo_block_size=32)
    full = ModelShard("sim", BS)
    work = workload_requests(8, 30)
    sent = 0
    for prompt, output in work:
        engine.serve(prompt, output)
        for seq, payload in list(engine._buffer)[sent:]:
            for b in core.on_frame(Frame(b"kv", seq, payload, time.time_ns())).batches:
                full.apply(b, 0.0)
        sent = len(engine._buffer)
    fresh = ModelShard("sim", BS)
    for p in core.resync(max_blocks=10):
        fresh.apply(p, 0.0)
    st_full, st_fresh = full.replicas[("sim-0", 0)], fresh.replicas[("sim-0", 0)]
    assert st_fresh.router_keys == st_full.router_keys > 0
    for prompt, _ in work:
        keys = dynamo_keys(dynamo_local_hashes(pack_tokens(prompt), 32))
        assert dict(fresh.groups[0].any.walk(keys).items()) == dict(full.groups[0].any.walk(keys).items())
    engine.close()
