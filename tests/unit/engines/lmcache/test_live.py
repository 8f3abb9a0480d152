"""A live relay with LMCache's controller feed: LMCache chunks arrive through the vLLM event stream
(PUB), their admit/evict messages on the relay's PULL endpoint; both update one mirror."""

import random
import socket
import sys
import threading
import time

import zmq

from index_service.store import ShardStore
from kvidx.core import walk
from kvidx.core.hashing import prompt_hashes
from kvidx.engines.lmcache.chunks import LmcacheConfig
from kvidx.engines.vllm.relay import VllmPublisherRelay
from relays.run import Relay
from relays.sinks import StoreSink
from relays.zmq_source import ZmqSource
from schemas.events import TIER_IDS
from tests.helpers import FIXTURES, wait_for

sys.path.insert(0, str(FIXTURES / "vllm-variants"))
import engine_wire as ew  # noqa: E402

rng = random.Random(9)
T = [rng.randrange(1024) for _ in range(256)]
H = prompt_hashes(T, 16)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_controller_messages_on_the_pull_endpoint_move_lmcache_blocks():
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    ctl_ep = f"tcp://127.0.0.1:{free_port()}"
    store = ShardStore(16)
    core = VllmPublisherRelay("m", "r", 16, engine_version="0.32.0",
                              lmcache=LmcacheConfig(ttl_s=None, evictions_reported=True))
    source = ZmqSource(f"tcp://127.0.0.1:{pub_port}", controller_endpoint=ctl_ep)
    relay = Relay(core, StoreSink(store), source)
    t = threading.Thread(target=relay.run_live, args=(0.02,), daemon=True)
    t.start()
    push = ctx.socket(zmq.PUSH)
    push.connect(ctl_ep)
    try:
        time.sleep(0.3)
        payload = ew.payload(ew.lmcache_store_call(T[:128], 64, 0, ew.lmcache_hash))
        pub.send_multipart([b"kv", (0).to_bytes(8, "big"), payload])
        wait_for(lambda: "m" in store.shards and walk.credited(store.shards["m"], H[:8], 129, "r") > 0,
                 timeout=10, what="LMCache chunks through the event stream")
        k1 = ew.lmcache_hash(T[:128])
        push.send(ew.controller(ew.KVAdmitMsg("inst", 0, k1, "LocalDiskBackend", 1)))

        def on_disk():
            disk = store.shards["m"].groups[0].tiers.get(TIER_IDS["DISK"], {})
            return all(h in disk for h in H[4:8])
        wait_for(on_disk, timeout=10, what="the admit message placing the second chunk on DISK")
        push.send(ew.controller(ew.KVEvictMsg("inst", 0, k1, "LocalCPUBackend", 2)))
        push.send(ew.controller(ew.KVEvictMsg("inst", 0, k1, "LocalDiskBackend", 3)))
        wait_for(lambda: walk.credited(store.shards["m"], H[:8], 129, "r") == 64, timeout=10,
                 what="the evictions retracting the second chunk")
    finally:
        relay.close()
        t.join(5)
        pub.close(0)
        push.close(0)
