"""The mask map (kvidx/core/maskmap.py): the native MaskMap (native/, Rust) and the pure-Python
reference PyMaskMap driven side by side by random operation sequences (slots 0..130, so masks wider
than one 64-bit word are covered), comparing every return value and exception and the final
contents; the walk and bulk masks against the AND-walk over a plain dict (maskmap.walk_masks), the
snapshot layout against format 2's mask packing as it was before the mask map (copied here); `chain`
against kvidx.core.hashing.chain.

Without kvidx_native the native half skips (the reference's own checks still run), unless
KVIDX_REQUIRE_NATIVE=1 (CI), where a missing native module fails."""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvidx.core import maskmap
from kvidx.core.hashing import chain as ref_chain
from kvidx.core.maskmap import PyMaskMap, py_chain, walk_masks
from tests.helpers import ROOT

try:
    import kvidx_native
except ImportError:
    kvidx_native = None

REQUIRE = os.environ.get("KVIDX_REQUIRE_NATIVE") == "1"


@pytest.fixture(scope="module")
def native():
    if kvidx_native is None:
        if REQUIRE:
            pytest.fail("KVIDX_REQUIRE_NATIVE=1 but kvidx_native does not import")
        pytest.skip("kvidx_native is not built (no Rust toolchain): the pure-Python core runs")
    return kvidx_native


@pytest.fixture(scope="module", params=["wide", "blocks", "numbers"])
def reader(native, request):
    """split_token_ids pinned to one way of reading token arrays (native/src/tokens.rs: AVX-512,
    64-byte blocks, number by number); skipped where this CPU lacks it."""
    if native.token_reader(request.param) != request.param:
        native.token_reader("wide")
        pytest.skip(f"this CPU does not run the {request.param!r} token reader")
    yield request.param
    native.token_reader("wide")


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
M64 = (1 << 64) - 1
PHI = 0x9E3779B97F4A7C15


def mix(k: int) -> int:
    """native/src/table.rs `mix`: the stored form of a key (its top bits pick the home bucket)."""
    return ((k ^ (k >> 32)) * PHI) & M64


def unmix(m: int) -> int:
    """The key whose stored form is `m` (table.rs `unmix`): keys that land where a test wants."""
    x = (m * pow(PHI, -1, 1 << 64)) & M64
    return x ^ (x >> 32)


def crowd(kind: str, n: int, at: int = 0) -> list[int]:
    """n keys the native table must hold together: "end": stored forms at the very top (all in the
    last bucket at any size: runs past the end of the array, into its slack), "start": just above 0
    (all in bucket 0), "run": consecutive stored forms from `at` (one long run: insertions and
    backward-shift deletions shift it), "small": 1..n (what tests use as hashes)."""
    if kind == "end":
        return [unmix(M64 - i) for i in range(n)]
    if kind == "start":
        return [unmix(1 + i) for i in range(n)]
    if kind == "run":
        return [unmix((at + i) & M64) for i in range(n)]
    return list(range(1, n + 1))


POOL = [0, 1, 2, 3, 63, 64, 1 << 32, 1 << 63, M64, M64 - 1, PHI, 12345678901234567,
        unmix(M64), unmix(M64 - 1), unmix(1), unmix(1 << 63)]  # the ends of the table too
hashes = st.one_of(st.sampled_from(POOL), st.integers(0, M64))
# the native map's forms (native/src/masks.rs): one word below 64; past it, up to 5 slots below 4,095
# or 3 below 2**20 - 1 inline, else a table per word (words 61 and beyond share one bitmap bit)
WIDE_SLOTS = [3903, 3904, 3968, 4094, 4095, 4096, 70_000, 1_048_574, 1_048_575]
slots = st.one_of(st.integers(0, 7), st.sampled_from([63, 64, 65, 127, 128]), st.integers(0, 130),
                  st.sampled_from(WIDE_SLOTS))
masks = st.sets(slots, min_size=1, max_size=7).map(lambda s: sum(1 << i for i in s))
N_MAPS = 4  # maps 0..2: tiers of a group; map 3: their union ("any tier")


