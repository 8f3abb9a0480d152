"""Recordings of raw engine streams: one JSON line per ZMQ message, as the fixtures hold them.

`{"recv_ns", "src": "pub"|"replay", "endpoint", "topic_b64", "seq_b64", "payload_b64", "seq"}`.
A relay can record what it receives and play a recording back instead of a live socket.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO

from kvidx.engines.contract import Frame
from schemas.events import EventBatch


def frame_to_line(frame: Frame) -> str:
    return json.dumps({
        "recv_ns": frame.recv_ns, "src": frame.src, "endpoint": frame.endpoint,
        "topic_b64": base64.b64encode(frame.topic).decode(),
        "seq_b64": base64.b64encode(frame.seq.to_bytes(8, "big", signed=True)).decode(),
        "payload_b64": base64.b64encode(frame.payload).decode(),
        "seq": frame.seq,
    })


def read_frames(path: str | Path | Iterable[Frame]) -> Iterator[Frame]:
    """Frames of a recording in file order (frames already read, e.g. split_at_lookups', as they
    are). Lines that are not valid frames raise ValueError naming the line."""
    if not isinstance(path, (str, Path)):
        yield from path
        return
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                yield Frame(
                    topic=base64.b64decode(d["topic_b64"]),
                    seq=int.from_bytes(base64.b64decode(d["seq_b64"]), "big", signed=True),
                    payload=base64.b64decode(d["payload_b64"]),
                    recv_ns=int(d["recv_ns"]), endpoint=d.get("endpoint", ""), src=d.get("src", "pub"))
            except (KeyError, ValueError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a recorded frame ({e})") from None


class Recorder:
    def __init__(self, path: str | Path):
        self._f: IO[str] = open(path, "a")

    def write(self, frame: Frame) -> None:
        self._f.write(frame_to_line(frame) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def request_steps(frames: Iterable[Frame], requests: list[dict]) -> Iterator[tuple[list[Frame], dict]]:
    """A recording as a router lived it: for each request in send order, the frames the engine had
    published by its send time (not sent before), then the request (a live replay, frame by frame,
    with a lookup before each request)."""
    frames = sorted(frames, key=lambda f: f.recv_ns)
    j = 0
    for r in sorted(requests, key=lambda r: r["t_send"]):
        t_ns = int(r["t_send"] * 1e9)
        k = j
        while k < len(frames) and frames[k].recv_ns <= t_ns:
            k += 1
        yield frames[j:k], r
        j = k


def split_at_lookups(frames: Iterable[Frame], cuts: Iterable[tuple[int, int]]
                     ) -> tuple[list[Frame], dict[tuple[int, int], int]]:
    """The frames of one publisher with each message cut where a request's prefix lookup fell, and
    per cut the receive time (ns) by which exactly the events before it have arrived.

    A cut `(seq, k)` (the conformance kit's `lookup_at`) is the message `seq` the engine's step
    published and the number of its events the engine had queued when it looked the request up.
    Messages are msgpack arrays `[ts, events, ...]` (vLLM's and SGLang's EventBatch); a cut message
    becomes consecutive messages of its parts, later sequence numbers shifted to follow on, each
    part 1 ns before the next so a replay stopping at a cut's time folds its events and no more."""
    import msgspec

    frames = sorted(frames, key=lambda f: f.recv_ns)
    if len({(f.endpoint, f.src) for f in frames}) > 1:
        raise ValueError("lookup cuts need a recording of one publisher")
    by_seq: dict[int, set[int]] = {}
    for seq, k in cuts:
        by_seq.setdefault(seq, set()).add(k)
    out: list[Frame] = []
    at: dict[tuple[int, int], int] = {}
    shift = 0
    for f in frames:
        ks = by_seq.pop(f.seq, set())
        for seq in [s for s in by_seq if s < f.seq]:  # steps that published nothing: before this one
            for k in by_seq.pop(seq):
                at[(seq, k)] = f.recv_ns - len(ks) - 2
        batch = msgspec.msgpack.decode(f.payload)
        n = len(batch[1])
        if ks and max(ks) > n:
            raise ValueError(f"lookup cut ({f.seq}, {max(ks)}): message {f.seq} has {n} events")
        bounds = sorted({k for k in ks if 0 < k < n}) + [n]
        start = 0
        for j, end in enumerate(bounds):
            payload = f.payload if len(bounds) == 1 else msgspec.msgpack.encode(
                [batch[0], batch[1][start:end], *batch[2:]])
            recv = f.recv_ns - (len(bounds) - 1 - j)
            out.append(Frame(f.topic, f.seq + shift + j, payload, recv, f.endpoint, f.src))
            for k in ks:
                if k == end or (k == 0 and j == 0):
                    at[(f.seq, k)] = recv - 1 if k == 0 else recv
            start = end
        shift += len(bounds) - 1
    last = out[-1].recv_ns if out else 0
    for seq, ks in by_seq.items():  # after the last message
        for k in ks:
            at[(seq, k)] = last + 1
    return out, at


def replay_requests(batches: Iterable[tuple[int, Callable[[], list[EventBatch]]]], requests: list[dict],
                    fold: Callable[[int, EventBatch], None]) -> Iterator[dict]:
    """The shadow loop, once for every engine: the requests that succeeded, in send order, each
    yielded once every engine message received (recv_ns) at or before its send time went through
    its relay and the relay's batches were folded (or at its `t_ns`, when it has one)."""
    it = iter(batches)
    nxt = next(it, None)
    for r in requests:
        if r.get("status", 200) != 200:
            continue
        t_ns = r["t_ns"] if "t_ns" in r else int(r["t_send"] * 1e9)
        while nxt is not None and nxt[0] <= t_ns:
            for b in nxt[1]():
                fold(nxt[0], b)
            nxt = next(it, None)
        yield r
