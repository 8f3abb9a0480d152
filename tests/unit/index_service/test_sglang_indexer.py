"""SGLang's external-indexer gRPC API on kvidx's index, over real gRPC: the bridges' feed
(ApplyExternalKvBatch: report, revoke, clear a tier), the router's prefix query, placement matches and
hit counts, SGLang's checks and status codes; an SGLang engine's own traffic relayed by kvidx (router
keys) answers the router's hashes like the canonical index; the generated protobuf module is current."""

from __future__ import annotations

import base64
import filecmp
import json
import subprocess
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from index_service.guard import EndpointAllowList
from index_service.sglang_indexer import SglangIndexer, start_server
from index_service.sglang_pb import kv_indexer_pb2 as pb
from index_service.store import ShardStore
from kvidx.core.hashing import prompt_hashes
from kvidx.engines.contract import Frame
from kvidx.engines.sglang.hashing import sglang_page_hashes
from kvidx.engines.sglang.relay import make_relay
from tests.helpers import SglangClient as Client
from tests.helpers import sglang_action as act
from tests.helpers import sglang_matches as matches

ROOT = Path(__file__).resolve().parents[3]
# SGLang's published vectors (sgl-router kv_events::hash cross-language tests): chain of [10..80], page 2
# the workers' addresses these tests use (http://a:30000 ...): host names, not in the default allow-list
TEST_HOSTS = EndpointAllowList(["a", "b", "c", "10.0.0.0/8"])
CHAIN = [str(h) for h in (978178666101069530, -895308556211281782, -8033692805846017938, 835415944263129316)]


@pytest.fixture()
def served():
    store = ShardStore(16)
    store.ready = True
    kept = []
    indexer = SglangIndexer(store, "qwen", store.apply, kept.append, allow=TEST_HOSTS)
    server, port = start_server(indexer, "127.0.0.1:0", workers=2)
    client = Client(port)
    try:
        yield indexer, client, kept
    finally:
        client.channel.close()
        server.stop(0)


def test_feed_then_prefix_matches_like_sglangs_indexer(served):
    indexer, c, kept = served
    c.apply("a", [act(pb.ACTION_REPORT, pb.TIER_HBM, CHAIN)])
    c.apply("b", [act(pb.ACTION_REPORT, pb.TIER_HBM, CHAIN[:1]),
                  act(pb.ACTION_REPORT, pb.TIER_DRAM, CHAIN[1:2])])
    c.apply("c", [act(pb.ACTION_REPORT, pb.TIER_SSD, CHAIN[1:])])  # no first block: no prefix
    r = c.prefix(CHAIN)
    assert matches(r) == [("a", 4, "http://a:30000"), ("b", 2, "http://b:30000")]
    assert (r.best_prefix_blocks, r.blocks_read) == (4, 4)
    r = c.prefix(CHAIN, max_blocks=1)
    assert matches(r) == [("a", 1, "http://a:30000"), ("b", 1, "http://b:30000")] and r.blocks_read == 1
    assert matches(c.prefix(["17"] + CHAIN)) == [] and c.prefix(["17"]).best_prefix_blocks == 0

    c.apply("a", [act(pb.ACTION_REVOKE, pb.TIER_HBM, CHAIN[2:3])], seq=2)  # a hole: the prefix stops
    assert matches(c.prefix(CHAIN))[0] == ("a", 2, "http://a:30000")
    c.apply("b", [act(pb.ACTION_CLEAR_ALL_AT_TIER, pb.TIER_DRAM)], seq=2)  # only b's DRAM blocks go
    assert ("b", 1, "http://b:30000") in matches(c.prefix(CHAIN))
    c.apply("a", [act(pb.ACTION_CLEAR_ALL_AT_TIER, pb.TIER_HBM)], seq=3)
    assert [m[0] for m in matches(c.prefix(CHAIN))] == ["b"]

    # the address: every batch sets it, an empty one makes the worker unroutable (left out)
    assert [(w.worker_id, w.address) for w in kept] == [("a", "http://a:30000"), ("b", "http://b:30000"),
                                                        ("c", "http://c:30000")]
    c.apply("b", [], address="")
    assert matches(c.prefix(CHAIN)) == [] and kept[-1].address == ""
    c.apply("b", [], address="http://10.0.0.2:30000")
    assert matches(c.prefix(CHAIN)) == [("b", 1, "http://10.0.0.2:30000")]