def operations(h: st.SearchStrategy, s: st.SearchStrategy) -> st.SearchStrategy:
    """One operation on hashes from `h` and slots from `s`."""
    hl = st.lists(h, max_size=12)
    m = st.one_of(masks, st.sets(s, min_size=1, max_size=3).map(lambda b: sum(1 << i for i in b)))
    i = st.integers(0, N_MAPS - 1)
    fold = st.one_of(  # the shard's fold: the most of a program
        st.tuples(st.just("tier_store"), st.integers(0, 2), hl, s),
        st.tuples(st.just("remove"), st.integers(0, 2), hl, s, st.sampled_from(
            ["tiers", "tiers", "none", "self_union", "self_in_others", "union_in_others"])),
    )
    return st.one_of(
        fold, fold, fold,
        st.tuples(st.just("store"), i, hl, s),
        st.tuples(st.just("clear_slot"), i, s),
        st.tuples(st.just("setitem"), i, h, st.one_of(m, st.just(0))),
        st.tuples(st.just("delitem"), i, h),
        st.tuples(st.just("pop"), i, h, st.sampled_from([(), (None,), (7,)])),
        st.tuples(st.just("get"), i, h),
        st.tuples(st.just("update"), i, st.lists(st.tuples(h, m), max_size=5)),
        st.tuples(st.just("export_load"), i, i, st.integers(1, 4)),
        st.tuples(st.just("or_into"), i, i),
        st.tuples(st.just("copy"), i, i),
        st.tuples(st.just("masks"), i, hl),
        st.tuples(st.just("lacking"), i, hl, s),
        st.tuples(st.just("walk"), i, hl),
    )


@st.composite
def programs(draw) -> list[tuple]:
    """A sequence of operations over a few hashes and slots of its own (so that tiers share blocks and
    slots, as in a shard), now and then any hash or slot; wide slots (>= 64) included."""
    hp = draw(st.lists(hashes, min_size=1, max_size=6, unique=True))
    sp = draw(st.lists(slots, min_size=1, max_size=3, unique=True))
    h = st.one_of(st.sampled_from(hp), st.sampled_from(hp), st.sampled_from(hp), hashes)
    s = st.one_of(st.sampled_from(sp), st.sampled_from(sp), st.sampled_from(sp), slots)
    return draw(st.lists(operations(h, s), min_size=10, max_size=60))


def apply(maps: list, op: tuple):
    """Runs one operation on `maps` (one implementation's); its result (or exception type) to compare."""
    name, i, *args = op
    d = maps[i]
    try:
        if name == "store":
            return d.store(args[0], args[1])
        if name == "tier_store":  # as the shard stores: in a tier and in the union
            return d.store(args[0], args[1]), maps[3].store(args[0], args[1])
        if name == "remove":
            hs, slot, mode = args
            tiers = [maps[j] for j in range(3) if j != i]
            if mode == "tiers":
                return d.remove(hs, slot, tiers, maps[3])
            if mode == "none":
                return d.remove(hs, slot)
            if mode == "self_union":  # one tier: the union is the tier's own map
                return d.remove(hs, slot, [], d)
            if mode == "self_in_others":
                return d.remove(hs, slot, [d, *tiers], maps[3])
            return d.remove(hs, slot, [maps[3]], maps[3])
        if name == "clear_slot":
            return d.clear_slot(args[0])
        if name == "setitem":
            d[args[0]] = args[1]
            return None
        if name == "delitem":
            del d[args[0]]
            return None
        if name == "pop":
            return d.pop(args[0], *args[1])
        if name == "get":
            return (d.get(args[0]), d.get(args[0], -1), args[0] in d, len(d))
        if name == "update":
            return d.update(args[0])
        if name == "export_load":
            keys, packed = d.export(args[1])
            maps[args[0]].load(keys, packed, args[1])
            return len(keys), len(packed)
        if name == "or_into":
            return d.or_into(maps[args[0]])
        if name == "copy":
            maps[args[0]] = d.copy()
            return None
        if name == "masks":
            return d.masks(args[0])
        if name == "lacking":
            return d.lacking(args[0], args[1])
        if name == "walk":
            return d.walk(args[0])
    except (ValueError, KeyError, OverflowError, TypeError) as e:
        return type(e)
    raise AssertionError(name)


