"""A running relay: a frame source (live ZMQ or a recording) -> relay logic -> a sink."""

from __future__ import annotations

import logging
import random
import threading
import time
from pathlib import Path

from prometheus_client import Counter, Gauge

from kvidx import engines
from kvidx.engines.contract import Frame, RelayOutput, SequencedRelay, dp_endpoints
from kvidx.engines.recording import Recorder, read_frames
from relays.sinks import Sink
from relays.zmq_source import ZmqSource
from schemas.events import ReplicaCleared

log = logging.getLogger("kvidx.relay")

FRAMES = Counter("kvidx_relay_frames_total", "Engine messages received", ["replica"])
BATCHES = Counter("kvidx_relay_batches_total", "Event batches published", ["replica"])
BLOCKS = Counter("kvidx_relay_blocks_total", "Block events published", ["replica", "kind"])
DEAD = Counter("kvidx_relay_dead_letters_total", "Malformed engine messages, by reason",
               ["replica", "reason"])
UNCHECKED_VERSION = Gauge("kvidx_relay_engine_version_unchecked",
                          "1: the engine's release was not checked by this kvidx and is read as another "
                          "(--allow-unchecked-engine-version)",
                          ["engine", "version", "read_as"])
GAPS = Counter("kvidx_relay_gaps_total", "Sequence gaps, by outcome", ["replica", "outcome"])
# label values are bounded: registered engine names, reasons and event kinds named in the code
SET_ASIDE = Counter("kvidx_relay_set_aside_events_total",
                    "Engine events set aside alone (the rest of their batch was folded), by reason and kind",
                    ["engine", "reason", "event"])


def set_aside_line(counts: dict[tuple[str, str], int]) -> str:
    """`reason/kind:n,...` for a status line ("none" when nothing was set aside)."""
    return ",".join(f"{r}/{k}:{n}" for (r, k), n in sorted(counts.items())) or "none"


def emit(sink: Sink, model: str, replica: str, out: RelayOutput, engine: str = "") -> int:
    """Publish a relay step's dead letters, set-aside events and batches, counted and logged as every
    relay counts them (ZMQ relays here, polled engines in relays/poller.py); returns the batches
    published. A set-aside event is a dead letter of its own (its position in its batch in the
    headers): the rest of its batch is published."""
    for dl in out.dead:
        DEAD.labels(replica, dl.reason).inc()
        log.warning("event=dead_letter replica=%s reason=%s seq=%d bytes=%d", replica, dl.reason,
                    dl.frame.seq, len(dl.frame.payload))
        sink.dead_letter(dl, model, replica)
    for dl in out.set_aside:
        SET_ASIDE.labels(engine, dl.reason, dl.event).inc()
        log.info("event=event_set_aside replica=%s reason=%s kind=%s seq=%d position=%d", replica, dl.reason,
                 dl.event, dl.frame.seq, dl.position)
        sink.dead_letter(dl, model, replica)
    for b in out.batches:
        sink.publish(b)
        BATCHES.labels(replica).inc()
        for ev in b.events:
            BLOCKS.labels(replica, type(ev).__name__).inc(len(getattr(ev, "hashes", ())))
    return len(out.batches)


