"""A client of the kvidx lookup service for routers written in Python, sync and asyncio.

    from kvidx.client import KvidxClient

    with KvidxClient("http://kvidx:8080", token=None, timeout=0.5) as kv:
        best = kv.rank("llama-3-8b", token_ids=prompt_ids).replicas[0]   # cheapest prefix first
        kv.route("req-17", "llama-3-8b", best.replica, token_ids=prompt_ids,
                 credited_tokens=best.resumable_tokens,              # pending credit for every router
                 evicting_tokens=best.evicting_tokens)               # (and eviction foresight)
        ...                                                          # send the request there
        kv.usage("req-17", "llama-3-8b", best.replica, len(prompt_ids), cached_tokens=96)  # the audit

`AsyncKvidxClient` has the same methods as coroutines. Both keep connections open (httpx pools),
send token ids in kvidx's binary form (packed uint32: no JSON to encode or parse) where the route has
one, and decode answers into kvidx's own types (schemas.answers.LookupAnswer). Retries: requests
that cannot change the index twice (lookups, rank, a route: its request id makes a repeat a no-op,
status) are retried on connection errors and on 429/502/503/504 with exponential backoff and full
jitter; a usage report only when the connection was never made. Every other error is a KvidxError with
the service's own message (`{"error": ...}`): UnknownModel for a model the index has no events of.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import msgspec
import numpy as np

from schemas.answers import LookupAnswer
from schemas.service import Health, Models, RouteAccepted, UsageAccepted

T = TypeVar("T")
RETRY_STATUSES = frozenset({429, 502, 503, 504})
_json = msgspec.json.Encoder()


class KvidxError(Exception):
    """An answer other than 2xx, or no answer at all (status 0), after the retries."""

    def __init__(self, status: int, message: str):
        super().__init__(f"kvidx: HTTP {status}: {message}" if status else f"kvidx: {message}")
        self.status = status
        self.message = message


class UnknownModel(KvidxError):
    """404 for a model: the index has no events of it (nothing is cached anywhere for it)."""


@dataclass(frozen=True)
class Retry:
    attempts: int = 3  # tries in all
    backoff_s: float = 0.02  # the first wait's ceiling; doubles per try (full jitter)
    max_backoff_s: float = 0.5

    def wait(self, attempt: int) -> float:
        return random.uniform(0, min(self.max_backoff_s, self.backoff_s * (2 ** attempt)))


@dataclass(frozen=True)
class _Call:
    """One request, built once for both clients: method, path, query, body, headers, answer type,
    and whether a repeat is harmless."""
    method: str
    path: str
    params: dict[str, Any] | None
    content: bytes | None
    headers: dict[str, str]
    answer: type
    retry: bool = True


def _tokens(token_ids: Sequence[int] | np.ndarray | bytes) -> bytes:
    if isinstance(token_ids, bytes | bytearray | memoryview):
        return bytes(token_ids)
    arr = np.asarray(token_ids)
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFF_FFFF):
        raise ValueError("token ids must be in 0..2^32-1")
    return arr.astype("<u4").tobytes()


def _body(**fields: Any) -> bytes:
    return _json.encode({k: v for k, v in fields.items() if v is not None})


_JSON_HEADERS = {"Content-Type": "application/json"}
_BINARY_HEADERS = {"Content-Type": "application/octet-stream"}


class _Calls:
    """What each method sends and expects, shared by the sync and asyncio clients."""

    @staticmethod
    def lookup(model: str, token_ids=None, block_hashes=None, prompt_tokens=None, lora_name=None,
               cache_salt=None, top_k=None, rank: bool = False, binary: bool = True) -> _Call:
        if (token_ids is None) == (block_hashes is None):
            raise ValueError("give either token_ids or block_hashes (with prompt_tokens)")
        if token_ids is not None and binary and not rank:
            params = {k: v for k, v in (("model", model), ("lora_name", lora_name),
                                        ("cache_salt", cache_salt), ("top_k", top_k)) if v is not None}
            return _Call("POST", "/v1/lookup/binary", params, _tokens(token_ids), _BINARY_HEADERS,
                         LookupAnswer)
        if token_ids is not None and not isinstance(token_ids, list):
            token_ids = np.frombuffer(_tokens(token_ids), dtype="<u4").tolist()
        body = _body(model=model, token_ids=token_ids,
                     block_hashes=list(block_hashes) if block_hashes is not None else None,
                     prompt_tokens=prompt_tokens, lora_name=lora_name, cache_salt=cache_salt, top_k=top_k)
        return _Call("POST", "/v1/rank" if rank else "/v1/lookup", None, body, _JSON_HEADERS, LookupAnswer)

    @staticmethod
    def route(request_id: str, model: str, replica: str, token_ids=None, block_hashes=None,
              prompt_tokens=None, credited_tokens: int = 0, dp_rank: int = 0, ttl_s: float | None = None,
              router: str = "", lora_name=None, cache_salt=None, evicting_tokens: int = 0) -> _Call:
        if token_ids is not None and not isinstance(token_ids, list):
            token_ids = np.frombuffer(_tokens(token_ids), dtype="<u4").tolist()
        body = _body(request_id=request_id, model=model, replica=replica, dp_rank=dp_rank,
                     credited_tokens=credited_tokens, ttl_s=ttl_s, router=router, token_ids=token_ids,
                     evicting_tokens=evicting_tokens or None,
                     block_hashes=list(block_hashes) if block_hashes is not None else None,
                     prompt_tokens=prompt_tokens, lora_name=lora_name, cache_salt=cache_salt)
        return _Call("POST", "/v1/routes", None, body, _JSON_HEADERS, RouteAccepted)

    @staticmethod
    def usage(request_id: str, model: str, replica: str, prompt_tokens: int, cached_tokens: int,
              dp_rank: int = 0, engine: str = "", tier: str = "", router: str = "") -> _Call:
        body = _body(request_id=request_id, model=model, replica=replica, prompt_tokens=prompt_tokens,
                     cached_tokens=cached_tokens, dp_rank=dp_rank, engine=engine, tier=tier, router=router)
        return _Call("POST", "/v1/usage", None, body, _JSON_HEADERS, UsageAccepted, retry=False)

    models = _Call("GET", "/v1/models", None, None, {}, Models)
    health = _Call("GET", "/healthz", None, None, {}, Health)


_DECODERS = {t: msgspec.json.Decoder(t) for t in (LookupAnswer, RouteAccepted, UsageAccepted, Models, Health)}


def _decode(call: _Call, status: int, content: bytes) -> Any:
    if 200 <= status < 300 or (call.answer is Health and status == 503):  # 503: not ready, still health
        return _DECODERS[call.answer].decode(content)
    try:
        message = msgspec.json.decode(content).get("error") or content[:300].decode(errors="replace")
    except (msgspec.DecodeError, AttributeError):
        message = content[:300].decode(errors="replace")
    if status == 404 and message.startswith("unknown model"):
        raise UnknownModel(status, message)
    raise KvidxError(status, message)


def _retry_after(call: _Call, retry: Retry, attempt: int, exc: Exception | None,
                 r: httpx.Response | None) -> float | None:
    """Seconds to wait before the next try, or None: this try's outcome is final."""
    if attempt == retry.attempts - 1:
        return None
    if exc is not None:  # no answer: a usage report is repeated only if it was never sent
        again = call.retry or isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
    else:
        again = call.retry and r.status_code in RETRY_STATUSES
    return retry.wait(attempt) if again else None


