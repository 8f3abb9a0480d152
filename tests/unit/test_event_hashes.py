"""An event's hashes as decode_batch hands them over (schemas/events.py BlockHashes): read off the wire
undecoded and unpacked by the compiled core (kvidx_native.unpack_hashes, a HashArray) or its
pure-Python stand-in (a list), each checked as msgspec checks list[BlockHash]. Both against msgspec's
own decode of the same bytes: the same hashes, the same refusals, the same messages."""

import random

import msgspec
import pytest

from kvidx.core.maskmap import native_module
from kvidx.core.shard import NATIVE_FOLD, ModelShard
from schemas import events
from schemas.events import (
    SCHEMA_VERSION,
    BlockHash,
    BlocksRemoved,
    BlocksStored,
    EventBatch,
    ReplicaCleared,
    decode_batch,
    encode_batch,
)

NATIVE = native_module()
UNPACKERS = [pytest.param(events._unpack_python, id="python")] + (
    [pytest.param(NATIVE.unpack_hashes, id="native")] if NATIVE is not None else [])
EDGES = [0, 1, 127, 128, 255, 256, 2**15, 2**16 - 1, 2**16, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63,
         2**64 - 1]


def _batch(*evs) -> bytes:
    return encode_batch(EventBatch(SCHEMA_VERSION, "m", "r", 0, 1, 0, 1.0, 1.0, 16, list(evs)))


def _wire(hashes_bytes: bytes) -> bytes:
    """A batch of one stored event whose hashes are these msgpack bytes (any encoder's forms)."""
    enc = msgspec.msgpack.encode
    ev = b"\x96" + enc("stored") + enc("GPU") + enc(0) + hashes_bytes + enc(None) + enc(0)
    head = b"".join(enc(x) for x in [SCHEMA_VERSION, "m", "r", 0, 1, 0, 1.0, 1.0, 16])
    return b"\x9a" + head + b"\x91" + ev


def _unpack_with(unpack, raw: bytes):
    b = msgspec.msgpack.Decoder(EventBatch).decode(raw)  # hashes left undecoded (msgspec.Raw)
    unpack(b.events, (BlocksStored, BlocksRemoved), msgspec.Raw, 0)
    return b.events[0].hashes


@pytest.mark.parametrize("unpack", UNPACKERS)
@pytest.mark.parametrize("seed", range(5))
def test_unpacked_hashes_are_what_msgspec_decodes(unpack, seed):
    r = random.Random(seed)
    hashes = [r.choice(EDGES) if r.random() < 0.3 else r.getrandbits(r.choice([7, 16, 32, 64]))
              for _ in range(r.choice([0, 1, 15, 16, 17, 300, 70_000]))]
    got = _unpack_with(unpack, _batch(BlocksStored("GPU", 0, hashes, None, 0)))
    assert list(got) == hashes and len(got) == len(hashes)
    assert type(got) is (list if unpack is events._unpack_python else NATIVE.HashArray)


@pytest.mark.parametrize("unpack", UNPACKERS)
def test_any_int_form_another_encoder_may_use_is_read(unpack):
    # signed forms of non-negative values (int8..int64) and the smallest unsigned ones, in an array16
    items = b"\xd0\x05" + b"\xd1\x01\x00" + b"\xd2\x00\x01\x00\x00" + b"\xd3" + (2**62).to_bytes(8, "big") + \
        b"\xcc\xff" + b"\x07"
    assert list(_unpack_with(unpack, _wire(b"\xdc\x00\x06" + items))) == [5, 256, 65536, 2**62, 255, 7]


@pytest.mark.parametrize("hashes_bytes", [
    b"\x92\x01\xff",  # a negative fixint
    b"\x92\x01\xd3" + (2**64 - 5).to_bytes(8, "big"),  # a negative int64
    b"\x91\xc3",  # a bool
    b"\x91\xcb" + bytes(8),  # a float
    b"\x91\xa1a",  # a str
    b"\x91\xc0",  # nil
    b"\x91\x90",  # an array in the array
    b"\xa1a",  # not an array
    b"\x80",  # a map
    b"\xc0",  # nil
])
def test_what_msgspec_refuses_is_refused_alike_with_its_path(hashes_bytes):
    raw = _wire(hashes_bytes)
    with pytest.raises(msgspec.ValidationError) as want:
        msgspec.msgpack.decode(hashes_bytes, type=list[BlockHash])
    path = "`$.events[0].hashes"
    for unpack in [p.values[0] for p in UNPACKERS]:
        with pytest.raises(msgspec.ValidationError) as got:
            _unpack_with(unpack, raw)
        want_why = str(want.value)  # msgspec names no path at the top of what it decodes
        want_why = want_why.replace("`$", path, 1) if " - at `$" in want_why else f"{want_why} - at {path}`"
        assert str(got.value) == want_why, unpack
    with pytest.raises(msgspec.ValidationError):
        decode_batch(raw)


def test_decoded_batches_fold_compiled_and_encode_again():
    evs = [BlocksStored("GPU", 0, [1, 2, 3], None, 0), BlocksRemoved("GPU", 0, [3]), ReplicaCleared("x")]
    b = decode_batch(_batch(*evs))
    assert b.events == evs and encode_batch(b) == _batch(*evs)  # equal to the lists, written as them
    if NATIVE is None:
        return
    assert type(b.events[0].hashes) is NATIVE.HashArray
    s = ModelShard("m", 16)
    s.apply(decode_batch(_batch(BlocksStored("GPU", 0, [9], None, 0))), 1.0)  # a new replica: Python's fold
    b = decode_batch(_batch(*evs[:2]))
    b.seq = 1
    folded = NATIVE_FOLD.folded
    assert s.apply(b, 2.0) and NATIVE_FOLD.folded == folded + 1  # taken by the compiled fold, not declined
    assert sorted(s.groups[0].any.items()) == [(1, 1), (2, 1), (9, 1)]


def test_hashes_nested_past_the_recursion_limit_are_a_decode_error():
    """msgspec steps over the undecoded hashes recursively: a deep nest is refused as undecodable, as
    every reader expects (DecodeError), never a RecursionError."""
    with pytest.raises(msgspec.DecodeError, match="nested too deeply"):
        decode_batch(_wire(b"\x91" * 5000 + b"\xc0"))
