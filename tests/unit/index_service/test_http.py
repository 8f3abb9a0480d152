"""The lookup service over real HTTP (uvicorn in a thread, httpx): answers equal the in-process
shard's, all three request forms agree, bad requests get the right 4xx naming the problem."""

from __future__ import annotations

import re
import struct
import time

import httpx
import msgspec
import numpy as np
import pytest

from index_service.app import create_app
from index_service.store import ShardStore
from kvidx.core import walk
from kvidx.core.hashing import prompt_hashes
from kvidx.engines.recording import read_frames
from kvidx.shadow import InProcessIndex, load_requests
from schemas.events import BlocksStored, EventBatch
from tests.helpers import LLAMA, ServerThread

FIXTURE = LLAMA
MODEL = "tiny"  # the fixture's served model name
REPLAY = "tiny-replay"  # the same recording, fed request by request during a test
SYNTH = "synth"
INDEX_BS = 16
SYNTH_BS = 8
MAX_TOKENS = 8192


def _frames():
    return sorted(read_frames(FIXTURE / "frames.jsonl"), key=lambda f: f.recv_ns)


def _synth_tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 2**32 - 1, n, dtype=np.uint64).tolist()


SYNTH_PROMPT = _synth_tokens(100, 1)  # 12 full blocks of 8 + 4 tokens


def _synth_batches() -> list[EventBatch]:
    """Replica r0 holds 10 blocks of SYNTH_PROMPT (first 6 in GPU, the next 4 only in CPU), r1 the
    first 5; r1 also holds the prompt under LoRA 'ad1' and under cache salt 's1' (first 3 blocks)."""
    base = prompt_hashes(SYNTH_PROMPT, SYNTH_BS)
    lora = prompt_hashes(SYNTH_PROMPT, SYNTH_BS, "ad1")
    salt = prompt_hashes(SYNTH_PROMPT, SYNTH_BS, None, "s1")

    def stored(tier, hashes, depth=0, parent=None):
        return BlocksStored(tier=tier, group=0, hashes=hashes, parent=parent, depth=depth)

    def batch(replica, events, engine_bs=SYNTH_BS):
        return EventBatch(v=1, model=SYNTH, replica=replica, dp_rank=0, epoch=0, seq=0,
                          engine_ts=time.time(), relay_ts=time.time(), block_size=engine_bs, events=events)

    return [
        batch("r0", [stored("GPU", base[:6]), stored("CPU", base[6:10], 6, base[5])], engine_bs=16),
        batch("r1", [stored("GPU", base[:5]), stored("GPU", lora[:3]), stored("GPU", salt[:3])]),
    ]


@pytest.fixture(scope="module")
def world():
    full = InProcessIndex(MODEL, INDEX_BS)
    for f in _frames():
        full.feed(f)
    store = ShardStore(INDEX_BS, block_sizes={SYNTH: SYNTH_BS})
    store.put(full.shard)
    replay = InProcessIndex(REPLAY, INDEX_BS)
    store.put(replay.shard)
    for b in _synth_batches():
        store.apply(b)
    store.ready = True
    app = create_app(store, max_tokens=MAX_TOKENS)
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        yield {"store": store, "full": full, "replay": replay, "client": client}


@pytest.fixture(scope="module")
def requests_log():
    return load_requests(FIXTURE / "requests.jsonl")


def _core(replicas: list) -> list[tuple]:
    """What must match exactly (freshness ages move with the clock), of HTTP or in-process answers."""
    replicas = msgspec.to_builtins(replicas)
    return [(r["replica"], r["dp_rank"], r["cached_tokens"], r["resumable_tokens"],
             [(t["tier"], t["tokens"]) for t in r["tiers"]], r["freshness"]["epoch"],
             r["freshness"]["seq"], r["freshness"]["seq_gaps"]) for r in replicas]


def _post_json(client, body: dict) -> httpx.Response:
    return client.post("/v1/lookup", json=body)


def _post_binary(client, tokens, **params) -> httpx.Response:
    data = np.asarray(tokens, dtype="<u4").tobytes() if not isinstance(tokens, bytes) else tokens
    return client.post("/v1/lookup/binary", params=params, content=data,
                       headers={"content-type": "application/octet-stream"})


