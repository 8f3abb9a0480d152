"""A generated hybrid vLLM 0.32 engine (full attention + sliding window and/or state space groups) and
the events it publishes, used by tests/unit/core/test_hybrid_streams.py and by the fleet simulator (`kvidx
simulate --hybrid`).

The generator keeps the engine's own view (per group: engine hash -> live physical copies) and emits
what vLLM 0.32's block pool emits for it (vllm/v1/core/block_pool.py cache_full_blocks,
cache_partial_block; ENGINES.md vLLM observations 5, 6, 9):
- full attention: the chunk's full blocks, parent = the block before the chunk (null at 0);
- sliding window: the same token range, but hashes only for the blocks a later hit can need (the
  ceil((w-1)/B) blocks before the chunk's end); the others are skipped (token_ids longer than
  hashes x block_size);
- mamba: one checkpoint per scheduled chunk, at its last block boundary: one hash, token_ids from 0
  to that boundary, parent null; a chunk without a new boundary gives an announcement without hash.
Evictions are one BlockRemoved per hash per group, each group on its own. `HybridEngine.reference`
is vLLM's hybrid resume rule (HybridKVCacheCoordinator.find_longest_cache_hit) over the engine's own
state.

`FleetHybridEngine` is a replica of the fleet simulator built on it: per group a capacity in physical
blocks with an LRU of its own (the hit's blocks are touched, stored blocks are the most recent; a
group evicts only when it needs room, so attention and state are evicted separately), one engine
batch per request in an outbox (seq, payload) with a replay buffer, and `serve` returning the tokens
vLLM really reuses by the hybrid rule, with each group's own hit within the full-attention hit.
Simplification: only the prompt is cached (decode blocks are not), one scheduler step per request.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict, deque

import msgspec

from kvidx.engines.contract import Frame


# ---- vLLM 0.32's wire structs (vllm/distributed/kv_events.py): tagged maps, defaults omitted ----------
class WStored(msgspec.Struct, tag="BlockStored", tag_field="type", omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class WRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", omit_defaults=True):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class WBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list
    data_parallel_rank: int | None = None


_enc = msgspec.msgpack.Encoder()


# ---- the generated engine --------------------------------------------------------------------------
def _ehash(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + bytes(str(tokens), "ascii")).digest()


def _fold(d: bytes) -> int:
    return int.from_bytes(d[-8:], "big")


class HybridEngine:
    """One replica's KV-cache groups as vLLM keeps them, and the events it publishes."""

    def __init__(self, groups: list[tuple[str, int | None]], block_size: int, unit: int | None = None):
        self.groups = groups  # index = group_idx: (kind, window)
        self.B = block_size
        self.unit = unit or block_size  # the hash unit (--prefix-match-unit)
        self.live: list[dict[int, int]] = [{} for _ in groups]  # group -> engine hash -> copies
        self.pending: list = []
        self.seq = 0
        self.hashless = 0

    def unit_hashes(self, tokens: list[int]) -> list[int]:
        out, d = [], b"root"
        for i in range(len(tokens) // self.unit):
            d = _ehash(d, tokens[i * self.unit:(i + 1) * self.unit])
            out.append(_fold(d))
        return out

    def block_hashes(self, tokens: list[int]) -> list[int]:
        """A block's hash is the unit chain's hash at its end (vLLM's BlockHashListWithBlockSize)."""
        s = self.B // self.unit
        return self.unit_hashes(tokens)[s - 1::s]

    def _store(self, g: int, hashes: list[int], parent: int | None, tokens: list[int], bs: int | None = None):
        kind, window = self.groups[g]
        for h in hashes:
            self.live[g][h] = self.live[g].get(h, 0) + 1
        self.pending.append(WStored(hashes, parent, tokens, bs or self.B, None, "GPU", None,
                                    [None] * len(hashes), g, kind, window))

    def prefill(self, tokens: list[int], chunk_tokens: int, rng: random.Random, hashless_p: float = 0.0,
                report_full_p: float = 0.0):
        """Compute a prompt from the engine's own hit, in scheduled chunks of `chunk_tokens`, caching
        as vLLM does (blocks after the hit that are still cached become second physical copies)."""
        B = self.B
        hs = self.block_hashes(tokens)
        hit = self.reference(tokens) // B
        if hit and rng.random() < report_full_p:  # kv_cache_report_mode "full": re-announce the hit
            for g, (kind, window) in enumerate(self.groups):
                self.pending.append(WStored(hs[:hit], None, tokens[:hit * B], B, None, "GPU", None,
                                            [None] * hit, g, kind, window))
        done = hit * B
        n = len(tokens)
        while done < n:
            end = min(n, done + chunk_tokens)
            b0, b1 = done // B, end // B  # blocks cached before / after this chunk
            for g, (kind, window) in enumerate(self.groups):
                if kind == "mamba":
                    if b1 > b0 and rng.random() >= hashless_p:
                        if rng.random() < 0.5:  # as observed: parent null, token_ids from 0
                            self._store(g, [hs[b1 - 1]], None, tokens[:b1 * B])
                        else:  # as cache_full_blocks writes it after a hit: from the chunk's start
                            self._store(g, [hs[b1 - 1]], hs[b0 - 1] if b0 else None, tokens[b0 * B:b1 * B])
                    else:  # decode-filled or skipped states: announced without a hash
                        self.pending.append(WStored([], None, tokens[done:end], B, None, "GPU", None, [],
                                                    g, kind, window))
                        self.hashless += 1
                    continue
                if b1 <= b0:
                    continue
                parent = hs[b0 - 1] if b0 else None
                if kind == "sliding_window":
                    need = -(-(window - 1) // B)
                    keep = list(range(max(b0, b1 - need), b1))
                else:
                    keep = list(range(b0, b1))
                self._store(g, [hs[i] for i in keep], parent, tokens[b0 * B:b1 * B])
            done = end

    def evict(self, g: int, h: int, silent: bool = False):
        c = self.live[g][h] - 1
        if c:
            self.live[g][h] = c
        else:
            del self.live[g][h]
        if not silent:
            self.pending.append(WRemoved([h], "GPU", g))

    def flush(self) -> Frame:
        payload = _enc.encode(WBatch(1.7e9 + self.seq, self.pending, 0))
        f = Frame(b"kv", self.seq, payload, 1_000_000_000 + self.seq, "tcp://engine:5557")
        self.seq += 1
        self.pending = []
        return f

    def reference(self, tokens: list[int]) -> int:
        """vLLM's rule from the engine's own state: the full-attention hit below the last token, then
        the largest block boundary p where each sliding-window group holds the ceil((w-1)/B) blocks
        before p (or all from 0) and each mamba group holds the state at exactly p."""
        B = self.B
        hs = self.block_hashes(tokens)
        fa = [g for g, (k, _) in enumerate(self.groups) if k == "full_attention"]
        hit = 0
        while hit < len(hs) and all(hs[hit] in self.live[g] for g in fa):
            hit += 1
        top = min(hit, (len(tokens) - 1) // B)
        for p in range(top, 0, -1):
            ok = True
            for g, (kind, window) in enumerate(self.groups):
                if kind == "sliding_window":
                    need = -(-(window - 1) // B)
                    ok = all(h in self.live[g] for h in hs[max(0, p - need):p])
                elif kind == "mamba":
                    ok = hs[p - 1] in self.live[g]
                if not ok:
                    break
            if ok:
                return p * B
        return 0


class FleetHybridEngine(HybridEngine):
    """A hybrid vLLM replica of the fleet simulator (see the module docstring).

    `capacity`: physical blocks per group (index = group_idx); `chunk_tokens`: the scheduler's chunk
    (for mamba groups, the checkpoint interval); `hashless_p`: the share of mamba chunk announcements
    without a hash; `report_full_p`: the share of hits re-announced (kv_cache_report_mode "full")."""

    topic = b"kv"

    def __init__(self, name: str, groups: list[tuple[str, int | None]], block_size: int,
                 capacity: list[int], chunk_tokens: int, seed: int = 0, hashless_p: float = 0.0,
                 report_full_p: float = 0.0, buffer_steps: int = 1000) -> None:
        super().__init__(groups, block_size)
        self.name = name
        self.capacity = list(capacity)
        self.chunk_tokens = chunk_tokens
        self.hashless_p = hashless_p
        self.report_full_p = report_full_p
        self.rng = random.Random(seed)
        self.now = 0.0
        self.lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in groups]
        self.used = [0] * len(groups)  # physical blocks holding a cached hash, per group
        self.outbox: list[tuple[int, bytes]] = []
        self._buffer: deque = deque(maxlen=buffer_steps)
        self._memo: tuple[list[int], list[int]] | None = None
        self.stored = [0] * len(groups)
        self.removed = [0] * len(groups)
        self.requests = 0
        self.last_group_hits: dict[int, int] = {}
        self._protected: list[set[int]] = [set() for _ in groups]  # in use by the request being served

    # -- hashes: one prompt's hashes are asked for several times per request
    def block_hashes(self, tokens: list[int]) -> list[int]:
        m = self._memo
        if m is not None and m[0] is tokens:
            return m[1]
        hs = super().block_hashes(tokens)
        self._memo = (tokens, hs)
        return hs

    @property
    def stored_blocks(self) -> int:
        return sum(self.stored)

    @property
    def removed_blocks(self) -> int:
        return sum(self.removed)

    # -- the block pool: per group capacity and LRU
    def _store(self, g: int, hashes: list[int], parent: int | None, tokens: list[int], bs: int | None = None):
        lru = self.lru[g]
        room = self.capacity[g] - len(hashes)
        while self.used[g] > room and lru:
            h = next(iter(lru))
            if h in self._protected[g]:
                break  # the rest is in use by this request: the group runs over its size for a step
            self.evict(g, h)
        super()._store(g, hashes, parent, tokens, bs)
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
            self._protected[g].add(h)
        self.used[g] += len(hashes)
        self.stored[g] += len(hashes)

    def evict(self, g: int, h: int, silent: bool = False):
        super().evict(g, h, silent)
        self.used[g] -= 1
        self.removed[g] += 1
        if h not in self.live[g]:
            del self.lru[g][h]

    def group_hits(self, tokens: list[int]) -> tuple[int, dict[int, int]]:
        """(resumable tokens by vLLM's rule, {group: its own hit within the full-attention hit}):
        full-attention groups their hit below the last token, a sliding-window group the largest p
        whose window before it is held, a mamba group the largest p with a checkpoint at p."""
        B = self.B
        hs = self.block_hashes(tokens)
        fa = [g for g, (k, _) in enumerate(self.groups) if k == "full_attention"]
        hit = 0
        while hit < len(hs) and all(hs[hit] in self.live[g] for g in fa):
            hit += 1
        top = min(hit, (len(tokens) - 1) // B)
        own: dict[int, int] = {}
        for g, (kind, window) in enumerate(self.groups):
            live = self.live[g]
            p = top
            if kind == "sliding_window":
                need = -(-(window - 1) // B)
                while p > 0 and not all(h in live for h in hs[max(0, p - need):p]):
                    p -= 1
            elif kind == "mamba":
                while p > 0 and hs[p - 1] not in live:
                    p -= 1
            own[g] = p * B
        return self.reference(tokens), own

    def serve(self, prompt: list[int], output: list[int] | None = None) -> int:
        """One request: vLLM's hybrid hit, the hit's blocks touched, the rest computed (in chunks of
        `chunk_tokens`) and cached; one engine batch to the outbox. Returns the reused tokens."""
        B = self.B
        hs = self.block_hashes(prompt)
        reused, self.last_group_hits = self.group_hits(prompt)
        p = reused // B
        self._protected = [set() for _ in self.groups]
        for g, (kind, window) in enumerate(self.groups):  # touch what the hit uses
            if not p:
                break
            if kind == "mamba":
                used = hs[p - 1:p]
            elif kind == "sliding_window":
                used = hs[max(0, p - -(-(window - 1) // B)):p]
            else:
                used = hs[:p]
            lru = self.lru[g]
            for h in used:
                lru.move_to_end(h)
            self._protected[g].update(used)
        self.prefill(prompt, self.chunk_tokens, self.rng, self.hashless_p, self.report_full_p)
        self._protected = [set() for _ in self.groups]
        self.requests += 1
        if self.pending:
            payload = _enc.encode(WBatch(self.now, self.pending, 0))
            self.pending = []
            seq = self.seq
            self.seq += 1
            self._buffer.append((seq, payload))
            self.outbox.append((seq, payload))
        return reused

    def replay_from(self, start_seq: int) -> list[tuple[int, bytes]]:
        return [(s, p) for s, p in self._buffer if s >= start_seq]

    def close(self) -> None:
        pass
