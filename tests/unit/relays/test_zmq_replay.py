"""The replay client (relays/zmq_source.py ZmqSource.replay) against a real ZMQ ROUTER that answers
the way vLLM's publisher does ([client, b"", topic, seq, payload] per batch, then the end marker):
a replay longer than the per-frame timeout is read to its end (the wait restarts with every frame),
a publisher that goes silent mid-replay or never ends is given up on, and a fresh socket per replay
never sees an earlier replay's tail."""

import threading
import time

import pytest
import zmq

from relays.zmq_source import END_SEQ, ZmqSource


class SlowReplayer:
    """A ROUTER that sends `n` buffered batches from the requested seq, `gap_s` apart, then the end
    marker (unless `endless`); after `stall_after` of them it stalls until the test `release`s it, so
    a replay that returns during the stall can only have given up (no race with a clock). `sent`
    counts the batches sent, `ended` is set once the end marker is."""

    def __init__(self, n: int, gap_s: float, stall_after: int = -1, endless=False):
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.n, self.gap_s, self.endless = n, gap_s, endless
        self.stall_after = stall_after
        self.release = threading.Event()
        self.sent = 0
        self.ended = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stop.is_set():
            if not poller.poll(50):
                continue
            client, _, start = self.sock.recv_multipart()
            seq = int.from_bytes(start, "big", signed=True)
            i = 0
            while (self.endless or i < self.n) and not self.stop.is_set():
                if i == self.stall_after:
                    while not (self.release.wait(0.05) or self.stop.is_set()):
                        pass
                self.sock.send_multipart([client, b"", b"kv", (seq + i).to_bytes(8, "big"), b"payload"])
                i += 1
                self.sent += 1
                time.sleep(self.gap_s)
            self.sock.send_multipart([client, b"", b"", END_SEQ.to_bytes(8, "big", signed=True), b""])
            self.ended.set()

    def close(self) -> None:
        self.release.set()
        self.stop.set()
        self.thread.join(5)
        self.sock.close(linger=0)


@pytest.fixture
def source():
    made = []

    def make(replayer: SlowReplayer) -> ZmqSource:
        s = ZmqSource("tcp://127.0.0.1:1", f"tcp://127.0.0.1:{replayer.port}")
        made.append((s, replayer))
        return s

    yield make
    for s, r in made:
        s.close()
        r.close()


def test_a_replay_longer_than_the_timeout_is_read_to_its_end(source):
    s = source(SlowReplayer(n=20, gap_s=0.05))  # ~1 s in all, 0.05 s between frames
    frames = s.replay(7, timeout_s=0.3)
    assert frames is not None and [f.seq for f in frames] == list(range(7, 27))
    assert {f.src for f in frames} == {"replay"}


def test_a_silent_publisher_is_given_up_on(source):
    r = SlowReplayer(n=10, gap_s=0.0, stall_after=3)  # silent after 3 batches until released
    s = source(r)
    assert s.replay(0, timeout_s=0.3) is None  # returned while the publisher was still silent
    assert r.sent == 3 and not r.ended.is_set()
    r.release.set()


def test_a_replay_that_never_ends_is_given_up_on(source):
    r = SlowReplayer(n=0, gap_s=0.02, endless=True)
    s = source(r)
    assert s.replay(0, timeout_s=0.3, max_s=0.6) is None  # the publisher never ends: max_s gave up
    assert r.sent > 0 and not r.ended.is_set()