# ---- answers ---------------------------------------------------------------------------------

def test_json_lookup_equals_in_process(world, requests_log):
    client, shard = world["client"], world["full"].shard
    hit = 0
    for r in requests_log[::10] + [r for r in requests_log if r["i"] in (2, 13, 56)]:
        tokens = r["prompt_token_ids"]
        resp = _post_json(client, {"model": MODEL, "token_ids": tokens})
        assert resp.status_code == 200, resp.text
        assert resp.headers["content-type"] == "application/json"
        got = resp.json()
        want = walk.lookup(shard, prompt_hashes(tokens, INDEX_BS), len(tokens), time.time())
        assert got["model"] == MODEL
        assert got["prompt_tokens"] == len(tokens)
        assert got["block_size"] == INDEX_BS
        assert _core(got["replicas"]) == _core(want)
        assert set(got["replicas"][0]["freshness"]) == {"last_event_age_ms", "apply_lag_ms", "epoch",
                                                       "seq", "seq_gaps", "age_clock"}
        assert got["replicas"][0]["freshness"]["age_clock"] == "engine"
        hit += got["replicas"][0]["cached_tokens"] > 0
    assert hit >= 3  # the comparison covered real hits, not only misses


def test_replay_over_http_matches_engine(world, requests_log):
    """Feed the recording up to each request's send time and ask over HTTP: the service credits what
    the in-process shard does, and (like the shadow audit) what the engine really reused."""
    client, index = world["client"], world["replay"]
    frames = _frames()
    k = exact = credited_total = 0
    for r in requests_log:
        t_ns = int(r["t_send"] * 1e9)
        while k < len(frames) and frames[k].recv_ns <= t_ns:
            index.feed(frames[k])
            k += 1
        tokens = r["prompt_token_ids"]
        resp = _post_binary(client, tokens, model=REPLAY)
        assert resp.status_code == 200, resp.text
        got = resp.json()["replicas"]
        want = walk.lookup(index.shard, prompt_hashes(tokens, INDEX_BS), len(tokens), time.time())
        assert _core(got) == _core(want)
        credited = max((a["resumable_tokens"] for a in got), default=0)
        credited_total += credited
        exact += credited == int(r["cached_tokens"])
    assert credited_total > 10_000
    assert exact >= len(requests_log) - 5


def test_binary_and_block_hashes_forms_match_json(world, requests_log):
    client = world["client"]
    for r in requests_log[2:60:7]:
        tokens = r["prompt_token_ids"]
        j = _post_json(client, {"model": MODEL, "token_ids": tokens, "lora_name": None, "cache_salt": None})
        b = _post_binary(client, tokens, model=MODEL)
        h = _post_json(client, {"model": MODEL, "block_hashes": prompt_hashes(tokens, INDEX_BS),
                                "prompt_tokens": len(tokens)})
        assert j.status_code == b.status_code == h.status_code == 200, (j.text, b.text, h.text)
        jj, bb, hh = j.json(), b.json(), h.json()
        assert _core(jj["replicas"]) == _core(bb["replicas"]) == _core(hh["replicas"])
        assert jj["prompt_tokens"] == bb["prompt_tokens"] == hh["prompt_tokens"] == len(tokens)


