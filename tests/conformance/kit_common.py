"""What every engine's recording generator shares: the workload and the capture of the publisher's
frames. Pure Python plus pyzmq; imported by the generators inside their engine venvs."""

from __future__ import annotations

import base64
import json
import random
import time
from dataclasses import dataclass
from typing import Any

VOCAB = 1024


@dataclass(kw_only=True)
class Workload:
    """The workload's shape, every kit's scenarios alike: 40 conversations of up to 4 turns and 40
    one-shots (seed 1234), 4 requests at a time, 6 output tokens each."""
    convs: int = 40
    turns: int = 4
    one_shot: int = 40
    concurrency: int = 4
    max_tokens: int = 6
    seed: int = 1234


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, VOCAB) for _ in range(n)]


def workload(seed: int, convs: int, turns: int, one_shot: int) -> list[tuple[str, Any]]:
    """Conversations (turn k = previous prompt + the engine's output + new user tokens) and
    one-shots over 5 shared system prompts, as ../../../shared/realengine/drive.py makes them."""
    rng = random.Random(seed)
    systems = [rand_tokens(rng, rng.randint(40, 130)) for _ in range(5)]
    jobs: list[tuple[str, Any]] = []
    for c in range(convs):
        sid = rng.randrange(5)
        users = [rand_tokens(rng, rng.randint(8, 60)) for _ in range(turns)]
        jobs.append(("conv", (c, sid, systems[sid], users)))
    for k in range(one_shot):
        sid = rng.randrange(5)
        jobs.append(("oneshot", (k, sid, systems[sid], rand_tokens(rng, rng.randint(8, 60)))))
    rng.shuffle(jobs)
    return jobs


class Capture:
    """A SUB socket on the publisher's endpoint: every message, raw, as JSON lines."""

    def __init__(self, endpoint: str):
        import zmq
        self.zmq = zmq
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.endpoint = endpoint
        self.sub.connect(endpoint)
        self.lines: list[str] = []
        self.seqs: list[int] = []

    def drain(self, expect: int, timeout: float = 10.0) -> None:
        """Receive until `expect` messages in all have arrived."""
        deadline = time.time() + timeout
        while len(self.lines) < expect:
            if self.sub.poll(100) == 0:
                if time.time() > deadline:
                    raise SystemExit(f"capture: {len(self.lines)} of {expect} messages arrived")
                continue
            topic, seq, payload = self.sub.recv_multipart()
            n = int.from_bytes(seq, "big", signed=True)
            self.seqs.append(n)
            self.lines.append(json.dumps({
                "recv_ns": time.time_ns(), "src": "pub", "endpoint": self.endpoint,
                "topic_b64": base64.b64encode(topic).decode(),
                "seq_b64": base64.b64encode(seq).decode(),
                "payload_b64": base64.b64encode(payload).decode(), "seq": n}))
