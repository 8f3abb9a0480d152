"""The engine adapter contract: what every engine adapter provides and guarantees, and the one
sequenced relay every ZMQ-publishing engine's relay logic is built on.

An adapter (kvidx/engines/<name>/, registered in kvidx.engines) provides:
- its wire decoding (`wire.py`: structs and decoding only) and the versions it was checked against;
- its mirror rules (`mirror.py`: eviction semantics, hash folding, tiers, speculative-decoding keys,
  partial blocks), pure: decoded engine events in, canonical schema events out;
- its relay logic (`relay.py`) and the source it is fed from (ZMQ PUB + replay, HTTP polling, a
  controller feed, recordings), and the recording kind `kvidx shadow` and `relay --play` read.
Every adapter guarantees: canonical keys (kvidx.core.hashing, the same for every engine), batches in
the engine's order, and bad input as a dead letter with a reason (never an exception, never folded).
Events are decoded and placed one by one: an event that cannot be decoded or placed is set aside on
its own (`RelayOutput.set_aside`: a dead letter with the event's position in its batch and its kind;
kvidx.engines.common.SetAside), the batch's other events are folded in order, and setting it aside
never credits more (the rule per event kind: kvidx.engines.common.place_unreadable, docs/engines.md).
A payload whose batch envelope cannot be read at all is a dead letter as a whole (its sequence number
is consumed: not a gap); nothing of it can be placed, and the replica is left as it was.

`SequencedRelay` is the engine-neutral part, free of sockets and brokers: frames in, versioned event
batches out. Per publisher (one engine replica or one DP rank): decode the payload, check the sequence
number, update the mirror, and wrap the canonical events in an `EventBatch`. Sequence handling:
- a frame whose seq was already seen (the replay endpoint repeats published batches) is dropped;
- a jump ahead is a gap: the caller asks the engine's replay endpoint for the missing batches and
  feeds them in; if they cannot be had, `gap_unfilled` publishes ReplicaCleared (a warm replica seen
  as cold costs little; a cold one seen as warm costs a slow request);
- seq 0 after a later seq is an engine restart: new epoch, everything cleared.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec

from kvidx.core.shard import wall_epoch
from kvidx.engines.common import MirrorError, SetAside
from kvidx.engines.sniff import wrong_engine
from schemas.events import SCHEMA_VERSION, BlocksStored, EventBatch, ReplicaCleared

MAX_PAYLOAD = 64 << 20  # a larger frame is not an engine batch
SNIFF_FRAMES = 20  # the first frames of a stream are checked for another engine's fields


@dataclass
class Frame:
    """One ZMQ message of the engine's PUB socket (or of its replay endpoint)."""
    topic: bytes
    seq: int
    payload: bytes
    recv_ns: int
    endpoint: str = ""
    src: str = "pub"


@dataclass
class DeadLetter:
    """A dead letter: a whole engine message (`position` -1), or one event of it that was set aside
    (`position`: its place in the engine batch, `event`: its kind; `frame.payload` is that event's own
    bytes and `frame.seq` the batch's)."""
    reason: str
    detail: str
    frame: Frame
    position: int = -1
    event: str = ""


@dataclass
class RelayOutput:
    batches: list[EventBatch] = field(default_factory=list)
    dead: list[DeadLetter] = field(default_factory=list)  # whole engine messages
    set_aside: list[DeadLetter] = field(default_factory=list)  # single events (the rest was folded)
    gap: tuple[int, int] | None = None  # (first missing seq, seq received) when a gap is detected

    def add(self, other: RelayOutput) -> None:
        self.batches += other.batches
        self.dead += other.dead
        self.set_aside += other.set_aside


def set_aside_letters(entries: list[SetAside], events: list, frame: Frame, counts: dict[tuple[str, str], int]
                      ) -> list[DeadLetter]:
    """The dead letters of a batch's set-aside events (each its own bytes: the undecodable event's, or
    the decoded event re-encoded), counted in `counts` by (reason, event kind)."""
    out = []
    for sa in entries:
        key = (sa.reason, sa.event)
        counts[key] = counts.get(key, 0) + 1
        raw = sa.raw
        if raw is None:
            try:
                raw = msgspec.msgpack.encode(events[sa.position])
            except (TypeError, IndexError, msgspec.EncodeError):
                raw = b""
        f = Frame(frame.topic, frame.seq, raw, frame.recv_ns, frame.endpoint, frame.src)
        out.append(DeadLetter(sa.reason, f"{sa.action}: {sa.detail}"[:300], f, sa.position, sa.event))
    return out


