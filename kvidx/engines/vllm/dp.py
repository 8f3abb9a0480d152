"""Data parallelism: vLLM runs one KV-event publisher per DP rank, each on the base endpoint offset by
its rank (vllm/distributed/kv_events.py ZmqEventPublisher.offset_endpoint_port, 0.32.0: tcp port +
rank, a tcp port of 0 left to the OS, inproc endpoints suffixed "_dp<rank>"), for the events and the
replay endpoint alike. One relay (and one mirror) per rank: each rank has its own sequence numbers,
its own cache and its own AllBlocksCleared (published by a rank only with its next step)."""

from __future__ import annotations

from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.engines.vllm.wire import check_engine_version
from relays.run import Relay
from relays.sinks import Sink


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """vLLM's rule for a rank's endpoint (offset_endpoint_port)."""
    if not endpoint or rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" in endpoint:
        if ":" in endpoint:
            i = endpoint.rfind(":")
            port = int(endpoint[i + 1:])
            return endpoint if port == 0 else f"{endpoint[:i]}:{port + rank}"
        return endpoint
    raise ValueError(f"invalid endpoint {endpoint!r}: must contain 'inproc' or 'tcp'")


def dp_endpoints(endpoint: str, replay_endpoint: str | None, dp_size: int) -> list[tuple[str, str | None]]:
    if dp_size < 1:
        raise ValueError(f"--dp-size must be >= 1, got {dp_size}")
    return [(offset_endpoint(endpoint, r), offset_endpoint(replay_endpoint, r)) for r in range(dp_size)]


def build_dp_relays(model: str, replica: str, endpoint: str, replay_endpoint: str | None, dp_size: int,
                    sink: Sink, index_block_size: int, engine_version: str, bind: bool = False,
                    source_factory=None, **relay_options) -> list[Relay]:
    """One Relay (ZMQ source + relay core) per DP rank, all publishing as `replica` with dp_rank set.
    The engine version is checked once, before any socket is opened. `source_factory(endpoint,
    replay_endpoint, bind)` builds the frame source (default: relays.zmq_source.ZmqSource)."""
    check_engine_version(engine_version)
    if source_factory is None:
        from relays.zmq_source import ZmqSource

        def source_factory(ep, rep, b):
            return ZmqSource(ep, rep, bind=b)
    relays = []
    for rank, (ep, rep) in enumerate(dp_endpoints(endpoint, replay_endpoint, dp_size)):
        core = VllmPublisherRelay(model, replica, index_block_size, dp_rank=rank,
                                  engine_version=engine_version, **relay_options)
        relays.append(Relay(core, sink, source_factory(ep, rep, bind)))
    return relays
