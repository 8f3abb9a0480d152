"""vLLM's own block hashes (`--prefix-caching-hash-algo sha256_cbor | sha256`), as Mooncake's conductor
computes them for a prompt (its `vllm_v1` hash profiles, projection `low64_be`): for routers and APIs
that speak in engine hashes. kvidx indexes canonical hashes (kvidx.core.hashing); these never key the
index.

vLLM's hash_block_tokens: NONE_HASH = H(python_hash_seed as text); block i hashes the tuple
(parent digest: all 32 bytes, tuple of the block's token ids, extra keys or None) and its digest is the
next parent. Extra keys: the LoRA name on every block, then the cache salt on the first block only. H
is SHA-256 of canonical CBOR (RFC 8949 shortest form, definite lengths: cbor2 canonical=True) or of
pickle protocol 5. The 64-bit key is the digest's last 8 bytes read big-endian (what vLLM publishes
as an int block hash). A trailing partial block has no hash. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Sequence

ALGORITHMS = ("sha256_cbor", "sha256")


def _head(major: int, n: int) -> bytes:
    """A CBOR item head: the major type and a length or value in its shortest form."""
    m = major << 5
    if n < 24:
        return bytes((m | n,))
    if n < 0x100:
        return bytes((m | 24, n))
    if n < 0x10000:
        return bytes((m | 25,)) + struct.pack(">H", n)
    if n < 0x1_0000_0000:
        return bytes((m | 26,)) + struct.pack(">I", n)
    return bytes((m | 27,)) + struct.pack(">Q", n)


def cbor(value: object) -> bytes:
    """Canonical CBOR of the values vLLM hashes: None, ints, bytes, str, tuples and lists."""
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        return b"\xf5" if value else b"\xf4"
    if isinstance(value, int):
        return _head(0, value) if value >= 0 else _head(1, -1 - value)
    if isinstance(value, bytes | bytearray | memoryview):
        b = bytes(value)
        return _head(2, len(b)) + b
    if isinstance(value, str):
        b = value.encode()
        return _head(3, len(b)) + b
    if isinstance(value, tuple | list):
        return _head(4, len(value)) + b"".join(map(cbor, value))
    raise TypeError(f"vLLM hashes no {type(value).__name__}")


def _encoder(algorithm: str):
    if algorithm == "sha256_cbor":
        return cbor
    if algorithm == "sha256":
        return lambda x: pickle.dumps(x, protocol=5)
    raise ValueError(f"unknown vLLM hash algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")


def root_digest(algorithm: str, python_hash_seed: str) -> bytes:
    """NONE_HASH: the parent of a chain's first block."""
    return hashlib.sha256(_encoder(algorithm)(python_hash_seed)).digest()


def block_digests(token_ids: Sequence[int], block_size: int, algorithm: str = "sha256_cbor",
                  python_hash_seed: str = "0", lora_name: str = "", cache_salt: str | None = None
                  ) -> list[bytes]:
    """The 32-byte digests of the prompt's full blocks."""
    enc = _encoder(algorithm)
    parent = root_digest(algorithm, python_hash_seed)
    out = []
    for i in range(len(token_ids) // block_size):
        extras = ([lora_name] if lora_name else []) + ([cache_salt] if i == 0 and cache_salt else [])
        value = (parent, tuple(int(t) for t in token_ids[i * block_size:(i + 1) * block_size]),
                 tuple(extras) if extras else None)
        parent = hashlib.sha256(enc(value)).digest()
        out.append(parent)
    return out


def block_keys(token_ids: Sequence[int], block_size: int, algorithm: str = "sha256_cbor",
               python_hash_seed: str = "0", lora_name: str = "", cache_salt: str | None = None
               ) -> list[int]:
    """The prompt's block hashes as vLLM publishes them (int) and the conductor looks them up: the
    last 8 bytes of each digest, big-endian."""
    return [int.from_bytes(d[-8:], "big") for d in
            block_digests(token_ids, block_size, algorithm, python_hash_seed, lora_name, cache_salt)]
