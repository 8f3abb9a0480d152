"""Service instances holding part of a model (replica groups, `kvidx serve --groups`) over real HTTP:
an instance asks the one holding the other groups and answers every lookup form like one instance
holding all; a peer that is down gives a partial answer naming its groups; routes to replicas of
groups held elsewhere are accepted and left to their holder."""

from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import msgspec
import pytest

from index_service.app import create_app
from index_service.fanout import Announcement, Fanout, PeerDirectory
from index_service.store import ShardStore
from kvidx.config import Config, ModelConfig
from kvidx.core.groups import hashed_group
from schemas.answers import LOOKUP_ANSWER_DECODER
from tests.helpers import ServerThread, random_fleet

G = 4
CONFIG = Config(models={"m": ModelConfig(replica_groups=G)})


def _store(groups=None) -> ShardStore:
    return ShardStore(16, config=CONFIG, groups=groups)


def _split_stores() -> dict[str, ShardStore]:
    """A full instance's store and the two halves' (groups 0-1, groups 2-3)."""
    return {"full": _store(), "a": _store(frozenset({0, 1})), "b": _store(frozenset({2, 3}))}


def _split_prompt(first_token: int, subnet: int) -> tuple[list[int], list[int], list[str]]:
    """A 24-block prompt, its hashes, and eight engine endpoints with some in each half's groups."""
    from kvidx.core.hashing import prompt_hashes

    prompt = list(range(first_token, first_token + 16 * 24))
    endpoints = [f"tcp://10.0.{subnet}.{i}:5557" for i in range(8)]
    assert {hashed_group(e, G) for e in endpoints} >= {0, 2}  # some in each half
    return prompt, prompt_hashes(prompt, 16), endpoints


@pytest.fixture(scope="module")
def fleet():
    batches, docs = random_fleet(40, seed=5, groups=G)
    stores = _split_stores()
    for b in batches:
        for s in stores.values():
            s.apply(b, 2.0)
    for s in stores.values():
        s.ready = True
    return stores, docs


def _names(store: ShardStore) -> set[str]:
    return {st.replica for st in store.shards["m"].replicas.values()}


def _replicas(c: httpx.Client, url: str, path: str, body: dict) -> list[dict]:
    return c.post(f"{url}{path}", json=body).json()["replicas"]


def _canon(raw: bytes) -> list:
    """An answer's replicas without what depends on the moment asked (event age), in a stable order."""
    ans = LOOKUP_ANSWER_DECODER.decode(raw)
    out = []
    for r in ans.replicas:
        r.freshness.last_event_age_ms = None
        out.append(msgspec.to_builtins(r))
    return sorted(out, key=lambda r: (-r["resumable_tokens"], r["replica"], r["dp_rank"]))


