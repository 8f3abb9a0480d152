"""Routing decisions (topic `kvidx.routes.v1`, key = model): what a router sent where and what the
index credited. Every service instance applies them as pending credit, and the audit joins them
with what the engines reused. Hashes and counts only. Same evolution rule as schemas/events.py."""

from __future__ import annotations

import msgspec

from schemas.events import BlockHash

ROUTES_VERSION = 1


class RouteDecision(msgspec.Struct, array_like=True):
    v: int
    request_id: str
    model: str
    replica: str
    dp_rank: int
    block_hashes: list[BlockHash]  # the prompt's canonical block hashes (index block size of the model)
    prompt_tokens: int
    credited_tokens: int  # what the index credited on this replica when the router chose it
    ts: float  # when the decision was made (s since the epoch)
    ttl_s: float  # how long the prompt counts as cached there without the engine's confirmation
    router: str = ""
    # resumable tokens the index did not credit because prefills already routed there will evict
    # blocks first, or its own host loads will (the answer's evicting_tokens: eviction foresight, a
    # TensorRT-LLM host tier); 0 in records before it
    evicting_tokens: int = 0


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(RouteDecision)


def encode_route(d: RouteDecision) -> bytes:
    return _enc.encode(d)


def decode_route(data: bytes) -> RouteDecision:
    d = _dec.decode(data)
    if d.v != ROUTES_VERSION:
        raise ValueError(f"unsupported routes version {d.v} (this reader knows {ROUTES_VERSION})")
    return d
