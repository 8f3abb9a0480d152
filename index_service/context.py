"""What the lookup service's HTTP handlers share: the JSON response, bounded body reading, the error
response with its rate-limited log line, and the answer's encoding with its metrics and debug log."""

from __future__ import annotations

import logging
import time

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from index_service.metrics import ServiceMetrics
from index_service.query import QueryPipeline
from index_service.store import ShardStore
from index_service.wire import Reject, decode

log = logging.getLogger("kvidx.index_service")

JSON = "application/json"
encode = msgspec.json.Encoder().encode


def json_response(obj: object, status: int = 200) -> Response:
    return Response(encode(obj), status_code=status, media_type=JSON)


def kv(**fields: object) -> str:
    """key=value pairs for log lines; strings with spaces or quotes are JSON-quoted."""
    out = []
    for k, v in fields.items():
        if isinstance(v, str) and (not v or any(c in v for c in ' "=\n')):
            v = encode(v).decode()
        out.append(f"{k}={v}")
    return " ".join(out)


class RejectLog:
    """Client errors logged at most once per second (with how many were left out), so a broken
    router cannot flood the log."""

    def __init__(self, interval: float = 1.0):
        self.interval = interval
        self.next_at = 0.0
        self.suppressed = 0

    def __call__(self, **fields: object) -> None:
        now = time.monotonic()
        if now < self.next_at:
            self.suppressed += 1
            return
        self.next_at = now + self.interval
        if self.suppressed:
            fields["suppressed"] = self.suppressed
            self.suppressed = 0
        log.info("%s", kv(event="lookup_rejected", **fields))


class ServiceContext:
    """One app's store, query pipeline, metrics and body limits, for its route modules."""

    def __init__(self, app: FastAPI, store: ShardStore, metrics: ServiceMetrics, max_tokens: int):
        self.app = app  # app.state.feedback and .publish_usage may be set after the app is made
        self.store = store
        self.metrics = metrics
        self.max_tokens = max_tokens
        self.pipeline = QueryPipeline(store, max_tokens)
        metrics.hint_gates = self.pipeline.hint_gates  # their pay-off ratios on /metrics
        self.fanout = None  # index_service.fanout.Fanout: the instances holding the other replica groups
        self.reject_log = RejectLog()
        # The largest JSON body that can hold max_tokens ids (10 digits, a comma and a space each) plus
        # the other fields; anything larger is refused before it is read in full.
        self.max_json_bytes = max_tokens * 12 + 65536
        self.max_binary_bytes = max_tokens * 4

    async def read_body(self, request: Request, limit: int, what: str) -> bytes:
        cl = request.headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > limit:
            raise Reject(413, f"{what} too large: {int(cl)} bytes, at most {limit} "
                              f"(max_tokens={self.max_tokens})")
        if cl is not None:
            return await request.body()
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise Reject(413, f"{what} too large: over {limit} bytes (max_tokens={self.max_tokens})")
            chunks.append(chunk)
        return b"".join(chunks)

    async def read_json(self, request: Request, decoder: msgspec.json.Decoder, limit: int | None = None):
        """The body (at most `limit` bytes, by default what max_tokens ids need) as the decoder's struct."""
        return decode(decoder, await self.read_body(request, limit or self.max_json_bytes, "JSON body"))

    def respond(self, form: str, t0: float, model: str, prompt_tokens: int,
                answer: tuple[bytes, int, int, int], blocks: int) -> Response:
        """A lookup answer (QueryPipeline.answer_json: its bytes, best resumable tokens, replicas and
        tokens below GPU memory, for a prompt of `blocks` hashes), counted in the metrics and logged
        at debug."""
        body, best, replicas, below_gpu = answer
        dt = time.perf_counter() - t0
        self.metrics.observe(form, 200, dt)
        self.metrics.answered(model, prompt_tokens, best, below_gpu)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s", kv(event="lookup", form=form, model=model,
                               prompt_tokens=prompt_tokens, blocks=blocks, replicas=replicas,
                               best_resumable=best, us=round(dt * 1e6)))
        return Response(body, media_type=JSON)

    def rejected(self, form: str, e: Exception, model: str | None) -> Response:
        if isinstance(e, Reject):
            status, error = e.status, e.error
            self.reject_log(form=form, status=status, model=model or "-", error=error)
        else:
            status, error = 500, "internal error"
            log.exception("%s", kv(event="lookup_failed", form=form, model=model or "-"))
        self.metrics.observe(form, status)
        return json_response({"error": error}, status)
