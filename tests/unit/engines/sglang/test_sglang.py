"""The SGLang adapter: wire decoding (both encodings), the mirror's rules, conformance fixtures per
checked version, live ZMQ (replay with and without the topic frame) and shadow agreement.

Regenerate the conformance fixtures with `python -m tests.test_sglang --regen` (they come from
kvidx/engines/sglang/sim.py, which follows SGLang's own serialization rules; see each header).
"""

from __future__ import annotations

import base64
import json
import random
import sys
import time
from typing import Any, Optional, Union

import msgspec
import pytest

from kvidx.core import walk
from kvidx.core.hashing import prompt_hashes
from kvidx.core.shard import ModelShard
from kvidx.engines import RelayOptions
from kvidx.engines.contract import Frame
from kvidx.engines.recording import frame_to_line
from kvidx.engines.sglang.mirror import SglangMirror
from kvidx.engines.sglang.relay import SglangPublisherRelay, make_relay
from kvidx.engines.sglang.sim import SimSglangEngine
from kvidx.engines.sglang.wire import (
    PY_EMPTY_TUPLE_HASH,
    SUPPORTED_VERSIONS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    UnsupportedEngineVersion,
    VersionMismatch,
    decode_payload,
)
from kvidx.shadow import run_shadow_engine, shadow
from kvidx.sim.prompts import workload_requests
from schemas.events import BlocksRemoved, BlocksStored, ReplicaCleared
from tests.helpers import FIXTURES

MAP_VERSIONS = ("0.5.22", "0.5.23")  # salts published (and LoRA names in 0.5.23)


