"""Fuzzing the decoders of untrusted bytes (hypothesis): vLLM engine frames (decode_payload and the
relay's on_frame), event batches (decode_batch, then the shard fold) and routing decisions
(decode_route, then the store).

Inputs start from real payloads (tests/fixtures/vllm-0.32/*/frames.jsonl, vllm-variants) and are
mutated at the byte level (truncate, flip, insert, splice a hostile msgpack header: 4-billion-element
arrays, 4 GB strings, deep nesting) and at the structure level (a node replaced by a value of another
type, wrong tags, huge ints, NaN, long lists), plus arbitrary msgpack values.

Properties (each checked against a second reading of the same bytes: msgspec's untyped msgpack decode,
the "tree"):
- decode_payload raises only msgspec.DecodeError / ValidationError, and refuses exactly when the tree
  refuses or is not a batch envelope ([ts: number, events: list, rank: int or nil]); what it accepts
  agrees with the tree (ts, rank, one event per tree event, each event's kind and block hashes);
- on_frame never raises: bad frames become DeadLetters, the relay keeps going (a valid frame after the
  bad ones is relayed), and every batch it emits encodes, decodes and folds into a shard;
- decode_batch / decode_route raise only DecodeError / ValidationError / ValueError (what the worker,
  the follower and the service catch); they refuse whatever the tree refuses, or whose version is not
  the schema's; what they accept is the tree field by field, encodes back to bytes that decode to the
  same value, and folds (a batch into a shard: its replica's seq is the batch's; a route into a store:
  applied once, its repeat refused as a duplicate);
- bounded: hostile length headers allocate little (tracemalloc) and an oversized frame is rejected
  before it is decoded.

The default run is short (mutations.FUZZ_EXAMPLES examples per property, a few seconds, fixed seed); the
`slow` tests (deselected by default, pyproject addopts) run each property 20x longer with a random
seed: `pytest -m slow tests/fuzz/test_decoders.py`. The mutations themselves are in
tests/fuzz/mutations.py (shared with tests/fuzz/test_engines.py).
"""

from __future__ import annotations

import math
import time
import tracemalloc
from functools import cache

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvidx.core import walk
from kvidx.core.shard import ModelShard
from kvidx.engines.common import Unreadable
from kvidx.engines.contract import MAX_PAYLOAD, Frame
from kvidx.engines.recording import read_frames
from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.engines.vllm.wire import AllBlocksCleared, decode_payload
from schemas.events import SCHEMA_VERSION, EventBatch, decode_batch, enc_hook, encode_batch
from schemas.routes import ROUTES_VERSION, RouteDecision, decode_route, encode_route
from tests.fuzz.mutations import (
    ENC_PLACEHOLDER,
    FAST,
    HOSTILE,
    PLACEHOLDER,
    SLOW,
    mutated,
    node_paths,
    replace_node,
)
from tests.helpers import FIXTURES

INDEX_BS = 16
DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError)
READER_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, ValueError)


# ---- real inputs ------------------------------------------------------------------------------

@cache
def fixture_frames() -> dict[str, list[Frame]]:
    out = {}
    for d in [*sorted((FIXTURES / "vllm-0.32").iterdir()), FIXTURES / "vllm-variants"]:
        if (d / "frames.jsonl").exists():
            frames = sorted(read_frames(d / "frames.jsonl"), key=lambda f: f.recv_ns)
            out[d.name] = frames[:60]  # enough variety (stores, removals, groups), cheap to replay
    return out


@cache
def real_payloads() -> list[bytes]:
    return [f.payload for frames in fixture_frames().values() for f in frames]


@cache
def real_batches() -> list[bytes]:
    """Event batches the relay really publishes for the fixtures."""
    out = []
    for name, frames in fixture_frames().items():
        relay = VllmPublisherRelay("m-" + name, "tcp://r:5557", INDEX_BS)
        for f in frames[:25]:
            out += [encode_batch(b) for b in relay.on_frame(f).batches]
    return out


@cache
def real_routes() -> list[bytes]:
    return [encode_route(RouteDecision(1, f"req-{i}", "m", "tcp://r:5557", i % 2, list(range(i)), 16 * i + 3,
                                       8 * i, 1.7e9 + i, 30.0, "router-a")) for i in range(6)]


def payloads() -> st.SearchStrategy[bytes]:
    return mutated(real_payloads())


# ---- engine frames ----------------------------------------------------------------------------

def _tree(data: bytes) -> tuple[bool, object]:
    """The reference reading: msgspec's untyped decode (True, value), or (False, None) if it refuses."""
    try:
        return True, msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return False, None


def _number(x: object) -> bool:
    return type(x) in (int, float)


def _same_float(a: float, b: object) -> bool:
    """A float field against the tree's number (an int is read as the float nearest to it)."""
    if type(b) is int:
        return a == float(b)
    return a == b or (math.isnan(a) and isinstance(b, float) and math.isnan(b))


