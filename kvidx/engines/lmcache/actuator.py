"""LMCache cache-controller actuator (issue #16): the index's prefetch hints acted on through LMCache's
own controller, for the models whose operator names a controller (hints.lmcache_controller).

A prefetch hint for a replica served by LMCache becomes the controller's orchestration messages
(lmcache/v1/cache_controller/message.py, the same in LMCache 0.3.x to 0.5.6; msgspec msgpack,
`MsgBase(msgspec.Struct, tag=True)`: a map whose "type" is the class name, then the fields in order):
- MoveMsg {event_id, old_position: (instance_id, location), new_position: (instance_id, location),
  tokens, copy}: each run held on disk (or another backend below the CPU) copied up to the instance's
  CPU backend, so that the engine's load at the request's turn reads host memory, not disk;
- PinMsg {event_id, instance_id, location, tokens}: the prompt's prefix pinned in the CPU backend
  until the request comes, so that LMCache's own LRU does not evict what was just promoted.
They are pushed to the controller's PULL socket (its "pull" monitor port, where LMCache workers push
their reports; the controller handles orchestration messages there too, without a reply), so that
acting never waits on the controller; whether the engine followed is measured from its events
(`kvidx audit`). LMCache keys chunks by token ids, so messages are built only for routing decisions
that carry the prompt's token ids, and the tokens are sent, never kept or logged.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import uuid
from collections.abc import Sequence

import msgspec

from schemas.answers import PrefetchHint

log = logging.getLogger("kvidx.engines.lmcache.actuator")

# kvidx tier -> LMCache storage backend name (the `location` its controller messages carry)
TIER_LOCATION = {"CPU": "LocalCPUBackend", "DISK": "LocalDiskBackend"}
MAX_QUEUED = 10_000  # messages waiting for the socket; beyond, hints are dropped (and counted)


class PinMsg(msgspec.Struct, tag=True):
    event_id: str
    instance_id: str
    location: str
    tokens: list[int]


class MoveMsg(msgspec.Struct, tag=True):
    event_id: str
    old_position: tuple[str, str]
    new_position: tuple[str, str]
    tokens: list[int] | None = None
    copy: bool | None = False


_enc = msgspec.msgpack.Encoder()


def prefetch_messages(hint: PrefetchHint, tokens: Sequence[int], instance_id: str, event_id: str,
                      locations: dict[str, str] | None = None) -> list[PinMsg | MoveMsg]:
    """The controller messages that carry out `hint` on LMCache instance `instance_id`: a copy to the CPU
    backend of each run held in another backend LMCache names, then a pin of the prefix up to the last
    run in the CPU backend. Runs in tiers without a location (GPU, shared pools) need nothing here."""
    loc = locations or TIER_LOCATION
    cpu = loc.get("CPU")
    if cpu is None:
        return []
    out: list[PinMsg | MoveMsg] = []
    end = 0
    for k, run in enumerate(hint.runs):
        where = loc.get(run.tier)
        if where is None:
            continue
        end = max(end, run.end)
        if where != cpu:
            out.append(MoveMsg(f"{event_id}-move{k}", (instance_id, where), (instance_id, cpu),
                               list(tokens[:run.end]), True))
    if end:
        out.append(PinMsg(f"{event_id}-pin", instance_id, cpu, list(tokens[:end])))
    return out


def encode(msg: PinMsg | MoveMsg) -> bytes:
    return _enc.encode(msg)


class LmcacheActuator:
    """Pushes controller messages to one LMCache controller (`url`: its PULL socket, tcp://host:port)
    from a background thread: the routing path only queues them."""

    def __init__(self, url: str, instances: dict[str, str] | None = None,
                 locations: dict[str, str] | None = None) -> None:
        import zmq

        self.url = url
        self.instances = instances or {}
        self.locations = locations or TIER_LOCATION
        # each counter written by one thread: hints and queue_full by the router's, the rest by the sender
        self.counters = {"hints": 0, "queue_full": 0, "sent": 0, "not_sent": 0, "errors": 0}
        self._ids = itertools.count()
        self._run = uuid.uuid4().hex[:8]
        self._q: queue.Queue[bytes | None] = queue.Queue(MAX_QUEUED)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.setsockopt(zmq.SNDHWM, MAX_QUEUED)
        try:
            self._sock.connect(url)  # ZMQ connects in the background: a controller not up yet is fine
        except zmq.ZMQError as e:  # a malformed address: acting is off, routing goes on
            self.broken = f"cannot connect to LMCache controller {url!r}: {e}"
            log.error("event=lmcache_actuator_off error=%s", self.broken)
            self._sock.close()
            self._ctx.term()
            self._thread = None
            return
        self.broken = ""
        self._thread = threading.Thread(target=self._send_loop, name="lmcache-actuator", daemon=True)
        self._thread.start()

    def act(self, replica: str, hint: PrefetchHint, tokens: Sequence[int]) -> int:
        """Queue the messages for `hint` on `replica`'s LMCache instance; how many were queued."""
        if self.broken:
            return 0
        instance = self.instances.get(replica, replica)
        event_id = f"kvidx-{self._run}-{next(self._ids)}"
        msgs = prefetch_messages(hint, tokens, instance, event_id, self.locations)
        if msgs:
            self.counters["hints"] += 1
        for m in msgs:
            try:
                self._q.put_nowait(encode(m))
            except queue.Full:
                self.counters["queue_full"] += 1
        return len(msgs)

    def _send_loop(self) -> None:
        import zmq

        sock = self._sock  # handed over: only this thread uses it from here on
        try:
            while (payload := self._q.get()) is not None:
                try:
                    sock.send(payload, flags=zmq.NOBLOCK)
                    self.counters["sent"] += 1
                except zmq.Again:
                    self.counters["not_sent"] += 1  # the controller is not reading: never block routing
                except zmq.ZMQError as e:
                    self.counters["errors"] += 1
                    log.warning("event=lmcache_actuator_error url=%s error=%s", self.url, e)
        finally:
            sock.close()
            self._ctx.term()

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (up to the socket's linger), then stop; never blocks longer than `timeout`."""
        if self._thread is None:
            return
        try:
            self._q.put(None, timeout=timeout)
        except queue.Full:  # the sender is stuck: it is a daemon thread, the process may exit
            log.warning("event=lmcache_actuator_close_timeout url=%s", self.url)
            return
        self._thread.join(timeout)


class HintActuators:
    """The service's `act_on_hint`: one LmcacheActuator per model whose configuration names an LMCache
    controller (hints.lmcache_controller), started at its first hint; models without one are left alone."""

    def __init__(self, config) -> None:  # kvidx.config.Config
        self.config = config
        self.by_model: dict[str, LmcacheActuator] = {}
        self._lock = threading.Lock()

    def __call__(self, model: str, replica: str, hint: PrefetchHint, tokens: list[int]) -> None:
        a = self.by_model.get(model)
        if a is None:
            hints = self.config.model(model).hints
            if not hints.lmcache_controller:
                return
            with self._lock:
                a = self.by_model.get(model)
                if a is None:
                    a = LmcacheActuator(hints.lmcache_controller, hints.lmcache_instances)
                    self.by_model[model] = a
        a.act(replica, hint, tokens)

    def close(self) -> None:
        for a in self.by_model.values():
            a.close()
