"""Mooncake Store (kvidx/engines/mooncake/): the master's RFC #1527 wire format with its legacy
aliases, the pool mirror's rules (tokenless objects through the key memo, removals, backends, tenants,
tiers), the relay's sequence and sniffing adjustments, pool crediting to attached replicas, and the
shadow audit of the generated conformance recording (tests/fixtures/mooncake-store/)."""

from __future__ import annotations

import json
import sys

import msgspec
import pytest

from index_service.store import ShardStore
from kvidx.config import Config, PoolConfig
from kvidx.core import walk
from kvidx.core.hashing import prompt_hashes
from kvidx.core.shard import ModelShard
from kvidx.engines import RelayOptions
from kvidx.engines.common import Unreadable
from kvidx.engines.contract import Frame
from kvidx.engines.mooncake.adapter import ADAPTER
from kvidx.engines.mooncake.mirror import MooncakeMirror
from kvidx.engines.mooncake.relay import KEY_FEED_SRC, MooncakeStoreRelay
from kvidx.engines.mooncake.wire import (
    Cleared,
    Removed,
    Stored,
    UnsupportedEngineVersion,
    check_version,
    connector_key_hash,
    decode_payload,
    key_hash,
    parse_hash,
)
from kvidx.engines.sniff import wrong_engine
from kvidx.shadow import Agreement, load_requests, shadow_batches
from schemas.answers import Tier
from schemas.events import BlocksRemoved, BlocksStored, ReplicaCleared
from tests.helpers import FIXTURES

MOON = FIXTURES / "mooncake-store"
sys.path.insert(0, str(MOON))
sys.path.insert(0, str(FIXTURES / "vllm-variants"))
import engine_wire as ew  # noqa: E402
import make_mooncake_store as make  # noqa: E402
import master_wire as mw  # noqa: E402

enc = msgspec.msgpack.Encoder()
BIG = (1 << 63) + 12345  # a seq hash the master's legacy alias sends as a negative int64
TOK = list(range(100, 164))  # four 16-token blocks
MASTER = "tcp://master:5557"


def master(events: list[dict], ts_ms: int = 1_800_000_000_000) -> bytes:
    return mw.payload(ts_ms, events)


def ev(kind: str, key: str, medium: str = "cpu", tenant: str = "", backend: str = "pool-a", **kw) -> dict:
    return mw.event_map(kind, 1, 1_800_000_000_000, key, medium, tenant, backend, **kw)


def mframe(payload: bytes, seq: int, src: str = "pub", endpoint: str = MASTER) -> Frame:
    return Frame(b"", seq, payload, 1_000_000 + seq, endpoint, src)


def canon(tokens=TOK, ibs: int = 16, **kw) -> list[int]:
    return prompt_hashes(tokens, ibs, **kw)


def stored(hashes, key=None, medium="cpu", tenant="default", backend="pool-a", **kw) -> Stored:
    return Stored(list(hashes), key, medium, tenant, backend, **kw)


def taught(ibs: int = 16, **kw) -> MooncakeMirror:
    """A mirror that knows seq hashes 1..4 name TOK's four blocks (as a key feed would teach it)."""
    m = MooncakeMirror(ibs, **kw)
    c = canon(ibs=ibs)
    k = 16 // ibs
    for j in range(4):
        m.learn(j + 1, tuple(c[j * k:(j + 1) * k]), j * k)
    return m


def hashes_of(out, cls=BlocksStored) -> list[int]:
    return [h for e in out if isinstance(e, cls) for h in e.hashes]


# ---- wire ---------------------------------------------------------------------------------------
def test_versions_pinned_with_a_clear_error():
    assert check_version("0.3.12")[0] == "object" and check_version("v0.3.12.post1")[1]["cpu"] == "POOL"
    assert check_version("rfc1527-v1")[0] == "medium"
    for bad in ("0.3.11", "0.4.0", "main", "", None):
        with pytest.raises(UnsupportedEngineVersion, match="0.3.12"):
            check_version(bad)
    with pytest.raises(ValueError, match="0.3.12"):
        ADAPTER.check_version("0.3.11")
    ADAPTER.check_version(None)
    with pytest.raises(ValueError, match="0.32"):  # the key feed's vLLM release is pinned too
        MooncakeStoreRelay("m", "pool", 16, key_feed_version="0.40.0")
    with pytest.raises(ValueError, match="unknown index tier"):
        MooncakeStoreRelay("m", "pool", 16, tiers={"cpu": "RAM"})