def test_a_partial_instance_answers_like_a_full_one(fleet):
    stores, docs = fleet
    directory = PeerDirectory("a")
    with ServerThread(create_app(stores["full"])) as full, ServerThread(create_app(stores["b"])) as b:
        directory.add_static(b, frozenset({2, 3}))
        app = create_app(stores["a"], fanout=Fanout(directory, timeout_s=5.0))
        with ServerThread(app) as a, httpx.Client() as c:
            assert _names(stores["a"]) < _names(stores["full"])
            hits = 0
            for d in docs:
                body = {"model": "m", "block_hashes": d, "prompt_tokens": len(d) * 16 + 1}
                want = c.post(f"{full}/v1/lookup", json=body)
                got = c.post(f"{a}/v1/lookup", json=body)
                assert got.status_code == 200 and _canon(got.content) == _canon(want.content)
                assert "partial" not in got.json()
                hits += sum(1 for r in want.json()["replicas"] if r["resumable_tokens"])
                ranked = [[r["price"]["total_s"] for r in _replicas(c, u, "/v1/rank", {**body, "top_k": 5})]
                          for u in (a, full)]
                assert ranked[0] == ranked[1]
                top = [[r["resumable_tokens"] for r in _replicas(c, u, "/v1/lookup", {**body, "top_k": 3})]
                       for u in (a, full)]
                assert top[0] == top[1]
            assert hits > len(docs)
            # another instance's fan-out is answered from the shard alone, for the groups asked
            only = _replicas(c, b, "/v1/lookup?local=1&groups=2", body)
            assert {r["replica"] for r in only} == {r for r in _names(stores["b"]) if hashed_group(r, G) == 2}
            assert {r["replica"] for r in _replicas(c, b, "/v1/lookup?local=1", body)} == _names(stores["b"])
            assert c.post(f"{b}/v1/lookup?local=1&groups=x", json=body).status_code == 422
            assert c.post(f"{a}/v1/lookup", json={**body, "model": "nope"}).status_code == 404
            assert "kvidx_fanout_seconds_count" in c.get(f"{a}/metrics").text
            health = c.get(f"{a}/healthz").json()  # what it holds, whom it asks
            assert health["groups"] == [0, 1] and health["peers"] == [{"name": b, "url": b, "groups": [2, 3]}]

        # a route to a replica of a group held elsewhere: accepted, credited by its holder
        with ServerThread(app) as a, httpx.Client() as c:
            far = sorted(_names(stores["b"]))[0]
            route = {"model": "m", "block_hashes": docs[0], "prompt_tokens": len(docs[0]) * 16 + 1,
                     "request_id": "r1", "replica": far, "dp_rank": 0}
            assert c.post(f"{a}/v1/routes", json=route).status_code == 202
            assert (far, 0) not in stores["a"].shards["m"].replicas  # no slot made here
            bad = {**route, "request_id": "r2", "replica": "no-such-replica"}
            if stores["a"].holds(hashed_group("no-such-replica", G)):
                assert c.post(f"{a}/v1/routes", json=bad).status_code == 422


def test_a_peer_that_is_down_gives_a_partial_answer(fleet):
    stores, docs = fleet
    directory = PeerDirectory("a")
    directory.add_static("http://127.0.0.1:9", frozenset({2, 3}))  # nothing listens there
    with ServerThread(create_app(stores["a"], fanout=Fanout(directory, timeout_s=0.5))) as a, \
            httpx.Client() as c:
        body = {"model": "m", "block_hashes": docs[0], "prompt_tokens": len(docs[0]) * 16 + 1}
        got = c.post(f"{a}/v1/lookup", json=body)
        assert got.status_code == 200, got.text
        ans = got.json()
        assert ans["partial"] is True and ans["missing_groups"] == [2, 3]
        assert {r["replica"] for r in ans["replicas"]} <= _names(stores["a"])
        binary = c.post(f"{a}/v1/lookup/binary?model=m", content=b"\x01\x00\x00\x00" * 40)
        assert binary.status_code == 200 and binary.json()["missing_groups"] == [2, 3]
        assert "kvidx_fanout_partial_total 2.0" in c.get(f"{a}/metrics").text


def test_directory_plans_the_fewest_live_peers():
    d = PeerDirectory("me", stale_s=5.0)
    d.announced(Announcement(1, "me", "http://me", [0], 100.0))  # itself: never asked
    d.announced(Announcement(1, "x", "http://x", [1, 2], 100.0))
    d.announced(Announcement(1, "y", "http://y", [2], 100.0))
    d.announced(Announcement(1, "z", "http://z", [3], 90.0))  # stale at 100
    asked, missing = d.plan([1, 2, 3], now=100.0)
    assert {n: g for n, (_, g) in asked.items()} == {"x": [1, 2]} and missing == [3]
    d.gone("x")
    asked, missing = d.plan([1, 2], now=100.0)
    assert {n: g for n, (_, g) in asked.items()} == {"y": [2]} and missing == [1]
    d.announced(Announcement(1, "all", "http://all", None, 100.0))  # holds every group
    asked, missing = d.plan([1, 2, 3], now=100.0)
    assert list(asked) == ["all"] and not missing


