"""Canonical block hashing: the one key every engine's blocks are indexed under.

A block's canonical hash is xxh3-64 over its token ids (packed little-endian uint32), seeded with its
parent's canonical hash, so it covers every token before it. Extra keys (LoRA adapter, cache salt,
multimodal ids) are folded into the seed of the block that carries them; the root seed namespaces a
chain by LoRA adapter. Engine hashes (sha256, cbor, xxhash with random seeds ...) are never joined
directly: relays re-hash from tokens, routers hash prompts the same way.

The index block size may be smaller than an engine's block size as long as it divides it: an engine
block then maps to several consecutive canonical blocks, so engines with different block sizes share
one index.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import xxhash

from kvidx.core.maskmap import chain as plain_chain
from kvidx.core.maskmap import chain_array

_xxh = xxhash.xxh3_64_intdigest
_M64 = (1 << 64) - 1
ROOT_SEED = 0x6B76_6964_7831  # "kvidx1": the seed of a chain's first block without namespace
_PACKED = (bytes, memoryview)  # token ids already packed (pack_tokens)


def namespace_seed(lora_name: str | None) -> int:
    """The seed a chain starts from: distinct per LoRA adapter (the base model uses ROOT_SEED)."""
    if not lora_name:
        return ROOT_SEED
    return _xxh(b"lora\x00" + lora_name.encode(), seed=ROOT_SEED)


def extra_seed(parent: int, extra: object) -> int:
    """Mix a block's extra keys (cache salt, multimodal ids) into the seed its tokens hash with."""
    if extra is None:
        return parent
    return _xxh(msgspec.msgpack.encode(extra), seed=parent)