def test_decode_the_masters_bytes():
    p = master([ev("stored", str(BIG)), ev("removed", "0x2a", "disk", tenant="t1", group_id="g")],
               1_800_000_000_123)
    raw = msgspec.msgpack.decode(p)
    assert len(raw) == 3 and raw[2] == 0 and len(raw[1][0]) == 20 and len(raw[1][1]) == 17  # map sizes
    assert raw[1][0]["block_hashes"] == [BIG - (1 << 64)] and raw[1][0]["seq_hashes"] == [BIG]
    b = decode_payload(p)
    assert b.ts == pytest.approx(1_800_000_000.123) and b.data_parallel_rank is None  # ms; not a rank
    s, r = b.events
    assert isinstance(s, Stored) and s.hashes == [BIG] and s.object_key == str(BIG) and s.medium == "cpu"
    assert s.tenant_id == "default" and s.backend_id == "pool-a" and s.token_ids is None
    assert s.base_block_idx == 0 and s.parent_hash is None and s.block_size is None
    assert isinstance(r, Removed) and r.hashes == [42] and r.medium == "disk" and r.tenant_id == "t1"


def test_decode_legacy_aliases():
    # only the legacy names (no event_type, no seq_hashes): read as the RFC's, int64 folded to u64
    legacy = {"type": "BlockStored", "block_hashes": [BIG - (1 << 64)], "parent_block_hash": -1,
              "token_ids": list(range(16)), "block_size": 16, "backend_id": "b"}
    s = decode_payload(enc.encode([1000, [legacy, {"type": "BlockRemoved", "block_hashes": [7]},
                                          {"type": "AllBlocksCleared"}], 0])).events
    assert s[0].hashes == [BIG] and s[0].parent_hash == (1 << 64) - 1 and s[0].token_ids == list(range(16))
    assert isinstance(s[1], Removed) and s[1].hashes == [7] and isinstance(s[2], Cleared)
    # both present: they must agree
    for bad in ({"event_type": "stored", "type": "BlockRemoved", "seq_hashes": [1]},
                {"event_type": "stored", "seq_hashes": [1], "block_hashes": [2]},
                {"event_type": "stored", "seq_hashes": [1], "parent_hash": 3, "parent_block_hash": 4}):
        assert "disagrees" in unreadable(enc.encode([0, [bad]]))
    # with compat fields and object keys off (kv_events_emit_legacy_compat / _emit_object_key = false)
    plain = ev("stored", "99", legacy=False, emit_object_key=False)
    assert "type" not in plain and "object_key" not in plain
    assert decode_payload(master([plain])).events[0].hashes == [99]


def test_decode_missing_and_extra_trailing_fields():
    e = {"event_type": "removed", "seq_hashes": ["0x10"]}  # an event with no envelope fields at all
    b = decode_payload(enc.encode([5, [e]]))  # no trailing dp_rank
    assert b.events[0].hashes == [16] and b.events[0].tenant_id == "default" and b.events[0].backend_id == ""
    # extra trailing batch elements and unknown map keys (newer publishers' fields) are ignored
    newer = {**ev("stored", "12"), "connector_block_hash": "ab" * 8, "tp_rank": 0, "cache_prefix": "x"}
    assert decode_payload(enc.encode([5, [newer], 0, "later"])).events[0].hashes == [12]
    for bad, what in (([5], "length 2"), ([-1, []], "timestamp")):  # the batch envelope
        with pytest.raises(msgspec.ValidationError, match=what):
            decode_payload(enc.encode(bad))
    for bad, what in (([5, [{"seq_hashes": [1]}]], "event_type"),  # one event: kept as Unreadable
                      ([5, [{"event_type": "stored"}]], "seq_hashes"), ([5, ["stored"]], "object"),
                      ([5, [{"event_type": "stored", "seq_hashes": [-3]}]], "unsigned"),
                      ([5, [{"event_type": "stored", "seq_hashes": ["0xzz"]}]], "decimal"),
                      ([5, [{"event_type": "stored", "seq_hashes": [str(1 << 64)]}]], "decimal"),
                      ([5, [{"event_type": "stored", "seq_hashes": [1], "token_ids": [-1]}]], ">= 0")):
        assert what in unreadable(enc.encode(bad))


