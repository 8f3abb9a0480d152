"""Fuzzing the decoders of untrusted bytes (hypothesis): vLLM engine frames (decode_payload and the
relay's on_frame), event batches (decode_batch, then the shard fold) and routing decisions
(decode_route, then the store).

Inputs start from real payloads (tests/fixtures/vllm-0.32/*/frames.jsonl, vllm-variants) and are
mutated at the byte level (truncate, flip, insert, splice a hostile msgpack header: 4-billion-element
arrays, 4 GB strings, deep nesting) and at the structure level (a node replaced by a value of another
type, wrong tags, huge ints, NaN, long lists), plus arbitrary msgpack values.

Properties:
- decode_payload raises only msgspec.DecodeError / ValidationError;
- on_frame never raises: bad frames become DeadLetters, the relay keeps going (a valid frame after the
  bad ones is relayed), and every batch it emits encodes, decodes and folds into a shard;
- decode_batch / decode_route raise only DecodeError / ValidationError / ValueError (what the worker,
  the follower and the service catch), and what they accept folds without an exception;
- bounded: hostile length headers allocate little (tracemalloc) and an oversized frame is rejected
  before it is decoded.

The default run is short (FUZZ_EXAMPLES examples per property, a few seconds, fixed seed); the
`slow` tests (deselected by default, pyproject addopts) run each property 20x longer with a random
seed: `pytest -m slow tests/test_fuzz.py`.
"""

from __future__ import annotations

import math
import time
import tracemalloc
from functools import cache

import msgspec
import pytest
from conftest import FIXTURES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvidx.core.shard import ModelShard
from kvidx.engines.contract import MAX_PAYLOAD, Frame
from kvidx.engines.recording import read_frames
from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.engines.vllm.wire import decode_payload
from schemas.events import EventBatch, decode_batch, encode_batch
from schemas.routes import RouteDecision, decode_route, encode_route

FUZZ_EXAMPLES = 300
SLOW_EXAMPLES = 6000
INDEX_BS = 16
DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError)
READER_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, ValueError)
PLACEHOLDER = "\x00kvidx-fuzz-placeholder\x00"
_ENC_PLACEHOLDER = msgspec.msgpack.encode(PLACEHOLDER)

FAST = settings(max_examples=FUZZ_EXAMPLES, deadline=2000, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SLOW = settings(FAST, max_examples=SLOW_EXAMPLES, derandomize=False)


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


# ---- mutations --------------------------------------------------------------------------------

msgpack_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
                   | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
                   | st.binary(max_size=40)
                   | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "GPU",
                                      "cpu", "", "mamba", "sliding_window", "full_attention"]))
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda kids: st.lists(kids, max_size=6) | st.dictionaries(
        st.text(max_size=12) | st.integers(-(2**63), 2**63 - 1), kids, max_size=5),
    max_leaves=30)

# Byte strings a hostile or broken sender could put where a msgpack value is expected.
HOSTILE = [
    b"\xdd\xff\xff\xff\xff",          # array32 claiming 4G elements, then nothing
    b"\xdd\x7f\xff\xff\xff\xc0",
    b"\xdf\xff\xff\xff\xff",          # map32 claiming 4G pairs
    b"\xdb\xff\xff\xff\xff" + b"x" * 8,  # str32 of 4 GB
    b"\xc6\xff\xff\xff\xff",          # bin32 of 4 GB
    b"\xc9\xff\xff\xff\xff\x01",      # ext32
    b"\xd4\x01\x00",                  # fixext (not used by vLLM)
    b"\xc1",                          # never used
    b"\x91" * 5000 + b"\xc0",         # 5000-deep nesting
    b"\x81\xc0" * 3000 + b"\xc0",     # 3000-deep maps keyed by nil
    b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff",  # uint64 max
    b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00",  # int64 min
    b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00",  # NaN
]


def _paths(obj, path=()):
    yield path
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*path, i))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*path, k))


def _replace(obj, path, new):
    if not path:
        return new
    obj[path[0]] = _replace(obj[path[0]], path[1:], new)
    return obj


