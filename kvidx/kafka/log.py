"""Reading the index's topics: consumers, partitions, watermarks and time ranges (shared by the
service, the relays, replay, audit and feedback), and the Kafka options of the tools' commands.

Kafka message timestamps are the producers' CreateTime: relays stamp an event batch when they publish
it, the service stamps a route or usage report when it records it. `offsets_for_times` finds the first
offset at or after a time in every partition; a range read stops at the first offset after its end.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

from confluent_kafka import Consumer, KafkaException, TopicPartition

from kvidx.kafka.config import client_config

_REL = re.compile(r"^-(\d+(?:\.\d+)?)([smhd])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def is_relative_time(text: str) -> bool:
    """`-15m`, `-2h`, `-1d`, `-30s`: a time back from now."""
    return _REL.match(text.strip()) is not None


def parse_time(text: str, now: float | None = None) -> float:
    """Seconds since the epoch from epoch seconds (`1764500000.5`), ISO 8601 (`2025-11-30T12:00:00Z`,
    `2025-11-30T13:00:00+01:00`; without a zone: UTC), `now`, or a time back from now (`-15m`, `-2h`,
    `-1d`, `-30s`)."""
    s = text.strip()
    now = time.time() if now is None else now
    if s == "now":
        return now
    m = _REL.match(s)
    if m:
        return now - float(m.group(1)) * _UNIT[m.group(2)]
    try:
        return float(s)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(s.replace("Z", "+00:00") if s.endswith("Z") else s)
    except ValueError:
        raise ValueError(f"not a time: {text!r} (ISO 8601, epoch seconds, 'now' or -15m/-2h/-1d)") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def consumer(bootstrap: str, what: str, **extra) -> Consumer:
    return Consumer({**client_config(), "bootstrap.servers": bootstrap,
                     "group.id": f"kvidx-{what}-{time.time_ns()}", "enable.auto.commit": False,
                     "fetch.max.bytes": 64 << 20, "max.partition.fetch.bytes": 16 << 20, **extra})


def partitions(c: Consumer, topic: str, timeout_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        t = c.list_topics(topic, timeout=10).topics.get(topic)
        if t is not None and t.error is None and t.partitions:
            return sorted(t.partitions)
        if time.monotonic() > deadline:
            raise RuntimeError(f"topic {topic} not found")
        time.sleep(0.2)


def offsets_for_times(c: Consumer, tps: list[TopicPartition], timeout_s: float = 30.0
                      ) -> list[TopicPartition]:
    """Consumer.offsets_for_times, retried while a new topic's partitions still elect their leader."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return c.offsets_for_times(tps, timeout=10)
        except KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def offsets_after(c: Consumer, topic: str, parts: list[int], ts: float | None) -> dict[int, int]:
    """Per partition: the first offset whose timestamp is after `ts` (ms resolution; None: the end).
    Messages before it are the ones at or before `ts`."""
    out = {}
    ends = {p: watermarks(c, topic, p)[1] for p in parts}
    if ts is None:
        return ends
    ms = int(ts * 1000) + 1  # first offset with timestamp >= ts_ms + 1, i.e. > ts
    found = offsets_for_times(c, [TopicPartition(topic, p, ms) for p in parts])
    for tp in found:
        out[tp.partition] = ends[tp.partition] if tp.offset < 0 else tp.offset
    return out


def offsets_at(c: Consumer, topic: str, parts: list[int], ts: float | None) -> dict[int, int]:
    """Per partition: the first offset whose timestamp is at or after `ts` (None: the beginning)."""
    lows = {p: watermarks(c, topic, p)[0] for p in parts}
    if ts is None:
        return lows
    found = offsets_for_times(c, [TopicPartition(topic, p, int(ts * 1000)) for p in parts])
    ends = {p: watermarks(c, topic, p)[1] for p in parts}
    return {tp.partition: (ends[tp.partition] if tp.offset < 0 else max(tp.offset, lows[tp.partition]))
            for tp in found}


@dataclass
class Msg:
    partition: int
    offset: int
    ts: float  # the Kafka timestamp, s
    key: bytes | None
    value: bytes | None


