"""Shadow audit: replay a recorded engine stream through the relay and fold code, and compare what
the index would have credited each request at its send time with what the engine really reused.
One loop for every engine (kvidx.engines.recording.replay_requests); each engine's adapter only turns
its recording into batches (kvidx.engines: `EngineAdapter.replay`).

recall = sum(min(credited, reused)) / sum(reused); over_credit = sum(max(credited - reused, 0)) /
sum(reused). The request log holds prompt token ids (read here, never stored or logged).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from kvidx import index
from kvidx.core.hashing import prompt_hashes
from kvidx.core.shard import ModelShard
from kvidx.engines import RelayOptions, ShadowResult, set_aside_counts
from kvidx.engines import get as get_engine
from kvidx.engines.contract import Frame, PublisherRelays, SequencedRelay
from kvidx.engines.recording import read_frames, replay_requests, split_at_lookups


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
                 relay_factory: Callable[[str, str, int], SequencedRelay] | None = None):
        """`relay_factory(model, endpoint, index_block_size)` builds a publisher's relay (another
        engine's adapter); by default vLLM's."""
        self.model = model
        self.shard = ModelShard(model, index_block_size, unreported_eviction_kinds)
        if relay_factory is None:
            from kvidx.engines.vllm.relay import VllmPublisherRelay

            def relay_factory(m: str, ep: str, ibs: int) -> SequencedRelay:
                return VllmPublisherRelay(m, ep, ibs, epoch=0)
        self.publishers = PublisherRelays(lambda ep: relay_factory(model, ep, index_block_size))
        self.relays = self.publishers.relays

    @property
    def dead_letters(self) -> int:
        return self.publishers.dead_letters

    def feed(self, frame: Frame) -> None:
        now = frame.recv_ns / 1e9
        for b in self.publishers.batches(frame):
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
                at = r.get("lookup_at")  # the conformance kit's [message seq, events before the lookup]
                if at is not None and not (isinstance(at, list) and len(at) == 2 and all(
                        type(x) is int and x >= 0 for x in at)):
                    raise ValueError(f"{path}:{n}: lookup_at must be [seq, events] (two integers >= 0)")
                reqs.append(r)
    reqs.sort(key=lambda r: r["t_send"])
    return reqs


def shadow_batches(batches, requests: list[dict], shard: ModelShard, pending_ttl: float = 0.0,
                   replica: str | None = None) -> Agreement:
    """Fold `batches` (a kvidx.engines.Batches) into `shard` and tally each request's credit on its
    replica (`replica` for all of them, else the request's own, else the recording's first). With
    `pending_ttl` > 0, every request, once credited, is recorded as a routing decision: its prompt
    counts as cached on its replica until the engine's events confirm it or the TTL passes (what
    routers get from POST /v1/routes)."""
    agreement = Agreement()
    bs = shard.block_size
    for r in replay_requests(batches, requests, lambda t_ns, b: shard.apply(b, t_ns / 1e9)):
        tokens = r["prompt_token_ids"]
        hashes = prompt_hashes(tokens, bs, r.get("lora"), r.get("cache_salt"), lookahead=shard.lookahead,
                               tails=True)
        to = replica if replica is not None else r.get("replica")
        now = r["t_ns"] / 1e9 if "t_ns" in r else r["t_send"]
        credited = index.credited(shard, hashes, len(tokens), to, r.get("dp_rank"), now=now)
        if pending_ttl > 0 and r.get("replica", "") is not None:  # an explicit null: not routed
            shard.add_pending(to or batches.default_replica(), r.get("dp_rank") or 0, hashes, len(tokens),
                              credited, r["t_send"] + pending_ttl)
        agreement.add(r.get("i", agreement.requests), len(tokens), int(r["cached_tokens"]), credited)
    return agreement


def run_shadow_engine(engine: str, recording: str | Path, requests: str | Path, model: str = "model",
                      index_block_size: int = 16, options: RelayOptions | None = None,
                      unreported_eviction_kinds: tuple[str, ...] = (), pending_ttl: float = 0.0,
                      pools: dict[str, list[str]] | None = None) -> tuple[ShadowResult, ModelShard]:
    """`kvidx shadow --engine E`: the engine's recording through its adapter and the one loop.
    `pools` (the deployment's topology: pool replica -> the replicas reading it) credits a shared
    cache's blocks to its readers, as the service does."""
    adapter = get_engine(engine)
    options = options or RelayOptions()
    batches = adapter.replay(recording, model, index_block_size, options)
    shard = ModelShard(model, index_block_size, unreported_eviction_kinds)
    reqs = load_requests(requests)
    if pools:
        shard.set_pools(pools)
        for r in reqs:  # a reader whose own relay is not in the recording holds nothing itself
            if r.get("replica"):
                shard.replica(r["replica"], r.get("dp_rank") or 0)
    agreement = shadow_batches(batches, reqs, shard, pending_ttl, adapter.shadow_defaults.get("replica"))
    extra = batches.extra()
    extra["index_entries"], extra["index_bytes"] = index.index_size([shard])
    if any(st.tails for st in index.replicas(shard)) or index_block_size < WHOLE_BLOCK:
        whole = ModelShard(model, max(index_block_size, WHOLE_BLOCK), unreported_eviction_kinds)
        for _, step in adapter.replay(recording, model, whole.block_size, options):
            for b in step():
                blocks = [e for e in b.events if not getattr(e, "tail", False)]
                whole.apply(msgspec.structs.replace(b, events=blocks), b.relay_ts)
        extra["index_entries_whole_blocks"], extra["index_bytes_whole_blocks"] = index.index_size([whole])
    else:
        extra["index_entries_whole_blocks"] = extra["index_entries"]
        extra["index_bytes_whole_blocks"] = extra["index_bytes"]
    if adapter.recording == "frames" and any(r.get("lookup_at") for r in reqs):
        extra["at_lookup"] = at_lookup_agreement(adapter, recording, reqs, model, index_block_size, options,
                                                 unreported_eviction_kinds).summary()
    if adapter.shadow_extra is not None:
        extra.update(adapter.shadow_extra(recording, reqs, model, index_block_size, options))
    # events (not batches) set aside, and why: the rest of their batches was folded
    aside = set_aside_counts(batches.relays.values())
    extra["set_aside_events"] = sum(aside.values())
    extra["set_aside"] = {f"{reason}/{kind}": n for (reason, kind), n in sorted(aside.items())}
    return ShadowResult(agreement, batches.dead_letters(), extra, batches.relays, aside), shard


WHOLE_BLOCK = 16  # the index's default block: what `index_bytes_whole_blocks` counts in


def at_lookup_agreement(adapter, recording: str | Path, reqs: list[dict], model: str, index_block_size: int,
                        options: RelayOptions, unreported_eviction_kinds: tuple[str, ...]) -> Agreement:
    """The agreement with each request credited where the engine looked it up (a conformance-kit
    recording's `lookup_at`): after exactly the events the engine had queued by then, those of its
    own step before the lookup included. What is left apart from the send-time figures is the
    index's reading of the events; what the send-time figures add is timing: blocks another request
    stored or evicted in the step that scheduled this one, after the request was sent (no index
    holds those yet when a router asks)."""
    # per publisher (a DP engine has one per rank: the kit names each request's in `publisher`)
    recorded = list(read_frames(recording))
    endpoints = {f.endpoint for f in recorded}
    if len(endpoints) > 1 and any(r.get("lookup_at") and r.get("publisher") not in endpoints for r in reqs):
        raise ValueError("lookup cuts of a recording with several publishers need each request's "
                         "`publisher` (one of the frames' endpoints)")
    frames, at = [], {}
    for ep in sorted(endpoints) or [""]:  # (an empty recording: its cuts fall after the last message)
        mine, cut = split_at_lookups([f for f in recorded if f.endpoint == ep],
                                     [tuple(r["lookup_at"]) for r in reqs
                                      if r.get("lookup_at") and r.get("publisher", ep) == ep])
        frames += mine
        at.update({(ep, *k): t for k, t in cut.items()})
    frames.sort(key=lambda f: f.recv_ns)
    one = next(iter(endpoints), "")
    timed = sorted(({**r, "t_ns": at[(r.get("publisher", one), *r["lookup_at"])]} for r in reqs
                    if r.get("lookup_at")), key=lambda r: r["t_ns"])
    shard = ModelShard(model, index_block_size, unreported_eviction_kinds)
    return shadow_batches(adapter.replay(frames, model, index_block_size, options), timed, shard)


def shadow(frames: Iterable[Frame], requests: list[dict], model: str = "model",
           index_block_size: int = 16, unreported_eviction_kinds: tuple[str, ...] = (),
           pending_ttl: float = 0.0, relay_factory: Callable | None = None
           ) -> tuple[Agreement, InProcessIndex]:
    """The shadow audit of ZMQ frames with `relay_factory(model, endpoint, index_block_size)`'s relays
    (None: vLLM's)."""
    from kvidx.engines.contract import zmq_replay

    index = InProcessIndex(model, index_block_size, unreported_eviction_kinds, relay_factory)
    agreement = shadow_batches(zmq_replay(frames, publishers=index.publishers), requests, index.shard,
                               pending_ttl)
    return agreement, index


def run_shadow(recording: str, requests: str, model: str = "model", index_block_size: int = 16,
               unreported_eviction_kinds: tuple[str, ...] = (), pending_ttl: float = 0.0
               ) -> tuple[Agreement, InProcessIndex]:
    return shadow(read_frames(recording), load_requests(requests), model, index_block_size,
                  unreported_eviction_kinds, pending_ttl)


def main(args) -> int:
    """`kvidx shadow`: a recording and its request log through relay and fold; the agreement printed."""
    from kvidx import engines
    from relays.inputs import InputError, check_file, check_recording_engine
    from relays.main import unchecked_engine_version

    adapter = engines.get(args.engine)
    args.index_block_size = args.index_block_size or 16
    try:  # a missing file, a requests log as the recording, another engine's recording: one line each
        check_file(args.recording, adapter.recording, "--recording")
        check_file(args.requests, "requests", "--requests")
        if adapter.recording == "frames":
            check_recording_engine(args.recording, args.engine)
        from kvidx.config import load_config

        pools = load_config(args.config).pool_readers() if args.config else None
        if adapter.shadow_defaults.get("needs_pools") and not pools:
            raise InputError(f"{args.engine}'s blocks live in a shared pool: pass --config with a "
                             "[pools.\"<the publisher's endpoint>\"] section naming the replicas reading it")
        unchecked_engine_version(args, logging.getLogger("kvidx.shadow"))
        result, _ = run_shadow_engine(args.engine, args.recording, args.requests,
                                      index_block_size=args.index_block_size,
                                      options=engines.RelayOptions(
                                          engine_version=args.engine_version,
                                          allow_unchecked_version=args.allow_unchecked_engine_version),
                                      unreported_eviction_kinds=tuple(args.unreported_eviction_kinds),
                                      pending_ttl=args.pending_ttl, pools=pools)
    except (InputError, ValueError) as e:  # ValueError: an engine version its adapter was not checked with
        sys.exit(f"error: {e}")
    summary = {**result.agreement.summary(), **result.extra}
    if args.json:
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            print(f"{k:>16}: {v}")
        print(f"{'dead_letters':>16}: {result.dead_letters}")
        for m in result.agreement.mismatches[:10]:
            print(f"  mismatch: request {m['i']}: engine reused {m['reused']}, index credited {m['credited']}"
                  f" of {m['prompt_tokens']} tokens")
    return 0