def _outcome(call: _Call, exc: Exception | None, r: httpx.Response | None) -> Any:
    if exc is not None:
        raise KvidxError(0, f"{type(exc).__name__}: {exc}") from None
    return _decode(call, r.status_code, r.content)


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


class _Methods:
    """The public methods, over `_send(call)` (a value, or an awaitable in the asyncio client)."""

    def _send(self, call: _Call):
        raise NotImplementedError

    def lookup(self, model: str, token_ids: Sequence[int] | np.ndarray | bytes | None = None,
               block_hashes: Sequence[int] | None = None, prompt_tokens: int | None = None,
               lora_name: str | None = None, cache_salt: str | None = None, top_k: int | None = None,
               binary: bool = True):
        """Replicas by resumable tokens (POST /v1/lookup, or /v1/lookup/binary for token ids)."""
        return self._send(_Calls.lookup(model, token_ids, block_hashes, prompt_tokens, lora_name, cache_salt,
                                        top_k, binary=binary))

    def rank(self, model: str, token_ids: Sequence[int] | np.ndarray | bytes | None = None,
             block_hashes: Sequence[int] | None = None, prompt_tokens: int | None = None,
             lora_name: str | None = None, cache_salt: str | None = None, top_k: int | None = None):
        """Replicas by prefix price, cheapest first (POST /v1/rank)."""
        return self._send(_Calls.lookup(model, token_ids, block_hashes, prompt_tokens, lora_name, cache_salt,
                                        top_k, rank=True))

    def route(self, request_id: str, model: str, replica: str,
              token_ids: Sequence[int] | np.ndarray | bytes | None = None,
              block_hashes: Sequence[int] | None = None, prompt_tokens: int | None = None,
              credited_tokens: int = 0, dp_rank: int = 0, ttl_s: float | None = None, router: str = "",
              lora_name: str | None = None, cache_salt: str | None = None, evicting_tokens: int = 0):
        """Record a routing decision (POST /v1/routes): the prompt counts as cached on `replica` for
        every router until the engine's events confirm it or `ttl_s` passes. `credited_tokens` and
        `evicting_tokens`: the chosen replica's resumable_tokens and evicting_tokens (for the audit)."""
        return self._send(_Calls.route(request_id, model, replica, token_ids, block_hashes, prompt_tokens,
                                       credited_tokens, dp_rank, ttl_s, router, lora_name, cache_salt,
                                       evicting_tokens))

    def usage(self, request_id: str, model: str, replica: str, prompt_tokens: int, cached_tokens: int,
              dp_rank: int = 0, engine: str = "", tier: str = "", router: str = ""):
        """Report what the engine reused for a routed request (POST /v1/usage: the audit)."""
        return self._send(_Calls.usage(request_id, model, replica, prompt_tokens, cached_tokens, dp_rank,
                                       engine, tier, router))

    def models(self):
        """The models indexed (GET /v1/models)."""
        return self._send(_Calls.models)

    def health(self):
        """GET /healthz (a Health answer also while the service is not ready)."""
        return self._send(_Calls.health)


