"""vLLM variants (kvidx/engines/vllm/mirror.py, wire.py; kvidx/engines/contract.py): version check, DP
ranks, LoRA / multimodal / cache-salt extra keys, offloading-connector CPU placeholders, one canonical
hash for every engine hash function and block size, speculative-decoding bigram pages, and the
generated conformance stream of tests/fixtures/vllm-variants/."""

from __future__ import annotations

import json
import os
import random
import sys

import pytest

from kvidx.core import walk
from kvidx.core.hashing import prompt_hashes
from kvidx.core.shard import ModelShard
from kvidx.core.spec_decode import SpecDecodeError, unpair_tokens
from kvidx.engines.contract import Frame, dp_endpoints, offset_endpoint
from kvidx.engines.recording import read_frames
from kvidx.engines.vllm.mirror import VllmMirror
from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.engines.vllm.wire import UnsupportedEngineVersion, check_engine_version, decode_payload
from relays.run import build_dp_relays
from schemas.events import BlocksRemoved, BlocksStored
from tests.helpers import FIXTURES

VARIANTS = FIXTURES / "vllm-variants"
sys.path.insert(0, str(VARIANTS))
import engine_wire as ew  # noqa: E402
import make_vllm_variants as make_variants  # noqa: E402

rng = random.Random(11)
T = [rng.randrange(1024) for _ in range(256)]


def _frame(payload: bytes, seq: int, endpoint: str = "tcp://e:5557") -> Frame:
    return Frame(b"kv", seq, payload, 1_000 + seq, endpoint)


def _stored(out) -> list[int]:
    return [h for e in out if isinstance(e, BlocksStored) for h in e.hashes]


# ---- version check -----------------------------------------------------------------------------
def test_version_check_pinned_and_clear_error():
    assert check_engine_version("0.32.0").encoding == "map"
    assert check_engine_version("v0.32.3").mm_extra_keys == "pair"
    assert check_engine_version("0.8.5").encoding == "positional"
    for bad in ("0.35.0", "1.0", "nightly", "", None, "0"):
        with pytest.raises(UnsupportedEngineVersion) as ei:
            check_engine_version(bad)
        assert "0.32" in str(ei.value) and "0.34" in str(ei.value)
    # one message: what changed and how to check it, and the documented way to run it anyway
    with pytest.raises(UnsupportedEngineVersion) as ei:
        check_engine_version("0.35.0")
    msg = str(ei.value)
    assert "kv_events.py from v0.34.0 to v0.35.0" in msg and "tests/conformance/run.sh vllm 0.35.0" in msg
    assert "--allow-unchecked-engine-version" in msg and "\n" not in msg
    assert check_engine_version("0.35.0", allow_unchecked=True) is check_engine_version("0.34.1")
    assert check_engine_version("0.29.0", allow_unchecked=True).encoding == "map"
    assert check_engine_version("0.20.0", allow_unchecked=True).encoding == "positional"
    with pytest.raises(UnsupportedEngineVersion):
        check_engine_version("nightly", allow_unchecked=True)
    with pytest.raises(UnsupportedEngineVersion):
        VllmPublisherRelay("m", "r", 16, engine_version="0.40.1")
    assert VllmPublisherRelay("m", "r", 16, engine_version="0.32.0").engine_version == "0.32.0"


# ---- data parallel -----------------------------------------------------------------------------
def test_dp_endpoints_follow_vllm_offset_rule():
    assert offset_endpoint("tcp://10.0.0.5:5557", 0) == "tcp://10.0.0.5:5557"
    assert offset_endpoint("tcp://10.0.0.5:5557", 3) == "tcp://10.0.0.5:5560"
    assert offset_endpoint("tcp://*:0", 2) == "tcp://*:0"
    assert offset_endpoint("inproc://cache", 1) == "inproc://cache_dp1"
    with pytest.raises(ValueError):
        offset_endpoint("ipc:///tmp/x", 1)
    assert dp_endpoints("tcp://h:5557", "tcp://h:5567", 2) == [("tcp://h:5557", "tcp://h:5567"),
                                                               ("tcp://h:5558", "tcp://h:5568")]
    with pytest.raises(ValueError):
        dp_endpoints("tcp://h:5557", None, 0)


