"""No prompt token ids or prompt text reach the lookup service's logs (tests/integration/test_privacy.py
covers Kafka, RocksDB and the relay/worker logs).

The service runs over real HTTP with every logger at DEBUG (the per-lookup debug line, the rejected
requests' log line, uvicorn's access and error logs). Hypothesis sends prompts in every form (JSON
token_ids, binary, block_hashes, /v1/rank, /v1/routes) and broken variants of them (an id out of
range, a float or a string among the ids, truncated or garbled JSON, extra fields holding prompt text,
too many tokens, a binary body of the wrong length, an unknown model). Token ids are drawn from
3,000,000,000..4,294,967,295, ten-digit numbers nothing else in a log line looks like, so a single id
in the logs (as text, or packed as bytes) fails the test.
"""

from __future__ import annotations

import json
import logging

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from index_service.app import create_app
from kvidx.core.hashing import prompt_hashes
from tests.helpers import SEEDED_MODEL as MODEL
from tests.helpers import ServerThread, seeded_store

MAX_TOKENS = 2048
LO, HI = 3_000_000_000, 2**32 - 1
SECRET_TEXT = "zebra-quartz-PROMPT-TEXT"


class Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record) + repr(record.args))


@pytest.fixture(scope="module")
def logged_service():
    cap = Capture()
    root = logging.getLogger()
    old = root.level
    root.addHandler(cap)
    root.setLevel(logging.DEBUG)
    app = create_app(seeded_store(), max_tokens=MAX_TOKENS)
    # log_config=None: uvicorn's loggers propagate to the root handler (its own config would not)
    server = ServerThread(app, log_config=None, access_log=True)
    server.server.config.log_level = "debug"
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "kvidx"):
        logging.getLogger(name).setLevel(logging.DEBUG)
    try:
        with server as url, httpx.Client(base_url=url, timeout=30) as client:
            yield client, cap
    finally:
        root.removeHandler(cap)
        root.setLevel(old)


prompts = st.lists(st.integers(LO, HI), min_size=1, max_size=200)
forms = st.sampled_from(["json", "binary", "hashes", "rank", "routes"])
breaks = st.sampled_from([None, "out_of_range", "negative", "float", "string", "truncate", "garble",
                          "extra_text", "too_many", "odd_binary", "unknown_model", "both_forms"])


def _request(client: httpx.Client, tokens: list[int], form: str, brk: str | None, i: int) -> httpx.Response:
    model = "no-such-model" if brk == "unknown_model" else MODEL
    ids: list = list(tokens)
    if brk == "too_many":
        ids = (ids * (MAX_TOKENS // len(ids) + 2))[:MAX_TOKENS + 1]
    if brk in ("out_of_range", "negative", "float", "string"):
        k = len(ids) // 2
        ids[k] = {"out_of_range": ids[k] + 2**32, "negative": -ids[k], "float": ids[k] + 0.5,
                  "string": str(ids[k])}[brk]
    if form == "binary":
        data = np.asarray([t for t in ids if isinstance(t, int) and 0 <= t <= HI], dtype="<u4").tobytes()
        if brk == "odd_binary":
            data += b"\x01\x02"
        if brk == "garble":
            data = SECRET_TEXT.encode() + data
        return client.post("/v1/lookup/binary", params={"model": model}, content=data)
    body: dict = {"model": model, "token_ids": ids}
    if form == "hashes":
        good = [t for t in ids if isinstance(t, int) and 0 <= t <= HI]
        body = {"model": model, "block_hashes": prompt_hashes(good, 16), "prompt_tokens": len(good)}
    if brk == "both_forms":
        body["block_hashes"] = [1]
    if brk == "extra_text":
        body["prompt"] = SECRET_TEXT
    path = {"json": "/v1/lookup", "hashes": "/v1/lookup", "rank": "/v1/rank", "routes": "/v1/routes"}[form]
    if form == "routes":
        body.update(request_id=f"priv-{i}", replica="tcp://10.0.0.1:5557", credited_tokens=16)
    raw = json.dumps(body).encode()
    if brk == "truncate":
        raw = raw[: len(raw) * 2 // 3]
    if brk == "garble":
        raw = raw.replace(b"[", b"[" + SECRET_TEXT.encode() + b" ", 1)
    return client.post(path, content=raw, headers={"content-type": "application/json"})


def needles(tokens: list[int]) -> set[str]:
    out = {str(t) for t in tokens}
    packed = np.asarray(tokens, dtype="<u4").tobytes()
    out |= {repr(packed[i:i + 8])[2:-1] for i in range(0, max(1, len(packed) - 8), 4)}
    out.add(SECRET_TEXT)
    return out


def test_no_token_ids_or_text_in_service_logs(logged_service):
    client, cap = logged_service
    sent: list[int] = []
    statuses: set[int] = set()
    counter = iter(range(10**9))

    @given(tokens=prompts, form=forms, brk=breaks)
    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(tokens, form, brk):
        r = _request(client, tokens, form, brk, next(counter))
        assert r.status_code < 500, r.text[:300]
        statuses.add(r.status_code)
        sent.extend(tokens)

    run()
    assert {200, 202} & statuses and {400, 404, 413, 422} <= statuses, statuses  # both paths exercised
    text = "\n".join(cap.lines)
    assert any("lookup_rejected" in line for line in cap.lines), "the rejected-request log was not captured"
    assert any("event=lookup " in line for line in cap.lines), "the per-lookup debug log was not captured"
    assert any("uvicorn" in line for line in cap.lines), "uvicorn's logs were not captured"
    leaked = sorted(n for n in needles(sent) if n in text)
    assert not leaked, f"prompt data in the service logs: {leaked[:5]}"