def test_a_dead_holder_is_passed_over_for_another(fleet):
    stores, docs = fleet
    directory = PeerDirectory("a")
    with ServerThread(create_app(stores["full"])) as full, ServerThread(create_app(stores["b"])) as b:
        now = 1e12  # announced far ahead: never stale during the test
        directory.announced(Announcement(1, "b-dead", "http://127.0.0.1:9", [2, 3], now))  # asked first
        directory.announced(Announcement(1, "b-live", b, [2, 3], now))
        app = create_app(stores["a"], fanout=Fanout(directory, timeout_s=5.0))
        with ServerThread(app) as a, httpx.Client() as c:
            body = {"model": "m", "block_hashes": docs[1], "prompt_tokens": len(docs[1]) * 16 + 1}
            got = c.post(f"{a}/v1/lookup", json=body)
            assert "partial" not in got.json()
            assert _canon(got.content) == _canon(c.post(f"{full}/v1/lookup", json=body).content)


def test_fanout_carries_the_bearer_token(fleet):
    stores, docs = fleet
    body = {"model": "m", "block_hashes": docs[2], "prompt_tokens": len(docs[2]) * 16 + 1}
    auth = {"authorization": "Bearer s3cret"}
    with ServerThread(create_app(stores["b"], auth_token="s3cret")) as b, httpx.Client() as c:
        for token, partial in (("s3cret", False), ("wrong", True)):
            directory = PeerDirectory("a")
            directory.add_static(b, frozenset({2, 3}))
            app = create_app(stores["a"], auth_token="s3cret",
                             fanout=Fanout(directory, timeout_s=5.0, auth_token=token))
            with ServerThread(app) as a:
                got = c.post(f"{a}/v1/lookup", json=body, headers=auth).json()
                assert bool(got.get("partial")) is partial  # a peer refusing the token: its groups missing


def test_a_connection_the_peer_closed_while_idle_is_replaced(fleet):
    """uvicorn closes keep-alive connections idle for timeout_keep_alive seconds: the next fan-out must
    not take the closed one for a dead peer."""
    import time

    stores, docs = fleet
    body = {"model": "m", "block_hashes": docs[3], "prompt_tokens": len(docs[3]) * 16 + 1}
    with ServerThread(create_app(stores["b"]), timeout_keep_alive=1) as b, httpx.Client() as c:
        directory = PeerDirectory("a")
        directory.add_static(b, frozenset({2, 3}))
        with ServerThread(create_app(stores["a"], fanout=Fanout(directory, timeout_s=5.0))) as a:
            for _ in range(2):
                assert "partial" not in c.post(f"{a}/v1/lookup", json=body).json()
                time.sleep(1.5)  # the peer drops the idle connection


@contextmanager
def _split_service(stores: dict, api: str, registries: dict) -> Iterator[tuple[str, str, httpx.Client]]:
    """The full instance and b (groups 2, 3) served with a router API's registries (`api`: the
    create_app keyword); a (groups 0, 1) asks b for the rest. (full's URL, a's URL, a client)."""
    for s in stores.values():
        s.ready = True
    directory = PeerDirectory("a")
    with ServerThread(create_app(stores["full"], **{api: registries["full"]})) as full, \
            ServerThread(create_app(stores["b"], **{api: registries["b"]})) as b:
        directory.add_static(b, frozenset({2, 3}))
        app = create_app(stores["a"], **{api: registries["a"]}, fanout=Fanout(directory, timeout_s=5.0))
        with ServerThread(app) as a, httpx.Client(timeout=10) as c:
            yield full, a, c