def test_lora_salt_tiers_and_order(world):
    """Per-model index block size, LoRA namespace and cache salt reach the hashing; replicas come
    best first with their tier runs; the engine block size bounds resumable tokens."""
    client = world["client"]
    p = SYNTH_PROMPT

    def ask(form, **extra):
        if form == "json":
            resp = _post_json(client, {"model": SYNTH, "token_ids": p, **extra})
        else:
            resp = _post_binary(client, p, model=SYNTH, **extra)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["block_size"] == SYNTH_BS
        return {a["replica"]: a for a in body["replicas"]}, [a["replica"] for a in body["replicas"]]

    for form in ("json", "binary"):
        by, order = ask(form)
        assert order == ["r0", "r1"]
        assert by["r0"]["cached_tokens"] == 80
        assert [(t["tier"], t["tokens"]) for t in by["r0"]["tiers"]] == [("GPU", 48), ("CPU", 32)]
        assert by["r0"]["resumable_tokens"] == 80  # engine blocks of 16
        assert by["r1"]["cached_tokens"] == by["r1"]["resumable_tokens"] == 40
        by, order = ask(form, lora_name="ad1")
        assert order[0] == "r1" and by["r1"]["cached_tokens"] == 24 and by["r0"]["cached_tokens"] == 0
        by, _ = ask(form, cache_salt="s1")
        assert by["r1"]["cached_tokens"] == 24 and by["r0"]["cached_tokens"] == 0
        by, _ = ask(form, lora_name="other")
        assert by["r0"]["cached_tokens"] == by["r1"]["cached_tokens"] == 0
    # block_hashes computed by the router with the LoRA namespace
    resp = _post_json(client, {"model": SYNTH, "block_hashes": prompt_hashes(p, SYNTH_BS, "ad1"),
                               "prompt_tokens": len(p)})
    assert {a["replica"]: a["cached_tokens"] for a in resp.json()["replicas"]} == {"r0": 0, "r1": 24}
    # a router may send only a prefix of the hashes
    resp = _post_json(client, {"model": SYNTH, "block_hashes": prompt_hashes(p, SYNTH_BS)[:2],
                               "prompt_tokens": len(p)})
    assert resp.json()["replicas"][0]["cached_tokens"] == 16


def test_max_tokens_is_accepted(world):
    tokens = [7] * MAX_TOKENS
    assert _post_json(world["client"], {"model": MODEL, "token_ids": tokens}).status_code == 200
    assert _post_binary(world["client"], tokens, model=MODEL).status_code == 200


# ---- bad requests ----------------------------------------------------------------------------

def _raw(client, content: bytes, path="/v1/lookup", **kw) -> httpx.Response:
    return client.post(path, content=content, headers={"content-type": "application/json"}, **kw)


BAD_JSON = [
    # (body, status, words the error must contain)
    (b'{"model": "tiny", "token_ids": [1, 2', 400, ["invalid JSON"]),
    (b"not json", 400, ["invalid JSON"]),
    (b"", 400, ["invalid JSON"]),
    (b'{"token_ids": [1, 2, 3]}', 422, ["model"]),
    (b'{"model": "nope", "token_ids": [1, 2, 3]}', 404, ["unknown model", "'nope'", "'tiny'"]),
    (b'{"model": "tiny", "token_ids": [1, -1, 3]}', 422, ["token_ids[1]", "uint32"]),
    (b'{"model": "tiny", "token_ids": [1, 4294967296]}', 422, ["token_ids[1]", "uint32"]),
    (b'{"model": "tiny", "token_ids": ["1", "2"]}', 422, ["token_ids", "int"]),
    (b'{"model": "tiny", "token_ids": [1.5]}', 422, ["token_ids"]),
    (b'{"model": "tiny", "token_ids": "1 2 3"}', 422, ["token_ids"]),
    (b'{"model": "tiny", "token_ids": []}', 422, ["token_ids", "empty"]),
    (b'{"model": "tiny"}', 422, ["token_ids", "block_hashes"]),
    (b'{"model": "tiny", "token_ids": [1], "block_hashes": [1], "prompt_tokens": 1}', 422,
     ["token_ids", "block_hashes", "not both"]),
    (b'{"model": "tiny", "block_hashes": [1, 2]}', 422, ["prompt_tokens"]),
    (b'{"model": "tiny", "block_hashes": [1, 2], "prompt_tokens": 20}', 422,
     ["block_hashes", "prompt_tokens"]),
    (b'{"model": "tiny", "block_hashes": [-1], "prompt_tokens": 20}', 422, ["block_hashes[0]", "uint64"]),
    (b'{"model": "tiny", "block_hashes": [], "prompt_tokens": 0}', 422, ["prompt_tokens"]),
    (b'{"model": "tiny", "token_ids": [1], "tokens": [1]}', 422, ["tokens"]),
    (b'{"model": 5, "token_ids": [1]}', 422, ["model", "str"]),
    (b'{"model": "tiny", "token_ids": [1, 2], "prompt_tokens": 3}', 422, ["prompt_tokens"]),
    (b'{"model": "tiny", "token_ids": [1], "lora_name": 3}', 422, ["lora_name"]),
    (b'[1, 2, 3]', 422, ["object"]),
]