def read(c: Consumer, topic: str, starts: dict[int, int], stops: dict[int, int],
         timeout_s: float = 120.0, batch: int = 10000,
         on_progress: Callable[[dict[int, int]], None] | None = None) -> Iterator[Msg]:
    """Every message of `topic` from `starts` up to (not including) `stops`, per partition in offset
    order (partitions interleave)."""
    todo = {p: s for p, s in stops.items() if s > starts.get(p, 0)}
    if not todo:
        return
    c.assign([TopicPartition(topic, p, starts.get(p, 0)) for p in todo])
    pos = {p: starts.get(p, 0) for p in todo}
    deadline = time.monotonic() + timeout_s
    idle_since = time.monotonic()
    try:
        while todo:
            msgs = c.consume(batch, 0.05)  # returns early when fewer are there
            if not msgs:
                if time.monotonic() > deadline or time.monotonic() - idle_since > 30:
                    raise TimeoutError(f"reading {topic}: partitions {sorted(todo)} stopped at {pos} "
                                       f"before {todo}")
                continue
            idle_since = time.monotonic()
            for m in msgs:
                if m.error():
                    continue
                p, off = m.partition(), m.offset()
                stop = todo.get(p)
                if stop is None:
                    continue
                pos[p] = off + 1
                if off >= stop:
                    todo.pop(p, None)
                    continue
                yield Msg(p, off, m.timestamp()[1] / 1000.0, m.key(), m.value())
                if off + 1 >= stop:
                    todo.pop(p, None)
            if on_progress is not None:
                on_progress(pos)
    finally:
        c.unassign()


def read_range(bootstrap: str, topic: str, t_from: float | None, t_to: float | None,
               what: str = "reader", key: bytes | None = None, slack_s: float = 60.0) -> list[Msg]:
    """Messages of `topic` with timestamps in [t_from, t_to] (None: open), all partitions; only those
    keyed `key` if given. An absent topic reads as empty. Timestamps of several producers interleave
    out of order in a partition: the read starts and stops `slack_s` beyond the range and filters."""
    c = consumer(bootstrap, what)
    try:
        t = c.list_topics(topic, timeout=10).topics.get(topic)
        if t is None or t.error is not None or not t.partitions:
            return []
        parts = sorted(t.partitions)
        starts = offsets_at(c, topic, parts, None if t_from is None else t_from - slack_s)
        stops = offsets_after(c, topic, parts, None if t_to is None else t_to + slack_s)
        lo = -float("inf") if t_from is None else int(t_from * 1000) / 1000
        hi = float("inf") if t_to is None else t_to
        out = [m for m in read(c, topic, starts, stops)
               if (key is None or m.key == key) and lo <= m.ts <= hi]
    finally:
        c.close()
    out.sort(key=lambda m: (m.ts, m.partition, m.offset))
    return out


class Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal, unless forced)."""

    def __init__(self, what: str, total: int, enabled: bool | None = None):
        self.what = what
        self.total = max(total, 1)
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.t0 = time.monotonic()
        self.last = 0.0
        self.done = 0
        self.items = 0

    def update(self, done: int, items: int) -> None:
        self.done, self.items = done, items
        now = time.monotonic()
        if self.enabled and now - self.last >= 0.2:
            self.last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        frac = min(1.0, self.done / self.total)
        bar = "#" * int(frac * 30)
        rate = self.items / max(now - self.t0, 1e-9)
        sys.stderr.write(f"\r[{self.what}] [{bar:<30}] {frac * 100:5.1f}% {self.done:,}/{self.total:,} "
                         f"offsets, {self.items:,} batches ({rate:,.0f}/s)")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            sys.stderr.write("\n")
            sys.stderr.flush()



def add_kafka_args(p) -> None:
    import os

    p.add_argument("--bootstrap", help="Kafka bootstrap servers (default: $KAFKA_BOOTSTRAP_SERVERS)")
    p.add_argument("--topic-prefix", default=os.environ.get("KVIDX_TOPIC_PREFIX", ""),
                   help="prefix of every topic name (several deployments on one cluster)")


def bootstrap_of(args) -> str:
    """The cluster of a one-shot command: named and answering, or exit with one line."""
    from kvidx.kafka.reach import require_broker, resolve_bootstrap

    b = resolve_bootstrap(args.bootstrap)
    require_broker(b)
    return b


def topic_prefix(names: dict[str, str]) -> str:
    from schemas.events import EVENTS_TOPIC

    return names.get("prefix") or names["events"][:-len(EVENTS_TOPIC)]


def watermarks(c: Consumer, topic: str, partition: int, timeout_s: float = 30.0) -> tuple[int, int]:
    """(low, high) offsets; retried while a new topic's partitions still elect their leader."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return c.get_watermark_offsets(TopicPartition(topic, partition), timeout=5)
        except KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
