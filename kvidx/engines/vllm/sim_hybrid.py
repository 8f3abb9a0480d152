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

    def _store(self, g: int, hashes: list[int], parent: int | None, tokens: list[int], bs: int | None = None,
               at: list[int] | None = None):
        """Cache `hashes` in group `g` (`at`: their block positions in the prompt) and announce them."""
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
                self._schedule(g, done, end)
                if kind == "mamba":
                    if b1 > b0 and rng.random() >= hashless_p:
                        if rng.random() < 0.5:  # as observed: parent null, token_ids from 0
                            self._store(g, [hs[b1 - 1]], None, tokens[:b1 * B], at=[b1 - 1])
                        else:  # as cache_full_blocks writes it after a hit: from the chunk's start
                            self._store(g, [hs[b1 - 1]], hs[b0 - 1] if b0 else None, tokens[b0 * B:b1 * B],
                                        at=[b1 - 1])
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
                self._store(g, [hs[i] for i in keep], parent, tokens[b0 * B:b1 * B], at=keep)
            done = end

    def _schedule(self, g: int, done: int, end: int) -> None:
        """A chunk [done, end) of the prompt is about to be computed in group `g` (the fleet engine
        allocates its blocks here); nothing to do for the bare generator."""

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

    `capacity`: physical blocks of the one pool all groups allocate from; `chunk_tokens`: the
    scheduler's chunk (for mamba groups, the checkpoint interval); `hashless_p`: the share of mamba
    chunk announcements without a hash; `report_full_p`: the share of hits re-announced
    (kv_cache_report_mode "full")."""

    topic = b"kv"

    def __init__(self, name: str, groups: list[tuple[str, int | None]], block_size: int,
                 capacity: int, chunk_tokens: int, seed: int = 0, hashless_p: float = 0.0,
                 report_full_p: float = 0.0, buffer_steps: int = 1000) -> None:
        super().__init__(groups, block_size)
        self.name = name
        self.capacity = capacity
        self.chunk_tokens = chunk_tokens
        self.hashless_p = hashless_p
        self.report_full_p = report_full_p
        self.rng = random.Random(seed)
        self.now = 0.0
        # the block pool (vllm/v1/core/block_pool.py): what each physical block caches, the copies of
        # each (group, hash) in the order they were cached, and the free queue (evicted from its head)
        self._key: list[tuple[int, int] | None] = [None] * capacity
        self._copies: dict[tuple[int, int], dict[int, None]] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(capacity))
        self._req: list[dict[int, int]] = [{} for _ in groups]  # the request's blocks: position -> block
        self.outbox: list[tuple[int, bytes]] = []
        self._buffer: deque = deque(maxlen=buffer_steps)
        self._memo: tuple[list[int], list[int]] | None = None
        self.stored = [0] * len(groups)
        self.removed = [0] * len(groups)
        self.overdrawn = 0  # blocks allocated past the pool (one request larger than it)
        self.requests = 0
        self.last_group_hits: dict[int, int] = {}

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

    # -- the block pool, shared by the groups as vLLM's hybrid allocator shares it
    def _allocate(self) -> int:
        """A block from the head of the free queue, its cached hash evicted (BlockRemoved)."""
        if not self._free:
            self.overdrawn += 1
            self._key.append(None)
            return len(self._key) - 1
        bid, _ = self._free.popitem(last=False)
        key = self._key[bid]
        if key is not None:
            self._key[bid] = None
            copies = self._copies[key]
            del copies[bid]
            if not copies:
                del self._copies[key]
            self.evict(*key)
        return bid

    def _release(self, bids) -> None:
        """Blocks the request no longer holds go to the free queue's tail, in the order given."""
        for bid in bids:
            self._free[bid] = None

    def _schedule(self, g: int, done: int, end: int) -> None:
        """Before a chunk [done, end): a sliding-window group frees the blocks that fell out of the
        window (SlidingWindowManager.remove_skipped_blocks: deepest first, up to the first null),
        a mamba group the state before the chunk; then full-attention and sliding-window groups
        allocate the chunk's blocks (mamba's checkpoint block is taken when it is cached)."""
        kind, window = self.groups[g]
        req, B = self._req[g], self.B
        if kind == "sliding_window":
            skipped = max(0, done - window + 1) // B
            freed = []
            for pos in range(skipped - 1, -1, -1):
                bid = req.pop(pos, None)
                if bid is None:
                    break
                freed.append(bid)
            self._release(freed)
        elif kind == "mamba":
            self._release([req.pop(pos) for pos in sorted(req) if pos < done // B])
        if kind != "mamba":
            for pos in range(done // B, -(-end // B)):
                if pos not in req:
                    req[pos] = self._allocate()

    def _store(self, g: int, hashes: list[int], parent: int | None, tokens: list[int], bs: int | None = None,
               at: list[int] | None = None):
        req = self._req[g]
        for h, pos in zip(hashes, at or (), strict=True):
            bid = req.get(pos)
            if bid is None:
                bid = req[pos] = self._allocate()
            self._key[bid] = (g, h)
            self._copies.setdefault((g, h), {})[bid] = None
        super()._store(g, hashes, parent, tokens, bs)
        self.stored[g] += len(hashes)

    def evict(self, g: int, h: int, silent: bool = False):
        super().evict(g, h, silent)
        self.removed[g] += 1

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
        """One request: vLLM's hybrid hit, the hit's blocks taken off the free queue, the rest computed
        (in chunks of `chunk_tokens`) and cached, then every block freed (per group, deepest first);
        one engine batch to the outbox. Returns the reused tokens."""
        B = self.B
        hs = self.block_hashes(prompt)
        reused, self.last_group_hits = self.group_hits(prompt)
        p = reused // B
        for g, (kind, window) in enumerate(self.groups):  # the hit's blocks (null before a window)
            if not p:
                break
            if kind == "mamba":
                span = range(p - 1, p)
            elif kind == "sliding_window":
                span = range(max(0, p - -(-(window - 1) // B)), p)
            else:
                span = range(p)
            req = self._req[g]
            for pos in span:
                bid = next(iter(self._copies[(g, hs[pos])]))
                self._free.pop(bid, None)
                req[pos] = bid
        self.prefill(prompt, self.chunk_tokens, self.rng, self.hashless_p, self.report_full_p)
        for req in self._req:  # KVCacheCoordinator.free: group by group, tail first
            self._release([req[pos] for pos in sorted(req, reverse=True)])
            req.clear()
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