def _pack_masks(values, n: int, n_slots: int) -> tuple[int, bytes]:
    """Snapshot format 2's masks as snapshot.py wrote them before the mask map (`words` little-endian
    uint64 words each): what `export` must keep producing for old and new snapshots to agree."""
    words = max(1, (n_slots + 63) // 64)
    if words == 1:
        return 1, np.fromiter(values, dtype=np.uint64, count=n).tobytes()
    buf = bytearray()
    for m in values:
        buf += m.to_bytes(words * 8, "little")
    return words, bytes(buf)


def _unpack_masks(packed) -> list[int]:
    words, data = packed
    if words == 1:
        return np.frombuffer(data, dtype=np.uint64).tolist()
    w = words * 8
    return [int.from_bytes(data[i:i + w], "little") for i in range(0, len(data), w)]


def contents(d) -> list[tuple[int, int]]:
    return sorted(d.items())


@settings(SETTINGS, max_examples=250)
@given(programs())
def test_native_and_reference_agree_on_random_operation_sequences(native, seq):
    py = [PyMaskMap() for _ in range(N_MAPS)]
    nat = [native.MaskMap() for _ in range(N_MAPS)]
    for op in seq:
        got_py, got_nat = apply(py, op), apply(nat, op)
        assert got_nat == got_py, op
    for a, b in zip(py, nat, strict=True):
        assert contents(b) == contents(a)
        assert len(b) == len(a)
        assert all(m > 0 for m in b.values())
        assert sorted(b.keys()) == sorted(a.keys()) and sorted(b.values()) == sorted(a.values())
        assert sorted(b) == sorted(a)


def _impls(native_mod):
    return [PyMaskMap] + ([native_mod.MaskMap] if native_mod is not None else [])


@SETTINGS
@given(base=st.lists(st.integers(0, M64), min_size=1, max_size=30, unique=True),
       held=st.lists(st.tuples(slots, st.integers(0, 30)), max_size=8),
       probe=st.lists(st.tuples(st.integers(0, 29), st.booleans()), max_size=8))
def test_walk_and_masks_match_the_shards_walk(base, held, probe):
    """Slot s holds base[:k] (prefixes, as engines do); the walk of base, of its prefixes and of
    variants with a foreign hash spliced in matches the shard's AND-walk over a plain dict."""
    ref: dict[int, int] = {}
    for s, k in held:
        for h in base[:k]:
            ref[h] = ref.get(h, 0) | 1 << s
    seqs = [base, base[:1], list(reversed(base))]
    for at, foreign in probe:
        s = list(base)
        s.insert(min(at, len(s)), 0x5EED if foreign else base[0])
        seqs.append(s)
    for impl in _impls(kvidx_native):
        d = impl()
        for s, k in held:
            d.store(base[:k], s)
        assert contents(d) == sorted(ref.items())
        for s in seqs:
            assert d.walk(s) == walk_masks(ref.get, s), (impl, s)
            assert list(d.walk(s).items()) == list(walk_masks(ref.get, s).items())  # same order too
            assert d.masks(s) == [ref.get(h, 0) for h in s]
        assert d.walk([]) == {}


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, M64), masks), max_size=30), st.integers(0, 3))
def test_export_is_the_snapshot_layout_and_load_reads_it_back(pairs, extra_words):
    for impl in _impls(kvidx_native):
        d = impl(pairs)
        n_slots = max((m.bit_length() for m in d.values()), default=0)
        words = max(1, (n_slots + 63) // 64)
        keys, packed = d.export(words)
        # exactly what snapshot.py writes: keys as little-endian u64s, masks by _pack_masks, one order
        assert keys == np.fromiter(d.keys(), dtype=np.uint64, count=len(d)).tobytes()
        assert (words, packed) == _pack_masks(d.values(), len(d), n_slots)
        assert _unpack_masks((words, packed)) == list(d.values())
        if words > 1:
            with pytest.raises(ValueError):
                d.export(words - 1)
        wide_keys, wide = d.export(words + extra_words)
        back = impl()
        back.load(wide_keys, wide, words + extra_words)
        assert contents(back) == contents(d)
        back.load(keys, packed, words)  # OR-ing the same entries in again changes nothing
        assert contents(back) == contents(d)


def test_load_ors_into_existing_entries_and_skips_zero_masks():
    for impl in _impls(kvidx_native):
        d = impl([(1, 0b01), (2, 1 << 70)])
        keys = np.array([1, 2, 3, 1], dtype="<u8").tobytes()
        packed = b"".join(m.to_bytes(16, "little") for m in (0b10, 1, 0, 1 << 100))
        d.load(keys, packed, 2)
        assert contents(d) == [(1, 0b11 | 1 << 100), (2, 1 << 70 | 1)], impl
        with pytest.raises(ValueError):
            d.load(keys, packed[:-8], 2)
        with pytest.raises(ValueError):
            d.load(keys, packed, 0)
        e = impl()
        e.load(memoryview(keys), bytearray(packed), 2)  # any bytes-like object
        assert contents(e) == [(1, 0b10 | 1 << 100), (2, 1)]


def test_dict_like_errors_and_copies(native):
    for impl in (PyMaskMap, native.MaskMap):
        d = impl([(5, 3), (1 << 63, 1 << 99)])
        for bad in (0, -1):
            with pytest.raises(ValueError):
                d[7] = bad
        with pytest.raises(OverflowError):
            d[-1] = 1
        with pytest.raises(OverflowError):
            d[1 << 64] = 1
        with pytest.raises(TypeError):
            d[7] = "1"
        with pytest.raises(KeyError):
            d[7]
        with pytest.raises(KeyError):
            del d[7]
        with pytest.raises(KeyError):
            d.pop(7)
        with pytest.raises(ValueError):
            d.store([1], -1)
        with pytest.raises(OverflowError):
            d.store([-1], 0)
        assert d.get(7) == 0 and d.get("x", None) is None and "x" not in d and -1 not in d
        assert d.pop(7, None) is None
        c = d.copy()
        c.store([5], 200)
        assert d[5] == 3 and c[5] == 3 | 1 << 200
        for other in (copy.copy(d), copy.deepcopy(d), pickle.loads(pickle.dumps(d))):
            assert type(other) is impl and contents(other) == contents(d)
        assert sorted(iter(d)) == [5, 1 << 63]
        d.update({9: 1})
        d.update(d)
        assert contents(d) == [(5, 3), (9, 1), (1 << 63, 1 << 99)]
        assert d.memory_bytes() > 0
        d.clear()
        assert len(d) == 0 and not d


def test_remove_retracts_the_union_only_when_the_last_tier_drops_a_block(native):
    for impl in (PyMaskMap, native.MaskMap):
        gpu, cpu, any_ = impl(), impl(), impl()
        for tier in (gpu, cpu):
            tier.store([1, 2], 3)
        gpu.store([1, 2], 100)
        gpu.or_into(any_)
        cpu.or_into(any_)
        assert gpu.remove([1, 2, 9], 3, [cpu], any_) == 2
        assert contents(any_) == [(1, 8 | 1 << 100), (2, 8 | 1 << 100)]  # cpu still holds slot 3
        assert cpu.remove([1], 3, [gpu], any_) == 1
        assert contents(any_) == [(1, 1 << 100), (2, 8 | 1 << 100)]
        assert gpu.remove([1, 1], 100, [cpu], any_) == 1
        assert contents(gpu) == [(2, 1 << 100)] and contents(any_) == [(2, 8 | 1 << 100)]
        assert any_.clear_slot(100) == 1 and contents(any_) == [(2, 8)]


@SETTINGS
@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.integers(1, 20), st.integers(0, M64))
def test_chain_matches_canonical_hashing(tokens, block_size, parent):
    packed = np.asarray(tokens, dtype="<u4").tobytes()
    want = ref_chain(packed, block_size, parent)
    for f in [py_chain] + ([kvidx_native.chain] if kvidx_native else []):
        assert f(packed, block_size, parent) == want
        assert f(memoryview(packed), block_size, parent) == want
        assert f(bytearray(packed), block_size, parent) == want


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=80), st.sampled_from([1, 2, 3, 16]),
       st.integers(0, 2**64 - 1), st.lists(st.integers(0, 2**64 - 1), max_size=8))