def unreadable(payload: bytes) -> str:
    """The detail of the one event of `payload`, which must not decode."""
    (u,) = decode_payload(payload).events
    assert isinstance(u, Unreadable)
    return u.detail


def test_an_unknown_event_type_costs_that_event_only():
    for e in ({"event_type": "updated", "seq_hashes": [1]}, {"type": "BlockUpdated", "block_hashes": [1]}):
        assert "unknown event type" in unreadable(enc.encode([0, [e]]))
    relay = MooncakeStoreRelay("m", "pool", 16)
    relay.mirror.learn(1, (11, 12), 0)
    relay.on_frame(mframe(master([ev("stored", "1")]), 1))
    assert relay.mirror.cached_index_blocks() == {11, 12}
    out = relay.on_frame(mframe(enc.encode([0, [{"event_type": "updated", "seq_hashes": [1]},
                                                ev("stored", "2")]]), 2))
    # an event of an unknown kind naming hashes may have moved or removed them: dropped everywhere
    assert out.dead == [] and [(d.reason, d.event, d.position, d.frame.seq) for d in out.set_aside] == [
        ("undecodable_event", "other", 0, 2)]
    assert relay.mirror.cached_index_blocks() == set() and relay.mirror.parked


def test_decode_malformed_and_empty_payloads():
    for p in (b"", b"\xc1", b"\x93\x01"):
        with pytest.raises(msgspec.DecodeError):
            decode_payload(p)
    with pytest.raises(msgspec.ValidationError):
        decode_payload(enc.encode({"ts": 0, "events": []}))  # a map, not the batch array
    relay = MooncakeStoreRelay("m", "pool", 16)
    for seq, p in enumerate((b"", b"\xc1"), 1):
        assert [d.reason for d in relay.on_frame(mframe(p, seq)).dead] == ["malformed_payload"]
    # a bad frame consumes its number: the next one is no gap
    assert relay.on_frame(mframe(master([ev("stored", "5")]), 3)).gap is None


def test_hash_and_key_encodings():
    assert parse_hash(7) == 7 and parse_hash("123") == 123 and parse_hash("0XfF") == 255
    assert parse_hash(b"\x00" * 24 + (5).to_bytes(8, "big")) == 5  # a digest: its last 8 bytes
    assert parse_hash(-1, signed_ok=True) == (1 << 64) - 1
    for bad in (-1, 1 << 64, True, 1.5, "12a", b"short", None):
        with pytest.raises(msgspec.ValidationError):
            parse_hash(bad)
    digest = bytes(range(32))
    low = int.from_bytes(digest[-8:], "big")
    assert key_hash("12345") == 12345 and key_hash("0x2a") == 42 and key_hash("") is None
    for k in (f"Qwen/Qwen2.5-7B@tp_rank:1@pcp0@dcp0@pp_rank:0@group:0@{digest.hex()}",
              f"prefix@ns@Qwen@tp_rank:0@pcp0@dcp0@pp_rank:0@{digest.hex()}",
              f"Qwen@pcp0@dcp0@head_or_tp_rank:3@pp_rank:0@{digest.hex()}",
              f"Qwen@pcp0@dcp0@head_or_tp_rank:3@0x{digest.hex()}@17"):
        assert key_hash(k) == low, k
    for k in ("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855_0_k",  # SGLang HiCache
              "123abc", "not-a-hash", "@tp_rank:0@pcp0@dcp0@pp_rank:0@ab",
              f"m@tp_rank:x@pcp0@dcp0@pp_rank:0@{digest.hex()}"):
        assert key_hash(k) is None and connector_key_hash(k) is None, k
    # a stored event with an unparsed key still decodes (identified by nothing): the mirror counts it
    s = decode_payload(master([ev("stored", "e3b0_0_k")])).events[0]
    assert s.hashes == [] and s.object_key == "e3b0_0_k"


