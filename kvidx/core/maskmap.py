"""The mask map: canonical block hash (u64) -> slot bitmask (a positive int; bit i set: replica slot i
holds the block), the shard's hot data structure, with the batched operations of the fold and the
lookup walk; and canonical block hashing (`chain`).

Two implementations of one API: `kvidx_native.MaskMap` (Rust, native/: masks of slots 0..63 inline as
a u64 beside the key, wider ones in a side table) and `PyMaskMap` here, the pure-Python reference (a
dict). `MaskMap` is the native one when it is installed (scripts/setup.sh builds it where cargo
exists) unless KVIDX_NATIVE=0; with KVIDX_REQUIRE_NATIVE=1 (CI) a missing native module is an
ImportError instead of a fallback. tests/unit/core/test_maskmap.py checks that both agree.

Semantics both implement:
- dict-like: get(h, default=0), m[h] (KeyError), m[h] = mask (ValueError for a mask <= 0: masks are
  never 0 in the index, an entry is deleted instead), del m[h], pop(h[, default]), len, in, iter,
  keys(), values(), items(), update(pairs or mapping) (sets), copy(), clear();
- store(hashes, slot) -> how many hashes did not have the bit (it is set on all);
- remove(hashes, slot, others=(), union=None) -> how many had the bit (cleared; an entry goes when
  its mask becomes 0); for each of those, unless a map of `others` has the bit, it is cleared in
  `union` too (the "any tier" map: retract only when the last tier drops it);
- clear_slot(slot) -> how many entries had the bit (cleared everywhere);
- masks(hashes) -> [mask or 0]; walk(hashes) -> {slot: leading hashes held} (`walk_masks`; the
  native map returns it as a read-only Mapping, `kvidx_native.Depths`, with no object per slot);
- or_into(other): OR every entry into other;
- export(words) -> (keys, masks) bytes (little-endian u64 keys; `words` little-endian u64 words per
  mask, same order: snapshot.py `_pack_masks`; ValueError if a mask needs more words);
  load(keys, masks, words): OR those entries in (a zero mask adds nothing);
  export_segments(first, last, bits, words): export() of the keys whose segment, the top `bits` bits
  of mix(key), is in [first, last), ordered by mix(key) (a snapshot's base pieces);
  export_keys(keys, words) -> the masks of those keys, all-zero for an absent one;
  assign(keys, masks, words): set those masks, replacing (an all-zero one deletes the key);
  reserve(n): room for n entries in all (a rebuild that knows its size);
- memory_bytes(): the native map's heap estimate (the reference: its dict's sizes, a lower bound).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping

import numpy as np
import xxhash

from kvidx.core.masks import shared_mask, slot_bit

_M64 = (1 << 64) - 1
_dget = dict.get
_dset = dict.__setitem__
_ddel = dict.__delitem__
_xxh = xxhash.xxh3_64_intdigest


_PHI = 0x9E3779B97F4A7C15


def mix(h: int) -> int:
    """The stored form of a key in the native table (native/src/table.rs `mix`, a bijection): its
    top bits are the key's snapshot segment."""
    return ((h ^ (h >> 32)) * _PHI) & _M64


def _words(words: int) -> int:
    if words < 1:
        raise ValueError(f"words must be >= 1, not {words}")
    return words


def _split_masks(mb, n: int, words: int) -> list[int]:
    if words == 1:
        return np.frombuffer(mb, dtype="<u8").tolist()
    w = words * 8
    return [int.from_bytes(mb[i * w:(i + 1) * w], "little") for i in range(n)]


def _layout(keys, masks, words: int) -> tuple[memoryview, memoryview]:
    kb, mb = memoryview(keys).cast("B"), memoryview(masks).cast("B")
    if len(kb) % 8 or len(mb) != len(kb) * words:
        raise ValueError(f"{len(kb)} key bytes and {len(mb)} mask bytes are not n keys of 8 bytes and "
                         f"n masks of {8 * words} bytes")
    return kb, mb


def _bit(slot: int) -> int:
    if slot < 0:
        raise ValueError(f"slot must be >= 0, not {slot}")
    return slot_bit(slot)


def _check(h: int, mask: int) -> None:
    if not 0 <= h <= _M64:
        raise OverflowError(f"a block hash is an unsigned 64-bit int, not {h}")
    if not isinstance(mask, int):
        raise TypeError(f"a mask is an int, not {type(mask).__name__}")
    if mask <= 0:
        raise ValueError("a mask is a positive int (bit i: slot i); never 0: delete the entry instead")


def _pairs(pairs) -> Iterable:
    items = getattr(pairs, "items", None)
    return items() if items is not None else pairs


