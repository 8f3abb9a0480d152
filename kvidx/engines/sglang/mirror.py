"""The relay's mirror of one SGLang engine's radix cache (one publisher = one replica or DP rank).

SGLang's rules (sglang 0.5.23 wheel unless noted; ENGINES.md):
- Only full pages are stored: a BlockStored lists pages of `block_size` = page size tokens each
  (mem_cache/radix_cache.py: keys are `page_aligned` before insert, l. 438 and l. 468), and its
  `parent_block_hash` is the last page of the radix parent (mem_cache/events.py `_parent_block_hash`,
  l. 180-197; None under the root). Per-page stores are merged into one event per parent-linked
  chain (events.py `enqueue`, l. 140-170), so a store is one chain.
- One BlockRemoved per evicted radix node listing all its pages (events.py `record_remove`,
  l. 273-303), and consecutive removals are merged into one event (same `enqueue`): a removal's hash
  list is several nodes, leaf first, **not one chain**. Removals are therefore applied page by page.
- Eviction takes leaves only (radix_cache.py `evict`, l. 556-582: a heap of evictable leaves; a
  parent becomes a candidate when its last child goes), so a page never outlives a cached
  descendant. Hence the **aggregation rule** for a page size P below the index block size B (page
  size 1 = one hash per token; B must be a multiple of P): an index block is cached when all its
  pages are, which under leaf-only eviction is exactly when the page that completes it (its last
  page) is cached. Each page carries the index blocks it completes (none for the first B/P - 1
  pages of a block, one for the last); with P >= B (B must divide P) a page completes P/B blocks.
  Index blocks are chained over the tokens (kvidx.core.hashing): the mirror keeps, per engine page,
  the canonical hash of the last complete index block before it and the tokens since, so the next
  chain can continue mid-index-block.
- Namespaces: the radix tree separates requests by `extra_key` (+ LoRA id) and `cache_salt`
  (radix_cache.py RadixKey). 0.5.22+ events carry `cache_salt` on every stored chain and
  `lora_name` when the adapter is known (events.py l. 199-235; the published hashes are then
  namespaced, kv_events.py `namespaced_block_hash`). The canonical hash follows the index's rule
  (kvidx.core.hashing.prompt_hashes): the LoRA name seeds the chain, the salt is an extra key of
  the first index block. Older releases publish neither: their salted or LoRA chains are indexed
  in the base namespace (and a caller-defined extra_key, never published, cannot be told apart).
- Tiers: medium "GPU", host "CPU_PINNED" (HiCache L2; 0.5.10's MEDIUM_CPU, 0.5.23's
  StorageMedium.CPU) or "CPU"; missing medium (<= 0.5.3) = GPU. Each tier is mirrored on its own.
- Two live copies of one engine hash are counted (radix namespaces whose published hashes agree,
  e.g. an unpublished extra_key; or <= 0.5.3's content-only page hashes): a page is retracted when
  its last copy goes. With content-only hashes (<= 0.5.3) a parent hash may name several places;
  the most recently stored one is taken (best effort, counted as `ambiguous_parent`).
- AllBlocksCleared (radix_cache.py `reset`) drops everything.
- Events are placed one by one (kvidx/engines/common.py, docs/engines.md): a store that cannot be
  placed (a parent never seen, a medium mapping to no known tier, bad sizes or tokens) is set aside
  and not indexed; a removal of pages not held is set aside; a removal on an unknown medium drops its
  pages from every tier; an undecodable event follows common.place_unreadable.
- Router keys (`router_keys=True`): each page's first live copy in a tier is also published under
  its SGLang key (the engine's page hash as the decimal int64 its router sends,
  kvidx.core.hashing.sglang_key; BlocksStored.router_keys), and its last copy's removal retracts it:
  what SGLang's external-indexer API answers from (index_service/sglang_indexer.py).
- EAGLE (bigram keys): pages of token pairs are turned back into single tokens (the pairs' first
  elements, kvidx.core.spec_decode.unpair_tokens) before anything else; the tree matches a page only
  where the prompt goes on with its last pair's second token, so every index block is keyed with the
  token after it (`lookahead_tokens` 1, as vLLM's lookahead hashing: a prompt sharing a page's tokens
  but not the next one is not credited with it; without it the kit's EAGLE stream over-credited 29
  of 200 requests by a page). Pairs that do not chain (a pair's second token is the next pair's
  first) or a page mixing ints and pairs are dead letters (`broken_bigram_chain`, `bad_bigram`).
The mirror is pure: no I/O, no clocks.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvidx.core.hashing import chain, extra_seed, namespace_seed, pack_tokens, sglang_key
from kvidx.core.spec_decode import SpecDecodeError, is_bigram_page, unpair_tokens
from kvidx.engines.common import (
    KNOWN_TIERS,
    UNKNOWN_HASH,
    UNKNOWN_MEDIUM,
    UNKNOWN_PARENT,
    MirrorError,
    PartialTails,
    SetAside,
    Unreadable,
    engine_cache_reset,
    hold,
    normalize_tier,
    place_unreadable,
    release,
    stored_runs,
)
from kvidx.engines.sglang.wire import AllBlocksCleared, BlockRemoved, BlockStored, u64
from schemas.events import BlocksRemoved, BlocksStored, Event

GROUP = 0  # SGLang's radix cache is one KV-cache group (full attention)


def _router_keys(engine_hashes: list[int]) -> list[int]:
    """SGLang keys of engine page hashes (u64 here; the router sends them as signed decimals)."""
    return [sglang_key(str(h - (1 << 64) if h >= 1 << 63 else h)) for h in engine_hashes]


class SglangMirror:
    def __init__(self, index_block_size: int, root_parents: Iterable[int] = (),
                 memo_limit: int = 1 << 21, router_keys: bool = False):
        """`root_parents`: parent hashes that mean "under the root" (<= 0.5.3 sends hash(()))."""
        self.index_block_size = index_block_size
        self.router_keys = router_keys
        self.root_parents = frozenset(root_parents)
        self.memo_limit = memo_limit
        # engine page hash -> (index blocks it completes, depth of the first (in index blocks),
        #                      canonical parent after it, tokens since that parent, salt, lora)
        self.memo: dict[int, tuple] = {}
        # (engine hash, tier, group) -> [copies, canonical hashes of the newest copy, [per copy]]
        self.live: dict[tuple[int, str, int], list] = {}
        self.refs: dict[tuple[int, str, int], int] = {}
        self.group_kinds: dict[int, tuple[str, int | None]] = {GROUP: ("full_attention", None)}
        self.block_size = 0  # the engine's page size
        self.stats = {"stored": 0, "removed": 0, "extra_copies": 0, "remove_unknown": 0,
                      "orphan_blocks": 0, "cleared": 0, "ambiguous_parent": 0, "empty_stored": 0,
                      "bigram_pages": 0}
        self.recompute_tokens = 1  # prompt tokens the engine recomputes at the end (EAGLE: 2)
        # EAGLE: a page of pairs is matched only where the prompt goes on with its last pair's second
        # token, so every index block is keyed with the token after it (as vLLM's lookahead hashing)
        self.lookahead_tokens = 0
        self._placed: dict[int, tuple] = {}  # <= 0.5.3: engine hash -> a different place seen
        # pages below the index block (the engine resumes at any page): the partial-block keys, and per
        # live page (engine hash, tier) [the page before it in its index block or None, its live
        # child pages there, the seed and tokens of the end it is while childless, whether that is a
        # full block]
        self.tails: PartialTails | None = None
        self.pages: dict[tuple[int, str], list] = {}
        self.set_aside: list[SetAside] = []  # the last batch's events that could not be placed

    def apply(self, events: Iterable[BlockStored | BlockRemoved | AllBlocksCleared | Unreadable],
              now: float | None = None) -> list[Event]:
        """`now` (the batch's engine time) is accepted for the relay's interface and not used. Events
        that cannot be placed are listed in `self.set_aside` (by position)."""
        out: list[Event] = []
        self.set_aside = []
        for i, ev in enumerate(events):
            try:
                if isinstance(ev, BlockStored):
                    self._stored(ev, out, i)
                elif isinstance(ev, BlockRemoved):
                    self._removed(ev, out, i)
                elif isinstance(ev, Unreadable):
                    self.set_aside.append(place_unreadable(self, ev, i, out))
                else:
                    engine_cache_reset(self, out)
            except MirrorError as e:  # raised before the event changed the cache's state
                self.set_aside.append(SetAside(i, "stored", e.reason, str(e)))
        return out

    def _stored(self, ev: BlockStored, out: list[Event], at: int = 0) -> None:
        nb = len(ev.block_hashes)
        if nb == 0:
            self.stats["empty_stored"] += 1
            return
        if normalize_tier(ev.medium) not in KNOWN_TIERS:
            raise MirrorError(UNKNOWN_MEDIUM, f"BlockStored on medium {str(ev.medium)[:40]!r}")
        P, B = ev.block_size, self.index_block_size
        if P <= 0 or (P % B and B % P):
            raise MirrorError("block_size_mismatch",
                              f"page size {P} and index block size {B}: one must divide the other")
        tokens = ev.token_ids
        after = None  # EAGLE: the token after the last pair's first, which the page's key includes
        if is_bigram_page(tokens):  # EAGLE: token pairs -> single tokens (kvidx/core/spec_decode.py)
            try:
                tokens, after = unpair_tokens(tokens)
            except SpecDecodeError as e:
                raise MirrorError(e.reason, str(e)) from None
            self.stats["bigram_pages"] += nb
            self.recompute_tokens = 2  # EAGLE matches n-1 tokens as n-2 pairs: one more recomputed
            self.lookahead_tokens = 1
        elif not all(type(t) is int for t in tokens):
            raise MirrorError("bad_bigram", "a page mixes single tokens and token pairs")
        if len(tokens) != nb * P:
            raise MirrorError("short_token_ids", f"{len(tokens)} token ids for {nb} pages of {P}")
        if tokens and (min(tokens) < 0 or max(tokens) > 0xFFFF_FFFF):  # hashed as uint32
            raise MirrorError("bad_token_id", "a token id outside 0..2^32-1")
        self.block_size = max(self.block_size, P)
        tier = normalize_tier(ev.medium)

        parent = ev.parent_block_hash
        if parent is None or parent in self.root_parents:
            seed, pending, depth_blocks = namespace_seed(ev.lora_name), (), 0
            salt, lora = ev.cache_salt, ev.lora_name
        else:
            known = self.memo.get(parent)
            if known is None:  # a parent we never saw (joined mid-stream): the chain can't be placed
                self.stats["orphan_blocks"] += nb
                self.set_aside.append(SetAside(at, "stored", UNKNOWN_PARENT, f"{nb} pages under a parent "
                                                                             "never seen"))
                return
            if parent in self._placed:
                self.stats["ambiguous_parent"] += 1
            blocks, d0, seed, pending, salt, lora = known
            depth_blocks = d0 + len(blocks)
        # canonical index blocks over (tokens since the last complete index block) + this chain
        stream = list(pending) + list(tokens)
        extras: list | None = [[salt]] if salt and depth_blocks == 0 else None
        if after is not None:  # each block keyed with the token after it (prompt_hashes(lookahead=1))
            nexts = stream[B::B] + [after]
            extras = [[*(extras[0] if k == 0 and extras else []), ["la", nexts[k]]]
                      for k in range(len(stream) // B)]
        canon = chain(pack_tokens(stream), B, seed, extras)
        lp = len(pending)

        new_pos: list[int] = []
        engine_new: list[int] = []
        done = 0  # index blocks completed by the pages so far
        refs = self.refs
        if P < B and self.tails is None:
            self.tails = PartialTails(B, P)
        tails = self.tails if P < B and after is None else None  # (lookahead engines resume at blocks)
        seed0 = extra_seed(seed, [salt]) if salt and depth_blocks == 0 else seed  # block 0's seed
        packed_stream = pack_tokens(stream) if tails is not None else b""
        prev = parent if lp else None  # the page before this one in its index block
        for j, eh in enumerate(ev.block_hashes):
            end = lp + (j + 1) * P  # stream offset after page j
            upto = end // B
            sub = tuple(canon[done:upto])
            first = done
            done = upto
            last = canon[done - 1] if done else seed
            state = (sub, depth_blocks + first, last, tuple(stream[done * B:end]), salt, lora)
            self._remember(eh, state)
            key = (eh, tier, GROUP)
            entry = self.live.get(key)
            if entry is None:
                self.live[key] = [1, sub, [sub]]
                self.stats["stored"] += 1
                engine_new.append(u64(eh))
                if tails is not None:
                    full = end % B == 0
                    b = (end - 1) // B  # the index block (stream position) the page lies in
                    self._page_stored(tails, eh, tier, prev, canon[b - 1] if b else seed0,
                                      packed_stream[4 * b * B:4 * end], full)
            else:
                entry[0] += 1
                entry[1] = sub
                entry[2].append(sub)
                self.stats["extra_copies"] += 1
            hold(refs, sub, tier, GROUP, first, new_pos)
            prev = eh if end % B else None
        for hashes, run_parent, depth, engine in stored_runs(canon, new_pos, seed, depth_blocks, engine_new):
            out.append(BlocksStored(tier, GROUP, hashes, run_parent, depth, engine))
        if self.router_keys and engine_new:
            out.append(BlocksStored(tier, GROUP, _router_keys(engine_new), None, 0, router_keys=True))
        if tails is not None:
            out.extend(tails.events(GROUP))

    def _page_stored(self, tails: PartialTails, eh: int, tier: str, prev: int | None, seed: int,
                     packed: bytes, full: bool) -> None:
        """A page's first live copy: it is an end of its block's trie (no child yet); the page before
        it in the block has one child more (and is an end no longer)."""
        self.pages[(eh, tier)] = [prev, 0, seed, packed, full]
        tails.add(tier, seed, packed, full)
        before = self.pages.get((prev, tier)) if prev is not None else None
        if before is not None:
            if not before[1]:
                tails.drop(tier, before[2], before[3], before[4])
            before[1] += 1

    def _page_removed(self, tails: PartialTails, eh: int, tier: str) -> None:
        """A page's last live copy went: the page before it may be an end again (leaf-first eviction)."""
        page = self.pages.pop((eh, tier), None)
        if page is None:
            return
        if not page[1]:
            tails.drop(tier, page[2], page[3], page[4])
        before = self.pages.get((page[0], tier)) if page[0] is not None else None
        if before is not None:
            before[1] -= 1
            if not before[1]:
                tails.add(tier, before[2], before[3], before[4])

    def _removed(self, ev: BlockRemoved, out: list[Event], at: int | None = None) -> None:
        """`at`: the event's position in its batch (None: no set-aside is recorded)."""
        tier = normalize_tier(ev.medium)
        if tier not in KNOWN_TIERS:  # a tier this mirror does not know: the pages could be anywhere
            self.drop_everywhere(ev.block_hashes, out)
            if at is not None:
                self.set_aside.append(SetAside(at, "removed", UNKNOWN_MEDIUM, f"BlockRemoved on medium "
                                               f"{str(ev.medium)[:40]!r}", "dropped_everywhere"))
            return
        hashes: list[int] = []
        engine: list[int] = []
        unknown = 0
        for eh in ev.block_hashes:  # several radix nodes, leaf first: page by page
            key = (eh, tier, GROUP)
            entry = self.live.get(key)
            if entry is None:
                self.stats["remove_unknown"] += 1
                unknown += 1
                continue
            sub = entry[2].pop()
            if entry[0] > 1:
                entry[0] -= 1
                entry[1] = entry[2][-1]
            else:
                del self.live[key]
                self.stats["removed"] += 1
                engine.append(u64(eh))
                if self.tails is not None:
                    self._page_removed(self.tails, eh, tier)
            release(self.refs, sub, tier, GROUP, hashes)
        if hashes or engine:
            out.append(BlocksRemoved(tier, GROUP, hashes, engine))
        if self.router_keys and engine:
            out.append(BlocksRemoved(tier, GROUP, _router_keys(engine), router_keys=True))
        if self.tails is not None:
            out.extend(self.tails.events(GROUP))
        if unknown and at is not None:
            self.set_aside.append(SetAside(at, "removed", UNKNOWN_HASH, f"{unknown} of "
                                           f"{len(ev.block_hashes)} pages not held in {tier}"))

    def drop_everywhere(self, engine_hashes: list, out: list[Event]) -> None:
        """Drop pages from every tier, every copy: what a removal the mirror cannot place could have
        referred to."""
        live = self.live
        for tier in {t for (_, t, _) in live}:
            gone = [eh for eh in engine_hashes if (eh, tier, GROUP) in live]
            for eh in gone:
                entry = live[(eh, tier, GROUP)]
                entry[0], entry[2] = 1, entry[2][-1:]
            if gone:
                self._removed(BlockRemoved(gone, tier), out)

    def _remember(self, eh: int, state: tuple) -> None:
        memo = self.memo
        old = memo.pop(eh, None)
        if old is not None and self.root_parents and old[1:4] != state[1:4]:
            self._placed[eh] = state  # a content-only hash (<= 0.5.3) seen at two places
        if old is None and len(memo) >= self.memo_limit:
            # forget the least recently stored pages that no live copy needs
            tiers = {t for (_, t, _) in self.live}
            budget = max(1, self.memo_limit // 8)
            for h in [h for h, _ in zip(memo, range(4 * budget), strict=False)]:
                if not any((h, t, GROUP) in self.live for t in tiers):
                    del memo[h]
                    self._placed.pop(h, None)
                    budget -= 1
                    if not budget:
                        break
        memo[eh] = state

    def clear(self) -> None:
        self.live.clear()
        self.refs.clear()
        self.pages.clear()
        if self.tails is not None:
            self.tails.clear()

    def live_blocks(self) -> int:
        return len(self.live)

    def replay_keys(self) -> list[Event]:
        """The partial-block keys and the router keys, for a mirror replay (SequencedRelay.resync)."""
        out = self.tails.replay(GROUP) if self.tails is not None else []
        if self.router_keys:
            by_tier: dict[str, list[int]] = {}
            for eh, tier, _g in self.live:
                by_tier.setdefault(tier, []).append(u64(eh))
            out += [BlocksStored(t, GROUP, _router_keys(ehs), None, 0, router_keys=True)
                    for t, ehs in by_tier.items()]
        return out

    def cached_index_blocks(self, tier: str = "GPU") -> set[int]:
        """Canonical hashes of the index blocks cached in `tier` (for tests and audits)."""
        return {c for (c, t, _g) in self.refs if t == tier}