# ---- relay --------------------------------------------------------------------------------------
def test_the_masters_stream_is_told_by_its_envelope_not_as_sglangs():
    p = master([ev("stored", str(BIG))])
    assert wrong_engine(p, "mooncake") is None  # RFC #1527's event_type, before the int64 alias
    assert "use --engine mooncake" in wrong_engine(p, "sglang") and "mooncake" in wrong_engine(p, "vllm")
    relay = MooncakeStoreRelay("m", "pool", 16)
    relay.mirror.learn(BIG, tuple(canon()[:1]), 0)
    out = relay.on_frame(mframe(p, 1))
    assert not out.dead and hashes_of(out.batches[0].events) == canon()[:1]
    assert relay.counters["frames"] == 1 and relay.wrong_engine_reason is None
    # another engine's stream is still told apart: vLLM 0.32's BlockStored carries group_idx
    vllm = ew.payload([ew.BlockStored([1], None, list(range(16)), 16, None, "GPU", None, [None], 0,
                                      "full_attention")])
    other = MooncakeStoreRelay("m", "pool", 16)
    dead = other.on_frame(mframe(vllm, 1)).dead
    assert [d.reason for d in dead] == ["wrong_engine"] and "vllm" in dead[0].detail


def test_relay_sequence_from_one_gaps_and_restarts():
    relay = MooncakeStoreRelay("m", "pool", 16, epoch=5)
    relay.mirror.learn(1, tuple(canon()[:1]), 0)
    out = relay.on_frame(mframe(master([ev("stored", "1")]), 1))
    assert out.batches[0].seq == 0 and out.batches[0].epoch == 5  # counted from 0
    assert relay.on_frame(mframe(master([]), 2)).batches
    gap = relay.on_frame(mframe(master([]), 5))
    assert gap.gap == (3, 5) and not gap.batches  # in the master's numbering; it has no replay
    filled = relay.gap_unfilled(mframe(master([]), 5))
    assert isinstance(filled.batches[0].events[0], ReplicaCleared) and relay.mirror.live_blocks() == 0
    assert relay.epoch == 6
    assert relay.on_frame(mframe(master([]), 5)).batches == []  # a duplicate
    relay.on_frame(mframe(master([ev("stored", "1")]), 6))
    restart = relay.on_frame(mframe(master([]), 1))  # a new master process starts at 1
    assert restart.batches[0].events == [ReplicaCleared("engine_restart")] and relay.counters["restarts"] == 1
    assert relay.mirror.live_blocks() == 0 and 1 in relay.mirror.memo  # keys stay known


def test_key_feed_teaches_keys_and_parked_objects_are_placed_later():
    relay = MooncakeStoreRelay("m", "pool", 16)
    digests = ew.vllm_digests(TOK, 16, "sha256", "seed")
    ints = [ew.external(d) for d in digests]
    # the pool stores block 0 before the engine's batch is out: parked
    out = relay.on_frame(mframe(master([ev("stored", str(ints[0]))]), 1))
    assert out.batches[0].events == [] and relay.mirror.stats["parked"] == 1
    feed = ew.payload([ew.BlockStored(ints, None, TOK, 16, None, "GPU", None, [None] * 4, 0,
                                      "full_attention")])
    fout = relay.on_frame(Frame(b"kv", 0, feed, 2_000_000, "tcp://node-a:5557", KEY_FEED_SRC))
    assert not fout.batches and not fout.dead and relay.counters["frames"] == 1  # not the master's
    out = relay.on_frame(mframe(master([ev("stored", str(ints[1]))]), 2))
    assert hashes_of(out.batches[0].events) == canon()[1:2] + canon()[:1]  # block 1, then parked block 0
    assert relay.mirror.stats["placed_late"] == 1
    # 32-byte hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) fold to the connector key's low 64 bits
    relay2 = MooncakeStoreRelay("m", "pool", 16)
    relay2.on_frame(Frame(b"kv", 0, ew.payload([ew.BlockStored(digests, None, TOK, 16, None, "GPU", None,
                                                                 [None] * 4, 0, "full_attention")]),
                          1, "tcp://node-c:5557", KEY_FEED_SRC))
    key = f"Qwen@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{digests[3].hex()}"
    out = relay2.on_frame(mframe(master([ev("stored", key)]), 1))
    assert hashes_of(out.batches[0].events) == canon()[3:4]
    bad = relay2.on_frame(Frame(b"kv", 1, b"\xc1", 2, "tcp://node-c:5557", KEY_FEED_SRC))
    assert [d.reason for d in bad.dead] == ["key_feed_malformed_payload"]


def test_resync_replays_the_pool():
    relay = MooncakeStoreRelay("m", "pool", 16)
    for j in range(4):
        relay.mirror.learn(j + 1, tuple(canon()[j:j + 1]), j)
    relay.on_frame(mframe(master([ev("stored", str(j)) for j in (4, 2, 3, 1)]), 1))
    parts = list(relay.resync())
    assert parts[0].events[0] == ReplicaCleared("resync") and parts[0].part == 1
    assert hashes_of(parts[0].events) == canon()  # shallowest first


