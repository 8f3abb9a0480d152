"""Shadow audit: replay a recorded engine stream through the relay and fold code, and compare what
the index would have credited each request at its send time with what the engine really reused.

recall = sum(min(credited, reused)) / sum(reused); over_credit = sum(max(credited - reused, 0)) /
sum(reused). The request log holds prompt token ids (read here, never stored or logged).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kvidx.core.hashing import prompt_hashes
from kvidx.core.shard import ModelShard
from kvidx.engines.contract import Frame
from kvidx.engines.vllm.relay import VllmPublisherRelay
from relays.recording import read_frames


@dataclass
class Agreement:
    requests: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    credited_tokens: int = 0
    matched_tokens: int = 0  # sum(min(credited, reused))
    over_tokens: int = 0  # sum(max(credited - reused, 0))
    exact: int = 0
    mismatches: list[dict] = field(default_factory=list)

    def add(self, i: int, prompt: int, reused: int, credited: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt
        self.reused_tokens += reused
        self.credited_tokens += credited
        self.matched_tokens += min(credited, reused)
        self.over_tokens += max(credited - reused, 0)
        if credited == reused:
            self.exact += 1
        elif len(self.mismatches) < 20:
            self.mismatches.append({"i": i, "prompt_tokens": prompt, "reused": reused, "credited": credited})

    def summary(self) -> dict:
        """Token-weighted agreement; with no requests at all every ratio is None (nothing was
        measured: 1.0 would read as perfect agreement)."""
        r = self.reused_tokens
        none = self.requests == 0
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": r,
            "credited_tokens": self.credited_tokens,
            "reuse_rate": None if none else round(r / self.prompt_tokens, 6) if self.prompt_tokens else 0.0,
            "recall": None if none else round(self.matched_tokens / r, 6) if r else 1.0,
            "over_credit": None if none else round(self.over_tokens / r, 6) if r else 0.0,
            "exact_requests": self.exact,
        }


class InProcessIndex:
    """Relays (one per publisher endpoint) feeding one shard in process: the same code the Kafka
    path runs, minus the broker."""

    def __init__(self, model: str, index_block_size: int, unreported_eviction_kinds: tuple[str, ...] = (),
                 relay_factory: Callable[[str, str, int], VllmPublisherRelay] | None = None):
        """`relay_factory(model, endpoint, index_block_size)` builds a publisher's relay (another
        engine's adapter); by default a VllmPublisherRelay."""
        self.model = model
        self.shard = ModelShard(model, index_block_size, unreported_eviction_kinds)
        self.relays: dict[str, VllmPublisherRelay] = {}
        self.dead_letters = 0
        self.relay_factory = relay_factory

    def feed(self, frame: Frame) -> None:
        relay = self.relays.get(frame.endpoint)
        if relay is None:
            relay = self.relays[frame.endpoint] = (
                self.relay_factory(self.model, frame.endpoint, self.shard.block_size) if self.relay_factory
                else VllmPublisherRelay(self.model, frame.endpoint, self.shard.block_size, epoch=0))
        out = relay.on_frame(frame)
        if out.gap is not None:  # a recording cannot be asked for the missing batches
            out = relay.gap_unfilled(frame)
        self.dead_letters += len(out.dead)
        now = frame.recv_ns / 1e9
        for b in out.batches:
            self.shard.apply(b, now)


def load_requests(path: str | Path) -> list[dict]:
    reqs = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                r = json.loads(line)
                for key in ("prompt_token_ids", "t_send", "cached_tokens"):
                    if key not in r:
                        raise ValueError(f"{path}:{n}: request without {key!r}")
                reqs.append(r)
    reqs.sort(key=lambda r: r["t_send"])
    return reqs


def shadow(frames: Iterable[Frame], requests: list[dict], model: str = "model",
           index_block_size: int = 16, unreported_eviction_kinds: tuple[str, ...] = (),
           pending_ttl: float = 0.0, relay_factory: Callable | None = None
           ) -> tuple[Agreement, InProcessIndex]:
    """`relay_factory`: see InProcessIndex (None: vLLM). With `pending_ttl` > 0, every request, once
    credited, is recorded as a routing decision: its prompt counts as cached on its replica until the
    engine's events confirm it or the TTL passes
    (what routers get from POST /v1/routes)."""
    index = InProcessIndex(model, index_block_size, unreported_eviction_kinds, relay_factory)
    ordered = sorted(frames, key=lambda f: f.recv_ns)
    agreement = Agreement()
    k = 0
    for r in requests:
        if r.get("status", 200) != 200:
            continue
        t_ns = int(r["t_send"] * 1e9)
        while k < len(ordered) and ordered[k].recv_ns <= t_ns:
            index.feed(ordered[k])
            k += 1
        tokens = r["prompt_token_ids"]
        hashes = prompt_hashes(tokens, index_block_size, r.get("lora"), r.get("cache_salt"))
        credited = index.shard.credited(hashes, len(tokens), r.get("replica"), r.get("dp_rank"),
                                        now=r["t_send"])
        if pending_ttl > 0 and r.get("replica", "") is not None:
            replica = r.get("replica") or next(iter(index.relays), "")
            index.shard.add_pending(replica, r.get("dp_rank") or 0, hashes, len(tokens), credited,
                                    r["t_send"] + pending_ttl)
        agreement.add(r.get("i", agreement.requests), len(tokens), int(r["cached_tokens"]), credited)
    return agreement, index


def run_shadow(recording: str, requests: str, model: str = "model", index_block_size: int = 16,
               unreported_eviction_kinds: tuple[str, ...] = (), pending_ttl: float = 0.0
               ) -> tuple[Agreement, InProcessIndex]:
    return shadow(read_frames(recording), load_requests(requests), model, index_block_size,
                  unreported_eviction_kinds, pending_ttl)
