"""Live engine streams over ZMQ: a SUB socket on the engine's PUB, and its replay ROUTER.

vLLM's PUB socket binds only for wildcard or ipc/inproc endpoints and connects otherwise, so the
relay can bind its SUB side (`bind=True`) or connect to a binding publisher.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator

import zmq

from kvidx.engines.contract import Frame

log = logging.getLogger("kvidx.relay")

END_SEQ = -1


class ZmqSource:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: bytes = b"",
                 bind: bool = False, ctx: zmq.Context | None = None, controller_endpoint: str | None = None,
                 key_feeds: Callable[[], Iterable[str]] | None = None):
        """`controller_endpoint`: also bind a PULL socket there for LMCache's admit/evict messages
        (point LMCache's controller URL, or a tee, at it); they come out as frames with src "controller"
        (the engine's relay takes them: SequencedRelay.on_controller).
        `key_feeds()`: the publishers of engines attached to this one (a Mooncake Store master's), asked
        again every second: each is subscribed to as well, its frames come out with src "keyfeed" and
        its endpoint (kvidx.engines.mooncake.relay)."""
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.ctx = ctx or zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.setsockopt(zmq.RCVHWM, 100_000)
        (self.sub.bind if bind else self.sub.connect)(endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.sub, zmq.POLLIN)
        self.pull = None
        if controller_endpoint:
            self.pull = self.ctx.socket(zmq.PULL)
            self.pull.bind(controller_endpoint)
            self.poller.register(self.pull, zmq.POLLIN)
        self.closed = False
        self._iterating = False
        self.key_feeds = key_feeds
        self.feeds: dict[str, zmq.Socket] = {}  # endpoint -> SUB (created and closed by the polling thread)
        self._feeds_checked = 0.0
        self._bad_feeds: set[str] = set()  # said once each

    def frames(self, timeout_s: float = 0.2) -> Iterator[Frame | None]:
        """Frames as they arrive; None every `timeout_s` without one (lets the caller stop/flush)."""
        self._iterating = True
        try:
            while not self.closed:
                if self.key_feeds is not None and time.monotonic() - self._feeds_checked >= 1.0:
                    self._follow_feeds()
                ready = dict(self.poller.poll(int(timeout_s * 1000)))
                if not ready:
                    yield None
                    continue
                if self.pull is not None and self.pull in ready:
                    payload = b"".join(self.pull.recv_multipart())
                    yield Frame(b"controller", -1, payload, time.time_ns(), self.endpoint, "controller")
                for ep, sock in list(self.feeds.items()):
                    if sock in ready:
                        yield self._frame(sock.recv_multipart(), "keyfeed", ep)
                if self.sub in ready:
                    yield self._frame(self.sub.recv_multipart(), "pub")
        finally:
            self._iterating = False
            # closed by the thread that polls them (ZMQ sockets aren't thread-safe)
            self.sub.close(linger=0)
            if self.pull is not None:
                self.pull.close(linger=0)
            for sock in self.feeds.values():
                sock.close(linger=0)

    def _follow_feeds(self) -> None:
        """Subscribe to the key feeds that appeared, drop those that went."""
        self._feeds_checked = time.monotonic()
        want = set(self.key_feeds())
        for ep in [e for e in self.feeds if e not in want]:
            sock = self.feeds.pop(ep)
            self.poller.unregister(sock)
            sock.close(linger=0)
        for ep in want - self.feeds.keys():
            sock = self.ctx.socket(zmq.SUB)
            try:
                sock.setsockopt(zmq.SUBSCRIBE, b"")
                sock.setsockopt(zmq.RCVHWM, 100_000)
                sock.connect(ep)
            except zmq.ZMQError as e:  # one engine's bad address must not stop the others' feeds
                sock.close(linger=0)
                if ep not in self._bad_feeds:
                    self._bad_feeds.add(ep)
                    log.warning("event=key_feed_unreachable endpoint=%s error=%s", ep, e)
                continue
            self.poller.register(sock, zmq.POLLIN)
            self.feeds[ep] = sock

    def _frame(self, parts: list[bytes], src: str, endpoint: str | None = None) -> Frame:
        now = time.time_ns()
        endpoint = endpoint or self.endpoint
        if len(parts) != 3 or len(parts[1]) != 8:
            # not the engine's 3-frame shape: hand it on as a malformed frame for the dead letters
            return Frame(b"", -2, b"".join(parts), now, endpoint, src)
        return Frame(parts[0], int.from_bytes(parts[1], "big", signed=True), parts[2], now, endpoint, src)

    def replay(self, start_seq: int, timeout_s: float = 2.0, max_s: float = 120.0) -> list[Frame] | None:
        """Ask the engine's replay endpoint for every buffered batch from `start_seq` on. None if
        there is no replay endpoint, or it goes `timeout_s` without a frame, or the replay takes more
        than `max_s` in all. The wait restarts with every frame: an engine sends its whole buffer
        (vLLM 0.33: up to 2 * (buffer_steps + 1) frames queued at once), which can take longer than
        any fixed deadline for the whole replay. A fresh socket each time: an abandoned replay's
        tail (and its end marker) never reaches the next one."""
        if not self.replay_endpoint:
            return None
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            sock.send_multipart([b"", start_seq.to_bytes(8, "big", signed=True)])
            out: list[Frame] = []
            give_up = time.monotonic() + max_s
            while True:
                left = min(timeout_s, give_up - time.monotonic())
                if left <= 0 or not sock.poll(int(left * 1000)):
                    return None
                parts = sock.recv_multipart()
                if parts and parts[0] == b"":
                    parts = parts[1:]
                if len(parts) == 2:  # some engines (SGLang) leave out the topic frame
                    parts = [b"", *parts]
                if len(parts) < 3:
                    return None
                seq = int.from_bytes(parts[1], "big", signed=True)
                if seq == END_SEQ:
                    return out
                out.append(Frame(parts[0], seq, parts[2], time.time_ns(), self.endpoint, "replay"))
        finally:
            sock.close()

    def close(self) -> None:
        """Stop; a running `frames()` loop closes the socket itself within its poll timeout."""
        self.closed = True
        if not self._iterating:
            self.sub.close(linger=0)
            if self.pull is not None:
                self.pull.close(linger=0)
