"""Mutations of real inputs for the fuzz tests (hypothesis strategies), shared by
tests/fuzz/test_decoders.py and tests/fuzz/test_engines.py: byte-level (truncate, flip, insert, splice a
hostile msgpack header, concat), structural (a node of the decoded tree replaced, dropped or
duplicated) and arbitrary msgpack values; the fast (fixed seed) and slow settings."""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FUZZ_EXAMPLES = 300  # per property in the default run (fixed seed)
SLOW_EXAMPLES = 6000  # per property in the `slow` run (random seed)
PLACEHOLDER = "\x00kvidx-fuzz-placeholder\x00"
ENC_PLACEHOLDER = msgspec.msgpack.encode(PLACEHOLDER)

FAST = settings(max_examples=FUZZ_EXAMPLES, deadline=2000, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SLOW = settings(FAST, max_examples=SLOW_EXAMPLES, derandomize=False)


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


def node_paths(obj, path=()):
    """Every path (tuple of keys and indexes) into a decoded msgpack/JSON tree, the root first."""
    yield path
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from node_paths(v, (*path, i))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from node_paths(v, (*path, k))


def replace_node(obj, path, new):
    """`obj` with the node at `path` replaced by `new` (in place where it can be)."""
    if not path:
        return new
    obj[path[0]] = replace_node(obj[path[0]], path[1:], new)
    return obj


@st.composite
def structural(draw, raw: bytes) -> bytes:
    """Decode a real payload generically, replace one node, re-encode."""
    tree = msgspec.msgpack.decode(raw)
    paths = list(node_paths(tree))
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
    out = msgspec.msgpack.encode(replace_node(tree, path, new))
    if kind == "hostile":
        out = out.replace(ENC_PLACEHOLDER, draw(st.sampled_from(HOSTILE)), 1)
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
