"""JSON lookup bodies read with the compiled token parser where built (index_service.wire.read_lookup):
the same request, packed the same, or refused with the same error, as msgspec's ordinary decode."""

import random

import msgspec
import pytest

from index_service.wire import LOOKUP_DECODER, Reject, decode, pack_tokens, read_lookup

BODIES = [
    b'{"model": "m", "token_ids": [1, 2, 3]}',
    b'{"model":"m","token_ids":[ 0 ,4294967295 ],"top_k":2}',
    b'{"model": "m", "token_ids": []}',
    b'{"model": "m", "token_ids": [4294967296]}',
    b'{"model": "m", "token_ids": [-1]}',
    b'{"model": "m", "token_ids": [1.0]}',
    b'{"model": "m", "token_ids": [1, "2"]}',
    b'{"model": "m", "token_ids": [1,]}',
    b'{"model": "m", "token_ids": [01]}',
    b'{"model": "m", "token_ids": null, "block_hashes": [5], "prompt_tokens": 16}',
    b'{"model": "m", "block_hashes": [5], "prompt_tokens": 16}',
    b'{"model": "m", "token_ids": [1], "extra": 1}',
    b'{"model": 3, "token_ids": [1]}',
    b'{"model": "m", "token_ids": [1]',
    b'not json',
    # the token ids cut out of the object: where they stand, what stands around them
    b'{"token_ids": [7, 8], "model": "m"}',
    b' { "top_k" : 1 , "token_ids" : [ 7 ] , "model" : "m" } ',
    b'{"model": "m]}\\"", "token_ids": [7]}',
    b'{"model": "m", "lora_name": "a\\\\", "token_ids": [7]}',
    b'{"model": "m", "token_ids": [7], "token_ids": [8]}',
    b'{"model": "m", "token\\u005fids": [7]}',
    b'{"model": "m", "token_ids": [7], "token\\u005fids": [8]}',
    b'{"model": "m", "extra": {"a": [1, {"b": "}"}]}, "token_ids": [7]}',
    b'{"model": "m", "token_ids": [7],}',
    b'{"model": "m" "token_ids": [7]}',
    b'{"model": "m", "token_ids": [7]} x',
    b'{"model": "m", "token_ids": [7], "top_k": }',
    b'{"model": "m", "token_ids": [7], "top_k": tru}',
    b'{"model": "m", "token_ids": 7}',
    b'{"model": "m", "token_ids": [7]]}',
    b'{}',
    b'[1, 2]',
    b'{"model": "m", "token_ids": [7], "cache_salt": null, "top_k": null}',
    b'{"model": "m", "token_ids": [1], "token\\u005fids": null}',  # the last value wins: null
    b'{"model": "m", "token_ids": [1], "\\u0074oken_ids": null, "block_hashes": [5], "prompt_tokens": 16}',
    b'{"model": "m", "token_ids": [1], "x": "\xff"}',
    b'{"model": "m", "token_ids": [1], "top_k": 1e999}',
]


def _ordinary(body: bytes):
    try:
        req = decode(LOOKUP_DECODER, body)
    except Reject as e:
        return ("reject", e.status, e.error)
    ids = req.token_ids
    try:
        packed = pack_tokens(ids) if ids is not None else None
    except Reject as e:
        return ("reject", e.status, e.error)
    return (req.model, packed, req.block_hashes, req.prompt_tokens, req.top_k)


def _read(body: bytes):
    try:
        req = read_lookup(body)
    except Reject as e:
        return ("reject", e.status, e.error)
    try:
        packed = pack_tokens(req.token_ids) if req.token_ids is not None else None
    except Reject as e:
        return ("reject", e.status, e.error)
    return (req.model, packed, req.block_hashes, req.prompt_tokens, req.top_k)


@pytest.mark.parametrize("body", BODIES)
def test_read_lookup_is_the_ordinary_decode(body):
    assert _read(body) == _ordinary(body)


def test_random_token_lists():
    r = random.Random(3)
    for _ in range(200):
        ids = [r.choice([0, 1, 9, 10, 2**32 - 1, r.randrange(2**32)]) for _ in range(r.randint(0, 50))]
        body = msgspec.json.encode({"model": "m", "token_ids": ids})
        assert _read(body) == _ordinary(body)


# Dynamo's POST /query body (index_service/dynamo_api.py): the compiled split against its ordinary decode
QUERY_BODIES = [
    b'{"model_name": "m", "token_ids": [1, 2]}',
    b'{"token_ids": [], "model_name": "m", "lora_name": "a"}',
    b'{"model_name": "m", "token_ids": [1], "token\\u005fids": null}',
    b'{"model_name": "m", "token_ids": [1], "x": "\xff"}',
    b'{"model_name": "m", "token_ids": [1], "x": [1e999]}',
    b'{"model_name": "m", "token_ids": [1], "x": {"token_ids": "y"}}',
    b'{"model_name": "m", "token_ids": [1.5]}',
    b'{"model_name": 1, "token_ids": [1]}',
    b'{"token_ids": [1]}',
]


def _query(body: bytes, monkeypatch, split: bool):
    from index_service import dynamo_api, wire
    if not split:
        monkeypatch.setattr(wire, "split_token_ids", None)
    got = dynamo_api._decode_body(body, dynamo_api.QueryRequest)
    monkeypatch.undo()
    if isinstance(got, dynamo_api.QueryRequest):
        ids = got.token_ids
        return ("ok", got.model_name, got.lora_name, pack_tokens(ids) if isinstance(ids, list) else ids)
    return ("error", got.status_code, got.body)


@pytest.mark.parametrize("body", QUERY_BODIES)
def test_dynamo_query_split_is_the_ordinary_decode(body, monkeypatch):
    assert _query(body, monkeypatch, True) == _query(body, monkeypatch, False)