def test_placement_matches_and_hit_counts(served):
    _, c, _ = served
    c.apply("a", [act(pb.ACTION_REPORT, pb.TIER_HBM, CHAIN[:2]),
                  act(pb.ACTION_REPORT, pb.TIER_SSD, CHAIN[3:])])
    c.apply("b", [act(pb.ACTION_REPORT, pb.TIER_DRAM, CHAIN[1:2])])
    req = pb.MatchExternalKvRequest(hashes=CHAIN + ["99"], count_as_hit=True)
    r = c.call("MatchExternalKv", req, pb.MatchExternalKvResponse)
    got = {m.worker_id: (m.address, {t.tier: list(t.hashes) for t in m.hashes_by_tier}) for m in r.matches}
    assert got == {"a": ("http://a:30000", {pb.TIER_HBM: CHAIN[:2], pb.TIER_SSD: CHAIN[3:]}),
                   "b": ("http://b:30000", {pb.TIER_DRAM: CHAIN[1:2]})}
    c.call("MatchExternalKv", pb.MatchExternalKvRequest(hashes=CHAIN[:1], count_as_hit=True),
           pb.MatchExternalKvResponse)
    c.call("MatchExternalKv", pb.MatchExternalKvRequest(hashes=CHAIN[:1]),  # not counted
           pb.MatchExternalKvResponse)
    counts = c.call("GetExternalKvHitCounts", pb.GetExternalKvHitCountsRequest(hashes=CHAIN + ["99"]),
                    pb.GetExternalKvHitCountsResponse)
    assert {e.hash: e.hit_count_total for e in counts.entries} == {
        CHAIN[0]: 2, CHAIN[1]: 1, CHAIN[3]: 1}  # never-matched hashes are left out, as SGLang does


@pytest.mark.parametrize("method, request_, code, text", [
    ("MatchExternalKvPrefix", pb.MatchExternalKvPrefixRequest(), grpc.StatusCode.INVALID_ARGUMENT,
     "hashes must not be empty"),
    ("MatchExternalKvPrefix", pb.MatchExternalKvPrefixRequest(hashes=["1", ""]),
     grpc.StatusCode.INVALID_ARGUMENT, "hashes must not contain empty values"),
    ("MatchExternalKv", pb.MatchExternalKvRequest(hashes=["1"] * 16_385), grpc.StatusCode.RESOURCE_EXHAUSTED,
     "request contains 16385 hashes; maximum is 16384"),
    ("ApplyExternalKvBatch", pb.ApplyExternalKvBatchRequest(actions=[]), grpc.StatusCode.INVALID_ARGUMENT,
     "worker_id must not be empty"),
    ("ApplyExternalKvBatch", pb.ApplyExternalKvBatchRequest(worker_id="a",
                                                            actions=[act(pb.ACTION_REPORT, 0, ["1"])]),
     grpc.StatusCode.INVALID_ARGUMENT, "tier must not be TIER_UNKNOWN"),
    ("ApplyExternalKvBatch", pb.ApplyExternalKvBatchRequest(worker_id="a",
                                                            actions=[act(0, pb.TIER_HBM, ["1"])]),
     grpc.StatusCode.INVALID_ARGUMENT, "action type is not supported"),
    ("ApplyExternalKvBatch", pb.ApplyExternalKvBatchRequest(worker_id="a", actions=[act(pb.ACTION_REVOKE,
                                                                                        pb.TIER_HBM)]),
     grpc.StatusCode.INVALID_ARGUMENT, "hashes must not be empty"),
    ("ApplyExternalKvBatch", pb.ApplyExternalKvBatchRequest(
        worker_id="a", actions=[act(pb.ACTION_CLEAR_ALL_AT_TIER, pb.TIER_HBM)] * 257),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "batch contains 257 actions; maximum is 256"),
])
def test_sglangs_checks_and_status_codes(served, method, request_, code, text):
    _, c, _ = served
    reply = {"MatchExternalKvPrefix": pb.MatchExternalKvPrefixResponse,
             "MatchExternalKv": pb.MatchExternalKvResponse,
             "ApplyExternalKvBatch": pb.ApplyExternalKvBatchResponse}[method]
    with pytest.raises(grpc.RpcError) as e:
        c.call(method, request_, reply)
    assert (e.value.code(), e.value.details()) == (code, text)


