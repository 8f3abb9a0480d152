"""kvidx.client against the real lookup service over real HTTP (uvicorn on loopback): typed answers,
the binary and JSON forms answering alike, routes, usage, models, health, bearer auth, the service's
errors as KvidxError, retries with backoff on 503 and on refused connections (not for a usage report
that may have been sent), timeouts; the asyncio client the same."""

from __future__ import annotations

import array
import asyncio
import socket

import httpx
import pytest

from index_service.app import create_app
from kvidx.client import AsyncKvidxClient, KvidxClient, KvidxError, Retry, UnknownModel
from kvidx.core.hashing import prompt_hashes
from schemas.answers import LookupAnswer
from tests.helpers import SEEDED_BS, SEEDED_MODEL, ServerThread, seeded_store

PROMPT = list(range(1000, 1000 + 40 * SEEDED_BS))


@pytest.fixture(scope="module")
def base_url():
    with ServerThread(create_app(seeded_store())) as url:
        yield url


def test_lookups_in_every_form_answer_alike(base_url):
    with KvidxClient(base_url) as kv:
        binary = kv.lookup(SEEDED_MODEL, token_ids=PROMPT)
        json_form = kv.lookup(SEEDED_MODEL, token_ids=PROMPT, binary=False)
        hashes = kv.lookup(SEEDED_MODEL, block_hashes=prompt_hashes(PROMPT, SEEDED_BS),
                           prompt_tokens=len(PROMPT))
        assert isinstance(binary, LookupAnswer) and len(binary.replicas) == 4
        for other in (json_form, hashes):
            assert [(r.replica, r.cached_tokens, r.resumable_tokens) for r in other.replicas] == \
                [(r.replica, r.cached_tokens, r.resumable_tokens) for r in binary.replicas]
        assert binary.replicas[0].resumable_tokens == len(PROMPT) - SEEDED_BS
        top = kv.lookup(SEEDED_MODEL, token_ids=array.array("I", PROMPT).tobytes(), top_k=2)
        assert len(top.replicas) == 2
        ranked = kv.rank(SEEDED_MODEL, token_ids=PROMPT, top_k=3)
        prices = [r.price.total_s for r in ranked.replicas]
        assert len(prices) == 3 and prices == sorted(prices)


def test_routes_usage_models_health(base_url):
    with KvidxClient(base_url) as kv:
        best = kv.rank(SEEDED_MODEL, token_ids=PROMPT).replicas[0]
        first = kv.route("c-1", SEEDED_MODEL, best.replica, token_ids=PROMPT,
                         credited_tokens=best.resumable_tokens, router="t")
        again = kv.route("c-1", SEEDED_MODEL, best.replica, token_ids=PROMPT)
        assert first.accepted and not first.duplicate and again.duplicate
        assert kv.usage("c-1", SEEDED_MODEL, best.replica, len(PROMPT), 320).accepted
        assert [m.model for m in kv.models().models] == [SEEDED_MODEL]
        h = kv.health()
        assert h.status == "ok" and h.ready


def test_errors_are_the_services_own_words(base_url):
    with KvidxClient(base_url) as kv:
        with pytest.raises(UnknownModel, match="unknown model 'nope'"):
            kv.lookup("nope", token_ids=PROMPT)
        with pytest.raises(KvidxError, match="HTTP 422: .*block_hashes needs prompt_tokens") as e:
            kv.lookup(SEEDED_MODEL, block_hashes=[1, 2])
        assert e.value.status == 422
        with pytest.raises(KvidxError, match="unknown replica"):
            kv.route("c-2", SEEDED_MODEL, "tcp://nowhere:1", token_ids=PROMPT)
        with pytest.raises(ValueError, match="either token_ids or block_hashes"):
            kv.lookup(SEEDED_MODEL)
        with pytest.raises(ValueError, match="0..2"):
            kv.lookup(SEEDED_MODEL, token_ids=[-1])


def test_bearer_token():
    with ServerThread(create_app(seeded_store(), auth_token="s3cret")) as url:
        with KvidxClient(url) as kv, pytest.raises(KvidxError, match="401: missing or wrong bearer token"):
            kv.lookup(SEEDED_MODEL, token_ids=PROMPT)
        with KvidxClient(url, token="s3cret") as kv:
            assert kv.lookup(SEEDED_MODEL, token_ids=PROMPT).replicas


class Flaky(httpx.BaseTransport):
    """Answers 503 (or fails to connect) `fail` times, then passes requests to a real transport."""

    def __init__(self, fail: int, refuse: bool = False):
        self.fail, self.refuse, self.seen = fail, refuse, 0
        self.real = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.seen += 1
        if self.seen <= self.fail:
            if self.refuse:
                raise httpx.ConnectError("refused", request=request)
            return httpx.Response(503, json={"error": "not ready: rebuilding"})
        return self.real.handle_request(request)


def test_retries_with_backoff_then_the_answer_or_the_last_error(base_url):
    fast = Retry(attempts=3, backoff_s=0.001)
    with KvidxClient(base_url, retry=fast, transport=Flaky(2)) as kv:
        assert kv.lookup(SEEDED_MODEL, token_ids=PROMPT).replicas
        assert kv.http._transport.seen == 3
    with KvidxClient(base_url, retry=fast, transport=Flaky(5)) as kv, \
            pytest.raises(KvidxError, match="503: not ready: rebuilding"):
        kv.lookup(SEEDED_MODEL, token_ids=PROMPT)
    with KvidxClient(base_url, retry=fast, transport=Flaky(2, refuse=True)) as kv:
        assert kv.usage("u-1", SEEDED_MODEL, "tcp://10.0.0.0:5557", 10, 0).accepted  # never sent: repeated
    with KvidxClient(base_url, retry=fast, transport=Flaky(1)) as kv, pytest.raises(KvidxError, match="503"):
        kv.usage("u-2", SEEDED_MODEL, "tcp://10.0.0.0:5557", 10, 0)  # answered: not repeated


def test_no_service_and_timeouts_fail_in_time():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    with KvidxClient(f"http://127.0.0.1:{port}", retry=Retry(attempts=2, backoff_s=0.001)) as kv, \
            pytest.raises(KvidxError, match="ConnectError") as e:
        kv.health()
    assert e.value.status == 0
    with socket.socket() as silent:  # accepts, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with KvidxClient(url, timeout=0.2, retry=Retry(attempts=1)) as kv, \
                pytest.raises(KvidxError, match="ReadTimeout"):
            kv.lookup(SEEDED_MODEL, token_ids=PROMPT)


def test_asyncio_client(base_url):
    async def run():
        async with AsyncKvidxClient(base_url, retry=Retry(backoff_s=0.001)) as kv:
            answers = await asyncio.gather(*(kv.lookup(SEEDED_MODEL, token_ids=PROMPT[:16 * k])
                                             for k in range(1, 6)))
            assert [a.prompt_tokens for a in answers] == [16 * k for k in range(1, 6)]
            ranked = await kv.rank(SEEDED_MODEL, token_ids=PROMPT)
            routed = await kv.route("a-1", SEEDED_MODEL, ranked.replicas[0].replica, token_ids=PROMPT)
            assert routed.accepted
            with pytest.raises(UnknownModel):
                await kv.lookup("nope", token_ids=PROMPT)
            assert (await kv.health()).ready

    asyncio.run(run())
