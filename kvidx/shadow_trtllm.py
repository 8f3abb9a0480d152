"""`kvidx shadow --engine trtllm`: replay a recording of pull-API polls (events.jsonl, one line per
poll, ../shared/fixtures/README.md) through the TensorRT-LLM relay and the shard, and compare, for
every request of requests.jsonl, what the index would have credited at its send time with the
engine's own `cached_tokens` (which counts host-tier hits too; `cached_tokens_by_level` splits them).

Partial-block reuse is credited at the index block size: with `index_block_size=1` the credit is
token-exact; with a larger one a partially reused block is credited down to an index block boundary.
"""

from __future__ import annotations

from pathlib import Path

from kvidx.core.hashing import prompt_hashes
from kvidx.core.shard import ModelShard
from kvidx.engines.trtllm.relay import TrtllmPollRelay, read_polls
from kvidx.shadow import Agreement, load_requests


def shadow(polls: list[tuple[int, list, str | None]], requests: list[dict], model: str = "model",
           index_block_size: int = 1, replica: str = "trtllm", block_size: int | None = None
           ) -> tuple[Agreement, ModelShard, TrtllmPollRelay]:
    shard = ModelShard(model, index_block_size)
    relay = TrtllmPollRelay(model, replica, index_block_size, block_size, epoch=0)
    ordered = sorted(polls, key=lambda p: p[0])
    agreement = Agreement()
    k = 0
    for r in requests:
        if r.get("status", 200) != 200:
            continue
        t_ns = int(r["t_send"] * 1e9)
        while k < len(ordered) and ordered[k][0] <= t_ns:
            recv_ns, events, error = ordered[k]
            out = relay.poll_failed(error, recv_ns) if error else relay.on_poll(events, recv_ns)
            for b in out.batches:
                shard.apply(b, recv_ns / 1e9)
            k += 1
        tokens = r["prompt_token_ids"]
        hashes = prompt_hashes(tokens, index_block_size, r.get("lora"), r.get("cache_salt"))
        credited = shard.credited(hashes, len(tokens), replica, r.get("dp_rank"), now=r["t_send"])
        agreement.add(r.get("i", agreement.requests), len(tokens), int(r["cached_tokens"]), credited)
    return agreement, shard, relay


def run_shadow(recording: str | Path, requests: str | Path, model: str = "model", index_block_size: int = 1,
               block_size: int | None = None) -> tuple[Agreement, ModelShard, TrtllmPollRelay]:
    """What the CLI calls: `kvidx shadow --engine trtllm --recording events.jsonl --requests
    requests.jsonl [--index-block-size N]`."""
    return shadow(list(read_polls(recording)), load_requests(requests), model, index_block_size,
                  block_size=block_size)