class _FakeSource:
    def __init__(self, ep, rep, bind):
        self.endpoint, self.replay_endpoint, self.bind = ep, rep, bind

    def replay(self, start):
        return []

    def close(self):
        pass


class _ListSink:
    def __init__(self):
        self.batches, self.dead = [], []

    def publish(self, b):
        self.batches.append(b)

    def dead_letter(self, dl, model, replica):
        self.dead.append(dl.reason)

    def flush(self, timeout=None):
        pass


def test_dp_relays_one_per_rank_and_clear_per_rank():
    sink = _ListSink()
    with pytest.raises(UnsupportedEngineVersion):
        build_dp_relays("m", "node1", "tcp://h:5557", "tcp://h:5567", 2, sink, 16, "0.1.0",
                        source_factory=_FakeSource)
    relays = build_dp_relays("m", "node1", "tcp://h:5557", "tcp://h:5567", 3, sink, 16, "0.32.0",
                             bind=True, source_factory=_FakeSource)
    assert [r.source.endpoint for r in relays] == ["tcp://h:5557", "tcp://h:5558", "tcp://h:5559"]
    assert [r.source.replay_endpoint for r in relays] == ["tcp://h:5567", "tcp://h:5568", "tcp://h:5569"]
    assert [r.core.dp_rank for r in relays] == [0, 1, 2] and all(r.source.bind for r in relays)
    shard = ModelShard("m", 16)
    d = ew.vllm_digests(T[:64], 32, "sha256", "vllm-none-hash")
    hs = [ew.external(x) for x in d]
    for rank, r in enumerate(relays):  # each rank caches the same prompt; seq from 0 on every rank
        r.handle(_frame(ew.payload([ew.BlockStored(hs, None, T[:64], 32, None, "GPU", None)], rank=rank), 0))
    for b in sink.batches:
        shard.apply(b, 0.0)
    h = prompt_hashes(T[:65], 16)
    assert [walk.credited(shard, h, 65, "node1", r) for r in range(3)] == [64, 64, 64]
    # a reset is published by the rank that steps next only (ENGINES.md vLLM observation 3)
    relays[1].handle(_frame(ew.payload([ew.AllBlocksCleared()], rank=1), 1))
    for b in sink.batches[3:]:
        shard.apply(b, 0.0)
    assert [walk.credited(shard, h, 65, "node1", r) for r in range(3)] == [64, 0, 64]
    assert not sink.dead


