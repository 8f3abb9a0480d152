"""Recordings of raw engine streams: one JSON line per ZMQ message, as the fixtures hold them.

`{"recv_ns", "src": "pub"|"replay", "endpoint", "topic_b64", "seq_b64", "payload_b64", "seq"}`.
A relay can record what it receives and play a recording back instead of a live socket.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from kvidx.engines.contract import Frame


def frame_to_line(frame: Frame) -> str:
    return json.dumps({
        "recv_ns": frame.recv_ns, "src": frame.src, "endpoint": frame.endpoint,
        "topic_b64": base64.b64encode(frame.topic).decode(),
        "seq_b64": base64.b64encode(frame.seq.to_bytes(8, "big", signed=True)).decode(),
        "payload_b64": base64.b64encode(frame.payload).decode(),
        "seq": frame.seq,
    })


def read_frames(path: str | Path) -> Iterator[Frame]:
    """Frames of a recording in file order. Lines that are not valid frames raise ValueError
    naming the line."""
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