# ---- SGLang's own structs, as declared in sglang/srt/disaggregation/kv_events.py ----------------
# 0.5.23 l. 233-300: batch array (no omit_defaults), events tagged maps with omitted defaults
class _EB23(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None  # noqa: UP045 (as SGLang writes it)


class _Ev23(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored23(_Ev23, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]  # noqa: UP045
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]  # noqa: UP045
    medium: Optional[str] = None  # noqa: UP045
    cache_salt: Optional[str] = None  # noqa: UP045
    session_id: Optional[str] = None  # noqa: UP045
    lora_name: Optional[str] = None  # noqa: UP045


class BlockRemoved23(_Ev23, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None  # noqa: UP045


# 0.5.10 l. 37-95: batch and events arrays (omit_defaults), events tagged (tag first)
class _EB10(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None  # noqa: UP045


class _Ev10(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored10(_Ev10, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]  # noqa: UP045
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]  # noqa: UP045
    medium: Optional[str] = None  # noqa: UP045


class BlockRemoved10(_Ev10, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None  # noqa: UP045


class AllBlocksCleared10(_Ev10, tag="AllBlocksCleared"):
    pass


# repository commit 006d053 (an older build): `[ts, events]` without a rank
class _EBold(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[BlockStored10, BlockRemoved10]]  # noqa: UP007


enc = msgspec.msgpack.Encoder()
NEG = -(1 << 63) + 5  # signed int64 hashes: about half are negative


def test_decode_map_0523_signed_hashes_omitted_defaults():
    payload = enc.encode(_EB23(1.5, [
        BlockStored23([NEG, 7], None, list(range(32)), 16, None, "GPU", cache_salt="s"),
        BlockRemoved23([NEG], "CPU_PINNED")], 2))
    raw = msgspec.msgpack.decode(payload)
    assert raw[2] == 2 and raw[1][0]["type"] == "BlockStored" and "lora_name" not in raw[1][0]
    assert list(raw[1][0])[:6] == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                                   "lora_id"]
    b = decode_payload(payload, "map")
    assert b.data_parallel_rank == 2 and b.ts == 1.5
    st, rm = b.events
    assert st.block_hashes == [NEG, 7] and st.cache_salt == "s" and st.lora_name is None
    assert rm.medium == "CPU_PINNED" and rm.block_hashes == [NEG]
    # the rank slot is always there in 0.5.23 (no omit_defaults on the batch), even as nil
    assert decode_payload(enc.encode(_EB23(1.0, [])), "map").data_parallel_rank is None


def test_decode_positional_with_and_without_rank_and_medium():
    evs = [BlockStored10([NEG], 3, [1, 2], 2, None, "GPU"), BlockRemoved10([NEG], "GPU"),
           AllBlocksCleared10()]
    p10 = enc.encode(_EB10(2.0, evs, 0))
    raw = msgspec.msgpack.decode(p10)
    assert raw[1][0][0] == "BlockStored" and len(raw) == 3
    b = decode_payload(p10, "positional")
    assert isinstance(b.events[2], AllBlocksCleared) and b.events[0].parent_block_hash == 3
    assert b.data_parallel_rank == 0
    # <= 0.5.3: no medium; oldest builds: `[ts, events]`
    old = enc.encode(_EBold(3.0, [BlockStored10([5], PY_EMPTY_TUPLE_HASH, [1], 1, None)]))
    assert len(msgspec.msgpack.decode(old)) == 2
    b = decode_payload(old, "positional")
    assert b.data_parallel_rank is None and b.events[0].medium is None


def test_version_pinning_and_bad_input():
    with pytest.raises(UnsupportedEngineVersion, match="supported: 0.4.9.post6"):
        make_relay("m", "r", 16, engine_version="0.6.1")
    assert "0.5.23" in SUPPORTED_VERSIONS
    p10 = enc.encode(_EB10(2.0, [BlockStored10([1], None, [1, 2], 2, None, "GPU")], 0))
    with pytest.raises(VersionMismatch):
        decode_payload(p10, "map")
    relay = make_relay("m", "r", 2, engine_version="0.5.23", epoch=0)
    out = relay.on_frame(Frame(b"kv", 0, p10, 1, "e"))
    assert [d.reason for d in out.dead] == ["version_mismatch"]
    out = relay.on_frame(Frame(b"kv", 1, b"\xc1garbage", 2, "e"))
    assert [d.reason for d in out.dead] == ["malformed_payload"]
    # a bad event costs that event only: it is set aside, its batch goes out
    too_big = enc.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1 << 63]}], 0])
    out = relay.on_frame(Frame(b"kv", 2, too_big, 3, "e"))
    assert not out.dead and [(d.reason, d.event) for d in out.set_aside] == [("undecodable_event", "removed")]
    wrong = enc.encode(_EB23(1.0, [BlockStored23([1, 2], None, [1, 2, 3], 2, None)], 0))
    out = relay.on_frame(Frame(b"kv", 3, wrong, 4, "e"))
    assert not out.dead and [d.reason for d in out.set_aside] == ["short_token_ids"]
    # the relay went on: seq 4 is accepted, a jump is a gap, seq 0 again is a restart
    ok = enc.encode(_EB23(1.0, [BlockStored23([1], None, [1, 2], 2, None, "GPU")], 0))
    assert relay.on_frame(Frame(b"kv", 4, ok, 5, "e")).batches
    assert relay.on_frame(Frame(b"kv", 9, ok, 6, "e")).gap == (5, 9)
    out = relay.on_frame(Frame(b"kv", 0, ok, 7, "e"))
    assert isinstance(out.batches[0].events[0], ReplicaCleared)


# ---- mirror rules ---------------------------------------------------------------------------------
def _st(hashes, parent, tokens, P, **kw):
    return BlockStored(hashes, parent, tokens, P, None, kw.pop("medium", "GPU"), **kw)


def test_removal_lists_several_nodes_leaf_first():
    m = SglangMirror(4)
    a, b, c = list(range(8)), list(range(8, 12)), list(range(20, 24))
    m.apply([_st([1, 2], None, a, 4), _st([3], 2, b, 4), _st([4], 2, c, 4)])
    full_b, full_c = prompt_hashes(a + b, 4), prompt_hashes(a + c, 4)
    assert m.cached_index_blocks() == set(full_b) | set(full_c)
    # one event: node [4] (leaf), node [3] (leaf), then their parent node [1, 2]: not one chain
    out = m.apply([BlockRemoved([4, 3, 1, 2], "GPU")])
    assert len(out) == 1 and isinstance(out[0], BlocksRemoved)
    assert set(out[0].hashes) == set(full_b) | set(full_c) and not m.cached_index_blocks()
    assert m.stats["remove_unknown"] == 0


