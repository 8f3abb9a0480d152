"""Issue #35: a registration removed before a restart stays removed (real Kafka: the compacted
registrations topic, index_service/registrations.py). Register through Dynamo's and the conductor's
registries, unregister, let the operator's own relay feed the engine's replica, restart: the
registrations' relays never start again - not even between reading a registration and its tombstone
(a relay's start clears its replica) - and the replica's state is untouched."""

from __future__ import annotations

import msgspec

from index_service.conductor_api import ConductorRegistry
from index_service.dynamo_api import DynamoRegistry, Listener, RegisterRequest, UnregisterRequest
from index_service.registrations import RegistrationLog
from index_service.store import ShardStore
from kvidx.engines.vllm.sim import SimVllmEngine
from kvidx.sim.prompts import workload_requests
from relays.managed import vllm_relay_starter
from relays.sinks import StoreSink
from tests.helpers import wait_for

B = 32
PROFILE = {"strategy": "vllm_v1", "algorithm": "sha256_cbor", "python_hash_seed": "0",
           "index_projection": "low64_be"}


def conductor_registration(endpoint: str) -> bytes:
    return msgspec.msgpack.encode({"endpoint": endpoint, "type": "vLLM", "modelname": "m",
                                   "instance_id": "c1", "block_size": B, "dp_rank": 0,
                                   "hash_profile": dict(PROFILE)})


def test_unregistered_registration_stays_removed_across_a_restart(kafka_bootstrap, topics):
    topic = topics["registrations"]
    store = ShardStore(16)
    store.ready = True
    starter = vllm_relay_starter(StoreSink(store), lambda model: 16)
    starts: list[str] = []

    def counted(model, replica, *rest):
        starts.append(replica)
        return starter(model, replica, *rest)

    # with a replay endpoint: batches published before the relay's subscription took effect (ZMQ's
    # slow joiner) are replayed, as they are in production
    engine = SimVllmEngine(num_blocks=40, block_size=B, endpoint="tcp://127.0.0.1:*",
                           replay_endpoint="tcp://127.0.0.1:*")
    other = SimVllmEngine(num_blocks=40, block_size=B, endpoint="tcp://127.0.0.1:*")
    log1 = RegistrationLog(kafka_bootstrap, topic)
    reg1 = DynamoRegistry(counted, owner="a", log=log1)
    conductor1 = ConductorRegistry(counted, owner="a", log=log1)
    log1.follow(reg1.apply_record, conductor=conductor1.apply_record)
    stop = None
    try:
        assert log1.caught_up.wait(30)
        assert reg1.register(RegisterRequest(5, engine.endpoint, "m", B))[0] == 201
        assert conductor1.register(conductor_registration(other.endpoint))[0] == 200
        assert starts == [engine.endpoint, other.endpoint]
        assert reg1.unregister(UnregisterRequest(5, "m"))[0] == 200
        assert conductor1.unregister(msgspec.msgpack.encode({"instance_id": "c1", "dp_rank": 0}))[0] == 200
        log1.close()
        # the operator's own relay feeds the engine's replica now
        stop = starter("m", engine.endpoint, 0, engine.endpoint, engine.replay_endpoint,
                       Listener(engine.endpoint, engine.replay_endpoint), B)
        wait_for(lambda: store.shards["m"].replicas[(engine.endpoint, 0)].epoch > 0, what="the relay's start")
        for prompt, output in workload_requests(3, 10, systems=1, sys_len=(64, 96)):
            engine.serve(prompt, output)
        last = engine.next_seq - 1
        wait_for(lambda: store.shards["m"].replicas[(engine.endpoint, 0)].seq == last, what="folded")
        st = store.shards["m"].replicas[(engine.endpoint, 0)]
        held = (st.epoch, st.seq, st.blocks)
        assert st.blocks > 0
        # the restart: the same instance name follows the topic from its start
        log2 = RegistrationLog(kafka_bootstrap, topic)
        reg2 = DynamoRegistry(counted, owner="a", log=log2, store=store)
        conductor2 = ConductorRegistry(counted, owner="a", log=log2, store=store)
        log2.follow(reg2.apply_record, conductor=conductor2.apply_record)
        try:
            assert log2.caught_up.wait(30)
            assert reg2.workers == {} and conductor2.services == {}
            assert starts == [engine.endpoint, other.endpoint], "a removed registration started again"
            st = store.shards["m"].replicas[(engine.endpoint, 0)]
            assert (st.epoch, st.seq, st.blocks) == held
            # and a registration of the replica the operator's relay feeds is refused after the restart
            assert reg2.register(RegisterRequest(6, engine.endpoint, "m", B))[0] == 409
        finally:
            log2.close()
    finally:
        if stop is not None:
            stop(False)
        reg1.stop_all()
        conductor1.stop_all()
        engine.close()
        other.close()
