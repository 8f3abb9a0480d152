"""Data parallelism: vLLM runs one KV-event publisher per DP rank, each on the base endpoint offset by
its rank (vllm/distributed/kv_events.py ZmqEventPublisher.offset_endpoint_port, 0.32.0: tcp port +
rank, a tcp port of 0 left to the OS, inproc endpoints suffixed "_dp<rank>"), for the events and the
replay endpoint alike. One relay (and one mirror) per rank: each rank has its own sequence numbers,
its own cache and its own AllBlocksCleared (published by a rank only with its next step)."""

from __future__ import annotations


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
