"""The TensorRT-LLM relay: polls trtllm-serve's `POST /kv_cache_events` (or plays a recording of polls)
and turns the engine's events into versioned event batches.

- Start-up: `GET /version` (trtllm-serve, openai_server.py `version`) must name a pinned series
  (kvidx/engines/trtllm/wire.py SUPPORTED_VERSIONS): an unknown version is a clear error, not a guess.
- A poll returns the events drained since the last one (a JSON list). Events are split per
  attention-DP rank (rank 0 gathers every rank's events; each event names its rank), and each rank
  is its own (replica, dp_rank) in the index with its own mirror and event-id sequence.
- event_id: +1 per event per rank (kvCacheEventManager.cpp `mEventId++`). An id going back is an
  engine restart (the pull API drains, it never repeats an event): new epoch, cleared. A jump ahead is a
  gap (the engine's bounded event queue discarded events, or a poll failed). No replay exists, so the
  replica's state is unknown: ReplicaCleared("gap_unfilled") and a fresh mirror (a warm replica seen
  as cold costs little; the reverse costs a slow request).
- 1.2.0rc2: the serializer raises on `updated` events without a priority (every host offload), so a
  poll can fail (HTTP 5xx) and its events are lost: counted (`poll_errors`), then handled as a gap.
  Fixed releases send `"priority": null`, which decodes.
- Only the largest attention window is indexed (from the `created` events when seen, otherwise the
  largest window seen); other windows' events are counted (`other_window`).
- Events are placed one by one (kvidx/engines/common.py, docs/engines.md): an event that does not
  decode is read loosely; with its event_id it keeps its place in the sequence and is set aside by
  the common rule (a store skipped; a removal or update whose hashes can be read drops them; one
  whose hashes cannot be read clears the rank); without an event_id it is a dead letter, and the gap
  it leaves clears the rank. Events the mirror cannot place are set aside alone.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from kvidx.engines.common import MirrorError, SetAside, Unreadable, place_unreadable
from kvidx.engines.contract import DeadLetter, Frame, RelayOutput, set_aside_letters
from kvidx.engines.trtllm.mirror import TrtllmMirror
from kvidx.engines.trtllm.wire import (
    BUGGY_UPDATED_SERIALIZER,
    Created,
    Event,
    check_version,
    decode_event,
    read_loosely,
    split_poll,
)
from schemas.events import SCHEMA_VERSION, EventBatch, ReplicaCleared

log = logging.getLogger("kvidx.relay")
MAX_EVENT = 16 << 20


@dataclass
class RankState:
    mirror: TrtllmMirror
    next_id: int | None = None
    epoch: int = 0
    max_window: int | None = None
    windows_created: set[int] = field(default_factory=set)


@dataclass
class _Loose:
    """An event that did not decode, with what could be read of its envelope."""
    event_id: int
    data: Unreadable
    window_size: int | None
    attention_dp_rank: int


class TrtllmPollRelay:
    """Relay logic for one trtllm-serve instance (all its attention-DP ranks), free of I/O."""

    engine = "trtllm"

    def __init__(self, model: str, replica: str, index_block_size: int, block_size: int | None = None,
                 epoch: int | None = None, partial_reuse: bool = True):
        self.model = model
        self.replica = replica
        self.index_block_size = index_block_size
        self.block_size = block_size
        self.partial_reuse = partial_reuse
        self.epoch0 = epoch if epoch is not None else int(time.time() * 1000)
        self.ranks: dict[int, RankState] = {}
        self.counters = {"polls": 0, "events": 0, "duplicates": 0, "gaps": 0, "restarts": 0,
                         "other_window": 0, "poll_errors": 0, "dead": 0}
        self.set_aside: dict[tuple[str, str], int] = {}  # (reason, event kind) -> events set aside

    def rank(self, r: int) -> RankState:
        st = self.ranks.get(r)
        if st is None:
            st = self.ranks[r] = RankState(TrtllmMirror(self.index_block_size, self.block_size,
                                                        self.partial_reuse), epoch=self.epoch0)
        return st

    # ---- input ---------------------------------------------------------------------------------
    def on_poll_body(self, body: bytes, recv_ns: int) -> RelayOutput:
        """A poll's raw response body (a JSON array of events)."""
        try:
            raws = split_poll(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.counters["dead"] += 1
            dl = DeadLetter("malformed_poll", str(e)[:300], self._frame(body, -1, recv_ns))
            return RelayOutput(dead=[dl])
        return self.on_poll(raws, recv_ns)

    def on_poll(self, events: list, recv_ns: int) -> RelayOutput:
        """One poll's events, each a dict (as recorded) or raw JSON bytes."""
        out = RelayOutput()
        self.counters["polls"] += 1
        per_rank: dict[int, list[tuple[int, Event | _Loose]]] = {}
        for pos, raw in enumerate(events):
            try:
                if isinstance(raw, bytes | bytearray) and len(raw) > MAX_EVENT:
                    raise ValueError(f"oversized event: {len(raw)} bytes")
                ev = decode_event(raw)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as e:
                big = isinstance(raw, bytes | bytearray) and len(raw) > MAX_EVENT
                eid, rank, window, u = (None, 0, None, None) if big else read_loosely(raw, str(e))
                if eid is None:  # no place in the sequence: a dead letter (its gap clears the rank)
                    self.counters["dead"] += 1
                    out.dead.append(DeadLetter("malformed_event", str(e)[:300],
                                               self._frame(raw, -1, recv_ns)))
                    continue
                ev = _Loose(eid, u, window, rank)
            per_rank.setdefault(ev.attention_dp_rank or 0, []).append((pos, ev))
        for r, evs in per_rank.items():
            self._rank_events(r, evs, recv_ns, out)
        return out

    def poll_failed(self, reason: str, recv_ns: int | None = None) -> RelayOutput:
        """A poll that failed on the engine's side (1.2.0rc2 serializer bug, a 5xx): the events it
        drained are lost for good, so every rank's state is unknown now: cleared at once (the next
        events are taken as they come)."""
        self.counters["poll_errors"] += 1
        log.warning("event=poll_failed replica=%s reason=%s", self.replica, reason)
        out = RelayOutput()
        now = recv_ns or time.time_ns()
        for r, st in self.ranks.items():
            self._flush_clear(st, r, [], -1, now, out, "poll_failed")
            st.next_id = None
        return out

    def _rank_events(self, r: int, evs: list[tuple[int, Event | _Loose]], recv_ns: int,
                     out: RelayOutput) -> None:
        st = self.rank(r)
        canon: list = []
        last_id = -1
        for pos, ev in evs:
            self.counters["events"] += 1
            if st.next_id is not None and ev.event_id != st.next_id:
                if ev.event_id < st.next_id:
                    # the pull API drains: it never repeats an event, so ids going back mean a new
                    # event manager (engine restart; its `created` events may have gone to another poller)
                    self.counters["restarts"] += 1
                    canon = self._flush_clear(st, r, canon, last_id, recv_ns, out, "engine_restart")
                    st.windows_created = set()
                    st.max_window = None
                else:
                    self.counters["gaps"] += 1
                    log.warning("event=gap_unfilled replica=%s rank=%d missing=%d..%d", self.replica, r,
                                st.next_id, ev.event_id - 1)
                    canon = self._flush_clear(st, r, canon, last_id, recv_ns, out, "gap_unfilled")
            st.next_id = ev.event_id + 1
            last_id = ev.event_id
            data = ev.data
            w = ev.window_size
            if isinstance(data, Created):
                if w is not None:
                    st.windows_created.add(w)
                    st.max_window = max(st.windows_created)
                st.mirror.apply([data])
                continue
            if w is not None:
                if st.max_window is None or (w > st.max_window and not st.windows_created):
                    if st.max_window is not None and st.mirror.live_blocks():
                        # a larger window than the one indexed so far: index that one instead
                        canon = self._flush_clear(st, r, canon, last_id - 1, recv_ns, out, "window_change")
                    st.max_window = w
                elif w != st.max_window:
                    self.counters["other_window"] += 1
                    continue
            frame = self._frame(b"", ev.event_id, recv_ns)
            if isinstance(data, Unreadable):
                aside = [place_unreadable(st.mirror, data, 0, canon)]
            else:
                try:
                    canon.extend(st.mirror.apply([data]))
                    aside = st.mirror.set_aside
                except (MirrorError, ValueError) as e:  # raised before the event changed anything
                    reason = e.reason if isinstance(e, MirrorError) else "bad_value"
                    aside = [SetAside(0, type(data).__name__.lower(), reason, str(e))]
            if aside:
                for sa in aside:
                    sa.position = pos
                    if sa.raw is None:
                        sa.raw = msgspec.json.encode(ev)
                out.set_aside += set_aside_letters(aside, [], frame, self.set_aside)
        if canon:
            out.batches.append(self._wrap(st, r, canon, last_id, recv_ns))

    def _flush_clear(self, st: RankState, r: int, canon: list, last_id: int, recv_ns: int,
                     out: RelayOutput, reason: str) -> list:
        if canon:
            out.batches.append(self._wrap(st, r, canon, last_id, recv_ns))
        st.mirror.clear()
        st.epoch += 1
        out.batches.append(self._wrap(st, r, [ReplicaCleared(reason)], -1, recv_ns))
        return []

    def _wrap(self, st: RankState, r: int, events: list, seq: int, recv_ns: int) -> EventBatch:
        ts = recv_ns / 1e9
        cap = st.mirror.capacity
        return EventBatch(v=SCHEMA_VERSION, model=self.model, replica=self.replica, dp_rank=r,
                          epoch=st.epoch, seq=seq, engine_ts=ts, relay_ts=ts,
                          block_size=st.mirror.block_size, events=events,
                          host_tier_blocks=cap[1] if cap and len(cap) > 1 else 0)

    def _frame(self, raw, seq: int, recv_ns: int) -> Frame:
        payload = raw if isinstance(raw, bytes) else json.dumps(raw, default=str).encode()
        return Frame(b"trtllm.kv_cache_events", seq, payload, recv_ns, self.replica, "poll")

    def start_fresh(self, recv_ns: int | None = None) -> list[EventBatch]:
        """What a starting relay publishes: the replica's view is unknown until its events arrive."""
        now = recv_ns or time.time_ns()
        st = self.rank(0)
        st.epoch += 1
        return [self._wrap(st, 0, [ReplicaCleared("relay_start")], -1, now)]


# ---- recordings (../shared/fixtures/README.md: one line per poll) -------------------------------
def read_polls(path: str | Path) -> Iterator[tuple[int, list, str | None]]:
    """(recv_ns, events, error) per poll; `error` (an extension of the format: a poll that failed on
    the engine's side, e.g. HTTP 500) is None for ordinary polls."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                yield int(rec["recv_ns"]), list(rec.get("events") or []), rec.get("error")
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a poll record ({e})") from None


class PollRecorder:
    def __init__(self, path: str | Path):
        self.f = open(path, "a")

    def write(self, recv_ns: int, events: list, error: str | None = None) -> None:
        rec = {"recv_ns": recv_ns, "events": events}
        if error:
            rec["error"] = error
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


# ---- live polling -------------------------------------------------------------------------------
class TrtllmHttpSource:
    """trtllm-serve's HTTP endpoints (stdlib only)."""

    def __init__(self, url: str, timeout_s: float = 10.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.version: str | None = None

    def check_version(self) -> str:
        """GET /version -> {"version": "..."}; raises UnsupportedVersion for an unknown one."""
        with urllib.request.urlopen(self.url + "/version", timeout=self.timeout_s) as r:
            self.version = str(json.loads(r.read())["version"])
        check_version(self.version)
        if self.version in BUGGY_UPDATED_SERIALIZER:
            log.warning("event=engine_serializer_bug version=%s: polls fail on host-offload events and "
                        "their events are lost (handled as gaps); upgrade the engine", self.version)
        return self.version

    def poll(self) -> tuple[int, bytes | None, str | None]:
        """(recv_ns, body or None, error) of one POST /kv_cache_events."""
        req = urllib.request.Request(self.url + "/kv_cache_events", data=b"", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return time.time_ns(), r.read(), None
        except urllib.error.HTTPError as e:
            return time.time_ns(), None, f"http_{e.code}"
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            return time.time_ns(), None, f"unreachable: {e}"