# ---- one canonical hash everywhere ---------------------------------------------------------------
@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
@pytest.mark.parametrize("as_int", [True, False])
@pytest.mark.parametrize("ebs", [16, 32, 64])
def test_same_prefix_same_key_for_every_hash_function_and_block_size(algo, as_int, ebs):
    seed = os.urandom(32).hex() if algo.startswith("xxhash") else "vllm-none-hash"  # random per process
    tokens = T[:192]
    digests = ew.vllm_digests(tokens, ebs, algo, seed)
    hs = [ew.external(x, as_int) for x in digests]
    half = len(hs) // 2
    p1 = ew.payload([ew.BlockStored(hs[:half], None, tokens[:half * ebs], ebs, None, "GPU", None)])
    p2 = ew.payload([ew.BlockStored(hs[half:], hs[half - 1], tokens[half * ebs:], ebs, None, "GPU", None)])
    m = VllmMirror(16)
    got = _stored(m.apply(decode_payload(p1).events)) + _stored(m.apply(decode_payload(p2).events))
    assert got == prompt_hashes(tokens, 16)
    # and the removal of a 32-byte or 64-bit engine hash finds its canonical blocks
    out = m.apply(decode_payload(ew.payload([ew.BlockRemoved([hs[-1]], "GPU")])).events)
    assert [h for e in out if isinstance(e, BlocksRemoved) for h in e.hashes] == \
        prompt_hashes(tokens, 16)[-(ebs // 16):]


# ---- extra keys: LoRA, multimodal, cache salt ---------------------------------------------------------
def _vllm_mm_keys(n_blocks, ebs, items, lora=None, salt=None):
    """vLLM 0.32's event extra keys per block (kv_cache_utils.py _gen_mm_extra_hash_keys +
    to_event_extra_keys): lora name, (identifier, offset - block start) per overlapping item, salt."""
    out = []
    for b in range(n_blocks):
        s, e = b * ebs, (b + 1) * ebs
        keys = [lora] if lora else []
        for ident, off, ln in items:
            if e > off and s < off + ln:
                keys.append([ident, off - s])
        if salt and b == 0:
            keys.append(salt)
        out.append(keys or None)
    return out


@pytest.mark.parametrize("ebs", [16, 32, 64])
def test_extra_keys_match_router_hashes_for_every_block_size(ebs):
    items = [("img-a", 20, 40), ("img-b", 70, 10)]  # an image across blocks, one inside a block
    tokens = T[:128]
    nb = len(tokens) // ebs
    for lora, salt in [(None, None), ("ad", None), (None, "s1"), ("ad", "s1")]:
        ek = _vllm_mm_keys(nb, ebs, items, lora, salt)
        m = VllmMirror(16)
        ev = ew.BlockStored(list(range(1, nb + 1)), None, tokens, ebs, None, "GPU", lora, ek)
        got = _stored(m.apply(decode_payload(ew.payload([ev])).events))
        want = prompt_hashes(tokens, 16, lora_name=lora, cache_salt=salt,
                             mm=[(i, off) for i, off, _ in items])
        assert got == want, (lora, salt)
    plain = prompt_hashes(tokens, 16)
    with_mm = prompt_hashes(tokens, 16, mm=[("img-a", 20)])
    other = prompt_hashes(tokens, 16, mm=[("img-z", 20)])
    assert with_mm[0] == plain[0] == other[0]  # before the image: shared
    assert not set(with_mm[1:]) & set(other[1:]) and not set(with_mm[1:]) & set(plain[1:])


def test_salt_carried_down_the_chain_across_events():
    # block 0 carries the salt, later blocks [None] (ENGINES.md vLLM observation 11)
    m = VllmMirror(16)
    a = m.apply([ew_dec(ew.BlockStored([1], None, T[:32], 32, None, "GPU", None, [["s1"]]))])
    b = m.apply([ew_dec(ew.BlockStored([2], 1, T[32:64], 32, None, "GPU", None, [None]))])
    assert _stored(a) + _stored(b) == prompt_hashes(T[:64], 16, cache_salt="s1")


def ew_dec(ev):
    return decode_payload(ew.payload([ev])).events[0]


# ---- CPU tier without token ids (offloading connector) --------------------------------------------
def test_cpu_placeholder_matched_through_engine_hash_memo():
    m = VllmMirror(16)
    m.apply([ew_dec(ew.BlockStored([1, 2, 3], None, T[:96], 32, None, "GPU", None))])
    # offloading/events.py _placeholder_stored: block_size 0, token_ids [], hash = chunk's last block
    out = m.apply([ew_dec(ew.BlockStored([2], None, [], 0, None, "CPU", None, group_idx=0))])
    (e,) = out
    # (the placeholder does not name its chunk's parent: the run says None; the shard keys by hash)
    assert (e.tier, e.hashes, e.depth) == ("CPU", prompt_hashes(T, 16)[2:4], 2)
    out = m.apply([ew_dec(ew.BlockRemoved([2], "CPU", 0))])
    assert out[0].tier == "CPU" and out[0].hashes == prompt_hashes(T, 16)[2:4]
    assert m.apply([ew_dec(ew.BlockStored([99], None, [], 0, None, "CPU", None))]) == []
    assert m.stats["placeholder_unknown"] == 1
    (s,) = m.apply([ew_dec(ew.BlockStored([3], None, [], 0, None, "STORAGE", None))])
    assert s.tier == "DISK"


def test_cpu_placeholder_of_a_multi_block_chunk():
    m = VllmMirror(16, cpu_chunk_blocks=2)
    m.apply([ew_dec(ew.BlockStored([1, 2], None, T[:64], 32, None, "GPU", None))])
    m.apply([ew_dec(ew.BlockStored([3, 4], 2, T[64:128], 32, None, "GPU", None))])
    (e,) = m.apply([ew_dec(ew.BlockStored([4], None, [], 0, None, "CPU", None))])
    assert e.hashes == prompt_hashes(T, 16)[4:8] and e.depth == 4


# ---- speculative decoding: bigram pages -------------------------------------------------------------
def test_bigram_pages_unpair_to_the_same_prefix():
    page = [[T[i], T[i + 1]] for i in range(16)]
    single, nxt = unpair_tokens(page)
    assert single == T[:16] and nxt == T[16]
    assert prompt_hashes(single, 16) == prompt_hashes(T[:16], 16)
    assert unpair_tokens(T[:4]) == (T[:4], None)
    with pytest.raises(SpecDecodeError) as ei:
        unpair_tokens([[1, 2], [3, 4]])
    assert ei.value.reason == "broken_bigram_chain"
    with pytest.raises(SpecDecodeError):
        unpair_tokens([[1, 2, 3]])


# ---- bad input through the relay ------------------------------------------------------------------
def test_bad_extra_keys_and_placeholders_never_stop_the_relay():
    r = VllmPublisherRelay("m", "r", 16, engine_version="0.32.0")
    for i, p in enumerate([b"\x91", b"\x93\xcb"]):  # truncated: dead letters
        out = r.on_frame(_frame(p, i))
        assert out.dead and not out.batches
    # short token ids: that event is set aside, its batch still goes out
    out = r.on_frame(_frame(ew.payload([ew.BlockStored([1], None, T[:20], 32, None, "GPU", None)]), 2))
    assert not out.dead and [d.reason for d in out.set_aside] == ["short_token_ids"]
    assert [b.events for b in out.batches] == [[]]
    ok = r.on_frame(_frame(ew.payload([ew.BlockStored([1], None, T[:32], 32, None, "GPU", None,
                                                      [[["odd", "keys"], 3.5]])]), 3))
    assert ok.batches and not ok.dead


# ---- generated conformance stream -------------------------------------------------------------
def test_variants_fixture_is_what_the_engine_rules_generate():
    lines = [json.loads(x) for x in (VARIANTS / "frames.jsonl").read_text().splitlines()]
    assert lines == make_variants.frames()
    assert json.loads((VARIANTS / "expected.json").read_text()) == make_variants.expected()


def test_variants_fixture_lookups():
    exp = make_variants.expected()
    shard = ModelShard("m", 16)
    relays: dict[str, VllmPublisherRelay] = {}
    for f in read_frames(VARIANTS / "frames.jsonl"):
        rel = relays.setdefault(f.endpoint, VllmPublisherRelay("m", "node1", 16, engine_version="0.32.0"))
        out = rel.on_frame(f)
        assert not out.dead and out.gap is None
        for b in out.batches:
            shard.apply(b, 0.0)
    prompt = make_variants.SYS + exp["prompt_tail"]
    n = len(prompt)
    ident, start, _ = make_variants.MM
    keys = {"plain": prompt_hashes(prompt, 16), "lora": prompt_hashes(prompt, 16, lora_name="ad"),
            "salt": prompt_hashes(prompt, 16, cache_salt="tenant-1"),
            "mm": prompt_hashes(prompt, 16, mm=[(ident, start)]),
            "mm_other_image": prompt_hashes(prompt, 16, mm=[("img-other", start)])}
    for name, want in exp["lookups"].items():
        rank0 = want["rank0"]["resumable_tokens"] if isinstance(want["rank0"], dict) else want["rank0"]
        assert walk.credited(shard, keys[name], n, "node1", 0) == rank0, name
        assert walk.credited(shard, keys[name], n, "node1", 1) == want["rank1"], name
    (a,) = [x for x in walk.lookup(shard, keys["plain"], n, 0.0) if x.dp_rank == 0]
    p = exp["lookups"]["plain"]["rank0"]
    assert a.cached_tokens == p["cached_tokens"]
    assert [[t.tier, t.tokens] for t in a.tiers] == p["tiers"]