class Relay:
    def __init__(self, core: SequencedRelay, sink: Sink, source: ZmqSource | None = None,
                 record_to: str | Path | None = None, resync_blocks_per_s: float = 50_000,
                 resync_jitter_s: float = 5.0, status_every_s: float = 30.0):
        self.core = core
        self.sink = sink
        self.source = source
        # a periodic one-line status (info): a relay pointed at a dead endpoint says so, not nothing
        self.status_every_s = status_every_s
        self._status_at = time.monotonic() + status_every_s
        self.batches_published = 0
        self.dead_letters = 0
        self.last_frame_at: float | None = None  # wall clock of the last engine message
        self.recorder = Recorder(record_to) if record_to else None
        self.stop_event = threading.Event()
        # mirror replays on request, spread out: a random start within the jitter (so that relays
        # asked together do not send together), then parts paced at resync_blocks_per_s
        self.resync_blocks_per_s = resync_blocks_per_s
        self.resync_jitter_s = resync_jitter_s
        self._resync_wanted = threading.Event()
        self._regroup_to = 0  # > 0: the replay moves the replica to its group among this many
        self._resync_first_part = 0
        self._resync = None
        self._resync_at = 0.0
        lost = getattr(sink, "on_undelivered", None)
        if lost is not None:  # a batch Kafka did not take: replay the mirror (it starts with a clear)
            lost.append(self._batch_lost)

    def _batch_lost(self, model: str, replica: str, dp_rank: int) -> None:
        core = self.core
        if (model, replica, dp_rank) == (core.model, core.replica, core.dp_rank or 0):
            log.warning("event=batch_lost replica=%s dp_rank=%d action=mirror_replay", replica, dp_rank)
            self.request_resync()

    def request_resync(self, replica_groups: int = 0) -> None:
        """Ask for a mirror replay (thread-safe: control listeners call it); with `replica_groups`,
        into the replica's group among that many (re-grouping: `_regroup`)."""
        if replica_groups:
            self._regroup_to = replica_groups
        self._resync_wanted.set()

    def resync_tick(self, now: float | None = None) -> bool:
        """Send the next mirror-replay part if one is due; True while a replay is in progress."""
        now = time.monotonic() if now is None else now
        if self._resync_wanted.is_set() and self._resync is None:
            self._resync_wanted.clear()
            self._resync = self.core.resync(max_blocks=max(1, int(self.resync_blocks_per_s / 10)))
            self._resync_first_part = self.core.resync_part
            self._resync_at = now + random.uniform(0, self.resync_jitter_s)
            log.info("event=resync_scheduled replica=%s in_s=%.2f", self.core.replica, self._resync_at - now)
        if self._resync is None or now < self._resync_at:
            return self._resync is not None
        if self._regroup_to and self.core.resync_part == self._resync_first_part:
            self._regroup()
        batch = next(self._resync, None)
        if batch is None:
            self._resync = None
            log.info("event=resync_done replica=%s parts=%d", self.core.replica, self.core.resync_part)
            return False
        self.sink.publish(batch)
        blocks = sum(len(getattr(e, "hashes", ())) for e in batch.events)
        self._resync_at = now + blocks / self.resync_blocks_per_s
        return True

    def _regroup(self) -> None:
        """Right before the replay's first part: if the replica's group changes, clear it in the old
        group (in a new epoch, so that it orders after everything sent there) and publish from now
        on, the replay first, under the new group's key. A reader that folds both groups sees the
        clear and the replay in either order: the clear is older than every replay part."""
        groups, self._regroup_to = self._regroup_to, 0
        move = getattr(self.sink, "regroup", None)
        if move is None:
            return  # a sink without groups (in process)
        old, new = move(self.core.model, self.core.replica, groups, dry_run=True)
        if old == new:
            return
        self.core.epoch += 1
        self._emit_clear("regroup")
        move(self.core.model, self.core.replica, groups)
        log.info("event=regrouped replica=%s replica_groups=%d from_group=%d to_group=%d",
                 self.core.replica, groups, old, new)

    def handle(self, frame: Frame) -> None:
        if frame.src == "controller":  # a connector's own feed (LMCache's admit/evict): same mirror, thread
            self._emit(self.core.on_controller(frame.payload, frame.recv_ns))
            return
        if self.recorder:
            self.recorder.write(frame)
        self.last_frame_at = time.time()
        FRAMES.labels(self.core.replica).inc()
        out = self.core.on_frame(frame)
        if out.gap is not None:
            self._emit(self._fill_gap(out.gap, frame))
        else:
            self._emit(out)

    def _fill_gap(self, gap: tuple[int, int], frame: Frame) -> RelayOutput:
        first, got = gap
        replayed = self.source.replay(first) if self.source else None
        missing = sorted((f for f in replayed or () if first <= f.seq < got), key=lambda f: f.seq)
        if not missing or missing[0].seq != first or len(missing) != got - first:
            GAPS.labels(self.core.replica, "unfilled").inc()
            log.warning("event=gap_unfilled replica=%s missing=%d..%d", self.core.replica, first, got - 1)
            return self.core.gap_unfilled(frame)
        GAPS.labels(self.core.replica, "filled").inc()
        log.info("event=gap_filled replica=%s batches=%d", self.core.replica, len(missing))
        total = RelayOutput()
        for f in [*missing, frame]:
            if self.recorder:
                self.recorder.write(f)
            total.add(self.core.on_frame(f, check_gap=False))
        return total

    def _emit(self, out: RelayOutput) -> None:
        if self.dead_letters == 0:
            wrong = next((dl for dl in out.dead if dl.reason == "wrong_engine"), None)
            if wrong is not None:
                log.error("event=wrong_engine replica=%s detail=%r", self.core.replica, wrong.detail)
        self.dead_letters += len(out.dead)
        self.batches_published += emit(self.sink, self.core.model, self.core.replica, out,
                                       getattr(self.core, "engine", ""))

    def start_fresh(self, replay_from_start: bool = True) -> None:
        """A relay that starts knows nothing of the engine's cache: clear the replica's view, then
        rebuild it from whatever the engine's replay buffer still holds."""
        self._emit_clear("relay_start")
        if replay_from_start and self.source is not None:
            frames = self.source.replay(0) or []
            log.info("event=startup_replay replica=%s batches=%d", self.core.replica, len(frames))
            for f in frames:
                self.handle(f)

    def retract(self, reason: str) -> None:
        """The replica leaves the index (its relay stops for good): a ReplicaCleared in a new epoch, so
        that it orders after everything this relay sent."""
        self.core.epoch += 1
        self._emit_clear(reason)
        self.sink.flush(5)

    def _emit_clear(self, reason: str) -> None:
        now = Frame(b"", -1, b"", time.time_ns(), self.source.endpoint if self.source else "", "relay")
        self._emit(RelayOutput(batches=[self.core._wrap([ReplicaCleared(reason)], -1, now, 0.0)]))

    def run_live(self, idle_flush_s: float = 0.2) -> None:
        assert self.source is not None
        for frame in self.source.frames(idle_flush_s):
            if self.stop_event.is_set():
                break
            self.resync_tick()
            self.status_tick()
            if frame is None:
                self.sink.flush(0)
                continue
            self.handle(frame)
        self.sink.flush()

    def status_tick(self, now: float | None = None) -> None:
        """Broker health (the sink's) on every turn; the relay's status line every status_every_s."""
        check = getattr(self.sink, "check_health", None)
        if check is not None:
            check()
        now = time.monotonic() if now is None else now
        if now < self._status_at:
            return
        self._status_at = now + self.status_every_s
        age = f"{time.time() - self.last_frame_at:.1f}" if self.last_frame_at is not None else "none"
        waiting = getattr(self.sink, "waiting", lambda: 0)()
        aside = getattr(self.core, "set_aside", {})
        log.info("event=relay_status replica=%s endpoint=%s frames=%d batches=%d dead_letters=%d "
                 "set_aside_events=%d set_aside=%s last_event_age_s=%s kafka_waiting=%d", self.core.replica,
                 self.source.endpoint if self.source else "", self.core.counters["frames"],
                 self.batches_published, self.dead_letters, sum(aside.values()), set_aside_line(aside), age,
                 waiting)

    def play(self, path: str | Path, realtime: bool = False, speed: float = 1.0) -> int:
        """Feed a recording instead of a live socket; with `realtime`, keep its timing."""
        n = 0
        t0 = w0 = None
        for frame in sorted(read_frames(path), key=lambda f: f.recv_ns):
            if self.stop_event.is_set():
                break
            if realtime:
                if t0 is None:
                    t0, w0 = frame.recv_ns, time.monotonic()
                delay = (frame.recv_ns - t0) / 1e9 / speed - (time.monotonic() - w0)
                if delay > 0:
                    time.sleep(delay)
            self.handle(frame)
            n += 1
        self.sink.flush()
        return n

    def close(self) -> None:
        self.stop_event.set()
        if self.recorder:
            self.recorder.close()
        if self.source:
            self.source.close()