def test_page_size_one_aggregates_into_index_blocks():
    m = SglangMirror(4)
    toks = [9, 8, 7, 6, 5, 4, 3]
    hs = list(range(100, 107))
    out = m.apply([_st(hs[:3], None, toks[:3], 1)])
    # 3 of the 4 pages of index block 0: no block, an open tail of 3 tokens (a partial key each)
    assert [e.tail for e in out] == [True] and len(out[0].hashes) == 3 and not m.cached_index_blocks()
    out = m.apply([_st(hs[3:], 102, toks[3:], 1)])  # a second node continues mid-index-block
    assert m.cached_index_blocks() == set(prompt_hashes(toks, 4))
    assert isinstance(out[0], BlocksStored) and out[0].depth == 0 and out[0].parent is None
    # block 0 is full and alone: its prefixes are no longer keyed; block 1 is an open tail of 3
    assert {len(e.hashes) for e in out if isinstance(e, BlocksRemoved) and e.tail} == {3}
    assert sorted(m.tails.published()["GPU"]) == sorted(prompt_hashes(toks, 4, tails=True).tail_keys(1))
    # evicting the leaf node's pages (tip first) retracts the index block its pages completed
    out = m.apply([BlockRemoved(hs[3:][::-1], "GPU")])
    assert out[0].hashes == prompt_hashes(toks, 4) and not m.cached_index_blocks()
    assert sorted(m.tails.published()["GPU"]) == sorted(prompt_hashes(toks, 4, tails=True).tail_keys(0)[:3])
    # the same tokens stored again under the surviving parent come back
    m.apply([_st(hs[3:], 102, toks[3:], 1)])
    assert m.cached_index_blocks() == set(prompt_hashes(toks, 4))


def test_page_larger_than_index_block_and_size_rules():
    m = SglangMirror(4)
    toks = list(range(16))
    m.apply([_st([1], None, toks, 16)])
    assert m.cached_index_blocks() == set(prompt_hashes(toks, 4))
    m16 = SglangMirror(16)
    assert m16.apply([_st([1], None, list(range(24)), 24)]) == []
    assert [a.reason for a in m16.set_aside] == ["block_size_mismatch"]


def test_salt_lora_and_tiers_namespace_like_the_router():
    m = SglangMirror(2)
    toks = [1, 2, 3, 4, 5, 6]
    ns = {"cache_salt": "s", "lora_name": "ad"}
    m.apply([_st([1, 2], None, toks[:4], 2, **ns), _st([3], 2, toks[4:], 2, **ns)])
    assert m.cached_index_blocks() == set(prompt_hashes(toks, 2, "ad", "s"))
    assert not set(prompt_hashes(toks, 2)) & m.cached_index_blocks()
    # host tier (CPU_PINNED) is mirrored on its own
    m.apply([_st([7], None, [1, 2], 2, medium="CPU_PINNED")])
    assert m.cached_index_blocks("CPU") == set(prompt_hashes([1, 2], 2))
    out = m.apply([BlockRemoved([7], "CPU_PINNED")])
    assert out[0].tier == "CPU" and m.cached_index_blocks("GPU")
    out = m.apply([AllBlocksCleared()])
    assert isinstance(out[0], ReplicaCleared) and not m.cached_index_blocks()


def test_two_namespaces_with_one_published_hash_are_counted_and_orphans_skipped():
    m = SglangMirror(2)
    m.apply([_st([1], None, [1, 2], 2), _st([1], None, [1, 2], 2)])  # e.g. an unpublished extra_key
    assert m.apply([BlockRemoved([1], "GPU")]) == []  # one copy left
    assert m.cached_index_blocks() and m.apply([BlockRemoved([1], "GPU")])[0].hashes
    m.apply([_st([5], 999, [3, 4], 2)])
    assert m.stats["orphan_blocks"] == 1
    legacy = SglangMirror(2, root_parents=(PY_EMPTY_TUPLE_HASH,))
    legacy.apply([_st([5], PY_EMPTY_TUPLE_HASH, [3, 4], 2)])  # <= 0.5.3: root child's parent hash(())
    assert legacy.cached_index_blocks() == set(prompt_hashes([3, 4], 2))


