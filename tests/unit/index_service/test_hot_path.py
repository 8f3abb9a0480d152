"""The lookups' lean route (index_service/hot_path.py): over real HTTP, a body in one piece, in many
chunks (chunked transfer, no Content-Length) and too large for a chunked stream all get the answers
and errors of the FastAPI route they stand in for."""

import httpx
import msgspec

from index_service.app import create_app
from tests.helpers import SEEDED_MODEL as MODEL
from tests.helpers import ServerThread, seeded_store


def chunks(data: bytes, n: int):
    for i in range(0, len(data), n):
        yield data[i:i + n]


def credit(answer: dict) -> list:
    return [(r["replica"], r["cached_tokens"], r["resumable_tokens"]) for r in answer["replicas"]]


def test_one_piece_chunked_and_too_large_bodies():
    app = create_app(seeded_store(), max_tokens=4096)
    body = msgspec.json.encode({"model": MODEL, "token_ids": list(range(1000, 1000 + 10 * 16))})
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        json_type = {"content-type": "application/json"}
        whole = client.post("/v1/lookup", content=body, headers=json_type)
        assert whole.status_code == 200 and credit(whole.json())
        chunked = client.post("/v1/lookup", content=chunks(body, 7), headers=json_type)
        assert chunked.status_code == 200 and credit(chunked.json()) == credit(whole.json())
        big = b'{"model": "%s", "token_ids": [' % MODEL.encode() + b"1, " * 60000 + b"1]}"
        r = client.post("/v1/lookup", content=chunks(big, 4096), headers=json_type)
        assert r.status_code == 413 and "too large" in r.json()["error"]
        r = client.post("/v1/lookup", content=b"{", headers=json_type)
        assert r.status_code in (400, 422) and r.json()["error"]
        packed = b"".join(t.to_bytes(4, "little") for t in range(1000, 1000 + 10 * 16))
        r = client.post(f"/v1/lookup/binary?model={MODEL}", content=chunks(packed, 100))
        assert r.status_code == 200 and credit(r.json()) == credit(whole.json())


def test_a_long_prompt_answers_as_its_binary_form():
    app = create_app(seeded_store(), max_tokens=131072)
    tokens = list(range(1000, 1000 + 10 * 16)) + [777] * 90000  # a 630 KB JSON body
    body = msgspec.json.encode({"model": MODEL, "token_ids": tokens})
    packed = b"".join(t.to_bytes(4, "little") for t in tokens)
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        long = client.post("/v1/lookup", content=body, headers={"content-type": "application/json"})
        assert long.status_code == 200 and long.json()["prompt_tokens"] == len(tokens)
        binary = client.post(f"/v1/lookup/binary?model={MODEL}", content=packed)
        assert credit(long.json()) == credit(binary.json()) and any(c for _, c, _ in credit(long.json()))
        bad = client.post("/v1/lookup", content=body[:-2] + b",-1]}", headers={"content-type": "json"})
        assert bad.status_code == 422 and "token_ids" in bad.json()["error"]