class KvidxClient(_Methods):
    def __init__(self, base_url: str, token: str | None = None, timeout: float = 1.0,
                 retry: Retry = Retry(), max_connections: int = 16,
                 transport: httpx.BaseTransport | None = None):
        self.retry = retry
        self.http = httpx.Client(base_url=base_url, headers=_headers(token), timeout=timeout,
                                 limits=httpx.Limits(max_connections=max_connections), transport=transport)

    def _send(self, call: _Call) -> Any:
        attempt = 0
        while True:
            exc = r = None
            try:
                r = self.http.request(call.method, call.path, params=call.params, content=call.content,
                                      headers=call.headers)
            except httpx.HTTPError as e:
                exc = e
            wait = _retry_after(call, self.retry, attempt, exc, r)
            if wait is None:
                return _outcome(call, exc, r)
            time.sleep(wait)
            attempt += 1

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> KvidxClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncKvidxClient(_Methods):
    """KvidxClient for asyncio: the same methods, as coroutines."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 1.0,
                 retry: Retry = Retry(), max_connections: int = 16,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.retry = retry
        self.http = httpx.AsyncClient(base_url=base_url, headers=_headers(token), timeout=timeout,
                                      limits=httpx.Limits(max_connections=max_connections),
                                      transport=transport)

    async def _send(self, call: _Call) -> Any:
        attempt = 0
        while True:
            exc = r = None
            try:
                r = await self.http.request(call.method, call.path, params=call.params, content=call.content,
                                            headers=call.headers)
            except httpx.HTTPError as e:
                exc = e
            wait = _retry_after(call, self.retry, attempt, exc, r)
            if wait is None:
                return _outcome(call, exc, r)
            await asyncio.sleep(wait)
            attempt += 1

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncKvidxClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
