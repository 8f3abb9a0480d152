"""`kvidx shadow --engine lmcache`: the shadow audit (kvidx.shadow) of a recording of a vLLM engine
running the LMCache connector (frames.jsonl: vLLM's own GPU events plus LMCache's stores re-published
by vLLM with medium "cpu"), against its request log (requests.jsonl, `cached_tokens` = what the
engine reused: its GPU prefix hit or LMCache's hit, the larger).

The relay is vLLM's (VllmPublisherRelay) with LMCache's options (kvidx.engines.lmcache.chunks.LmcacheConfig):
LMCache's evictions are not re-published, so its chunks are kept `ttl_s` seconds of engine time after
their last store (and at most `capacity_blocks` index blocks): a credit that relies on them is an
upper bound. The summary counts the requests whose credit needed the LMCache tier
(`upper_bound_requests`) and the mirror's LMCache counters, so an over-credit can be told apart from
a relay error: it is LMCache having evicted earlier than the TTL assumes.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from kvidx.core.hashing import prompt_hashes
from kvidx.engines.lmcache.chunks import LmcacheConfig
from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.shadow import Agreement, InProcessIndex, load_requests, shadow
from relays.recording import read_frames


def run_shadow_lmcache(recording: str | Path, requests: str | Path, index_block_size: int = 16,
                       ttl_s: float | None = 300.0, model: str = "model", capacity_blocks: int | None = None,
                       tier: str = "CPU", pending_ttl: float = 0.0
                       ) -> tuple[Agreement, InProcessIndex, dict]:
    """(Agreement, InProcessIndex, extra) where `extra` holds the LMCache counters summed over the
    relays and `upper_bound_requests`: requests whose credit on their replica was larger than what
    the replica's own (GPU) tiers alone gave."""

    def factory(m: str, endpoint: str, ibs: int) -> VllmPublisherRelay:
        cfg = LmcacheConfig(ttl_s=ttl_s, capacity_blocks=capacity_blocks, tier=tier)
        return VllmPublisherRelay(m, endpoint, ibs, epoch=0, lmcache=cfg)

    reqs = load_requests(requests)
    agreement, index = shadow(read_frames(recording), reqs, model, index_block_size,
                              pending_ttl=pending_ttl, relay_factory=factory)
    extra: dict = {}
    for relay in index.relays.values():
        for k, v in relay.mirror.lmcache.stats.items():
            extra[k] = extra.get(k, 0) + v
    extra["upper_bound_requests"] = _upper_bound_requests(recording, reqs, model, index_block_size, factory,
                                                          tier)
    return agreement, index, extra


def _upper_bound_requests(recording, reqs: list[dict], model: str, ibs: int, factory, tier: str) -> int:
    """Replays again and counts the requests whose credit needed the LMCache tier: credited with
    every tier > credited without `tier` (a second shard fed the same batches minus that tier)."""
    from kvidx.core.shard import ModelShard
    from schemas.events import BlocksRemoved, BlocksStored

    full = InProcessIndex(model, ibs, relay_factory=factory)
    gpu_only = ModelShard(model, ibs)
    frames = sorted(read_frames(recording), key=lambda f: f.recv_ns)
    k = n = 0
    for r in reqs:
        if r.get("status", 200) != 200:
            continue
        t_ns = int(r["t_send"] * 1e9)
        while k < len(frames) and frames[k].recv_ns <= t_ns:
            f = frames[k]
            relay = full.relays.get(f.endpoint)
            if relay is None:
                relay = full.relays[f.endpoint] = factory(model, f.endpoint, ibs)
            out = relay.on_frame(f)
            if out.gap is not None:
                out = relay.gap_unfilled(f)
            for b in out.batches:
                full.shard.apply(b, f.recv_ns / 1e9)
                evs = [e for e in b.events
                       if not (isinstance(e, BlocksStored | BlocksRemoved) and e.tier == tier)]
                gpu_only.apply(msgspec.structs.replace(b, events=evs), f.recv_ns / 1e9)
            k += 1
        tokens = r["prompt_token_ids"]
        hashes = prompt_hashes(tokens, ibs, r.get("lora"), r.get("cache_salt"))
        a = full.shard.credited(hashes, len(tokens), r.get("replica"), r.get("dp_rank"))
        g = gpu_only.credited(hashes, len(tokens), r.get("replica"), r.get("dp_rank"))
        n += a > g
    return n