def _envelope(tree: object) -> bool:
    """vLLM's batch envelope: [ts, events, data_parallel_rank] (the rank optional or nil)."""
    return (isinstance(tree, list) and len(tree) in (2, 3) and _number(tree[0]) and isinstance(tree[1], list)
            and (len(tree) == 2 or tree[2] is None or type(tree[2]) is int))


def _event_kind_and_hashes(ev: object) -> tuple[object, object]:
    """A tree event's tag and block hashes: {"type": ..., "block_hashes": ...} or [tag, hashes, ...]."""
    if isinstance(ev, dict):
        return ev.get("type"), ev.get("block_hashes")
    if isinstance(ev, list) and ev:
        return ev[0], ev[1] if len(ev) > 1 and ev[0] != "AllBlocksCleared" else None
    return None, None


def _check_payload(data: bytes) -> None:
    ok, tree = _tree(data)
    try:
        b = decode_payload(data)
    except DECODE_ERRORS:
        assert not ok or not _envelope(tree), "a well-formed batch envelope was refused"
        return
    assert ok and _envelope(tree), "bytes that are not a batch envelope were accepted"
    assert _same_float(b.ts, tree[0])
    assert b.data_parallel_rank == (tree[2] if len(tree) == 3 else None)
    assert len(b.events) == len(tree[1])
    for ev, t in zip(b.events, tree[1], strict=True):
        kind, hashes = _event_kind_and_hashes(t)
        if isinstance(ev, Unreadable):
            enc = msgspec.msgpack.encode  # (compared encoded: NaN != NaN)
            assert enc(msgspec.msgpack.decode(ev.raw)) == enc(t)
            continue
        assert kind == type(ev).__name__
        if not isinstance(ev, AllBlocksCleared):
            assert ev.block_hashes == hashes


def _valid_clear(seq: int) -> Frame:
    payload = msgspec.msgpack.encode([time.time(), [{"type": "AllBlocksCleared"}], 0])
    return Frame(b"kv", seq, payload, time.time_ns(), "tcp://fuzz:5557")


def _check_relay(name: str, warm: int, bad: list[bytes], seqs: list[int]) -> None:
    """Warm a relay with the first `warm` real frames of a fixture (so parents, groups and memo are
    known), feed the bad payloads, then a valid frame: nothing raises, every output folds, the
    relay goes on relaying."""
    frames = fixture_frames()[name]
    warm = min(warm, len(frames))
    relay = VllmPublisherRelay("fuzz", "tcp://fuzz:5557", INDEX_BS)
    shard = ModelShard("fuzz", INDEX_BS)
    outs = [relay.on_frame(f) for f in frames[:warm]]
    seq = frames[warm - 1].seq + 1 if warm else 0
    for i, data in enumerate(bad):
        s = seq + seqs[i % len(seqs)] if seqs else seq
        outs.append(relay.on_frame(Frame(b"kv", s, data, time.time_ns(), "tcp://fuzz:5557")))
        seq = max(seq, s + 1)
    nxt = relay.next_seq if relay.next_seq is not None else seq
    last = relay.on_frame(_valid_clear(nxt), check_gap=False)
    assert last.batches and not last.dead, "the relay stopped relaying after bad frames"
    now = time.time()
    for out in [*outs, last]:
        for d in out.dead:
            assert d.reason and isinstance(d.detail, str) and len(d.detail) <= 300
        for b in out.batches:
            again = decode_batch(encode_batch(b))  # what the worker will read
            assert again == b or any(isinstance(x, float) and math.isnan(x)
                                     for x in (b.engine_ts, b.relay_ts))
            shard.apply(again, now)


frames_case = st.tuples(
    st.sampled_from(sorted(fixture_frames())),
    st.integers(0, 40),
    st.lists(payloads(), min_size=1, max_size=4),
    st.lists(st.integers(-2, 3), max_size=4),  # seq offsets: duplicates, gaps, in order
)


@FAST
@given(payloads())
def test_decode_payload_raises_only_msgspec_errors(data):
    _check_payload(data)


@FAST
@given(frames_case)
def test_relay_turns_bad_frames_into_dead_letters(case):
    _check_relay(*case)


@pytest.mark.slow
@SLOW
@given(frames_case)
def test_relay_turns_bad_frames_into_dead_letters_long(case):
    _check_relay(*case)


def _known_bad() -> list[bytes]:
    """A deterministic corpus (regressions of what the fuzzers found): every field of a real
    BlockStored / BlockRemoved replaced by each hostile header and by out-of-range values."""
    out = []
    for frames in fixture_frames().values():
        for f in frames[:6]:
            tree = msgspec.msgpack.decode(f.payload)
            # every field, and the first two items of every list
            for path in [p for p in node_paths(tree) if all(not isinstance(k, int) or k < 2 for k in p[2:])]:
                for new in [PLACEHOLDER, -1, 5, 2**32, 2**64 - 1, [2**64 - 1] * 40, {"a": 1}, "x", None,
                            1.5, [[1, [2]]]]:
                    t = msgspec.msgpack.decode(f.payload)
                    enc = msgspec.msgpack.encode(replace_node(t, path, new))
                    if new == PLACEHOLDER:
                        out += [enc.replace(ENC_PLACEHOLDER, h, 1) for h in HOSTILE]
                    else:
                        out.append(enc)
    return out


