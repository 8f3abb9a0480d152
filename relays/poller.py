"""A running relay of an engine whose events are pulled over HTTP (TensorRT-LLM's trtllm-serve
POST /kv_cache_events): the same metrics, dead letters, broker health and status line as a ZMQ relay
(relays/run.py), with the engine's adapter supplying the poll source, the relay logic and the
recording format."""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error

from kvidx.engines import EngineAdapter, RelayOptions
from relays.run import FRAMES, emit, set_aside_line
from relays.sinks import Sink

log = logging.getLogger("kvidx.relay")


def play(adapter: EngineAdapter, path, model: str, sink: Sink, index_block_size: int, replica: str | None,
         opts: RelayOptions) -> int:
    """Publish a recording of polls; returns how many polls it held."""
    core = adapter.make_poll_relay(model, replica or adapter.shadow_defaults.get("replica", adapter.name),
                                   index_block_size, opts, epoch=0)
    n = 0
    for recv_ns, events, error in sorted(adapter.read_polls(path), key=lambda p: p[0]):
        FRAMES.labels(core.replica).inc()
        out = core.poll_failed(error, recv_ns) if error else core.on_poll(events, recv_ns)
        emit(sink, core.model, core.replica, out, adapter.name)
        n += 1
    sink.flush()
    return n


def _connect(source, url: str, stop: threading.Event) -> str | None:
    """The engine's version, asked until it answers (the engine may start after its relay), one line
    per attempt; None if stopped first. An unsupported version is no such error: it ends the relay."""
    attempt = 0
    while True:
        try:
            return source.check_version()
        except (urllib.error.URLError, TimeoutError, OSError, ValueError, KeyError) as e:
            attempt += 1
            log.error("event=engine_unreachable url=%s attempt=%d retry_in_s=5 reason=%r", url, attempt,
                      str(getattr(e, "reason", e))[:200])
            if stop.wait(5.0):
                return None


def run(adapter: EngineAdapter, url: str, model: str, sink: Sink, index_block_size: int, opts: RelayOptions,
        record_to=None, stop: threading.Event | None = None, interval_s: float = 0.05,
        status_every_s: float = 30.0, source=None):
    """`kvidx relay --engine trtllm --url http://host:port`: check the version, then poll until `stop`."""
    stop = stop or threading.Event()
    source = source or adapter.http_source(url)
    version = _connect(source, url, stop)
    if version is None:
        return None
    log.info("event=relay_start engine=%s version=%s url=%s model=%s", adapter.name, version, url, model)
    core = adapter.make_poll_relay(model, url, index_block_size, opts)
    recorder = adapter.poll_recorder(record_to) if record_to else None
    for b in core.start_fresh():
        sink.publish(b)
    polls = batches = 0
    last_poll = None
    status_at = time.monotonic() + status_every_s
    try:
        while not stop.is_set():
            recv_ns, body, err = source.poll()
            polls += 1
            FRAMES.labels(core.replica).inc()
            if err is not None:
                if recorder:
                    recorder.write(recv_ns, [], err)
                batches += emit(sink, core.model, core.replica, core.poll_failed(err, recv_ns),
                                adapter.name)
            elif body is not None:
                last_poll = time.time()
                if recorder:
                    recorder.write(recv_ns, json.loads(body))
                batches += emit(sink, core.model, core.replica, core.on_poll_body(body, recv_ns),
                                adapter.name)
                sink.flush(0)
            check = getattr(sink, "check_health", None)
            if check is not None:
                check()
            if time.monotonic() >= status_at:
                status_at = time.monotonic() + status_every_s
                age = f"{time.time() - last_poll:.1f}" if last_poll else "none"
                aside = getattr(core, "set_aside", {})
                log.info("event=relay_status replica=%s url=%s polls=%d batches=%d set_aside_events=%d "
                         "set_aside=%s last_answer_age_s=%s", core.replica, url, polls, batches,
                         sum(aside.values()), set_aside_line(aside), age)
            time.sleep(interval_s)
    finally:
        sink.flush()
        if recorder:
            recorder.close()
    return core
