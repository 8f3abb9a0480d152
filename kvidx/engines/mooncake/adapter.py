"""Mooncake Store (kvcache-ai/Mooncake#2214, the RFC #1527 KV-events publisher on mooncake_master):
the master's events over ZMQ PUB (no replay endpoint) for the objects of a pool shared across nodes,
published as the pool's replica ([pools.NAME] in kvidx/config.py) and credited by the shard to the
replicas attached to it.

Read: Mooncake tag v0.3.12 mooncake-store/src/kv_event/kv_event_publisher.cpp, include/kv_event/
{kv_event_publisher.h, kv_event_config.h, key_util.h}, src/master_service.cpp (the Publish* call
sites), src/master.cpp (flags), tests/kv_event_publisher_test.cpp, docs/source/design/conductor/
indexer-api-design.md (its "Mooncake Store master publisher" section and field provenance matrix);
branch dev/conductor mooncake-conductor/src/kvevent/{event_manager.cpp, event_handler.cpp},
mooncake-store/include/kv_event/key_util.h, docs/source/design/kv-event/{publisher-design.md,
subscriber-guide.md}; the RFC (issue #1527) and PR #2214's conversation. Lines are cited where used.

Choices the sources leave open (details in wire.py, mirror.py, relay.py):
- versions pinned: "0.3.12", "0.3.12.post1" (the master: a removal = the object is gone from every
  medium) and "rfc1527-v1" (the RFC's per-medium removals, for publishers that send tokens);
- the master sends no token ids: its objects are placed through an engine-hash memo learned from
  token-carrying events and from the attached vLLM engines' own streams (frames marked src
  "keyfeed"); unknown keys are parked (placed once learned), never guessed, never dead letters;
- keys: decimal/0x (v0.3.12's rule), else a vLLM connector key's low 64 bits (dev/conductor's rule);
- tiers: "cpu" -> POOL, "disk" -> DISK (configurable); one pool replica for every backend_id of a
  stream, objects tracked per backend; one tenant and one model per relay; group 0 only;
- gaps clear the pool (no replay); the master's sequence from 1 is counted from 0.

Relay options (`RelayOptions.extra`): tenant_id, tiers, model_names, key_feed_version, park_limit;
in a replay also `replica`, the pool's name (default: the master's endpoint, as other adapters name
replicas)."""

from __future__ import annotations

from kvidx.engines import Batches, EngineAdapter, RelayOptions
from kvidx.engines.mooncake.wire import DEFAULT_VERSION, SUPPORTED_VERSIONS


def make_relay(model: str, replica: str, index_block_size: int, dp_rank: int | None, opts: RelayOptions):
    from kvidx.engines.mooncake.relay import MooncakeStoreRelay

    return MooncakeStoreRelay(model, replica, index_block_size, dp_rank,
                              engine_version=opts.engine_version or DEFAULT_VERSION,
                              engine_block_size=opts.engine_block_size, **opts.extra)


def replay(recording, model: str, index_block_size: int, opts: RelayOptions) -> Batches:
    """The pool relays' batches of a recording in receive order (a kvidx.engines.Batches): one relay
    per master endpoint; frames marked src "keyfeed" (attached engines' streams) teach every pool
    relay their keys and make no batch."""
    from kvidx.engines.mooncake.relay import KEY_FEED_SRC, MooncakeStoreRelay
    from kvidx.engines.recording import read_frames

    extra = dict(opts.extra)
    name = extra.pop("replica", None)
    version = opts.engine_version or DEFAULT_VERSION
    MooncakeStoreRelay(model, "check", index_block_size, engine_version=version, **extra)  # a clear error
    frames = sorted(read_frames(recording), key=lambda f: f.recv_ns)
    relays: dict[str, MooncakeStoreRelay] = {}
    for f in frames:
        if f.src != KEY_FEED_SRC and f.endpoint not in relays:
            relays[f.endpoint] = MooncakeStoreRelay(model, name or f.endpoint, index_block_size,
                                                    engine_version=version, epoch=0,
                                                    engine_block_size=opts.engine_block_size, **extra)
    dead = [0]

    def step(f) -> list:
        if f.src == KEY_FEED_SRC:
            for relay in relays.values():
                dead[0] += len(relay.on_frame(f).dead)
            return []
        relay = relays[f.endpoint]
        out = relay.on_frame(f)
        if out.gap is not None:  # the master has no replay endpoint
            out = relay.gap_unfilled(f)
        dead[0] += len(out.dead)
        return out.batches

    def gen():  # a frame reaches the relays only when the consumer folds that far (see Batches)
        for f in frames:
            yield f.recv_ns, lambda f=f: step(f)

    def stats() -> dict:
        out: dict = {}
        for relay in relays.values():
            for k, v in {**relay.mirror.stats, **relay.counters}.items():
                out[k] = out.get(k, 0) + v
        return out

    return Batches(gen(), dead=lambda: dead[0], extra=stats,
                   default_replica=lambda: next((r.replica for r in relays.values()), ""), relays=relays)


ADAPTER = EngineAdapter(
    name="mooncake", summary="Mooncake Store master KV events (RFC #1527) over ZMQ: a shared pool's objects",
    versions=SUPPORTED_VERSIONS, default_version=DEFAULT_VERSION, recording="frames", live="zmq",
    make_relay=make_relay, replay=replay, conformance=("mooncake-store",),
    # its blocks live in a pool no engine is: credited only to the replicas a topology names
    shadow_defaults={"needs_pools": True})