@st.composite
def structural(draw, raw: bytes) -> bytes:
    """Decode a real payload generically, replace one node, re-encode."""
    tree = msgspec.msgpack.decode(raw)
    paths = list(_paths(tree))
    path = draw(st.sampled_from(paths))
    kind = draw(st.sampled_from(["value", "hostile", "long_list", "wrong_tag", "big_int", "drop",
                                 "duplicate"]))
    if kind == "value":
        new = draw(msgpack_values)
    elif kind == "hostile":
        new = PLACEHOLDER
    elif kind == "long_list":
        new = [draw(st.integers(-(2**63), 2**64 - 1))] * draw(st.integers(1_000, 200_000))
    elif kind == "wrong_tag":
        new = draw(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Blockstored",
                                    "", 0, None]))
    elif kind == "big_int":
        new = draw(st.sampled_from([-1, 0, 2**31, 2**32, 2**63 - 1, -(2**63), 2**64 - 1, 1 << 40]))
    elif kind == "drop" and path:
        parent = tree
        for p in path[:-1]:
            parent = parent[p]
        del parent[path[-1]]
        return msgspec.msgpack.encode(tree)
    else:  # duplicate the node where it is (a list of it)
        node = tree
        for p in path:
            node = node[p]
        new = [node] * draw(st.integers(2, 50))
    out = msgspec.msgpack.encode(_replace(tree, path, new))
    if kind == "hostile":
        out = out.replace(_ENC_PLACEHOLDER, draw(st.sampled_from(HOSTILE)), 1)
    return out


@st.composite
def byte_level(draw, raw: bytes) -> bytes:
    kind = draw(st.sampled_from(["truncate", "flip", "insert", "splice", "concat"]))
    n = len(raw)
    if kind == "truncate":
        return raw[:draw(st.integers(0, max(0, n - 1)))]
    if kind == "flip":
        b = bytearray(raw)
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, n - 1))
            b[i] ^= draw(st.integers(1, 255))
        return bytes(b)
    if kind == "insert":
        i = draw(st.integers(0, n))
        return raw[:i] + draw(st.binary(min_size=1, max_size=16)) + raw[i:]
    if kind == "splice":
        i = draw(st.integers(0, n))
        return raw[:i] + draw(st.sampled_from(HOSTILE)) + raw[i + draw(st.integers(0, 8)):]
    return raw + raw[:draw(st.integers(1, max(1, n)))]


def mutated(seeds: list[bytes]) -> st.SearchStrategy[bytes]:
    seed = st.integers(0, len(seeds) - 1).map(seeds.__getitem__)  # (sampled_from's repr lists them)
    return st.one_of(
        seed.flatmap(byte_level),
        seed.flatmap(structural),
        msgpack_values.map(msgspec.msgpack.encode),
        st.binary(max_size=64),
    )


def payloads() -> st.SearchStrategy[bytes]:
    return mutated(real_payloads())


# ---- engine frames ----------------------------------------------------------------------------

def _check_payload(data: bytes) -> None:
    try:
        decode_payload(data)
    except DECODE_ERRORS:
        pass


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
            for path in [p for p in _paths(tree) if all(not isinstance(k, int) or k < 2 for k in p[2:])]:
                for new in [PLACEHOLDER, -1, 5, 2**32, 2**64 - 1, [2**64 - 1] * 40, {"a": 1}, "x", None,
                            1.5, [[1, [2]]]]:
                    t = msgspec.msgpack.decode(f.payload)
                    enc = msgspec.msgpack.encode(_replace(t, path, new))
                    if new == PLACEHOLDER:
                        out += [enc.replace(_ENC_PLACEHOLDER, h, 1) for h in HOSTILE]
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

def _check_batch(data: bytes) -> None:
    try:
        b = decode_batch(data)
    except READER_ERRORS:
        return
    assert isinstance(b, EventBatch)
    ModelShard("fuzz", INDEX_BS).apply(b, time.time())


def _check_route(data: bytes) -> None:
    from index_service.store import ShardStore

    try:
        d = decode_route(data)
    except READER_ERRORS:
        return
    store = ShardStore(INDEX_BS)
    store.apply_route(d)
    shard = store.shards[d.model]
    shard.lookup(d.block_hashes[:64], max(1, d.prompt_tokens) if d.prompt_tokens < 1 << 30 else 1 << 20,
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