# ---- mirror -------------------------------------------------------------------------------------
def test_token_carrying_stores_chain_like_every_engine():
    m = MooncakeMirror(8, "medium", {"": "GPU", "cpu": "CPU"})
    out = m.apply([stored([11, 12], None, "cpu", token_ids=TOK[:32], block_size=16)])
    assert out[0].tier == "CPU" and out[0].hashes == canon(ibs=8)[:4] and out[0].engine_hashes == [11, 12]
    assert m.block_size == 16
    out = m.apply([stored([13], None, "cpu", token_ids=TOK[32:48], block_size=16, parent_hash=12)])
    assert out[0].hashes == canon(ibs=8)[4:6] and out[0].parent == canon(ibs=8)[3] and out[0].depth == 4
    # the LoRA name seeds the chain, the salt is an extra key of its first block (prompt_hashes' rule)
    out = m.apply([stored([21], None, "cpu", token_ids=TOK[:16], block_size=16, lora_name="ad",
                          additional_salt="s1")])
    assert out[0].hashes == canon(TOK[:16], 8, lora_name="ad", cache_salt="s1")
    # an unknown parent, or a chain's middle without one, cannot be placed
    assert m.apply([stored([31], None, token_ids=TOK[:16], block_size=16, parent_hash=999)]) == []
    assert m.apply([stored([32], None, token_ids=TOK[:16], block_size=16, base_block_idx=3)]) == []
    assert m.stats["orphan_blocks"] == 2
    for kw, reason in (({"block_size": 16, "token_ids": TOK[:20]}, "short_token_ids"),
                       ({"token_ids": TOK[:16]}, "no_block_size"),
                       ({"block_size": 12, "token_ids": TOK[:12]}, "block_size_mismatch")):
        assert m.apply([stored([41], **kw)]) == []
        assert [a.reason for a in m.set_aside] == [reason]
    cfg = MooncakeMirror(16, engine_block_size=16)  # the block size from the configuration
    assert cfg.apply([stored([1], token_ids=TOK[:16])])[0].hashes == canon()[:1]


def test_tokenless_objects_through_the_memo():
    m = taught(8)
    out = m.apply([stored([2], "2"), stored([1], "1")])
    assert [e.hashes for e in out] == [canon(ibs=8)[2:4], canon(ibs=8)[0:2]]
    assert out[0].tier == "POOL" and out[0].depth == 2 and out[0].parent is None
    assert out[0].engine_hashes == [2]
    assert m.block_size == 16
    assert m.apply([stored([2], "2")]) == [] and m.stats["refreshed"] == 1  # a re-put refreshes it
    assert m.apply([stored([9], "9")]) == [] and m.stats["parked"] == 1  # not known yet: parked
    assert m.apply([stored([], "e3b0_0_k")]) == [] and m.stats["unparsed_key"] == 1
    # a removal of a parked object unparks it; learning it later then places nothing
    assert m.apply([Removed([9], "9", "cpu", "default", "pool-a")]) == []
    m.learn(9, (12345,), 0)
    assert m.apply([]) == [] and m.stats["remove_unknown"] == 0
    small = MooncakeMirror(16, park_limit=2)
    small.apply([stored([h], str(h)) for h in (5, 6, 7)])
    assert small.stats["park_dropped"] == 1 and list(small.parked) == [(6, "POOL", "pool-a", "6"),
                                                                       (7, "POOL", "pool-a", "7")]


def test_removal_drops_every_tier_under_the_masters_rule():
    m = taught()
    m.apply([stored([1], "1", "cpu"), stored([1], "1", "disk"), stored([2], "2", "disk")])
    assert m.cached_index_blocks("POOL") == set(canon()[:1])
    assert m.cached_index_blocks("DISK") == set(canon()[:2])
    # v0.3.12: "removed" once nothing is left, its medium "cpu" even when the last copy was on disk
    out = m.apply([Removed([2], "2", "cpu", "default", "pool-a"),
                   Removed([1], "1", "cpu", "default", "pool-a")])
    assert {(e.tier, h) for e in out for h in e.hashes} == {("DISK", canon()[1]), ("DISK", canon()[0]),
                                                             ("POOL", canon()[0])}
    assert m.live_blocks() == 0 and m.stats["removed"] == 3
    assert m.apply([Removed([3], "3", "cpu", "default", "pool-a")]) == [] and m.stats["remove_unknown"] == 1
    rfc = taught(removal="medium", tiers={"": "GPU", "cpu": "CPU", "disk": "DISK"})
    rfc.apply([stored([1], "1", "cpu"), stored([1], "1", "disk")])
    out = rfc.apply([Removed([1], "1", "cpu", "default", "pool-a")])
    assert out == [BlocksRemoved("CPU", 0, canon()[:1], [1])]
    assert rfc.cached_index_blocks("DISK") == {canon()[0]}


