"""LMCache's chunks in the index: stores re-published through vLLM, and the controller's admit/evict.

Rules, read in LMCache's source (lmcache/v1/cache_engine.py `store`, lmcache/utils.py
`convert_tokens_to_list`; seen with LMCache 0.5.6 under vLLM 0.32, ../shared/ENGINES.md) and vLLM's
connector (vllm/distributed/kv_transfer/kv_connector/v1/lmcache_connector.py,
get_kv_connector_kv_cache_events, 0.32.0):
- one BlockStored per chunk, one hash per event (`key.chunk_hash`), `medium` "cpu" (or the tokens'
  device), `block_size` = the chunk's token count, no group_idx / extra_keys (the connector copies
  only block_hashes, parent_block_hash, token_ids, lora_id, block_size, medium, lora_name);
- `token_ids` = tokens[start:end + 1]: a chunk that is not the last of its store call carries one
  extra id, the next chunk's first token;
- `parent_block_hash` = None when start == 0, else `prev_key`, which starts at 0 in every store call:
  the first chunk of a call that skips already-stored chunks says parent 0;
- when LMCache stores by hashes instead of tokens, `token_ids` are those hashes (`hashes[start:end+1]`):
  not tokens, dead-lettered (`lmcache_hash_token_ids`);
- its hashes are LMCache's own (Python `hash()` per process by default): never joined to vLLM's;
- evictions are not published through vLLM (the non-MP connector only stores).

So a chunk is placed by its tokens and what came before it, never by its parent: the chunk of a
store call's start (parent None) at the root; a later chunk after the chain whose last chunk announced
this chunk's first token as its extra id (`tails`), or, failing that, where its first index blocks
continue a recently seen chain of the same relay (`content`: index-block tokens -> parents and
depths, from vLLM's own GPU stores and from LMCache chunks), the candidate whose deeper blocks also
match winning. A chunk that cannot be placed is counted (`lmcache_orphans`) and skipped.

Unreported evictions: LMCache blocks are upper bounds. They are published in their tier (default
"CPU"), kept at most `ttl_s` seconds after their last store (engine time) and, with
`capacity_blocks`, at most that many index blocks (least recently stored dropped first, like
LMCache's LRU); dropping one publishes an ordinary BlocksRemoved. `unreported_tiers` names the tiers
whose credit is an upper bound; `mark_upper_bound` flags a lookup answer that relies on them.
With the controller's admit/evict messages wired (`evictions_reported=True`), the TTL and the flag are
off: evictions arrive as `KVEvictMsg`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import xxhash

from kvidx.core.hashing import chain, namespace_seed, pack_tokens
from kvidx.engines.common import hold, release, stored_runs
from schemas.answers import ReplicaAnswer
from schemas.events import BlocksRemoved, BlocksStored, Event

_xxh = xxhash.xxh3_64_intdigest
_U32 = 1 << 32


class LmcacheError(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class LmcacheConfig:
    ttl_s: float | None = 300.0  # age a chunk out this long after its last store (None: never)
    capacity_blocks: int | None = None  # cap on live index blocks per tier (LMCache's max size / chunk)
    tier: str = "CPU"  # where chunks re-published through vLLM ("cpu") are placed
    evictions_reported: bool = False  # the controller's KVEvictMsg are wired: no TTL, not an upper bound
    memo_limit: int = 1 << 18  # content and key memo entries
    location_tiers: dict[str, str] = field(default_factory=dict)  # controller location -> tier


def location_tier(location: str, overrides: dict[str, str] | None = None) -> str:
    """A controller `location` (a storage backend name such as "LocalCPUBackend", "LocalDiskBackend",
    or a remote backend) as an index tier."""
    if overrides and location in overrides:
        return overrides[location]
    loc = location.lower()
    if "cpu" in loc or "hbm" in loc or "pinned" in loc:
        return "CPU"
    if "disk" in loc or "gds" in loc:
        return "DISK"
    return "POOL"


class LmcacheChunks:
    def __init__(self, index_block_size: int, refs: dict, cfg: LmcacheConfig | None = None):
        self.ibs = index_block_size
        self.refs = refs  # shared with the vLLM mirror: (canonical, tier, group) -> live holders
        self.cfg = cfg or LmcacheConfig()
        self.tails: OrderedDict[int, tuple[int, int]] = OrderedDict()  # next token -> (canon, depth)
        self.content: OrderedDict[int, dict[int, int]] = OrderedDict()  # block tokens -> {parent: depth}
        self.by_key: OrderedDict[int, tuple[tuple[int, ...], int]] = OrderedDict()  # chunk hash -> canon
        self.live: OrderedDict[tuple[int, str], list] = OrderedDict()  # (chunk hash, tier) -> [sub, exp]
        self.tier_blocks: dict[str, int] = {}
        self.seen = False  # an LMCache store has arrived: note vLLM's chains from now on
        self.stats = {"lmcache_stored": 0, "lmcache_restored": 0, "lmcache_orphans": 0,
                      "lmcache_aged_out": 0, "lmcache_capacity_evicted": 0, "lmcache_admitted": 0,
                      "lmcache_evicted": 0, "lmcache_unknown_key": 0, "lmcache_ambiguous": 0,
                      "lmcache_short_chunks": 0}

    @property
    def unreported_tiers(self) -> frozenset[str]:
        if self.cfg.evictions_reported or not self.seen:
            return frozenset()
        return frozenset({self.cfg.tier})

    # ---- memo of recent chains ------------------------------------------------------------
    def note_chain(self, canon: list[int], packed: bytes, depth0: int, parent: int) -> None:
        """Remember which parent (and depth) each index block's tokens followed."""
        step = self.ibs * 4
        content = self.content
        for i in range(len(canon)):
            key = _xxh(packed[i * step:(i + 1) * step])
            p = canon[i - 1] if i else parent
            d = content.pop(key, None)
            if d is None:
                d = {}
                if len(content) >= self.cfg.memo_limit:
                    content.popitem(last=False)
            d.pop(p, None)
            d[p] = depth0 + i
            if len(d) > 4:
                del d[next(iter(d))]
            content[key] = d

    def _place(self, packed: bytes, n_blocks: int) -> tuple[int, int] | None:
        step = self.ibs * 4
        first = _xxh(packed[:step])
        cands: dict[int, int] = dict(self.content.get(first, {}))
        tail = self.tails.get(int.from_bytes(packed[:4], "little"))
        if tail is not None:
            cands[tail[0]] = tail[1]
        if not cands:
            return None
        if len(cands) == 1:
            return next(iter(cands.items()))
        best, best_score, tie = None, -1.0, False
        for p, d in cands.items():  # later entries are more recent: ties go to the most recent
            canon = chain(packed[: n_blocks * step], self.ibs, p)
            score = 0.5 if tail is not None and p == tail[0] else 0.0
            for i in range(1, len(canon)):
                if canon[i - 1] in self.content.get(_xxh(packed[i * step:(i + 1) * step]), {}):
                    score += 1
            if score > best_score:
                best, best_score, tie = (p, d), score, False
            elif score == best_score:
                best, tie = (p, d), True
        if tie:
            self.stats["lmcache_ambiguous"] += 1
        return best

    # ---- stores re-published through vLLM ---------------------------------------------------
    def stored(self, block_hashes: list, parent, token_ids: list[int], block_size: int,
               lora_name: str | None, out: list[Event], now: float | None) -> None:
        self.seen = True
        n = block_size
        if len(block_hashes) != 1:
            raise LmcacheError("lmcache_hash_count", f"{len(block_hashes)} hashes in one chunk event")
        if n <= 0 or len(token_ids) not in (n, n + 1):
            raise LmcacheError("lmcache_token_count", f"{len(token_ids)} token ids for a chunk of {n}")
        if any(t < 0 or t >= _U32 for t in token_ids):
            raise LmcacheError("lmcache_hash_token_ids", "token_ids are not token ids (hashes?)")
        nxt = token_ids[n] if len(token_ids) == n + 1 else None
        packed = pack_tokens(token_ids[:n])
        nb = n // self.ibs
        if not nb:  # a last chunk shorter than an index block: nothing the index could credit
            self.stats["lmcache_short_chunks"] += 1
            return
        if parent is None:
            root, depth0 = namespace_seed(lora_name), 0
        else:
            placed = self._place(packed, nb)
            if placed is None:
                self.stats["lmcache_orphans"] += 1
                return
            root, depth0 = placed
        canon = chain(packed, self.ibs, root)
        if not canon:
            return
        self.note_chain(canon, packed, depth0, root)
        if nxt is not None and n % self.ibs == 0:
            self.tails.pop(nxt, None)
            self.tails[nxt] = (canon[-1], depth0 + len(canon))
            if len(self.tails) > self.cfg.memo_limit:
                self.tails.popitem(last=False)
        key = _fold(block_hashes[0])
        self._remember(key, tuple(canon), depth0)
        self._admit(key, self.cfg.tier, tuple(canon), depth0, root, out, now)

    def _remember(self, key: int, sub: tuple[int, ...], depth: int) -> None:
        self.by_key.pop(key, None)
        self.by_key[key] = (sub, depth)
        if len(self.by_key) > self.cfg.memo_limit:
            self.by_key.popitem(last=False)

    def _admit(self, key: int, tier: str, sub: tuple[int, ...], depth0: int, parent: int | None,
               out: list[Event], now: float | None) -> None:
        ttl = None if self.cfg.evictions_reported else self.cfg.ttl_s
        exp = now + ttl if (now is not None and ttl) else None
        lk = (key, tier)
        entry = self.live.get(lk)
        if entry is not None:  # stored again: LMCache keeps one copy; refresh its age
            entry[1] = exp
            self.live.move_to_end(lk)
            self.stats["lmcache_restored"] += 1
            return
        self.live[lk] = [sub, exp]
        self.stats["lmcache_stored"] += 1
        self.tier_blocks[tier] = self.tier_blocks.get(tier, 0) + len(sub)
        new_pos: list[int] = []
        hold(self.refs, sub, tier, 0, 0, new_pos)
        for hashes, run_parent, depth, engine in stored_runs(list(sub), new_pos, parent, depth0, [key]):
            out.append(BlocksStored(tier, 0, hashes, run_parent, depth, engine))
        cap = self.cfg.capacity_blocks
        if cap is not None:
            while self.tier_blocks.get(tier, 0) > cap:
                victim = next((k for k in self.live if k[1] == tier), None)
                if victim is None or victim == lk and len(self.live) == 1:
                    break
                self._drop(victim, out)
                self.stats["lmcache_capacity_evicted"] += 1

    def _drop(self, lk: tuple[int, str], out: list[Event]) -> None:
        sub, _ = self.live.pop(lk)
        tier = lk[1]
        self.tier_blocks[tier] -= len(sub)
        gone: list[int] = []
        release(self.refs, sub, tier, 0, gone)
        if gone:
            out.append(BlocksRemoved(tier, 0, gone, [lk[0]]))

    def expire(self, now: float | None, out: list[Event]) -> None:
        """Age out chunks past their TTL (engine time); the oldest stores come first."""
        if now is None:
            return
        while self.live:
            lk, entry = next(iter(self.live.items()))
            if entry[1] is None or entry[1] > now:
                break
            self._drop(lk, out)
            self.stats["lmcache_aged_out"] += 1

    # ---- the controller's admit / evict ---------------------------------------------------
    def admit(self, key: int, location: str, out: list[Event], now: float | None) -> None:
        known = self.by_key.get(key)
        if known is None:  # a chunk whose tokens this relay never saw: it cannot be placed
            self.stats["lmcache_unknown_key"] += 1
            return
        self.stats["lmcache_admitted"] += 1
        sub, depth0 = known
        self._admit(key, location_tier(location, self.cfg.location_tiers), sub, depth0, None, out, now)

    def evict(self, key: int, location: str, out: list[Event]) -> None:
        lk = (key, location_tier(location, self.cfg.location_tiers))
        if lk not in self.live:
            self.stats["lmcache_unknown_key"] += 1
            return
        self.stats["lmcache_evicted"] += 1
        self._drop(lk, out)

    def evict_location(self, location: str, out: list[Event]) -> None:
        """Evict every chunk of a location's tier (what an eviction that names no readable key could
        have referred to)."""
        tier = location_tier(location, self.cfg.location_tiers)
        for lk in [k for k in self.live if k[1] == tier]:
            self.stats["lmcache_evicted"] += 1
            self._drop(lk, out)

    def clear(self) -> None:
        self.live.clear()
        self.tier_blocks.clear()


def _fold(h) -> int:
    if isinstance(h, int):
        return h & 0xFFFF_FFFF_FFFF_FFFF
    return int.from_bytes(bytes(h)[-8:], "big")


def mark_upper_bound(answer: ReplicaAnswer, unreported_tiers: frozenset[str] | set[str]) -> ReplicaAnswer:
    """Flag a replica's lookup answer whose resumable prefix relies on a tier whose evictions go
    unreported (LMCache through vLLM): `upper_bound` true, and `upper_bound_tiers` listing them."""
    used: list[str] = []
    seen = 0
    for run in answer.tiers:
        if seen >= answer.resumable_tokens:
            break
        if run.tier in unreported_tiers and run.tier not in used:
            used.append(run.tier)
        seen += run.tokens
    if used:
        answer.upper_bound = True
        answer.upper_bound_tiers = used
    return answer