def test_dynamo_query_on_a_partial_instance_answers_like_a_full_one():
    """Dynamo's POST /query on an instance holding some replica groups: the others' workers come from
    their holder (`?local=1` there), merged into one ScoreResponse equal to a full instance's."""
    import time

    from index_service.dynamo_api import DynamoRegistry
    from schemas.events import BlocksStored, EventBatch
    from schemas.registrations import REGISTRATIONS_VERSION, Registration, registration_key

    prompt, hashes, endpoints = _split_prompt(3000, 2)
    stores = _split_stores()
    registries = {k: DynamoRegistry() for k in stores}
    now = time.time()
    for i, ep in enumerate(endpoints):
        iid, rank = 100 + i // 2, i % 2
        reg = Registration(REGISTRATIONS_VERSION, iid, rank, "m", "default", 16, ep, None, "elsewhere")
        stored = [BlocksStored("GPU", 0, hashes[:3 * (i + 1)], None, 0)]
        batch = EventBatch(1, "m", ep, rank, 1, 0, now, now, 16, stored, replica_group=hashed_group(ep, G))
        for k in stores:
            registries[k].apply_record(registration_key(reg.instance_id, reg.dp_rank), reg)
            stores[k].apply(batch, 2.0)
    with _split_service(stores, "dynamo", registries) as (full, a, c):
        for n in (5, 12, 24):
            body = {"token_ids": prompt[:n * 16], "model_name": "m"}
            want = c.post(f"{full}/query", json=body).json()
            got = c.post(f"{a}/query", json=body).json()
            alone = c.post(f"{a}/query?local=1", json=body).json()
            assert got == want and len(want["instances"]) == 4, (n, got, want)
            assert alone != want  # a alone misses the other half's workers
        # a holder asked for some groups answers for those only (a full instance, here)
        body = {"token_ids": prompt, "model_name": "m"}
        only2 = c.post(f"{full}/query?local=1&groups=2", json=body).json()["instances"]
        want2 = {str(100 + i // 2) for i, ep in enumerate(endpoints) if hashed_group(ep, G) == 2}
        assert set(only2) == want2
        assert c.post(f"{full}/query?local=1&groups=x", json=body).status_code == 422


def test_conductor_query_on_a_partial_instance_answers_like_a_full_one():
    """Mooncake conductor's msgpack POST /query on an instance holding some replica groups: the other
    groups' holder answers its part (`?local=1&groups=...`: per replica its GPU cursor, per tier the
    blocks any replica holds), merged before the cursors are read, so a rank's host and disk phases
    continue through blocks held in any group, as on a full instance."""
    from index_service.conductor_api import ConductorRegistry, Reach
    from schemas.events import BlocksStored, EventBatch

    mp = {"Content-Type": "application/msgpack"}
    prompt, hashes, endpoints = _split_prompt(5000, 3)
    stores = _split_stores()
    registries = {k: ConductorRegistry() for k in stores}
    # GPU prefixes of different lengths; host memory and disk runs further on, in both halves
    held = {0: [("GPU", 0, 3)], 1: [("GPU", 0, 6), ("CPU", 6, 12)], 2: [("CPU", 0, 9)],
            3: [("GPU", 0, 2), ("DISK", 12, 20)], 4: [("CPU", 12, 16)], 5: [("GPU", 0, 4), ("DISK", 9, 12)],
            6: [("DISK", 16, 24)], 7: [("GPU", 0, 12)]}
    for i, ep in enumerate(endpoints):
        iid, rank = f"engine-{i // 2}", i % 2
        reg = {"endpoint": ep, "type": "vLLM", "modelname": "m", "instance_id": iid, "block_size": 32,
               "dp_rank": rank, "hash_profile": {"strategy": "vllm_v1", "algorithm": "sha256_cbor",
                                                 "python_hash_seed": "0", "index_projection": "low64_be"}}
        events = [BlocksStored(t, 0, hashes[lo:hi], hashes[lo - 1] if lo else None, lo)
                  for t, lo, hi in held[i]]
        batch = EventBatch(1, "m", ep, rank, 1, 0, 1.0, 1.0, 32, events, replica_group=hashed_group(ep, G))
        for k in stores:
            assert registries[k].register(msgspec.msgpack.encode(reg))[0] == 200
            stores[k].apply(batch, 2.0)
    alone = create_app(stores["a"], conductor=registries["a"], fanout=Fanout(PeerDirectory("a"), 1.0))
    with _split_service(stores, "conductor", registries) as (full, a, c), ServerThread(alone) as solo:
        for n in (5, 12, 24):
            body = msgspec.msgpack.encode({"model": "m", "block_size": 32, "token_ids": prompt[:n * 16]})
            want = msgspec.msgpack.decode(c.post(f"{full}/query", content=body, headers=mp).content)
            got = msgspec.msgpack.decode(c.post(f"{a}/query", content=body, headers=mp).content)
            assert got == want and len(want["instances"]) == 4, (n, got, want)
            if n >= 12:  # the lower tiers take part, through blocks of both halves: a alone differs
                assert any(v["disk"] > v["gpu"] for v in want["instances"].values()), want
                part = msgspec.msgpack.decode(c.post(f"{solo}/query", content=body, headers=mp).content)
                assert part != want
        r = c.post(f"{full}/query?local=1&groups=x", content=body, headers=mp)
        assert r.status_code == 422 and msgspec.msgpack.decode(r.content)["field"] == "groups"
        # `?local=1` alone: an answer from this instance's groups, in the conductor's form (as Dynamo's)
        own = msgspec.msgpack.decode(c.post(f"{a}/query?local=1", content=body, headers=mp).content)
        assert set(own) == {"instances"} and own == part
    # a holder's part that does not parse is refused, not merged (its groups count as missing)
    bad = msgspec.msgpack.encode({"reach": {"gpu": [], "reads": [], "lower": [b""], "pools": {}}})
    with pytest.raises(ValueError):
        Reach.decode(bad)
    with pytest.raises(msgspec.DecodeError):
        Reach.decode(msgspec.msgpack.encode({"reach": {"gpu": "x"}}))


def test_sglang_prefix_on_a_partial_instance_answers_like_a_full_one():
    """SGLang's MatchExternalKvPrefix on an instance holding some replica groups: the other groups'
    workers come from their holder over HTTP (POST /internal/sglang/{model}/match_prefix?local=1),
    merged per worker into the answer a full instance gives."""
    import asyncio
    import threading
    import time

    from index_service.sglang_indexer import (
        SglangIndexer,
        action_events,
        add_sglang_peer_route,
        remote_prefix,
    )
    from index_service.sglang_pb import kv_indexer_pb2 as pb
    from schemas.events import EventBatch

    chain = [str(h) for h in range(1000, 1024)]
    workers = [f"worker-{i}" for i in range(8)]
    assert len({hashed_group(w, G) for w in workers}) > 2
    stores = _split_stores()
    indexers = {k: SglangIndexer(s, "m") for k, s in stores.items()}
    now = time.time()
    for i, w in enumerate(workers):
        actions = [pb.ExternalKvAction(type=pb.ACTION_REPORT, tier=pb.TIER_HBM, hashes=chain[:2 * (i + 1)])]
        batch = EventBatch(1, "m", w, 0, 1, 0, now, now, 0, action_events(actions),
                           replica_group=hashed_group(w, G))
        for k in stores:
            stores[k].apply(batch, 2.0)
            indexers[k].addresses[w] = f"http://{w}:30000"
    app_b = create_app(stores["b"])
    add_sglang_peer_route(app_b, {"m": indexers["b"]})
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        with ServerThread(app_b) as b:
            directory = PeerDirectory("a")
            directory.add_static(b, frozenset({2, 3}))
            indexers["a"].remote = remote_prefix(Fanout(directory, timeout_s=5.0), "m", loop)
            for n in (3, 9, 24):
                req = pb.MatchExternalKvPrefixRequest(hashes=chain[:n])
                want = indexers["full"].match_prefix(req)
                got = indexers["a"].match_prefix(req)
                assert got == want and len(want.matches) == min(8, len(workers)), (n, got, want)
                assert indexers["a"].match_prefix(req, frozenset()) != want  # a alone: half the workers
            with httpx.Client() as c:  # the peer route's own checks
                r = c.post(f"{b}/internal/sglang/m/match_prefix?local=1&groups=x", content=b"")
                assert r.status_code == 422
                r = c.post(f"{b}/internal/sglang/other/match_prefix?local=1", content=b"")
                assert r.status_code == 404
    finally:
        loop.call_soon_threadsafe(loop.stop)