def test_backends_tp_parts_and_clears():
    m = taught()
    m.apply([stored([1], "k@tp_rank:0", backend="seg-1"), stored([1], "k@tp_rank:1", backend="seg-1"),
             stored([1], "1", backend="seg-2"), stored([2], "2", backend="seg-2")])
    assert m.live_blocks() == 4 and m.cached_index_blocks() == set(canon()[:2])
    # one segment's or one TP part's removal keeps the block while another object holds it
    assert m.apply([Removed([1], "1", "cpu", "default", "seg-2")]) == []
    assert m.apply([Removed([1], "k@tp_rank:0", "cpu", "default", "seg-1")]) == []
    assert m.apply([Removed([1], "k@tp_rank:0", "cpu", "default", "seg-3")]) == []  # another segment's
    out = m.apply([Cleared("default", "seg-1")])  # newer publishers: one backend's objects
    assert out == [BlocksRemoved("POOL", 0, canon()[:1], [1])] and m.cached_index_blocks() == {canon()[1]}
    assert m.apply([Cleared("default", "")]) == [ReplicaCleared("engine_cache_reset")]
    assert m.live_blocks() == 0


def test_one_tenant_and_one_model_per_relay():
    m = taught(tenant_id="tenant-x", models=("m", "Qwen/Qwen2.5-7B"))
    assert m.apply([stored([1], "1"), stored([2], "2", model_name="other")]) == []
    assert m.stats["other_tenant"] == 2
    out = m.apply([stored([1], "1", tenant="tenant-x"),
                   stored([2], "2", tenant="tenant-x", model_name="other"),
                   stored([3], "3", tenant="tenant-x", model_name="Qwen/Qwen2.5-7B")])
    assert hashes_of(out) == [canon()[0], canon()[2]] and m.stats["other_model"] == 1
    assert m.apply([Removed([1], "1", "cpu", "default", "pool-a"), Cleared("default", "")]) == []


def test_pool_blocks_credit_the_attached_replicas_only():
    relay = MooncakeStoreRelay("m", "pool-a", 16)
    for j in range(4):
        relay.mirror.learn(j + 1, tuple(canon()[j:j + 1]), j)
    store = ShardStore(16, config=Config(pools={"pool-a": PoolConfig(replicas=["node-a", "node-b"])}))
    for b in relay.on_frame(mframe(master([ev("stored", str(j)) for j in (1, 2, 3)]
                                          + [ev("stored", "3", "disk")]), 1)).batches:
        store.apply(b, 1.0)
    shard = store.shard("m")
    for name in ("node-a", "node-b", "node-x"):
        shard.replica(name, 0)  # known replicas holding nothing themselves
    h, n = canon(TOK + [1]), 65
    assert walk.credited(shard, h, n, "node-a") == 48 and walk.credited(shard, h, n, "node-b") == 48
    assert walk.credited(shard, h, n, "node-x") == 0  # not attached
    answers = {a.replica: a for a in walk.lookup(shard, h, n, 1.0)}
    assert "pool-a" not in answers  # a pool is not a routing target
    # the shard ranks DISK before POOL (TIERS: fastest first): a block in both reads as DISK
    assert answers["node-b"].tiers == [Tier("POOL", 32), Tier("DISK", 16)]
    for b in relay.on_frame(mframe(master([ev("removed", "2")]), 2)).batches:
        store.apply(b, 2.0)
    assert walk.credited(shard, h, n, "node-b") == 16


