"""SGLang's block hashes, for its router and its external KV indexer (index_service/sglang_indexer.py)
and the simulated SGLang engine (kvidx/engines/sglang/sim.py).

sglang 0.5.23 (mem_cache/utils.py `get_hash_str`, cpp_utils/hash_binding.cpp `hash_page`; sgl-router
kv_events::hash): a page's digest is SHA-256 over the previous page's 32-byte digest (none for the first
page) and the page's token ids as little-endian uint32; the event and router hash is its first 8 bytes
read big-endian as a signed int64 (`hash_str_to_int64`). Only full pages are hashed. Namespaced chains
(LoRA extra keys, cache salts) are re-hashed per block (kv_events.py `namespaced_block_hash`). Pinned
by SGLang's published vectors in tests/unit/engines/sglang/test_hashing.py.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

_NS_TAG = b"sglang-kv-event-namespace-v1"  # kv_events.py 0.5.23 l. 307-310


def hash_str_to_int64(hex_str: str) -> int:
    v = int(hex_str[:16], 16)
    return v - (1 << 64) if v >= 1 << 63 else v


def page_hash_hex(tokens: Sequence[int] | np.ndarray, prior_hex: str | None) -> str:
    h = hashlib.sha256()
    if prior_hex:
        h.update(bytes.fromhex(prior_hex))
    h.update(np.asarray(tokens, dtype="<u4").tobytes())
    return h.hexdigest()


def sglang_page_hashes(tokens: Sequence[int] | np.ndarray, page_size: int) -> list[int]:
    """The int64 hashes of a prompt's full pages, as SGLang's events and sgl-router carry them."""
    if page_size <= 0:
        raise ValueError(f"page size must be positive, not {page_size}")
    packed = np.asarray(tokens, dtype="<u4").tobytes()
    step = 4 * page_size
    out: list[int] = []
    prior = b""
    for i in range(0, len(packed) - step + 1, step):
        prior = hashlib.sha256(prior + packed[i:i + step]).digest()
        out.append(int.from_bytes(prior[:8], "big", signed=True))
    return out


def namespace_seed(extra_key: str | None, cache_salt: str | None) -> bytes | None:
    if extra_key is None and cache_salt is None:
        return None
    d = hashlib.sha256(_NS_TAG)
    for part in (extra_key, cache_salt):
        if part is None:
            d.update(b"\x00")
            continue
        e = part.encode()
        d.update(b"\x01" + len(e).to_bytes(8, "little") + e)
    return d.digest()


def namespaced(h: int, seed: bytes | None) -> int:
    if seed is None:
        return h
    d = hashlib.sha256(seed + h.to_bytes(8, "big", signed=True)).digest()
    return int.from_bytes(d[:8], "big", signed=True)