class SequencedRelay:
    """The relay logic of one publisher of a ZMQ-publishing engine. A subclass sets `engine` (its
    registry name), builds `self.mirror` (the engine's mirror: `apply(events, now)`, `clear()`,
    `block_size`, `live`, `memo`, `group_kinds`, `replay_keys()`: the stores of its keys besides
    blocks, for a mirror replay) before or after calling this __init__, and
    implements `decode(payload)` (the engine's wire decoding, raising msgspec errors on bad input)."""

    engine = ""  # the engine whose stream this relay reads (another engine's is a dead letter)

    def __init__(self, model: str, replica: str, index_block_size: int, dp_rank: int | None = None,
                 epoch: int | None = None):
        self.model = model
        self.replica = replica
        self.dp_rank = dp_rank
        # epochs order a replica's batches across relay restarts: start from the wall clock (ms), the
        # clock every writer's epochs share (kvidx.core.shard.wall_epoch)
        self.epoch = epoch if epoch is not None else wall_epoch()
        self.next_seq: int | None = None
        self.counters: dict[str, int] = {"frames": 0, "duplicates": 0, "gaps": 0, "restarts": 0}
        self.resync_part = 0  # mirror-replay parts sent (EventBatch.part), increasing for ever
        self.wrong_engine_reason: str | None = None  # why the stream is another engine's, once seen
        self.set_aside: dict[tuple[str, str], int] = {}  # (reason, event kind) -> events set aside

    def on_controller(self, payload: bytes, recv_ns: int) -> RelayOutput:
        """A message of the engine's connector on its own feed (relays.zmq_source's controller socket);
        an engine without one dead-letters it."""
        out = RelayOutput()
        frame = Frame(b"controller", -1, payload, recv_ns, self.replica, "controller")
        out.dead.append(DeadLetter("unexpected_controller_message", f"{len(payload)} bytes: this engine's "
                                   "relay takes no controller feed", frame))
        return out

    def on_frame(self, frame: Frame, check_gap: bool = True) -> RelayOutput:
        out = RelayOutput()
        self.counters["frames"] += 1
        if self.next_seq is not None:
            if frame.seq < self.next_seq:
                if frame.seq == 0 and frame.src == "pub":  # the engine restarted
                    self.counters["restarts"] += 1
                    self.epoch += 1
                    self.mirror.clear()
                    self.next_seq = 0
                    out.batches.append(self._wrap([ReplicaCleared("engine_restart")], -1, frame, 0.0))
                else:
                    self.counters["duplicates"] += 1
                    return out
            elif frame.seq > self.next_seq and check_gap:
                self.counters["gaps"] += 1
                out.gap = (self.next_seq, frame.seq)
                return out
        if len(frame.payload) > MAX_PAYLOAD:
            self._skip(frame)
            out.dead.append(DeadLetter("oversized", f"{len(frame.payload)} bytes", frame))
            return out
        if self.wrong_engine_reason is None and self.counters["frames"] <= SNIFF_FRAMES:
            self.wrong_engine_reason = wrong_engine(frame.payload, self.engine)
        if self.wrong_engine_reason is not None:  # never folded as this engine's: it may decode, misread
            self._skip(frame)
            out.dead.append(DeadLetter("wrong_engine", self.wrong_engine_reason, frame))
            return out
        try:
            batch = self.decode(frame.payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._skip(frame)
            out.dead.append(DeadLetter("malformed_payload", str(e)[:300], frame))
            return out
        try:
            events = self.mirror.apply(batch.events, now=batch.ts)
        except MirrorError as e:  # a mirror places events one by one: this is a bug's safety net
            self._skip(frame)
            out.dead.append(DeadLetter(e.reason, str(e)[:300], frame))
            return out
        self.next_seq = frame.seq + 1
        if batch.data_parallel_rank is not None:
            self.dp_rank = batch.data_parallel_rank  # the publisher's rank, for clears too
        aside = getattr(self.mirror, "set_aside", None)
        if aside:
            out.set_aside += set_aside_letters(aside, batch.events, frame, self.set_aside)
        out.batches.append(self._wrap(events, frame.seq, frame, batch.ts))
        return out

    def decode(self, payload: bytes):
        """The engine batch in a payload: `.ts`, `.events`, `.data_parallel_rank`."""
        raise NotImplementedError

    def gap_unfilled(self, frame: Frame) -> RelayOutput:
        """The replay endpoint could not return the missing batches: forget the replica's state and
        carry on from `frame`."""
        self.mirror.clear()
        self.epoch += 1
        out = RelayOutput(batches=[self._wrap([ReplicaCleared("gap_unfilled")], -1, frame, 0.0)])
        self.next_seq = None
        nxt = self.on_frame(frame)
        out.add(nxt)
        return out

    def _skip(self, frame: Frame) -> None:
        # a bad frame still consumes its sequence number: it is dead-lettered, not a gap
        if self.next_seq is None or frame.seq >= self.next_seq:
            self.next_seq = frame.seq + 1

    def _wrap(self, events, seq: int, frame: Frame, engine_ts: float) -> EventBatch:
        return EventBatch(
            v=SCHEMA_VERSION, model=self.model, replica=self.replica,
            dp_rank=self.dp_rank or 0, epoch=self.epoch, seq=seq,
            engine_ts=engine_ts or frame.recv_ns / 1e9, relay_ts=frame.recv_ns / 1e9,
            block_size=self.mirror.block_size, events=events,
            copies_removed=getattr(self.mirror, "copies_removed", None) or {}, **self._resume_rules())

    def _resume_rules(self) -> dict:
        """How the engine resumes (EventBatch fields), on its live batches and mirror replays alike."""
        return {"recompute_tokens": getattr(self.mirror, "recompute_tokens", 1),
                "lookahead_tokens": getattr(self.mirror, "lookahead_tokens", 0),
                "external_after_local": getattr(self.mirror, "external_after_local", 0)}

    def resync(self, max_blocks: int = 4096) -> Iterator[EventBatch]:
        """Replay the mirror (when the index lost this replica's state): a ReplicaCleared, then the
        live blocks shallowest first, `max_blocks` index blocks per batch. Parts are built when they
        are taken, from the mirror as it is then, so the caller can spread them out in time between
        live batches: a block evicted meanwhile is not re-sent, and each part is ordered after the
        last engine batch (EventBatch.part)."""
        depth = self.mirror.memo
        plan = sorted(self.mirror.live, key=lambda key: depth.get(key[0], ((), 0))[1])
        i, first = 0, True
        while first or i < len(plan):
            events: list = [ReplicaCleared("resync")] if first else []
            first = False
            chunk: dict[tuple[str, int], list[int]] = {}
            n = 0
            while i < len(plan) and n < max_blocks:
                key = plan[i]
                i += 1
                entry = self.mirror.live.get(key)
                if entry is not None:
                    chunk.setdefault((key[1], key[2]), []).extend(entry[1])
                    n += len(entry[1])
            for (tier, group), hashes in chunk.items():
                kind, window = self.mirror.group_kinds.get(group, ("full_attention", None))
                events.append(BlocksStored(tier, group, hashes, None, 0, group_kind=kind,
                                           sliding_window=window))
            if i >= len(plan):  # the last part: the keys kept beside the blocks (partial, Dynamo)
                events += self.mirror.replay_keys()
            self.resync_part += 1
            now = time.time()
            yield EventBatch(v=SCHEMA_VERSION, model=self.model, replica=self.replica,
                             dp_rank=self.dp_rank or 0, epoch=self.epoch,
                             seq=self.next_seq - 1 if self.next_seq is not None else -1,
                             engine_ts=now, relay_ts=now, block_size=self.mirror.block_size,
                             events=events, part=self.resync_part, **self._resume_rules())


class PublisherRelays:
    """One relay per publisher endpoint of a ZMQ engine, made on its first frame: the frame -> batches
    step every in-process consumer of recorded or live frames shares (shadow, demo, tests)."""

    def __init__(self, make_relay):
        self.make_relay = make_relay  # endpoint -> SequencedRelay
        self.relays: dict[str, SequencedRelay] = {}
        self.dead_letters = 0  # whole engine messages
        self.set_aside_events = 0  # single events set aside (the relays count them by reason and kind)

    def batches(self, frame: Frame) -> list[EventBatch]:
        relay = self.relays.get(frame.endpoint)
        if relay is None:
            relay = self.relays[frame.endpoint] = self.make_relay(frame.endpoint)
        out = relay.on_frame(frame)
        if out.gap is not None:  # a recording cannot be asked for the missing batches
            out = relay.gap_unfilled(frame)
        self.dead_letters += len(out.dead)
        self.set_aside_events += len(out.set_aside)
        return out.batches


def zmq_replay(frames, make_relay=None, publishers: PublisherRelays | None = None):
    """The batches a ZMQ engine's relays (`make_relay(endpoint)`, or given `publishers`) make of
    recorded frames, in receive order: what `kvidx shadow` folds (a kvidx.engines.Batches)."""
    from kvidx.engines import Batches

    pub = publishers or PublisherRelays(make_relay)

    def gen():  # a frame reaches its relay only when the consumer folds that far (see Batches)
        for f in sorted(frames, key=lambda f: f.recv_ns):
            yield f.recv_ns, lambda f=f: pub.batches(f)

    return Batches(gen(), dead=lambda: pub.dead_letters, default_replica=lambda: next(iter(pub.relays), ""),
                   relays=pub.relays)


# ---- data parallelism: one KV-event publisher per DP rank ------------------------------------------
# vLLM runs one publisher per DP rank, each on the base endpoint offset by its rank
# (vllm/distributed/kv_events.py ZmqEventPublisher.offset_endpoint_port, 0.32.0: tcp port + rank, a tcp
# port of 0 left to the OS, inproc endpoints suffixed "_dp<rank>"), for the events and the replay
# endpoint alike; SGLang's publisher is a port of it with the same rule. One relay (and one mirror) per
# rank: each rank has its own sequence numbers, its own cache and its own AllBlocksCleared (published by
# a rank only with its next step).
def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """A rank's endpoint (vLLM's and SGLang's offset_endpoint_port)."""
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
    """(events endpoint, replay endpoint) of every DP rank's publisher, rank 0 first."""
    if dp_size < 1:
        raise ValueError(f"--dp-size must be >= 1, got {dp_size}")
    return [(offset_endpoint(endpoint, r), offset_endpoint(replay_endpoint, r)) for r in range(dp_size)]