# ---- the simulator follows SGLang's serialization -----------------------------------------------
def test_sim_payloads_are_sglangs_encoding():
    e = SimSglangEngine(64, 4, "0.5.23", endpoint=None, clock=lambda: 1.0)
    e.serve(list(range(10)), [50, 51, 52], cache_salt="s")
    b = msgspec.msgpack.decode(e.published[0][2], type=_EB23)
    ev = b.events[0]
    again = enc.encode(_EB23(1.0, [BlockStored23(**{k: v for k, v in ev.items() if k != "type"})], 0))
    assert e.published[0][2] == again  # byte for byte what SGLang's structs encode
    e10 = SimSglangEngine(64, 4, "0.5.10", endpoint=None, clock=lambda: 1.0)
    e10.serve(list(range(10)), [50])
    b = msgspec.msgpack.decode(e10.published[0][2], type=_EB10)
    re = enc.encode(_EB10(1.0, [BlockStored10(*ev[1:]) for ev in b.events], 0))
    assert e10.published[0][2] == re and len(b.events) == 2  # one event per page before 0.5.22


# ---- conformance fixtures ------------------------------------------------------------------------
FIXTURE_CASES = {  # version -> (page size, index block size)
    "0.4.9.post6": (4, 4), "0.5.3": (16, 16), "0.5.10": (16, 16), "0.5.22": (16, 16), "0.5.23": (1, 4),
}
HEADER = {
    "0.4.9.post6": "sglang 0.4.9.post6 wheel: srt/disaggregation/kv_events.py l. 37-71 (positional "
                   "arrays, tag first; [ts, events, attn_dp_rank]); srt/mem_cache/radix_cache.py l. 395-410 "
                   "(_split_node: remove child, store prefix, store child), l. 497-538 (hash(tuple(page)), "
                   "root child parent hash(()), one event per page); replay without topic frame (l. 300-311)",
    "0.5.3": "sglang 0.5.3 wheel: kv_events.py l. 37-71 (as 0.4.9.post6); radix_cache.py l. 552-565, "
             "652-695 (RadixKey pages, hash(tuple(page)), split events)",
    "0.5.10": "sglang 0.5.10 wheel: kv_events.py l. 37-95 (positional arrays with trailing medium "
              "'GPU'/'CPU_PINNED'); radix_cache.py l. 832-891 (one event per page; sha256 chain, "
              "hicache_storage.py get_hash_str l. 17-32, hash_str_to_int64 signed); no split events",
    "0.5.22": "sglang 0.5.22 wheel: kv_events.py l. 233-300 (maps tagged by type, omitted defaults; "
              "[ts, events, attn_dp_rank]); mem_cache/events.py enqueue (chains and removals merged), "
              "record_remove (one per node); default format publishes hashes unchanged (no lora_name)",
    "0.5.23": "sglang 0.5.23 wheel: kv_events.py l. 233-300, l. 307-340 (namespaced_block_hash); "
              "mem_cache/events.py l. 140-303 (enqueue, salt-seeded event chain via utils.py l. 178-214, "
              "LoRA namespace and lora_name, cache_salt on stores); page size 1 = one hash per token",
}


def _scenario(version: str, P: int) -> tuple[SimSglangEngine, list[dict]]:
    clock = iter(range(10**6))
    eng = SimSglangEngine(num_pages=96 // P, page_size=P, version=version, endpoint=None,
                          clock=lambda: 1000.0 + next(clock))
    rng = random.Random(7)
    sys_p = [rng.randrange(500) for _ in range(21)]
    reqs = []
    for i in range(14):
        prompt = sys_p + [rng.randrange(500) for _ in range(rng.randint(3, 30))]
        salt = "tenant-a" if version in MAP_VERSIONS and i % 4 == 1 else None
        lora = "adapter-x" if version == "0.5.23" and i % 5 == 2 else None
        eng.serve(prompt, [rng.randrange(500) for _ in range(5)], cache_salt=salt, lora_name=lora)
        reqs.append({"prompt_token_ids": prompt, "cache_salt": salt, "lora": lora})
    return eng, reqs