@pytest.mark.parametrize(("body", "status", "words"), BAD_JSON)
def test_bad_json_requests(world, body, status, words):
    resp = _raw(world["client"], body)
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    for w in words:
        assert w in error, (w, error)


def test_oversized_requests(world):
    client = world["client"]
    too_many = [1] * (MAX_TOKENS + 1)
    resp = _post_json(client, {"model": MODEL, "token_ids": too_many})
    assert resp.status_code == 413 and "max_tokens" in resp.json()["error"]
    resp = _post_json(client, {"model": MODEL, "block_hashes": [], "prompt_tokens": MAX_TOKENS + 1})
    assert resp.status_code == 413 and "prompt_tokens" in resp.json()["error"]
    huge = b'{"model": "tiny", "token_ids": [' + b"1000000000, " * (MAX_TOKENS + 10000) + b"1]}"
    resp = _raw(client, huge)
    assert resp.status_code == 413 and "too large" in resp.json()["error"]
    resp = _post_binary(client, too_many, model=MODEL)
    assert resp.status_code == 413 and "binary body too large" in resp.json()["error"]


def test_oversized_chunked_body_is_refused(world):
    def chunks():
        for _ in range(MAX_TOKENS // 1024 + 2):
            yield b"\x00" * 4096
    resp = world["client"].post("/v1/lookup/binary", params={"model": MODEL}, content=chunks())
    assert resp.status_code == 413, resp.text
    # a chunked body within the limit is read in full
    resp = world["client"].post("/v1/lookup/binary", params={"model": MODEL},
                                content=iter([b"\x01\x00\x00\x00", b"\x02\x00\x00\x00"]))
    assert resp.status_code == 200 and resp.json()["prompt_tokens"] == 2


@pytest.mark.parametrize(("data", "params", "status", "words"), [
    (b"\x01\x00\x00\x00\x02", {"model": MODEL}, 400, ["multiple of 4"]),
    (b"", {"model": MODEL}, 422, ["empty"]),
    (struct.pack("<2I", 1, 2), {}, 422, ["model"]),
    (struct.pack("<2I", 1, 2), {"model": "nope"}, 404, ["unknown model", "'nope'"]),
    (struct.pack("<2I", 1, 2), {"model": MODEL, "lora": "x"}, 422, ["lora"]),
])
def test_bad_binary_requests(world, data, params, status, words):
    resp = _post_binary(world["client"], data, **params)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    for w in words:
        assert w in error, (w, error)


def test_unknown_model_list_is_truncated():
    store = ShardStore()
    for i in range(30):
        store.shard(f"m{i:02d}")
    store.ready = True
    with ServerThread(create_app(store)) as url:
        resp = httpx.post(f"{url}/v1/lookup", json={"model": "x", "token_ids": [1]})
    assert resp.status_code == 404
    error = resp.json()["error"]
    assert "'m00'" in error and "'m29'" not in error and "20 more" in error


# ---- health, models, metrics -----------------------------------------------------------------

def test_healthz_and_models(world):
    client, store = world["client"], world["store"]
    resp = client.get("/healthz")
    assert resp.status_code == 200
    assert resp.json() == {"status": "ok", "ready": True, "models": 3, "batches_applied": 2,
                           "auth": "off"}
    resp = client.get("/v1/models")
    assert resp.status_code == 200
    models = {m["model"]: m for m in resp.json()["models"]}
    assert set(models) == {MODEL, REPLAY, SYNTH}
    tiny = models[MODEL]
    stats = store.shards[MODEL].stats()
    assert tiny["block_size"] == INDEX_BS
    assert tiny["replicas"] == stats["replicas"] == 1
    assert tiny["groups"]["0"]["blocks"] == stats["groups"][0]["blocks"] > 0
    assert tiny["blocks_applied"] == stats["blocks_applied"]
    assert tiny["freshness"]["replicas_never_applied"] == 0
    assert tiny["freshness"]["last_event_age_ms_max"] > 0
    assert tiny["freshness"]["age_clock"] == "engine"
    assert models[SYNTH]["replicas"] == 2 and models[SYNTH]["block_size"] == SYNTH_BS


def test_healthz_not_ready():
    with ServerThread(create_app(ShardStore())) as url:
        resp = httpx.get(f"{url}/healthz")
    assert resp.status_code == 503
    assert resp.json()["ready"] is False and resp.json()["status"] == "not_ready"


def test_a_model_not_known_yet_is_503_while_rebuilding_and_404_once_ready():
    """While the shards are rebuilt, a model the instance does not hold yet may be on its way: 503
    (retry, or ask another instance), never the 404 that tells a router nothing is cached anywhere
    (bench/chaos.py caught restarted instances answering 404 and routers routing blind)."""
    store = ShardStore()
    store.not_ready_reason = "rebuilding the shards from the snapshot topic and the events topic"
    route = {"request_id": "r", "model": "m", "replica": "x", "token_ids": [1, 2]}
    with ServerThread(create_app(store)) as url, httpx.Client(base_url=url) as c:
        answers = [c.post("/v1/lookup", json={"model": "m", "token_ids": [1, 2, 3]}),
                   c.post("/v1/lookup/binary", params={"model": "m"}, content=struct.pack("<2I", 1, 2)),
                   c.post("/v1/routes", json=route)]
        assert [a.status_code for a in answers] == [503] * 3, [a.text for a in answers]
        assert all("not ready: rebuilding the shards" in a.json()["error"] for a in answers)
        store.ready = True
        after = c.post("/v1/lookup", json={"model": "m", "token_ids": [1, 2, 3]})
        assert after.status_code == 404 and "unknown model 'm'" in after.json()["error"], after.text


def test_models_lists_every_model_a_lookup_answers_for():
    """A partial instance (groups 0-1 of a model split in 4) with no event of it yet: a lookup answers
    (the other groups' holders are asked), so /v1/models lists the model, saying which groups are
    elsewhere; a model nobody configured is neither answered nor listed."""
    from kvidx.config import Config, ModelConfig

    store = ShardStore(16, config=Config(models={"split": ModelConfig(replica_groups=4)}), groups={0, 1})
    store.ready = True
    with ServerThread(create_app(store)) as url:
        listed = {m["model"]: m for m in httpx.get(f"{url}/v1/models").json()["models"]}
        for model in ("split", "other"):
            lookup = httpx.post(f"{url}/v1/lookup", json={"model": model, "token_ids": list(range(40))})
            assert (lookup.status_code == 200) == (model in listed), (model, lookup.text, listed)
    assert listed["split"]["missing_groups"] == [2, 3] and listed["split"]["replicas"] == 0
    assert "split" not in store.shards  # listing made no shard


def test_events_lost_to_retention_show_in_healthz_and_metrics():
    store = ShardStore()
    store.ready, store.events_lost = True, 7  # the follower's count (tests/integration/test_retention_gap.py)
    with ServerThread(create_app(store)) as url:
        assert httpx.get(f"{url}/healthz").json()["events_lost"] == 7
        assert "kvidx_events_lost_total 7.0" in httpx.get(f"{url}/metrics").text


def test_metrics(world):
    client = world["client"]
    tokens = [1, 2, 3] * 40
    assert _post_json(client, {"model": MODEL, "token_ids": tokens}).status_code == 200
    assert _post_binary(client, tokens, model=MODEL).status_code == 200
    assert _raw(client, b"{").status_code == 400
    text = client.get("/metrics").text
    assert 'kvidx_lookup_latency_seconds_bucket{form="json",le="5e-05"}' in text
    assert 'kvidx_lookup_latency_seconds_count{form="binary"}' in text
    assert 'kvidx_lookups_total{form="json",status="200"}' in text
    assert 'kvidx_lookups_total{form="json",status="400"}' in text
    blocks = world["store"].shards[MODEL].stats()["groups"][0]["blocks"]
    assert f'kvidx_index_blocks{{group="0",model="{MODEL}"}} {float(blocks)}' in text
    assert f'kvidx_replicas{{model="{SYNTH}"}} 2.0' in text
    assert "kvidx_batches_applied_total 2.0" in text
    assert "kvidx_ready 1.0" in text
    from kvidx.core.maskmap import IMPLEMENTATION
    assert f'kvidx_core_info{{maskmap="{IMPLEMENTATION}"}} 1.0' in text
    # the compiled fold took the plain batches (both here; its count is the process's), where it is built
    folded = re.search(r"^kvidx_fold_compiled_batches_total (\S+)$", text, re.M)
    assert (folded is not None and float(folded[1]) >= 2) == (IMPLEMENTATION == "native")
    # and handed the first batch of each replica to the Python fold (which makes the replica)
    reference = re.search(r'^kvidx_fold_reference_batches_total\{reason="new_replica"\} (\S+)$', text, re.M)
    assert (reference is not None and float(reference[1]) >= 1) == (IMPLEMENTATION == "native")
    assert f'kvidx_lookup_prompt_tokens_total{{model="{MODEL}"}}' in text
    assert 'model="nope"' not in text  # client-chosen names never become label values
    # a second app in the same process has its own registry: its counters start at zero
    with ServerThread(create_app(ShardStore())) as url:
        other = httpx.get(f"{url}/metrics").text
    assert 'kvidx_lookups_total{form="json",status="200"}' not in other
    assert "kvidx_ready 0.0" in other


def test_bearer_token_required_on_v1_when_configured(world):
    store = world["store"]
    with ServerThread(create_app(store, auth_token="s3cret")) as base, httpx.Client(base_url=base) as c:
        body = {"model": MODEL, "token_ids": list(range(64))}
        r = c.post("/v1/lookup", json=body)
        assert r.status_code == 401 and "bearer" in r.json()["error"]
        r = c.post("/v1/lookup", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = c.post("/v1/lookup", json=body, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["model"] == MODEL
        assert c.get("/healthz").status_code == 200  # probes stay open
        # the lookups taken before the middleware (hot_path.HotPath) and a route behind it alike
        binary = np.arange(64, dtype="<u4").tobytes()
        for path, kw in (("/v1/rank", {"json": body}),
                         (f"/v1/lookup/binary?model={MODEL}", {"content": binary}),
                         ("/v1/routes", {"json": {"request_id": "r", "model": MODEL, "replica": "x"}})):
            assert c.post(path, **kw).status_code == 401, path
            r = c.post(path, **kw, headers={"Authorization": "Bearer s3cret"})
            assert r.status_code != 401, path


def test_route_to_an_unknown_replica_is_refused(world):
    c = world["client"]
    before = len(world["store"].shards[MODEL].replicas)
    r = c.post("/v1/routes", json={"request_id": "x1", "model": MODEL, "replica": "no-such-replica",
                                   "token_ids": list(range(40))})
    assert r.status_code == 422 and "unknown replica" in r.json()["error"]
    assert len(world["store"].shards[MODEL].replicas) == before  # no slot was made for it


def test_top_k_describes_only_the_best_replicas(world, requests_log):
    c = world["client"]
    tokens = requests_log[120]["prompt_token_ids"]
    full = c.post("/v1/lookup", json={"model": SYNTH, "token_ids": _synth_tokens(80, 1)}).json()["replicas"]
    assert len(full) >= 2
    top = c.post("/v1/lookup", json={"model": SYNTH, "token_ids": _synth_tokens(80, 1), "top_k": 1}).json()
    assert [r["replica"] for r in top["replicas"]] == [full[0]["replica"]]
    assert top["replicas"][0]["resumable_tokens"] == full[0]["resumable_tokens"] > 0
    packed = np.asarray(tokens, dtype="<u4").tobytes()
    r = c.post(f"/v1/lookup/binary?model={MODEL}&top_k=1", content=packed)
    assert r.status_code == 200 and len(r.json()["replicas"]) == 1
    for bad in ("0", "-1", "x", "99999"):
        r = c.post(f"/v1/lookup/binary?model={MODEL}&top_k={bad}", content=packed)
        assert r.status_code == 422 and "top_k" in r.json()["error"], bad
