"""The TensorRT-LLM relay over real HTTP: a trtllm-serve stand-in (stdlib HTTP server: GET /version,
POST /kv_cache_events answering the recorded polls one by one) and relays/poller.py, the same run loop
and metrics as every relay; what it publishes equals what playing the recording publishes."""

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvidx import engines
from kvidx.engines.trtllm.relay import read_polls
from relays import poller
from tests.helpers import FIXTURES, ListSink, wait_for

EVENTS = FIXTURES / "trtllm-1.2" / "gpu" / "events.jsonl"


def serve(polls):
    pending = list(polls)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _json(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._json({"version": "1.2.0"})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self._json(pending.pop(0) if pending else [])

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, pending


def test_live_polls_over_http_publish_what_the_recording_does(caplog):
    polls = [events for _, events, error in read_polls(EVENTS) if not error]
    adapter, opts = engines.get("trtllm"), engines.RelayOptions(engine_block_size=32)
    played = ListSink()
    poller.play(adapter, EVENTS, "m", played, 16, None, opts)

    server, pending = serve(polls)
    live, stop = ListSink(), threading.Event()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    caplog.set_level(logging.INFO, logger="kvidx.relay")
    th = threading.Thread(target=poller.run, args=(adapter, url, "m", live, 16, opts), daemon=True,
                          kwargs={"stop": stop, "interval_s": 0.001, "status_every_s": 0.2})
    th.start()
    try:
        wait_for(lambda: not pending, timeout=30, what="every recorded poll served")
        time.sleep(0.3)
    finally:
        stop.set()
        th.join(10)
        server.shutdown()
    strip = [[(type(e).__name__, getattr(e, "hashes", None)) for e in b.events] for b in live.batches]
    want = [[(type(e).__name__, getattr(e, "hashes", None)) for e in b.events] for b in played.batches]
    assert strip[0] == [("ReplicaCleared", None)]  # a relay that starts knows nothing of the cache
    assert strip[1:] == want and not live.dead
    assert "event=relay_start engine=trtllm version=1.2.0" in caplog.text
    assert "event=relay_status" in caplog.text and "polls=" in caplog.text
