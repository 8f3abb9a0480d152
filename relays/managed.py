"""Relays started by the lookup service itself (Dynamo's and Mooncake conductor's `POST /register`:
index_service/dynamo_api.py, conductor_api.py): an engine's ZMQ publisher (vLLM's, or a Mooncake Store
master's) followed in a thread of the service, publishing to the service's sink (the events topic under
`kvidx serve`) exactly as a `kvidx relay` process does."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvidx import engines
from relays.run import Relay
from relays.sinks import Sink
from relays.zmq_source import ZmqSource

log = logging.getLogger("kvidx.relay")
REGISTERED_ENGINE = "vllm"  # the engine Dynamo's and the conductor's workers run (their /register)
POOL_ENGINE = "mooncake"  # a Mooncake Store master, registered with the conductor as a shared pool


def vllm_relay_starter(sink: Sink, index_block_size: Callable[[str], int]):
    """start(model, replica, dp_rank, endpoint, replay_endpoint, listener, dynamo_block_size) ->
    stop(retract=True): a live relay in a thread (the engine's replay buffer first, then its publisher),
    hashing at the model's index block size (and publishing the Dynamo keys of blocks of
    `dynamo_block_size`, for /query_by_hash); `stop()` ends it and retracts the replica
    (Relay.retract); `stop(False)` only ends it (the service shuts down: the engine and the index's
    view of it go on)."""

    def start(model: str, replica: str, dp_rank: int, endpoint: str, replay_endpoint: str | None, listener,
              dynamo_block_size: int = 0):
        core = engines.get(REGISTERED_ENGINE).make_relay(
            model, replica, index_block_size(model), dp_rank,
            engines.RelayOptions(extra={"dynamo_block_size": dynamo_block_size}))
        listener.mirror = core.mirror  # what Dynamo's GET /dump lists of this engine
        return _run(Relay(core, sink, ZmqSource(endpoint, replay_endpoint)), replica, listener)

    return start


def mooncake_relay_starter(sink: Sink, index_block_size: Callable[[str], int]):
    """start(model, pool, endpoint, listener, key_feeds, tenant_id, engine_block_size) -> stop: a live
    relay of a Mooncake Store master's events (kvidx.engines.mooncake: the pool's replica `pool`), its
    objects placed through the attached engines' own streams, `key_feeds()` (their publishers, asked
    again every second: engines come and go). `stop` as vllm_relay_starter's."""

    def start(model: str, pool: str, endpoint: str, listener, key_feeds: Callable[[], list[str]],
              tenant_id: str = "default", engine_block_size: int | None = None):
        core = engines.get(POOL_ENGINE).make_relay(
            model, pool, index_block_size(model), None,
            engines.RelayOptions(engine_block_size=engine_block_size, extra={"tenant_id": tenant_id}))
        return _run(Relay(core, sink, ZmqSource(endpoint, key_feeds=key_feeds)), pool, listener)

    return start


def _run(relay: Relay, replica: str, listener):
    """`relay` live in a thread; its stop(retract=True)."""

    def run() -> None:
        try:
            relay.start_fresh()
            relay.run_live()
        except Exception as e:  # noqa: BLE001 - one engine's relay must not take the service down
            listener.status, listener.last_error = "failed", f"{type(e).__name__}: {e}"[:300]
            log.warning("event=managed_relay_failed replica=%s error=%s", replica, listener.last_error)

    thread = threading.Thread(target=run, daemon=True, name=f"relay-{replica}")
    thread.start()

    def stop(retract: bool = True) -> None:
        relay.stop_event.set()
        thread.join(5)
        relay.close()
        if retract:
            relay.retract("unregistered")

    return stop