# ---- the adapter and the conformance recording --------------------------------------------------
def test_adapter_is_registered():
    import kvidx.engines as engines

    assert "mooncake" in engines.names() and engines.get("mooncake") is ADAPTER
    assert ADAPTER.recording == "frames" and ADAPTER.live == "zmq"
    assert ADAPTER.conformance == ("mooncake-store",)
    relay = ADAPTER.make_relay("m", "pool-a", 16, None, RelayOptions(extra={"tenant_id": "t"}))
    assert isinstance(relay, MooncakeStoreRelay) and relay.mirror.tenant_id == "t"


def test_fixture_is_what_the_generator_writes():
    w = make.build()
    assert (MOON / "frames.jsonl").read_text() == "".join(json.dumps(d) + "\n" for d in w.frames)
    assert (MOON / "requests.jsonl").read_text() == "".join(json.dumps(r) + "\n" for r in w.requests)
    expected = json.loads((MOON / "expected.json").read_text())
    assert {k: expected[k] for k in w.expected} == w.expected
    lines = [json.loads(line) for line in (MOON / "frames.jsonl").read_text().splitlines()]
    pub = [d for d in lines if d["src"] == "pub"]
    assert all(d["topic_b64"] == "" for d in pub) and [d["seq"] for d in pub][:2] == [1, 2]


def shadow(opts: RelayOptions, pool: str = "pool-a") -> tuple[Agreement, object]:
    """The shadow loop (kvidx.shadow.shadow_batches: per request in send order, every frame received by
    its send time through its relay and folded, then the prompt credited to its replica) on a shard
    where the pool's readers are configured and the reader is known."""
    expected = json.loads((MOON / "expected.json").read_text())
    batches = ADAPTER.replay(MOON / "frames.jsonl", "model", expected["index_block_size"], opts)
    shard = ModelShard("model", expected["index_block_size"])
    shard.set_pools({pool: expected["readers"]})
    reqs = load_requests(MOON / "requests.jsonl")
    for r in reqs:
        shard.replica(r["replica"], 0)  # the reader's own relay is not part of this recording
    return shadow_batches(batches, reqs, shard), batches


def test_shadow_on_the_recording_credits_the_pool_exactly():
    agreement, batches = shadow(RelayOptions(extra={"replica": "pool-a"}))
    s = agreement.summary()
    assert s["requests"] == 16 and s["reused_tokens"] > 0 and agreement.mismatches == []
    assert s["recall"] == 1.0 and s["over_credit"] == 0.0
    expected = json.loads((MOON / "expected.json").read_text())
    stats = batches.extra()
    assert batches.dead_letters() == 0 and stats["restarts"] == expected["restarts"]
    for k in ("unparsed_key", "placed_late", "parked"):
        assert stats[k] == expected[k], k
    assert stats["gaps"] == 0 and stats["orphan_blocks"] == 0 and stats["remove_unknown"] == 0
    assert [r.replica for r in batches.relays.values()] == ["pool-a"]


def test_shadow_by_endpoint_name_and_the_rules_it_depends_on():
    agreement, batches = shadow(RelayOptions(), pool="tcp://mooncake-master:5557")  # replicas named as met
    assert agreement.summary()["recall"] == 1.0 and batches.default_replica() == "tcp://mooncake-master:5557"
    # per-medium removals (the RFC's rule, with the master's media as pool tiers) keep a block whose
    # last copy left the disk: over-credit
    wrong, _ = shadow(RelayOptions(engine_version="rfc1527-v1", extra={"replica": "pool-a",
                                                                       "tiers": {"": "POOL", "cpu": "POOL"}}))
    assert wrong.summary()["over_credit"] > 0


def test_cli_shadow_engine_mooncake_with_the_pool_topology(tmp_path):
    import subprocess
    import sys

    from tests.helpers import ROOT as root

    args = [sys.executable, "-m", "kvidx.cli", "shadow", "--engine", "mooncake", "--json",
            "--recording", str(MOON / "frames.jsonl"), "--requests", str(MOON / "requests.jsonl")]
    p = subprocess.run(args, cwd=root, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "--config" in p.stderr and "Traceback" not in p.stderr  # no topology
    expected = json.loads((MOON / "expected.json").read_text())
    cfg = tmp_path / "pools.toml"
    readers = json.dumps(expected["readers"])
    cfg.write_text(f'[pools."tcp://mooncake-master:5557"]\nreplicas = {readers}\n')
    p = subprocess.run([*args, "--config", str(cfg)], cwd=root, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert s["requests"] == 16 and s["recall"] == 1.0 and s["over_credit"] == 0.0 and s["reused_tokens"] > 0
