"""LMCache behind vLLM (lmcache/v1/cache_engine.py, vLLM's LMCache connector): LMCache's stores come
re-published through vLLM's publisher, placed by their tokens in an upper-bound tier with a TTL and a
capacity, or exactly with the controller's admit/evict feed (--lmcache-controller-endpoint)."""

from __future__ import annotations

from kvidx.engines import EngineAdapter, RelayOptions
from kvidx.engines.vllm.adapter import DEFAULT_VERSION, controller_endpoint, relay_extra


def _options(opts: RelayOptions) -> dict:
    from kvidx.engines.lmcache.chunks import LmcacheConfig

    extra = dict(opts.extra)
    extra.setdefault("lmcache", LmcacheConfig(ttl_s=300.0))
    return extra


VERSIONS = ("0.5.6",)  # the LMCache releases whose connector's re-published stores were read


def check_lmcache_version(version: str | None) -> None:
    """`--engine-version` names LMCache's release (vLLM's publisher carries its stores and is read as
    the newest checked vLLM, which reads every checked vLLM stream)."""
    if version is not None and version.strip().lstrip("v") not in VERSIONS:
        raise ValueError(f"LMCache {version!r} was not checked by this kvidx (checked: "
                         f"{', '.join(VERSIONS)}; --engine-version names LMCache's release, vLLM's stream is "
                         f"read as {DEFAULT_VERSION})")


def make_relay(model: str, replica: str, index_block_size: int, dp_rank: int | None, opts: RelayOptions):
    from kvidx.engines.vllm.relay import VllmPublisherRelay

    check_lmcache_version(opts.engine_version)
    return VllmPublisherRelay(model, replica, index_block_size, dp_rank, group_kinds=opts.group_kinds or None,
                              engine_version=DEFAULT_VERSION, **_options(opts))


def replay(recording, model: str, index_block_size: int, opts: RelayOptions):
    from kvidx.engines.contract import zmq_replay
    from kvidx.engines.recording import read_frames
    from kvidx.engines.vllm.relay import VllmPublisherRelay

    check_lmcache_version(opts.engine_version)
    extra = _options(opts)
    batches = zmq_replay(read_frames(recording), lambda ep: VllmPublisherRelay(
        model, ep, index_block_size, epoch=0, **extra))

    def stats() -> dict:
        out: dict = {}
        for relay in batches.relays.values():
            for k, v in relay.mirror.lmcache.stats.items():
                out[k] = out.get(k, 0) + v
        return out

    batches.extra = stats
    return batches


def upper_bound_requests(recording, requests: list[dict], model: str, index_block_size: int,
                         opts: RelayOptions) -> dict:
    """How many requests' credit needed LMCache's tier: credited with every tier > credited without it
    (a second shard fed the same batches minus that tier)."""
    import msgspec

    from kvidx import index
    from kvidx.core.hashing import prompt_hashes
    from kvidx.core.shard import ModelShard
    from kvidx.engines.recording import replay_requests
    from schemas.events import BlocksRemoved, BlocksStored

    tier = _options(opts)["lmcache"].tier
    full, without = ModelShard(model, index_block_size), ModelShard(model, index_block_size)

    def fold(t_ns: int, b) -> None:
        full.apply(b, t_ns / 1e9)
        evs = [e for e in b.events if not (isinstance(e, BlocksStored | BlocksRemoved) and e.tier == tier)]
        without.apply(msgspec.structs.replace(b, events=evs), t_ns / 1e9)

    n = 0
    for r in replay_requests(replay(recording, model, index_block_size, opts), requests, fold):
        tokens = r["prompt_token_ids"]
        hashes = prompt_hashes(tokens, index_block_size, r.get("lora"), r.get("cache_salt"))
        n += (index.credited(full, hashes, len(tokens), r.get("replica"), r.get("dp_rank"))
              > index.credited(without, hashes, len(tokens), r.get("replica"), r.get("dp_rank")))
    return {"upper_bound_requests": n}


ADAPTER = EngineAdapter(
    name="lmcache", summary="LMCache's chunks re-published through vLLM (upper bound) or its controller",
    versions=VERSIONS, default_version=VERSIONS[-1], recording="frames", live="zmq", make_relay=make_relay,
    relay_extra=relay_extra, controller_endpoint=controller_endpoint,
    replay=replay, conformance=("lmcache-0.5.6",), shadow_extra=upper_bound_requests)