def test_known_bad_payloads():
    bad = _known_bad()
    assert len(bad) > 1000
    for data in bad:
        _check_payload(data)
    name = sorted(fixture_frames())[0]
    for i in range(0, len(bad), 50):
        _check_relay(name, 3, bad[i:i + 50], [])


def test_hostile_headers_allocate_little():
    """A few bytes claiming 4G elements or 4 GB strings (or nesting thousands deep) are refused without
    allocating what they claim."""
    relay = VllmPublisherRelay("fuzz", "tcp://fuzz:5557", INDEX_BS)
    seed = real_payloads()[0]
    tracemalloc.start()
    try:
        for h in HOSTILE:
            for data in (h, b"\x93\xcb" + seed[2:10] + h, seed[:40] + h):
                tracemalloc.reset_peak()
                seq = relay.next_seq or 0
                out = relay.on_frame(Frame(b"kv", seq, data, time.time_ns()))
                peak = tracemalloc.get_traced_memory()[1]
                assert peak < 8 << 20, (h[:8], peak)
                assert out.dead or out.batches
    finally:
        tracemalloc.stop()


def test_oversized_frame_rejected_before_decoding(monkeypatch):
    import kvidx.engines.vllm.relay as vr

    def boom(_):
        raise AssertionError("an oversized frame was decoded")

    monkeypatch.setattr(vr, "decode_payload", boom)
    relay = VllmPublisherRelay("fuzz", "tcp://fuzz:5557", INDEX_BS)
    big = bytes(MAX_PAYLOAD + 1)
    out = relay.on_frame(Frame(b"kv", 0, big, time.time_ns()))
    assert [d.reason for d in out.dead] == ["oversized"]
    assert relay.next_seq == 1  # the sequence number is consumed: no gap follows


# ---- event batches and routes (what the worker, the follower and the service read) ------------

def _agrees(value: object, tree: object) -> bool:
    """A decoded value (as builtins: array-like structs are lists) against the tree: equal, floats
    read from ints or NaN alike, an array-like struct's omitted trailing fields its defaults (and
    trailing items the struct does not know ignored)."""
    if isinstance(value, float):
        return _same_float(value, tree)
    if isinstance(value, list) and isinstance(tree, list):
        return all(_agrees(v, t) for v, t in zip(value, tree, strict=False))
    if isinstance(value, dict) and isinstance(tree, dict):
        return value.keys() == tree.keys() and all(_agrees(value[k], tree[k]) for k in value)
    return type(value) is type(tree) and value == tree


def _round_trips(value: object, encode, decode) -> None:
    again = decode(encode(value))
    enc = msgspec.msgpack.Encoder(enc_hook=enc_hook).encode  # (decoded hashes: a HashArray)
    assert enc(again) == enc(value)  # (NaN != NaN: bytes compared)


def _check_batch(data: bytes) -> None:
    ok, tree = _tree(data)
    try:
        b = decode_batch(data)
    except READER_ERRORS:
        return
    assert ok and isinstance(tree, list) and tree[0] == SCHEMA_VERSION, "accepted what the tree refuses"
    assert isinstance(b, EventBatch) and _agrees(msgspec.to_builtins(b, enc_hook=enc_hook), tree)
    _round_trips(b, encode_batch, decode_batch)
    shard = ModelShard("fuzz", INDEX_BS)
    now = time.time()
    if shard.apply(b, now):  # (False: an epoch from the future, or not after a new replica's start)
        st = shard.replicas[(b.replica, b.dp_rank)]
        assert (st.epoch, st.seq) == (b.epoch, b.seq)
        assert not shard.apply(again := decode_batch(data), now), again  # a redelivery folds nothing


def _check_route(data: bytes) -> None:
    from index_service.store import ShardStore

    ok, tree = _tree(data)
    try:
        d = decode_route(data)
    except READER_ERRORS:
        return
    assert ok and isinstance(tree, list) and tree[0] == ROUTES_VERSION, "accepted what the tree refuses"
    assert _agrees(msgspec.to_builtins(d), tree)
    _round_trips(d, encode_route, decode_route)
    store = ShardStore(INDEX_BS)
    assert store.apply_route(d) and not store.apply_route(d)  # the repeat is a duplicate
    shard = store.shards[d.model]
    walk.lookup(shard, d.block_hashes[:64], max(1, d.prompt_tokens) if d.prompt_tokens < 1 << 30 else 1 << 20,
                 time.time())


@FAST
@given(mutated(real_batches()))
def test_decode_batch_and_fold(data):
    _check_batch(data)


@FAST
@given(mutated(real_routes()))
def test_decode_route_and_apply(data):
    _check_route(data)


@pytest.mark.slow
@SLOW
@given(mutated(real_payloads()))
def test_decode_payload_long(data):
    _check_payload(data)


@pytest.mark.slow
@SLOW
@given(st.one_of(mutated(real_batches()), mutated(real_routes())))
def test_decode_batch_and_route_long(data):
    _check_batch(data)
    _check_route(data)