def walk_masks(get, hashes: list[int]) -> dict[int, int]:
    """The AND-walk over a mask getter `get(hash, 0)`: slot -> leading hashes held, for every slot
    holding hashes[0]. The reference map's walk, and the shard's where pools or pending credit
    overlay the masks (kvidx.core.walk)."""
    if not hashes:
        return {}
    alive = get(hashes[0], 0)
    out: dict[int, int] = {}
    if not alive:
        return out
    i = 1
    n = len(hashes)
    while i < n:
        m = get(hashes[i], 0) & alive
        if m != alive:
            lost = alive & ~m
            while lost:
                low = lost & -lost
                out[low.bit_length() - 1] = i
                lost ^= low
            alive = m
            if not alive:
                return out
        i += 1
    while alive:
        low = alive & -alive
        out[low.bit_length() - 1] = n
        alive ^= low
    return out


class PyMaskMap(dict):
    """The pure-Python mask map: a dict with the batched operations as plain loops (single-slot masks
    are the shared int objects of masks.py, as the shard stores them)."""

    __slots__ = ()

    def __init__(self, pairs=()):
        super().__init__()
        self.update(pairs)

    def get(self, h, default=0):
        return _dget(self, h, default)

    def __setitem__(self, h: int, mask: int) -> None:
        _check(h, mask)
        _dset(self, h, shared_mask(mask))

    def update(self, pairs=()) -> None:
        if pairs is self:
            return
        for h, m in _pairs(pairs):
            _check(h, m)
            _dset(self, h, shared_mask(m))

    def copy(self) -> PyMaskMap:
        out = PyMaskMap()
        dict.update(out, self)
        return out

    __copy__ = copy

    def __deepcopy__(self, memo=None) -> PyMaskMap:
        return self.copy()

    def __reduce__(self):
        return (PyMaskMap, (list(self.items()),))

    def __repr__(self) -> str:
        return f"PyMaskMap(<{len(self)} entries>)"

    # ---- batched --------------------------------------------------------------------------------
    def store(self, hashes: Iterable[int], slot: int) -> int:
        bit = _bit(slot)
        get = super().get
        new = 0
        for h in hashes:
            m = get(h, 0)
            if not m & bit:
                if not m and not 0 <= h <= _M64:
                    raise OverflowError(f"a block hash is an unsigned 64-bit int, not {h}")
                _dset(self, h, m | bit if m else bit)  # a lone holder shares its slot's mask object
                new += 1
        return new

    def remove(self, hashes: Iterable[int], slot: int, others: Iterable[PyMaskMap] = (),
               union: PyMaskMap | None = None) -> int:
        bit = _bit(slot)
        clear = ~bit
        get = super().get
        if union is self:
            union = None  # clearing self again changes nothing
        ogets = [super(PyMaskMap, o).get for o in others] if union is not None else []
        gone = 0
        for h in hashes:
            m = get(h, 0)
            if not m & bit:
                continue
            gone += 1
            m &= clear
            if m:
                _dset(self, h, shared_mask(m))
            else:
                _ddel(self, h)
            if union is not None and not any(og(h, 0) & bit for og in ogets):
                a = _dget(union, h, 0)  # retract only when the last tier drops it
                if a & bit:
                    a &= clear
                    if a:
                        _dset(union, h, shared_mask(a))
                    else:
                        _ddel(union, h)
        return gone

    def clear_slot(self, slot: int) -> int:
        bit = _bit(slot)
        clear = ~bit
        held = [h for h, m in self.items() if m & bit]
        for h in held:
            m = dict.__getitem__(self, h) & clear
            if m:
                _dset(self, h, shared_mask(m))
            else:
                _ddel(self, h)
        return len(held)

    def masks(self, hashes: Iterable[int]) -> list[int]:
        get = super().get
        return [get(h, 0) for h in hashes]

    def lacking(self, hashes: Iterable[int], slot: int) -> list[int]:
        """The hashes whose mask lacks bit `slot` (absent ones included), in order."""
        get, bit = super().get, 1 << slot
        return [h for h in hashes if not get(h, 0) & bit]

    def walk(self, hashes: list[int]) -> dict[int, int]:
        """slot -> number of leading hashes it holds, for every slot holding hashes[0]."""
        return walk_masks(super().get, hashes if isinstance(hashes, list) else list(hashes))

    def or_into(self, other: PyMaskMap) -> None:
        if other is self:
            return
        oget = super(PyMaskMap, other).get
        for h, m in self.items():
            o = oget(h, 0)
            _dset(other, h, o | m if o else m)

    # ---- snapshot -------------------------------------------------------------------------------
    def export(self, words: int) -> tuple[bytes, bytes]:
        return self._export(list(self.items()), words)

    def _export(self, items: list[tuple[int, int]], words: int) -> tuple[bytes, bytes]:
        _words(words)
        n = len(items)
        keys = np.fromiter((h for h, _ in items), dtype="<u8", count=n).tobytes()
        try:
            if words == 1:
                return keys, np.fromiter((m for _, m in items), dtype="<u8", count=n).tobytes()
            w = words * 8
            return keys, b"".join([m.to_bytes(w, "little") for _, m in items])
        except OverflowError:
            need = max((m.bit_length() + 63) // 64 for m in self.values())
            raise ValueError(f"a mask needs {need} words, more than {words}") from None

    def export_segments(self, first: int, last: int, bits: int, words: int) -> tuple[bytes, bytes]:
        if not (1 <= bits <= 32 and 0 <= first < last <= 1 << bits):
            raise ValueError(f"segments [{first}, {last}) of 2**{bits}: need 1 <= bits <= 32 and "
                             f"first < last <= 2**bits")
        shift = 64 - bits
        items = sorted(((mix(h), h, m) for h, m in self.items() if first <= mix(h) >> shift < last))
        return self._export([(h, m) for _, h, m in items], words)

    def export_keys(self, keys: bytes, words: int) -> bytes:
        _words(words)
        kb = memoryview(keys).cast("B")
        if len(kb) % 8:
            raise ValueError(f"{len(kb)} key bytes are not n keys of 8 bytes")
        get = super().get
        return self._export([(h, get(h, 0)) for h in np.frombuffer(kb, dtype="<u8").tolist()], words)[1]

    def assign(self, keys: bytes, masks: bytes, words: int) -> None:
        kb, mb = _layout(keys, masks, _words(words))
        hashes = np.frombuffer(kb, dtype="<u8").tolist()
        for h, m in zip(hashes, _split_masks(mb, len(hashes), words), strict=True):
            if m:
                _dset(self, h, shared_mask(m))
            else:
                self.pop(h, None)

    def load(self, keys: bytes, masks: bytes, words: int) -> None:
        kb, mb = _layout(keys, masks, _words(words))
        hashes = np.frombuffer(kb, dtype="<u8").tolist()
        vals = _split_masks(mb, len(hashes), words)
        if not self and 0 not in vals:  # a fresh map (a restore): one C-level update
            dict.update(self, zip(hashes, map(shared_mask, vals), strict=True))
            if len(self) == len(hashes):
                return
            dict.clear(self)  # a key repeated: OR them one by one
        get = super().get
        for h, m in zip(hashes, vals, strict=True):
            if m:
                o = get(h, 0)
                _dset(self, h, shared_mask(o | m) if o else shared_mask(m))

    def reserve(self, n: int) -> None:
        """Room for n entries (a dict needs no hint)."""

    def memory_bytes(self) -> int:
        """The dict's own size plus its int objects (shared single-slot masks counted once): what
        tracemalloc would see of a dict built the shard's way."""
        seen: set[int] = set()
        total = sys.getsizeof(self)
        for h, m in self.items():
            if h >= 1 << 30 or h < 0:  # small ints are cached by CPython, cost nothing per entry
                total += sys.getsizeof(h)
            if id(m) not in seen:
                seen.add(id(m))
                total += sys.getsizeof(m)
        return total


def py_chain(packed: bytes | memoryview, block_size: int, parent: int) -> list[int]:
    """Canonical hashes of the full blocks of `packed` (little-endian uint32 tokens), chained from
    `parent`: kvidx.core.hashing.chain without extra keys (the same loop, kept here so that hashing.py
    may use this module without an import cycle)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, not {block_size}")
    step = block_size * 4
    mv = memoryview(packed).cast("B")
    out = [0] * (len(mv) // step)
    h = parent
    for i in range(len(out)):
        h = _xxh(mv[i * step:(i + 1) * step], seed=h)
        out[i] = h
    return out


def _native():
    if os.environ.get("KVIDX_NATIVE") == "0":
        return None
    try:
        import kvidx_native
    except ImportError as e:
        if os.environ.get("KVIDX_REQUIRE_NATIVE") == "1":
            raise ImportError(f"KVIDX_REQUIRE_NATIVE=1 but kvidx_native does not import ({e}): build it with "
                              f"`.venv/bin/python -m pip install ./native` (needs cargo) or run "
                              f"scripts/setup.sh") from e
        return None
    return kvidx_native


_mod = _native()


def native_module():
    """kvidx_native where it is built and allowed (KVIDX_NATIVE), else None."""
    return _mod


if _mod is not None:
    Mapping.register(_mod.Depths)
MaskMap: type = _mod.MaskMap if _mod is not None else PyMaskMap
chain = _mod.chain if _mod is not None else py_chain
# chain into a kvidx_native.HashArray (no Python int per hash; the maps read it directly), or a list
chain_array = _mod.chain_array if _mod is not None else py_chain
IMPLEMENTATION = "native" if _mod is not None else "python"
# a lookup answer written as JSON by the compiled core (kvidx.core.walk.lookup_json); None:
# the typed answer, encoded by msgspec, everywhere
lookup_json = getattr(_mod, "lookup_json", None)
# whether it writes unpriced answers too (kvidx.index.lookup's; a build before 2026-12-08 does not)
UNPRICED_JSON = "priced" in (getattr(lookup_json, "__text_signature__", None) or "")
# JSON token ids straight to packed uint32, cut out of a request body (index_service.wire.read_split);
# None: decoded by msgspec
split_token_ids = getattr(_mod, "split_token_ids", None)