def test_relayed_sglang_engine_answers_the_routers_hashes():
    """An SGLang engine's traffic (the 0.5.22 conformance recording, pages of 16) relayed by kvidx with
    router keys: for every unsalted prompt, the prefix the router's own hashes find is the GPU prefix
    the canonical index holds, and it covers what the engine reused."""
    fx = json.loads((ROOT / "tests/fixtures/sglang-0.5.22/conformance.json").read_text())
    P = fx["page_size"]
    store = ShardStore(P)
    store.ready = True
    relay = make_relay("qwen", "http://w0:30000", P, engine_version="0.5.22", epoch=1, router_keys=True)
    for i, f in enumerate(fx["frames"]):
        out = relay.on_frame(Frame(base64.b64decode(f["topic_b64"]), f["seq"],
                                   base64.b64decode(f["payload_b64"]), i + 1, "w0"))
        for b in out.batches:
            store.apply(b)
    server, port = start_server(SglangIndexer(store, "qwen"), "127.0.0.1:0", workers=1)
    c = Client(port)
    try:
        shard = store.shards["qwen"]
        checked = 0
        for lk in fx["lookups"]:
            toks = lk["prompt_token_ids"]
            if lk["cache_salt"] or lk["lora"] or len(toks) < P:
                continue
            canonical = shard.groups[0].tiers[0].walk(prompt_hashes(toks, P)).get(0, 0)
            got = matches(c.prefix([str(h) for h in sglang_page_hashes(toks, P)]))
            assert got == ([("http://w0:30000", canonical, "http://w0:30000")] if canonical else []), lk
            assert canonical * P >= lk["engine_reuses"]
            checked += canonical > 0
        assert checked >= 3
    finally:
        c.channel.close()
        server.stop(0)


def test_checked_in_protobuf_module_is_what_the_generator_makes(tmp_path):
    subprocess.run(["bash", str(ROOT / "scripts/gen_protos.sh"), str(tmp_path)], check=True, cwd=ROOT)
    assert filecmp.cmp(tmp_path / "kv_indexer_pb2.py", ROOT / "index_service/sglang_pb/kv_indexer_pb2.py",
                       shallow=False)


# ---- property: the feed and the queries against SGLang's semantics, written out as a reference -------
WORKERS, TIERS, HASHES = ["a", "b", "c"], [pb.TIER_HBM, pb.TIER_DRAM, pb.TIER_SSD], [str(h) for h in range(8)]
_action = st.one_of(
    st.tuples(st.sampled_from([pb.ACTION_REPORT, pb.ACTION_REVOKE]), st.sampled_from(TIERS),
              st.lists(st.sampled_from(HASHES), min_size=1, max_size=5)),
    st.tuples(st.just(pb.ACTION_CLEAR_ALL_AT_TIER), st.sampled_from(TIERS), st.just([])))
_batch = st.tuples(st.sampled_from(WORKERS), st.lists(_action, max_size=4))


class Reference:
    """SGLang's in-memory indexer, reduced to its semantics (sgl-kv-indexer service.rs and backend):
    per (worker, tier) the hashes reported and not revoked or cleared."""

    def __init__(self):
        self.held: dict[tuple[str, int], set[str]] = {}

    def apply(self, worker, actions) -> None:
        for kind, tier, hashes in actions:
            s = self.held.setdefault((worker, tier), set())
            if kind == pb.ACTION_REPORT:
                s.update(hashes)
            elif kind == pb.ACTION_REVOKE:
                s.difference_update(hashes)
            else:
                s.clear()

    def prefix(self, hashes) -> list[tuple[str, int]]:
        out = []
        for w in WORKERS:
            held = set().union(*(self.held.get((w, t), set()) for t in TIERS))
            n = 0
            while n < len(hashes) and hashes[n] in held:
                n += 1
            if n:
                out.append((w, n))
        return sorted(out, key=lambda x: (-x[1], x[0]))

    def placement(self, hashes) -> dict:
        out = {}
        for w in WORKERS:
            tiers = {t: [h for h in hashes if h in self.held.get((w, t), set())] for t in TIERS}
            tiers = {t: hs for t, hs in tiers.items() if hs}
            if tiers:
                out[w] = tiers
        return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(_batch, max_size=12), query=st.lists(st.sampled_from(HASHES), min_size=1, max_size=8))
def test_feed_and_queries_follow_sglangs_semantics(batches, query):
    store = ShardStore(16)
    store.ready = True
    indexer = SglangIndexer(store, "m", store.apply, allow=EndpointAllowList(["any"]))
    ref = Reference()
    for worker, actions in batches:
        req = pb.ApplyExternalKvBatchRequest(worker_id=worker, worker_address=f"http://{worker}",
                                             actions=[act(k, t, h) for k, t, h in actions])
        indexer.apply(req)
        ref.apply(worker, actions)
    got = [(m.worker_id, m.matched_prefix_blocks)
           for m in indexer.match_prefix(pb.MatchExternalKvPrefixRequest(hashes=query)).matches]
    assert got == ref.prefix(query)
    placed = indexer.match(pb.MatchExternalKvRequest(hashes=query)).matches
    got_placement = {m.worker_id: {t.tier: list(t.hashes) for t in m.hashes_by_tier} for m in placed}
    assert got_placement == ref.placement(query)