def test_hash_array_is_the_chain_and_the_maps_read_it_as_the_list(tokens, block_size, parent, other):
    """chain_array (the service's prompt hashes, no int per hash) against the reference chain: equal
    as a sequence (items, negative indexes, slices, iteration), and every batched map operation
    answers on it as on the list."""
    packed = np.asarray(tokens, dtype="<u4").tobytes()
    want = ref_chain(packed, block_size, parent)
    got = maskmap.chain_array(packed, block_size, parent)
    assert got == want and list(got) == want and len(got) == len(want) and bool(got) == bool(want)
    if maskmap.native_module() is None:  # the pure-Python core (KVIDX_NATIVE=0 or not built): a list
        return
    assert isinstance(got, kvidx_native.HashArray) and got.tolist() == want
    assert got[::-1] == want[::-1] and got[1:-1:2] == want[1:-1:2]
    if want:
        assert got[-1] == want[-1] and got[0] == want[0]
    with pytest.raises(IndexError):
        got[len(want)]
    for impl in _impls(kvidx_native):
        m = impl()
        m.store(want[: len(want) // 2] + other, 5)
        m.store(want[:1], 70)  # a wide mask
        assert m.walk(got) == m.walk(want) and m.masks(got) == m.masks(want)


def test_native_chain_on_long_inputs(native):
    packed = np.arange(1 << 17, dtype="<u4").tobytes()  # long enough to hash without the GIL
    for bs in (1, 16, 1000):  # the pure-Python loop: ref_chain is the compiled chain in this build
        assert native.chain(packed, bs, 11) == py_chain(packed, bs, 11)
    assert native.chain(np.arange(64, dtype="<u4"), 16, 3) == py_chain(np.arange(64, dtype="<u4").tobytes(),
                                                                       16, 3)
    with pytest.raises(ValueError):
        native.chain(packed, 0, 1)


def _select(env: dict, code: str = "") -> subprocess.CompletedProcess:
    run = ("import sys\n" + code + "\nfrom kvidx.core import maskmap\n"
           "print(maskmap.IMPLEMENTATION, maskmap.MaskMap.__name__, maskmap.chain.__name__)")
    full = {k: v for k, v in os.environ.items() if not k.startswith("KVIDX_")} | env
    return subprocess.run([sys.executable, "-c", run], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=60)


def test_selection_falls_back_or_refuses():
    p = _select({"KVIDX_NATIVE": "0"})
    assert p.returncode == 0 and p.stdout.split() == ["python", "PyMaskMap", "py_chain"], p.stderr
    block = "sys.modules['kvidx_native'] = None"  # as if not built
    p = _select({}, block)
    assert p.returncode == 0 and p.stdout.split()[0] == "python", p.stderr
    p = _select({"KVIDX_REQUIRE_NATIVE": "1"}, block)
    assert p.returncode != 0 and "ImportError: KVIDX_REQUIRE_NATIVE=1" in p.stderr
    assert "pip install ./native" in p.stderr
    if kvidx_native is not None:
        assert maskmap.IMPLEMENTATION == ("python" if os.environ.get("KVIDX_NATIVE") == "0" else "native")
        p = _select({"KVIDX_REQUIRE_NATIVE": "1"})
        assert p.stdout.split() == ["native", "MaskMap", "chain"], p.stderr


def test_the_mixer_is_a_bijection():
    for k in POOL + list(range(100)):
        assert unmix(mix(k)) == k and mix(unmix(k)) == k
    assert mix(0) == 0


def _same(py: PyMaskMap, nat) -> None:
    assert len(nat) == len(py)
    assert contents(nat) == contents(py)
    keys = list(py)
    assert nat.masks(keys) == py.masks(keys)
    assert all(h in nat for h in keys)


@SETTINGS
@given(kind=st.sampled_from(["end", "start", "run", "small"]), n=st.integers(1, 300),
       at=st.integers(0, M64), ops=st.lists(st.tuples(st.sampled_from(["store", "remove", "del", "set",
                                                                        "clear_slot", "walk"]),
                                                       st.integers(0, 299), st.integers(1, 40),
                                                       st.sampled_from([0, 1, 5, 63, 64, 100])),
                                             min_size=1, max_size=40))
def test_crowded_keys_agree(native, kind, n, at, ops):
    """Keys that share buckets (long runs, the ends of the array, small ints): growth, insertions
    into a run, backward-shift deletion chains, the slack past the last bucket."""
    keys = crowd(kind, n, at)
    py, nat = PyMaskMap(), native.MaskMap()
    for name, i, k, slot in ops:
        hs = keys[i % n:i % n + k]
        if name == "store":
            assert nat.store(hs, slot) == py.store(hs, slot)
        elif name == "remove":
            assert nat.remove(hs, slot) == py.remove(hs, slot)
        elif name == "del":
            for h in hs:
                assert nat.pop(h, None) == py.pop(h, None)
        elif name == "set":
            for h in hs:
                nat[h] = py[h] = 1 << slot | 1
        elif name == "clear_slot":
            assert nat.clear_slot(slot) == py.clear_slot(slot)
        else:
            assert nat.walk(hs) == py.walk(hs)
        _same(py, nat)
    for m in (nat.copy(), pickle.loads(pickle.dumps(nat))):
        assert contents(m) == contents(py)


def test_every_key_of_a_long_run_survives_deletions_from_anywhere(native):
    """One run of 200 keys (consecutive stored forms) with deletions from its start, middle and end,
    each checked against the reference: backward-shift deletion keeps every other key findable."""
    for at in (0, 1 << 63, M64 - 500, 12345 << 40):
        keys = crowd("run", 200, at)
        py, nat = PyMaskMap(), native.MaskMap()
        for d in (py, nat):
            d.store(keys, 3)
            d.store(keys[::3], 70)  # a word past the first on some
        for victims in (keys[:5], keys[100:140:2], keys[-7:], keys[50:60], keys[::7]):
            assert nat.remove(victims, 3) == py.remove(victims, 3)
            _same(py, nat)
            assert nat.walk(keys) == py.walk(keys)
        assert nat.clear_slot(70) == py.clear_slot(70)
        _same(py, nat)


def test_large_maps_grow_and_shrink_like_the_reference(native):
    """Past 2 MiB a native table is a mapping of its own, grown in place: 300k random keys (and
    crowded ones) stored in events, half removed, cleared slots, wide masks; the same contents,
    lookups, walks, copies and snapshots as the reference, and memory within 40 bytes an entry (+ a
    constant) all through the growth."""
    rng = np.random.default_rng(7)
    keys = rng.integers(0, M64, size=300_000, dtype=np.uint64, endpoint=True).tolist()
    keys += crowd("end", 300) + crowd("start", 300) + crowd("small", 300) + [0, M64]
    py, nat = PyMaskMap(), native.MaskMap()
    for i in range(0, len(keys), 25):
        ev, slot = keys[i:i + 25], i % 61
        assert nat.store(ev, slot) == py.store(ev, slot)
        assert nat.memory_bytes() <= 40 * len(nat) + 2048  # (+ the slack, the struct)
    _same(py, nat)
    assert nat.memory_bytes() <= 46 * len(nat)
    for i in range(0, len(keys), 1000):
        assert nat.store(keys[i:i + 25], 64 + i % 70) == py.store(keys[i:i + 25], 64 + i % 70)
    sample = keys[::997]
    assert nat.masks(sample) == py.masks(sample)
    for i in range(0, len(keys), 50):
        ev, slot = keys[i:i + 25], i % 67
        assert nat.remove(ev, slot) == py.remove(ev, slot)
    assert nat.clear_slot(5) == py.clear_slot(5) and nat.clear_slot(64) == py.clear_slot(64)
    _same(py, nat)
    for s in range(0, len(keys) - 40, 4999):
        assert nat.walk(keys[s:s + 40]) == py.walk(keys[s:s + 40])
    words = 2
    k, m = nat.export(words)
    back = native.MaskMap()
    back.load(k, m, words)
    assert contents(back) == contents(py) == contents(nat.copy())
    for h in keys[:2000]:
        assert nat.pop(h, 0) == py.pop(h, 0)
    _same(py, nat)


def test_the_native_walk_answers_as_a_read_only_mapping(native):
    """MaskMap.walk's Depths: a Mapping equal to the reference's dict, in its order, with a dict's
    lookups (a missing or non-int key: KeyError / the default / not in)."""
    from collections.abc import Mapping

    nat, ref = native.MaskMap(), PyMaskMap()
    hs = [11, 12, 13]
    for slot, n in ((0, 3), (5, 1), (70, 2), (3, 3)):
        nat.store(hs[:n], slot)
        ref.store(hs[:n], slot)
    got, want = nat.walk(hs), ref.walk(hs)
    if maskmap.native_module() is None:  # kvidx.core.maskmap registers it where it selects this core
        Mapping.register(native.Depths)
    assert isinstance(got, Mapping) and got == want and want == got.to_dict()
    assert list(got.items()) == list(want.items()) and list(got) == list(want) and len(got) == 4
    assert got[70] == 2 and got.get(5) == 1 and got.get(6) is None and got.get(6, 0) == 0
    assert 3 in got and 4 not in got and "3" not in got and True not in got and -1 not in got
    with pytest.raises(KeyError):
        got[4]
    assert dict(got) == want and got != {0: 3} and nat.walk([]) == {} and not nat.walk([99])
    assert nat.walk(hs) == got  # Depths == Depths


EDGE_IDS = [0, 9, 10, 99999999, 100000000, 4294967295, 4294967296]


@given(st.lists(st.one_of(st.integers(0, 2**32 + 5), st.integers(0, 999), st.sampled_from(EDGE_IDS)),
                max_size=40),
       st.sampled_from(["", " ", "\n", "\t ", "0", "-", ".5", "e1", "x", "00"]), st.integers(0, 3))
@SETTINGS
def test_split_token_ids_is_strict_json(native, reader, ids, junk, where):
    """The compiled token parser (8 digits at a time) reads exactly what a JSON decoder reads into
    uint32s, and refuses (None) everything else: out of range, leading zeros, signs, fractions."""
    sep = [",", ", ", " ,", ",\n"][where]
    text = "[" + sep.join(map(str, ids)) + "]"
    if where == 3 and junk:
        text = text[:-1] + (junk if ids else "") + "]"
    import json
    try:
        want = json.loads(text)
        ok = isinstance(want, list) and all(type(x) is int and 0 <= x < 2**32 for x in want)
        ok = ok and not any(f"{sep}0" + d in text or "[0" + d in text for d in "0123456789")
    except ValueError:
        ok = False
    got = native.split_token_ids(b'{"model": "m", "token_ids": ' + text.encode() + b"}")
    if ok:
        assert got is not None and got[0] == b'{"model": "m"}', text
        assert np.frombuffer(got[1], dtype="<u4").tolist() == want, text
    else:
        assert got is None, text


def _json_token_ids(text: str) -> list[int] | None:
    """What a JSON decoder reads from `text` if it is an array of uint32s, else None."""
    import json
    try:
        got = json.loads(text)
    except ValueError:
        return None
    ok = isinstance(got, list) and all(type(x) is int and 0 <= x < 2**32 for x in got)
    return got if ok else None


@given(st.lists(st.one_of(st.integers(0, 200_000), st.integers(0, 9), st.sampled_from(EDGE_IDS)),
                min_size=12, max_size=300),
       st.sampled_from([",", ", ", " ,", ",\n", ",  ", ", \t"]), st.booleans(),
       st.sampled_from(["", "", "", ",", ", ", " ", "\n", "0", "00", "-1", ".5", "e1", "x", "]", "[", ",,",
                        '"']),
       st.floats(0, 1), st.integers(0, 2))
@settings(SETTINGS, max_examples=600)
def test_split_token_ids_long_arrays_with_a_fault_anywhere(native, reader, ids, sep, mixed, junk, where, pad):
    """Arrays long enough for the 64-bytes-at-a-time reading (compact or ", " separated), with a
    separator of another kind here and there (`mixed`) and a fault (`junk`) put at any byte (`where`),
    read exactly as a JSON decoder reads them, or refused: over block boundaries, at the array's
    last bytes, in the middle of a number."""
    parts = [str(ids[0])]
    for k, x in enumerate(ids[1:]):
        parts += (sep if not mixed or k % 7 == 3 else ",", str(x))
    text = "[" + "".join(parts) + "]"
    at = 1 + int(where * (len(text) - 1))
    text = text[:at] + junk + text[at:]
    body = '{"model": "m", "token_ids": ' + text + "}" + " " * pad
    want = _json_token_ids(text)
    got = native.split_token_ids(body.encode())
    if want is None:
        assert got is None, text
    else:
        assert got is not None and got[0] == b'{"model": "m"}', text
        assert np.frombuffer(got[1], dtype="<u4").tolist() == want, text


@pytest.mark.parametrize("sep", [",", ", "])
def test_split_token_ids_a_fault_at_every_byte(native, reader, sep):
    """Every fault a router's JSON could carry, put at every byte of a 3-block stretch of an array
    read 64 bytes at a time (both separator forms, numbers of 1-10 digits crossing the blocks'
    edges): read exactly as a JSON decoder reads the result, or refused."""
    rng = np.random.default_rng(5)
    ids = [int(x) for x in rng.integers(0, 10 ** rng.integers(1, 9, 60), dtype=np.int64)] + [12345678, 0]
    text = "[" + sep.join(map(str, ids)) + "]"
    faults = ["", ",", " ", "  ", "\n", "0", "01", "-", ".5", "e1", "x", "]", "[", ",,", ", ,", '"', "9" * 3]
    checked = 0
    for at in range(1, min(len(text), 200)):
        for junk in faults:
            bad = text[:at] + junk + text[at:]
            want = _json_token_ids(bad)
            got = native.split_token_ids(b'{"model": "m", "token_ids": ' + bad.encode() + b"}")
            if want is None:
                assert got is None, (at, junk)
            else:
                assert got is not None and np.frombuffer(got[1], dtype="<u4").tolist() == want, (at, junk)
                checked += 1
    assert checked > 500  # valid arrays too, not only refusals



@pytest.mark.parametrize("wide", [False, True])
def test_walk_known_depths(wide):
    """The walk by hand, in this build's MaskMap and the reference: slot -> leading hashes held, a slot
    holding the whole prompt at its length (slot 70: masks wider than one 64-bit word)."""
    hs = [21, 22, 23, 24]
    held = {0: 4, 5: 1, 3: 2, **({70: 3} if wide else {})}
    for impl in (maskmap.MaskMap, PyMaskMap):
        m = impl()
        for slot, n in held.items():
            m.store(hs[:n], slot)
        m.store([99], 9)  # off the prompt
        assert dict(m.walk(hs)) == held, impl
        assert dict(m.walk(hs[:2])) == {0: 2, 5: 1, 3: 2, **({70: 2} if wide else {})}, impl
        # any run of hashes walks alike: from 22, slot 3 holds one (it lacks 23), slots 0 and 70 two
        assert dict(m.walk([22, 23])) == {0: 2, 3: 1, **({70: 2} if wide else {})}, impl
        assert dict(m.walk([99, 21])) == {9: 1} and dict(m.walk([7])) == {} and dict(m.walk([])) == {}, impl