def pack_tokens(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as packed little-endian uint32: the bytes every canonical hash is computed over."""
    return np.asarray(token_ids, dtype="<u4").tobytes()


def chain(packed: bytes | memoryview, block_size: int, parent: int,
          extras: Sequence[object] | None = None) -> list[int]:
    """Canonical hashes of the full blocks of `packed` tokens, chained from `parent`.

    `extras[i]` (optional) are block i's extra keys. A trailing partial block is not hashed.
    """
    if extras is None:
        return plain_chain(packed, block_size, parent)  # compiled where built (kvidx.core.maskmap)
    step = block_size * 4
    mv = memoryview(packed)
    n = len(mv) // step
    out = [0] * n
    h = parent
    for i in range(n):
        e = extras[i] if i < len(extras) else None
        seed = h if e is None else extra_seed(h, e)
        h = _xxh(mv[i * step:(i + 1) * step], seed=seed)
        out[i] = h
    return out


def tail_key(seed: int, packed: bytes | memoryview) -> int:
    """The key of a partial block: its first tokens (fewer than the index block size), hashed like a
    block from `seed` (its parent's canonical hash, the namespace seed at the root, with a first
    block's extra keys mixed in). A full block's hash is the same function over all its tokens, so
    a partial key differs from every block hash by its length."""
    return _xxh(packed, seed=seed)


DYNAMO_SEED = 1337  # dynamo-kv-router's XXH3_SEED / CHAIN_XXH3_SEED
_DYNAMO_ROOT = 0x64796E616D6F  # "dynamo": where the chain of Dynamo keys starts
_DYNAMO_CHAIN_SEED = 0x6B76_6964_7844  # distinct from every canonical seed


def dynamo_seed(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """Dynamo's per-request XXH3 seed (dynamo-kv-hashing 1.6.1 compute_salt_hash): 1337, plus the
    LoRA name hashed with seed 0, plus the salt hashed with seed 1 (empty strings are absent)."""
    seed = DYNAMO_SEED
    if lora_name:
        seed = (seed + _xxh(lora_name.encode(), seed=0)) & _M64
    if cache_salt:
        seed = (seed + _xxh(cache_salt.encode(), seed=1)) & _M64
    return seed


def dynamo_local_hashes(packed: bytes | memoryview, block_size: int, seed: int = DYNAMO_SEED) -> list[int]:
    """Dynamo's per-block ("local") hashes of packed tokens: XXH3-64 of each full block's LE uint32
    tokens, all with one seed, not chained (dynamo-kv-router protocols.rs compute_block_hash_for_seq)."""
    step = 4 * block_size
    mv = memoryview(packed)
    return [_xxh(mv[i:i + step], seed=seed) for i in range(0, len(mv) - step + 1, step)]


def dynamo_keys(local_hashes: Sequence[int], parent: int | None = None) -> list[int]:
    """The keys kvidx indexes a Dynamo-registered engine's blocks under besides their canonical hashes:
    Dynamo's local hashes chained (each key covers the blocks before it, as Dynamo's radix tree path
    does), so a router's `POST /query_by_hash` list walks like a prompt."""
    h = _DYNAMO_ROOT if parent is None else parent
    out = []
    for x in local_hashes:
        h = _xxh((h & _M64).to_bytes(8, "little") + (x & _M64).to_bytes(8, "little"), seed=_DYNAMO_CHAIN_SEED)
        out.append(h)
    return out


_SGLANG_SEED = 0x6B76_6964_7853  # SGLang keys: distinct from every canonical and Dynamo seed


def sglang_key(block_hash: str) -> int:
    """The key kvidx indexes an SGLang block hash under for SGLang's external-indexer API
    (index_service/sglang_indexer.py): its text as the router and the bridge send it (a decimal int64;
    SGLang's indexer compares the strings, so any text works alike), hashed into kvidx's key space.
    The hashes are chains already (each covers the pages before it): no chaining here."""
    return _xxh(block_hash.encode(), seed=_SGLANG_SEED)


class PromptHashes(list):
    """A prompt's canonical block hashes (a list) that can also key the prompt's partial block at any
    depth: what a lookup needs to credit an engine that resumes inside blocks (partial tails,
    BlocksStored.tail). Made by `prompt_hashes(..., tails=True)`; a router's own block hashes are a
    plain list and credit whole blocks only."""

    __slots__ = ("packed", "block_size", "seed0", "_tails")

    def tail_keys(self, depth: int) -> list[int]:
        """Keys of the prompt's first 1, 2 ... tokens after its `depth` full blocks (fewer than a
        block: at most the prompt's end): key l-1 covers l tokens. Kept per depth: a lookup asks
        again for the answer's tiers."""
        keys = self._tails.get(depth)
        if keys is None:
            bs = self.block_size
            start = depth * bs * 4
            end = min(len(self.packed), start + (bs - 1) * 4)
            keys = []
            if start < end and depth <= len(self):
                seed = self[depth - 1] if depth else self.seed0
                mv = memoryview(self.packed)
                keys = [tail_key(seed, mv[start:start + 4 * k]) for k in range(1, (end - start) // 4 + 1)]
            self._tails[depth] = keys
        return keys


def mm_start_extras(n_blocks: int, block_size: int, mm: Sequence[tuple[str, int]] | None,
                    extras: list[object] | None = None) -> list[object] | None:
    """Add multimodal items to per-block extra keys by the canonical rule: an item `(identifier,
    start)` (start = the prompt position of its first placeholder token) is an extra key
    `["mm", identifier, start % block_size]` of the block holding its start only. Later blocks of the
    item carry it through their parent, so the rule does not depend on the engine's block size
    (vLLM lists an item in every block it overlaps, with its offset from the block start:
    vllm/v1/core/kv_cache_utils.py _gen_mm_extra_hash_keys, 0.32.0)."""
    if not mm:
        return extras
    out: list[object] = list(extras or [None] * n_blocks)
    if len(out) < n_blocks:
        out += [None] * (n_blocks - len(out))
    for ident, start in mm:
        b = start // block_size
        if 0 <= b < n_blocks:
            cur = out[b]
            out[b] = [*(cur or []), ["mm", ident, start % block_size]]
    return out


def prompt_hashes(token_ids: Sequence[int] | np.ndarray | bytes, block_size: int,
                  lora_name: str | None = None, cache_salt: str | None = None,
                  mm: Sequence[tuple[str, int]] | None = None, lookahead: int = 0,
                  tails: bool = False, array: bool = False) -> list[int]:
    """What a router (or the lookup service) computes for a prompt: the canonical hashes of its full
    blocks. The cache salt is an extra key of the first block only, as in vLLM; later blocks carry it
    through their parent. `mm`: multimodal items as (identifier, start position in the prompt), the
    identifiers vLLM uses (its mm_hash / mm_feature.identifier); see `mm_start_extras`. `lookahead`:
    the model's engines hash a block with the L tokens after it (vLLM >= 0.33 with EAGLE or MTP): each
    block's last extra key is ["la", *those tokens], and only the blocks with L tokens after them are
    hashed ((n - L) // block_size of n), as the engine can reuse no others. `tails`: a PromptHashes,
    which keys partial blocks too (not with `mm` or `lookahead`, whose engines resume at blocks).
    `array`: where the compiled core is built, plain chains (no salt, tails, mm or lookahead) come as a
    kvidx_native.HashArray, a sequence the maps read without a Python int per hash (the lookup
    service's form); equal to the list."""
    if array and not (cache_salt or tails or mm or lookahead):  # the service's form: first, and lean
        packed = token_ids if isinstance(token_ids, _PACKED) else pack_tokens(token_ids)
        return chain_array(packed, block_size, namespace_seed(lora_name) if lora_name else ROOT_SEED)
    packed = token_ids if isinstance(token_ids, _PACKED) else pack_tokens(token_ids)
    extras: list[object] | None = [[cache_salt]] if cache_salt else None
    if tails and not mm and not lookahead:
        out = PromptHashes(chain(packed, block_size, namespace_seed(lora_name), extras))
        out.packed, out.block_size, out._tails = bytes(packed), block_size, {}
        out.seed0 = extra_seed(namespace_seed(lora_name), extras[0] if extras else None)  # block 0's
        return out
    n = len(packed) // (4 * block_size)
    if mm:
        extras = mm_start_extras(n, block_size, mm, extras)
    if lookahead:
        tokens = np.frombuffer(packed, dtype="<u4")
        n = max(0, (len(tokens) - lookahead) // block_size)
        extras = [[*((extras[i] or []) if extras and i < len(extras) else []),
                   ["la", *tokens[(i + 1) * block_size:(i + 1) * block_size + lookahead].tolist()]]
                  for i in range(n)]
        packed = packed[:n * block_size * 4]
    return chain(packed, block_size, namespace_seed(lora_name), extras)