def play_recording(path: str | Path, model: str, sink: Sink, index_block_size: int,
                   replica: str | None = None, dp_rank: int | None = None, relay_factory=None) -> int:
    """Publish a recording through one relay per publisher endpoint it holds; returns the frames.
    `relay_factory(model, replica, index_block_size, dp_rank)` builds the engine's relay (the default
    engine's by default)."""
    make = relay_factory or engines.default_relay
    by_endpoint: dict[str, list[Frame]] = {}
    for f in read_frames(path):
        by_endpoint.setdefault(f.endpoint, []).append(f)
    for ep, frames in sorted(by_endpoint.items()):
        relay = Relay(make(model, replica or ep, index_block_size, dp_rank), sink)
        relay.start_fresh(replay_from_start=False)
        for f in sorted(frames, key=lambda f: f.recv_ns):
            relay.handle(f)
    sink.flush()
    return sum(len(v) for v in by_endpoint.values())


def build_dp_relays(model: str, replica: str, endpoint: str, replay_endpoint: str | None, dp_size: int,
                    sink: Sink, index_block_size: int, engine_version: str, bind: bool = False,
                    source_factory=None, engine: str = engines.DEFAULT, **relay_options) -> list[Relay]:
    """One Relay (ZMQ source + the engine's relay logic) per DP rank, all publishing as `replica` with
    dp_rank set. The engine version is checked once, before any socket is opened. `source_factory(
    endpoint, replay_endpoint, bind)` builds the frame source (default: relays.zmq_source.ZmqSource)."""
    adapter = engines.get(engine)
    opts = engines.RelayOptions(engine_version=engine_version, extra=relay_options)
    cores = [adapter.make_relay(model, replica, index_block_size, rank, opts) for rank in range(dp_size)]
    if source_factory is None:
        from relays.zmq_source import ZmqSource

        def source_factory(ep, rep, b):
            return ZmqSource(ep, rep, bind=b)
    return [Relay(core, sink, source_factory(ep, rep, bind))
            for core, (ep, rep) in zip(cores, dp_endpoints(endpoint, replay_endpoint, dp_size), strict=True)]