def _expected_blocks(eng: SimSglangEngine, ibs: int) -> list[int]:
    """Canonical index blocks of every radix path (from the engine's tree, not from the mirror)."""
    out: set[int] = set()
    names = eng.lora_names
    stack = [(n, list(n.key)) for n in eng.root.children.values()]
    while stack:
        node, path = stack.pop()
        lora = names.get(node.ns[0]) if eng.version == "0.5.23" else None
        salt = node.ns[1] if eng.version in MAP_VERSIONS else None
        out.update(prompt_hashes(path, ibs, lora, salt))
        stack += [(c, path + c.key) for c in node.children.values()]
    return sorted(out)


def build_fixture(version: str) -> dict:
    P, ibs = FIXTURE_CASES[version]
    eng, reqs = _scenario(version, P)
    lookups = []
    for r in reqs[-6:] + [{"prompt_token_ids": list(range(40)), "cache_salt": None, "lora": None}]:
        toks = r["prompt_token_ids"]
        reused = eng.cached_tokens_of(toks, r["cache_salt"], r["lora"])
        whole = eng.cached_tokens_of(toks, r["cache_salt"], r["lora"], cap=False)
        # the index sees whole index blocks of the cached prefix, then the engine's own cap and page
        credited = min(whole // ibs * ibs, len(toks) - 1) // P * P
        assert credited <= reused
        lookups.append({**r, "engine_reuses": reused, "credited": credited})
    return {
        "header": {"engine": "sglang", "engine_version": version,
                   "generated_by": "kvidx/engines/sglang/sim.py", "serialization": HEADER[version],
                   "rules": "engine_reuses = the engine's match (at most len-1 tokens, page-aligned); "
                            "credited "
                            "= the whole index blocks of its cached prefix, capped at len-1 and rounded "
                            "down to a page; expected_index_blocks = canonical blocks of every radix path"},
        "page_size": P, "index_block_size": ibs,
        "frames": [{"seq": s, "topic_b64": "a3Y=", "payload_b64": base64.b64encode(p).decode()}
                   for s, _ts, p in eng.published],
        "expected_index_blocks": [str(h) for h in _expected_blocks(eng, ibs)],
        "lookups": lookups,
    }


def _replay(fx: dict, version: str) -> tuple[SglangPublisherRelay, ModelShard]:
    relay = make_relay("m", "r", fx["index_block_size"], engine_version=version, epoch=1)
    shard = ModelShard("m", fx["index_block_size"])
    for i, f in enumerate(fx["frames"]):
        out = relay.on_frame(Frame(base64.b64decode(f["topic_b64"]), f["seq"],
                                   base64.b64decode(f["payload_b64"]), i + 1, "r"))
        assert not out.dead and out.gap is None
        for b in out.batches:
            shard.apply(b, 0.0)
    return relay, shard


@pytest.mark.parametrize("version", sorted(FIXTURE_CASES))
def test_conformance_fixture(version):
    path = FIXTURES / f"sglang-{version}" / "conformance.json"
    fx = json.loads(path.read_text())
    assert fx["header"]["engine_version"] == version
    assert build_fixture(version)["frames"] == fx["frames"]  # the simulator still writes these bytes
    relay, shard = _replay(fx, version)
    assert sorted(relay.mirror.cached_index_blocks()) == sorted(int(h) for h in fx["expected_index_blocks"])
    for lk in fx["lookups"]:
        toks = lk["prompt_token_ids"]
        hashes = prompt_hashes(toks, fx["index_block_size"], lk["lora"], lk["cache_salt"])
        assert walk.credited(shard, hashes, len(toks)) == lk["credited"], lk


# ---- live ZMQ: PUB + replay, with (0.5.23) and without (0.5.10) the topic frame ------------------
@pytest.mark.parametrize("version", ["0.5.23", "0.5.10"])
def test_live_publisher_and_replay(version):
    from relays.zmq_source import ZmqSource
    with SimSglangEngine(64, 4, version, endpoint="tcp://127.0.0.1:*",
                         replay_endpoint="tcp://127.0.0.1:*") as eng:
        src = ZmqSource(eng.endpoint, eng.replay_endpoint)
        try:
            time.sleep(0.2)
            eng.serve(list(range(20)), [1, 2, 3])
            got = []
            for f in src.frames(0.2):
                if f is None:
                    break
                got.append(f)
            replayed = src.replay(0)
            assert replayed is not None and [f.seq for f in replayed] == list(range(eng.next_seq))
            assert [f.payload for f in replayed] == [p for _s, _t, p in eng.published]
            assert [f.payload for f in got] == [p for _s, _t, p in eng.published]
            relay = make_relay("m", "r", 4, engine_version=version, epoch=0)
            for f in replayed:
                assert relay.on_frame(f).batches
            assert relay.mirror.cached_index_blocks() == set(prompt_hashes(list(range(20)) + [1, 2], 4))
        finally:
            src.close()


# ---- shadow agreement on generated recordings ----------------------------------------------------
def _recording(version: str, P: int, n: int = 300, seed: int = 3, namespaces: bool = True):
    t = [1000.0]

    def clock() -> float:
        t[0] += 0.001
        return t[0]

    eng = SimSglangEngine(num_pages=1500 // P, page_size=P, version=version, endpoint=None, clock=clock)
    rng = random.Random(seed)
    reqs = []
    for i, (p, o) in enumerate(workload_requests(seed, n)):
        salt = rng.choice([None, None, "s1"]) if namespaces and version in MAP_VERSIONS else None
        lora = rng.choice([None, None, "ad1"]) if namespaces and version == "0.5.23" else None
        ts = clock()
        reused = eng.serve(p, o, cache_salt=salt, lora_name=lora)
        reqs.append({"i": i, "t_send": ts + 5e-7, "prompt_token_ids": p, "cached_tokens": reused,
                     "cache_salt": salt, "lora": lora})
    frames = [Frame(b"kv", s, pl, int(ts * 1e9), "tcp://sim:5557", "pub") for s, ts, pl in eng.published]
    return eng, frames, reqs


def _factory(version):
    return lambda m, e, b: SglangPublisherRelay(m, e, b, engine_version=version, epoch=0)


@pytest.mark.parametrize("version,P", [("0.5.23", 16), ("0.5.23", 32), ("0.5.22", 16), ("0.5.10", 16),
                                       ("0.5.3", 16)])
def test_shadow_exact_when_pages_are_index_blocks_or_multiples(version, P):
    eng, frames, reqs = _recording(version, P)
    ag, idx = shadow(frames, reqs, "m", 16, relay_factory=_factory(version))
    s = ag.summary()
    assert s["exact_requests"] == s["requests"] == 300, ag.mismatches
    assert s["reused_tokens"] > 0.25 * s["prompt_tokens"] and idx.dead_letters == 0
    mirror = next(iter(idx.relays.values())).mirror
    assert mirror.stats["removed"] > 100 and mirror.stats["remove_unknown"] == 0


@pytest.mark.parametrize("version,P", [("0.5.23", 1), ("0.5.23", 4), ("0.4.9.post6", 8)])
def test_shadow_small_pages_credit_to_the_page(version, P):
    """Pages below the index block: whole index blocks plus the partial-block keys (open tails and
    branches inside a block), never more than the engine reuses; what is left is prompts leaving a
    block inside it where only one cached path reaches it (shared system prompts of any length)."""
    _eng, frames, reqs = _recording(version, P, n=200)
    ag, _idx = shadow(frames, reqs, "m", 16, relay_factory=_factory(version))
    assert ag.over_tokens == 0
    assert sum(r["cached_tokens"] // 16 * 16 for r in reqs) < ag.credited_tokens <= ag.reused_tokens
    s = ag.summary()
    assert s["recall"] > 0.97


def test_shadow_engine_sglang_on_a_recording(tmp_path):
    _eng, frames, reqs = _recording("0.5.23", 16, n=60)
    rec, rq = tmp_path / "frames.jsonl", tmp_path / "requests.jsonl"
    rec.write_text("".join(frame_to_line(f) + "\n" for f in frames))
    rq.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    res, _ = run_shadow_engine("sglang", rec, rq, index_block_size=16,
                               options=RelayOptions(engine_version="0.5.23"))
    assert res.agreement.summary()["exact_requests"] == 60
    with pytest.raises(UnsupportedEngineVersion):
        run_shadow_engine("sglang", rec, rq, options=RelayOptions(engine_version="0.7"))


if __name__ == "__main__" and "--regen" in sys.argv:
    for v in FIXTURE_CASES:
        d = FIXTURES / f"sglang-{v}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "conformance.json").write_text(json.dumps(build_fixture(v), indent=1) + "\n")
        print("wrote", d)
