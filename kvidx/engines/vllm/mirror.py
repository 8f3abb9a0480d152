"""The relay's mirror of one vLLM engine's cache (one publisher = one replica or DP rank).

It turns the engine's events into canonical index events by vLLM's rules (vllm/v1/core/block_pool.py):
- blocks are evicted one by one from an LRU free queue, so a cached block can outlive its evicted
  parent: each block is tracked on its own, and canonical hashes (content-based) make it reachable
  again when the parent returns;
- a BlockStored's parent is an engine hash: the mirror memoizes engine hash -> canonical hashes so
  it can chain the next blocks and match later removals (engine hashes are content hashes, so the
  memo stays valid after eviction);
- a group can hold two physical copies of one hash (the recomputed last block of a fully cached
  prompt; whole chains in hybrid models; a prefix two requests loaded from the connector's tier in
  one step): copies are counted and a block is retracted only when its last copy goes. A
  re-announcement (kv_cache_report_mode "full", a request's opt-in: vLLM re-lists the blocks a
  request reused, from the root, parent null) is not a copy and does not count. It can be told
  apart: in a single-group model only by the relay's `--kv-cache-report-mode full` (every chain
  re-stored from the root is then one); in a hybrid model, vLLM re-announces
  every group of the request in one batch with the same hash list, token_ids exactly covering it,
  and the hit it reports is cached: the full-attention groups hold every listed hash and each other
  group holds the last one (see `_reannounced`). Anything else re-storing a live hash is a copy;
- stores that skip blocks (sliding window, mamba) list hashes that are not always the range's last
  blocks (vLLM's reachable_block_mask keeps the window before the replay boundary): each goes to the
  block the same batch's dense (full-attention) store, or an earlier store, put that engine hash at;
- state-space ("mamba") groups: vLLM announces a state checkpoint as one hash at the last block of
  the chunk's token range (token_ids cover the whole chunk, parent null): it is placed at that block,
  chained from the root over all tokens, and kept under its last index block only (a checkpoint is
  a point: the state after exactly p tokens). Announcements without any hash are counted and ignored;
- partial blocks (--prefix-match-unit): BlockStored events whose block_size is a finer unit than the
  group's block size are placed like any block (by their parent's hash); the canonical events carry
  that unit so the shard knows where the engine may resume;
- extra keys (vLLM 0.32 publishes them untagged per block: the LoRA name, (mm identifier, offset from
  the block start) pairs, the cache salt, prompt-embeds digests: vllm/v1/core/kv_cache_utils.py
  to_event_extra_keys): the LoRA name namespaces the chain; the salt is an extra key of the chain's
  first index block; an mm item is an extra key ["mm", identifier, offset] of the index block holding
  its start only (an entry with a negative offset continues an item that started earlier); anything
  else (older releases' bare mm hashes, prompt-embeds digests) is kept as is on the engine block's
  first index block. kvidx.core.hashing.prompt_hashes(..., cache_salt=, mm=) hashes prompts the same way;
- CPU-tier events of the offloading connector without token ids (block_size 0, one hash: the last
  block hash of the offloaded chunk, vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py
  _placeholder_stored, 0.32.0) are matched through the engine-hash memo (the same hashes as the GPU
  blocks) and placed in their tier; a chunk of several blocks (`cpu_chunk_blocks`) is walked back
  through the engine parents. Self-describing ones carry tokens and are placed like any store;
- LMCache's stores re-published through vLLM (a medium vLLM never uses, e.g. "cpu") go to
  kvidx/engines/lmcache/chunks.py: placed by tokens, in an upper-bound tier with a TTL / capacity;
- AllBlocksCleared drops everything the replica held;
- events are placed one by one (kvidx/engines/common.py, the table in docs/engines.md): a store that
  cannot be placed (a parent never seen, a medium that maps to no known tier, a tokenless store of an
  engine hash never seen with tokens — vLLM 0.34's simple_kv_offload lazy mode stores every block it
  copies to host memory that way, with the GPU block's size — wrong sizes or lookahead) is set aside
  and not indexed; a removal of hashes not held is set aside; a removal on an unknown medium drops
  its hashes from every tier and group; an undecodable event follows common.place_unreadable.
The mirror is pure: no I/O, no clocks. It is fed decoded engine batches and returns schema events.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from kvidx.core.hashing import (
    chain,
    dynamo_keys,
    dynamo_local_hashes,
    dynamo_seed,
    namespace_seed,
    pack_tokens,
)
from kvidx.core.walk import FULL_KINDS, STATE_KINDS, WINDOW_KINDS
from kvidx.engines.common import (
    KNOWN_TIERS,
    UNKNOWN_HASH,
    UNKNOWN_MEDIUM,
    UNKNOWN_PARENT,
    MirrorError,
    SetAside,
    Unreadable,
    engine_cache_reset,
    hold,
    normalize_tier,
    place_unreadable,
    release,
    stored_runs,
)
from kvidx.engines.lmcache.chunks import LmcacheChunks, LmcacheConfig, LmcacheError
from kvidx.engines.vllm.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    fold_engine_hash,
    is_lmcache_store,
)
from schemas.events import BlocksRemoved, BlocksStored, Event

_M64 = (1 << 64) - 1


class VllmMirror:
    def __init__(self, index_block_size: int, memo_limit: int = 1 << 21,
                 group_kinds: dict[int, tuple[str, int | None]] | None = None, cpu_chunk_blocks: int = 1,
                 lmcache: LmcacheConfig | None = None, lookahead: bool = True, dynamo_block_size: int = 0,
                 full_reports: bool = False):
        """`group_kinds`: KV-cache groups known from configuration (group -> (kind, window)), for
        engines whose events do not say (the events' own metadata wins when they carry it).
        `cpu_chunk_blocks`: engine blocks per offloaded chunk of vLLM's offloading connector (its
        block_size / the GPU block size); `lmcache`: how LMCache's chunks are aged and placed;
        `lookahead`: whether the engine's release may send lookahead tokens (vLLM >= 0.33; a release
        pinned older refuses them rather than credit blocks the engine will not reuse).
        `dynamo_block_size` (> 0: the relay of a worker registered through Dynamo's API): the engine's
        blocks of that size are also published under their Dynamo keys (BlocksStored.router_keys).
        `full_reports`: the engine's requests may ask for kv_cache_report_mode "full" (vLLM re-announces
        every hit from the root): in a single-group model a chain from the root re-stored while live
        is then taken as a re-announcement; by default (vLLM's "incremental") it is a second physical
        copy (two requests loading one prefix from the connector's tier in one step each cache it)."""
        self.index_block_size = index_block_size
        self.memo_limit = memo_limit
        # engine hash -> (canonical hashes of its index sub-blocks, depth of the first one)
        self.memo: dict[EngineHash, tuple[tuple[int, ...], int]] = {}
        # (engine hash, tier, group) -> [physical copies, canonical hashes it was stored under]
        self.live: dict[tuple[EngineHash, str, int], list] = {}
        # group -> index blocks whose extra physical copy the last batch evicted (the last copy's
        # eviction is a BlocksRemoved): eviction foresight counts the room copies take
        self.copies_removed: dict[int, list[int]] = {}
        # (canonical hash, tier, group) -> live engine blocks covering it: with an index block size
        # below the engine's, two engine blocks can share their first index blocks
        self.refs: dict[tuple[int, str, int], int] = {}
        self.group_kinds: dict[int, tuple[str, int | None]] = dict(group_kinds or {})
        self.block_size = 0  # the engine's (largest) block size seen
        self.stats = {"stored": 0, "removed": 0, "restored_live": 0, "extra_copies": 0,
                      "remove_unknown": 0, "orphan_blocks": 0, "cleared": 0, "hashless_stored": 0,
                      "reannounced": 0, "partial_blocks": 0, "partial_unaligned": 0,
                      "placeholder_stored": 0, "placeholder_unknown": 0, "placed_inner": 0}
        self.set_aside: list[SetAside] = []  # the last batch's events that could not be placed
        self.cpu_chunk_blocks = max(1, cpu_chunk_blocks)
        self.eparent: dict[EngineHash, EngineHash | None] = {}  # only with cpu_chunk_blocks > 1
        self.lmcache = LmcacheChunks(index_block_size, self.refs, lmcache)
        self.accepts_lookahead = lookahead
        self.lookahead_tokens = 0  # L of the engine's lookahead block hashing, once seen (EventBatch)
        # the scheduler's local (GPU) hit, then its KV connector's from there (EventBatch)
        self.external_after_local = 1
        self.dynamo_block_size = dynamo_block_size
        self.full_reports = full_reports
        self.dynamo: dict[EngineHash, int] = {}  # engine hash -> its Dynamo key (dynamo_block_size > 0)
        # engine hash -> (Dynamo's tokens_hash of the block, its parent's engine hash): Dynamo's GET /dump
        self.dynamo_meta: dict[EngineHash, tuple[int, EngineHash | None]] = {}

    @property
    def hybrid(self) -> bool:
        return len(self.group_kinds) > 1

    def apply(self, events: Iterable[BlockStored | BlockRemoved | AllBlocksCleared | Unreadable],
              now: float | None = None) -> list[Event]:
        """`now`: the engine batch's timestamp, which ages LMCache's chunks (engines/lmcache/chunks.py).
        Events that cannot be placed are listed in `self.set_aside` (by their position in `events`)."""
        out: list[Event] = []
        self.copies_removed = {}
        self.set_aside = []
        events, origins = _merge_removals(events)
        reannounced = self._reannounced(events)
        dense = _dense_positions(events)
        for i, ev in enumerate(events):
            at = origins[i]
            try:
                if isinstance(ev, BlockStored):
                    if is_lmcache_store(ev):
                        try:
                            self.lmcache.stored(ev.block_hashes, ev.parent_block_hash, ev.token_ids,
                                                ev.block_size, ev.lora_name, out, now)
                        except LmcacheError as e:
                            raise MirrorError(e.reason, str(e)) from None
                        continue
                    if reannounced and i in reannounced:
                        self.stats["reannounced"] += 1
                        self.stats["restored_live"] += len(ev.block_hashes)
                        continue
                    self._stored(ev, out, dense, at[0])
                elif isinstance(ev, BlockRemoved):
                    self._removed(ev, out, at)
                elif isinstance(ev, Unreadable):
                    self.set_aside.append(place_unreadable(self, ev, at[0], out))
                else:
                    engine_cache_reset(self, out)
            except MirrorError as e:  # raised before the event changed anything
                kind = "stored" if isinstance(ev, BlockStored) else "removed"
                self.set_aside.append(SetAside(at[0], kind, e.reason, str(e)))
        if self.lmcache.live:
            self.lmcache.expire(now, out)
        return out

    def _reannounced(self, events: list) -> set[int] | None:
        """Positions of hybrid-model re-announcements in one engine batch (kv_cache_report_mode
        "full"): vLLM's emit_cached_block_events lists, for every group of a request with a hit, the
        hit's hashes from the root (parent null, token_ids exactly nb x block_size), all in one batch,
        and that hit is a valid resume point: every full-attention group holds all its blocks, every
        sliding-window group the ceil((w-1)/B) before its end, every other group (state) the last.
        A second physical copy differs: the engine recomputes because the point is not valid in some
        group, and the other groups' stores of that step skip their null blocks (other hash lists).
        One case stays ambiguous: a prompt of exactly one block, fully cached, whose block vLLM
        recomputes (it never reuses the last token): taken as a re-announcement, which errs toward
        under-credit (the block is retracted one removal early)."""
        if len(events) < 2 or not self.hybrid:
            return None
        cands: dict[tuple, list[int]] = {}
        for i, ev in enumerate(events):
            if (isinstance(ev, BlockStored) and ev.parent_block_hash is None and ev.block_hashes
                    and len(ev.token_ids) == len(ev.block_hashes) * ev.block_size):
                cands.setdefault((tuple(ev.block_hashes), ev.block_size, normalize_tier(ev.medium)),
                                 []).append(i)
        out: set[int] = set()
        for (hashes, bs, tier), idx in cands.items():
            groups = {events[i].group_idx or 0 for i in idx}
            if len(groups) < 2:
                continue
            live = self.live
            ok = True
            for g in groups:
                kind, window = self.group_kinds.get(g, ("full_attention", None))
                if kind in WINDOW_KINDS and window:
                    need = hashes[-max(1, -(-(window - 1) // bs)):]
                elif kind in FULL_KINDS:
                    need = hashes
                else:
                    need = hashes[-1:]
                if not all((h, tier, g) in live for h in need):
                    ok = False
                    break
            if ok:
                out.update(idx)
        return out or None

    def _stored(self, ev: BlockStored, out: list[Event],
                dense: dict[EngineHash, tuple[EngineHash | None, int, int]] | None = None,
                at: int = 0) -> None:
        """`dense`: where the batch's stores that list every block of their token range put each
        engine hash (see `_positions`); `at`: the event's position in its batch (for set-asides)."""
        nb = len(ev.block_hashes)
        if nb == 0:
            # vLLM's mamba groups announce chunks whose state blocks were all skipped (blocks filled
            # during decode): nothing was cached
            self.stats["hashless_stored"] += 1
            return
        if normalize_tier(ev.medium) not in KNOWN_TIERS:
            raise MirrorError(UNKNOWN_MEDIUM, f"BlockStored on medium {str(ev.medium)[:40]!r}")
        ibs, ebs = self.index_block_size, ev.block_size
        if not ev.token_ids:
            # tokenless: the offloading connector's placeholders (block_size 0) and vLLM 0.34's
            # simple_kv_offload (the GPU block's size): placed through the engine-hash memo
            self._placeholder(ev, out, at)
            return
        if 0 < ebs < self.block_size and ebs % ibs:
            # a partial block (--prefix-match-unit) finer than the index block size: not indexable,
            # the engine's full blocks still are
            self.stats["partial_unaligned"] += 1
            return
        if ebs <= 0 or ebs % ibs:
            raise MirrorError("block_size_mismatch",
                              f"engine block size {ebs} is not a multiple of the index block size {ibs}: "
                              "set --index-block-size (or the model's index_block_size) to a divisor of it")
        k = ebs // ibs
        n_token_blocks = len(ev.token_ids) // ebs
        if n_token_blocks < nb:
            raise MirrorError("short_token_ids",
                              f"{len(ev.token_ids)} token ids for {nb} blocks of {ebs}")
        group = ev.group_idx or 0
        kind = ev.kv_cache_spec_kind or "full_attention"
        gk = self.group_kinds.setdefault(group, (kind, ev.kv_cache_spec_sliding_window))
        if ev.kv_cache_spec_kind is None and gk[0] != kind:
            kind = gk[0]  # a partial event may come without the group's metadata: keep what we know
        partial = 0 < ebs < self.block_size
        if partial:
            self.stats["partial_blocks"] += nb
        else:
            self.block_size = max(self.block_size, ebs)
        state = kind in STATE_KINDS
        tier = normalize_tier(ev.medium)

        if ev.parent_block_hash is None:
            parent, depth0 = namespace_seed(ev.lora_name), 0
        else:
            known = self.memo.get(ev.parent_block_hash)
            if known is None:  # a parent we never saw (joined mid-stream): the chain can't be placed
                self.stats["orphan_blocks"] += nb
                self.set_aside.append(SetAside(at, "stored", UNKNOWN_PARENT, f"{nb} blocks under a parent "
                                                                             "never seen"))
                return
            parent, depth0 = known[0][-1], known[1] + len(known[0])

        # Sliding-window and mamba groups skip blocks (null ones outside the window, and the ones
        # vLLM's reachable_block_mask leaves out): token_ids then cover more blocks than are listed.
        skip = n_token_blocks - nb
        pos = (list(range(nb)) if not skip
               else self._positions(ev.block_hashes, ev.parent_block_hash, ebs, n_token_blocks, depth0, k,
                                 dense))
        extras = _index_block_extras(ev.extra_keys, ev.lora_name, pos, n_token_blocks, k, ibs, ebs)
        if ev.lookahead_token_ids is not None:
            extras = self._lookahead_extras(ev, extras, n_token_blocks, nb, ibs, ebs)
        packed = pack_tokens(ev.token_ids[: n_token_blocks * ebs])
        canon = chain(packed, ibs, parent, extras)
        if self.lmcache.seen and not state and extras is None:
            self.lmcache.note_chain(canon, packed, depth0, parent)
        if self.cpu_chunk_blocks > 1 and skip == 0:
            ep = self.eparent
            prev = ev.parent_block_hash
            for eh in ev.block_hashes:
                ep[eh] = prev
                prev = eh
            if len(ep) > self.memo_limit:
                for old in list(ep)[: len(ep) // 8]:
                    del ep[old]

        # A store of a live hash is a second physical copy (vLLM recomputes the last block of a fully
        # cached prompt; hybrid models recompute whole chains; two requests loading one prefix from
        # the connector in one step cache it twice), except, where requests may ask for full reports,
        # a chain re-announced from the root in a single-group model, which is the same copy.
        count_copies = self.hybrid or ev.parent_block_hash is not None or not self.full_reports
        refs = self.refs
        new_pos: list[int] = []  # positions in `canon` of index blocks that became cached here
        engine_new: list[int] = []
        copied: list[int] = []  # index blocks stored again as extra physical copies
        for j, eh in enumerate(ev.block_hashes):
            first = pos[j] * k
            sub = tuple(canon[first:first + k])
            self._remember(eh, sub, depth0 + first)
            if state:  # a state checkpoint is a point: the state after the block's last token
                first += k - 1
                sub = sub[-1:]
            key = (eh, tier, group)
            entry = self.live.get(key)
            if entry is not None:
                if count_copies:
                    entry[0] += 1
                    self.stats["extra_copies"] += 1
                    copied.extend(entry[1])
                else:
                    self.stats["restored_live"] += 1
                continue
            self.live[key] = [1, sub]
            self.stats["stored"] += 1
            engine_new.append(fold_engine_hash(eh))
            hold(refs, sub, tier, group, first, new_pos)
        for hashes, run_parent, depth, engine in stored_runs(canon, new_pos, parent, depth0, engine_new):
            out.append(BlocksStored(tier, group, hashes, run_parent, depth, engine, kind,
                                    ev.kv_cache_spec_sliding_window or gk[1], ebs if partial else 0))
        if copied:
            out.append(BlocksStored(tier, group, copied, None, 0, [], kind,
                                    ev.kv_cache_spec_sliding_window or gk[1], copy=True))
        if self.dynamo_block_size and ebs == self.dynamo_block_size and not skip and kind in FULL_KINDS:
            self._dynamo_stored(ev, packed, tier, group, out)

    def _dynamo_stored(self, ev: BlockStored, packed: bytes, tier: str, group: int, out: list[Event]) -> None:
        """The Dynamo keys of the engine blocks this store made live (Dynamo's listener hashes each
        block's tokens with the event's LoRA name: zmq_wire/convert.rs; the key chains them from the
        parent's, as its radix tree does)."""
        parent = None
        if ev.parent_block_hash is not None:
            parent = self.dynamo.get(ev.parent_block_hash)
            if parent is None:  # a parent Dynamo could not place either
                return
        local = dynamo_local_hashes(packed, ev.block_size, dynamo_seed(ev.lora_name))
        keys = dynamo_keys(local, parent)
        dyn, meta = self.dynamo, self.dynamo_meta
        fresh = []
        up = ev.parent_block_hash
        for eh, key, tokens_hash in zip(ev.block_hashes, keys, local, strict=False):
            dyn[eh] = key
            meta[eh] = (tokens_hash, up)
            up = eh
            if self.live.get((eh, tier, group), (0,))[0] == 1:  # its first live copy here
                fresh.append(key)
        if len(dyn) > self.memo_limit:
            for old in list(dyn)[: len(dyn) // 8]:
                if old not in self.memo:
                    del dyn[old]
                    meta.pop(old, None)
        if fresh:
            out.append(BlocksStored(tier, group, fresh, None, 0, router_keys=True))

    def _positions(self, hashes: list[EngineHash], parent: EngineHash | None, ebs: int, n_token_blocks: int,
                   depth0: int, k: int, dense: dict[EngineHash, tuple[EngineHash | None, int, int]] | None
                   ) -> list[int]:
        """The engine blocks (0 = the first of the token range) that a store skipping blocks lists.
        They are not always the last ones: with vLLM 0.32's default prefix_cache_retention_interval 0,
        a sliding-window group caches only the ceil((w-1)/B) blocks before the prompt's replay
        boundary (SlidingWindowManager.reachable_block_mask), e.g. block 6 of the blocks 6-7 of a
        256-token prompt. Engine hashes are content hashes, so a hash's block is the one another
        group's dense store of this batch (vLLM lists every group of a step, full attention dense)
        or an earlier store put it at; when that is not known for every hash, the last blocks (the
        blocks that left the window lead)."""
        out: list[int] = []
        memo = self.memo
        for eh in hashes:
            got = dense.get(eh) if dense else None
            if got is not None and got[:2] == (parent, ebs):
                p = got[2]
            else:
                known = memo.get(eh)
                if known is None or (known[1] - depth0) % k:
                    break
                p = (known[1] - depth0) // k
            if not 0 <= p < n_token_blocks or (out and p <= out[-1]):
                break
            out.append(p)
        else:
            if out != list(range(n_token_blocks - len(hashes), n_token_blocks)):
                self.stats["placed_inner"] += 1
            return out
        return list(range(n_token_blocks - len(hashes), n_token_blocks))

    def _lookahead_extras(self, ev: BlockStored, extras: list | None, n_token_blocks: int, nb: int,
                          ibs: int, ebs: int) -> list:
        """vLLM >= 0.33's lookahead hashing: an engine block is reusable only where the prompt goes on
        with the L tokens after it, so every index block is keyed with the L tokens after it (an
        extra key ["la", *tokens], kvidx.core.hashing.prompt_hashes(lookahead=L) does the same)."""
        la = ev.lookahead_token_ids
        if not self.accepts_lookahead:
            raise MirrorError("wrong_engine", "BlockStored carries lookahead_token_ids (vLLM >= 0.33 with "
                                              "EAGLE/MTP): run the relay with --engine-version 0.33.0 "
                                              "or later")
        n_la = len(la[0]) if la else 0
        if len(la) != nb or any(len(x) != n_la for x in la) or n_la == 0:
            raise MirrorError("bad_lookahead", f"{len(la)} lookahead token lists of lengths "
                                               f"{sorted({len(x) for x in la})} for {nb} blocks")
        if self.lookahead_tokens and n_la != self.lookahead_tokens:
            raise MirrorError("lookahead_changed", f"lookahead of {n_la} tokens after "
                                                   f"{self.lookahead_tokens}: the engine restarted with "
                                                   "another speculative config")
        self.lookahead_tokens = n_la
        tokens = [*ev.token_ids[: n_token_blocks * ebs], *la[-1]]  # then the L after the last block
        out = list(extras) if extras is not None else [None] * (n_token_blocks * (ebs // ibs))
        for i in range(len(out)):
            end = (i + 1) * ibs
            out[i] = [*(out[i] or []), ["la", *tokens[end:end + n_la]]]
        return out

    def _placeholder(self, ev: BlockStored, out: list[Event], at: int = 0) -> None:
        """A store without tokens (the offloading connector's, vLLM 0.34's simple_kv_offload): its hash
        is the engine hash of the last GPU block of the offloaded chunk; the chunk's canonical hashes
        come from the memo. Hashes the memo does not know are set aside (one entry per event)."""
        tier = normalize_tier(ev.medium)
        group = ev.group_idx or 0
        kind, window = self.group_kinds.get(group, ("full_attention", None))
        unknown = self.stats["placeholder_unknown"]
        for eh in ev.block_hashes:
            subs: list[tuple[tuple[int, ...], int]] = []
            h: EngineHash | None = eh
            for _ in range(self.cpu_chunk_blocks):
                known = self.memo.get(h) if h is not None else None
                if known is None:
                    break
                subs.append(known)
                h = self.eparent.get(h)
            if len(subs) < self.cpu_chunk_blocks and (not subs or subs[-1][1] != 0):
                self.stats["placeholder_unknown"] += 1
                continue
            subs.reverse()
            sub = tuple(c for s_, _ in subs for c in s_)
            depth0 = subs[0][1]
            if kind in STATE_KINDS:  # a state checkpoint is a point: the state after its last block
                depth0 += len(sub) - 1
                sub = sub[-1:]
            key = (eh, tier, group)
            entry = self.live.get(key)
            if entry is not None:
                entry[0] += 1
                self.stats["extra_copies"] += 1
                out.append(BlocksStored(tier, group, list(entry[1]), None, 0, [], kind, window, copy=True))
                continue
            self.live[key] = [1, sub]
            self.stats["placeholder_stored"] += 1
            new_pos: list[int] = []
            hold(self.refs, sub, tier, group, 0, new_pos)
            # (a placeholder does not name its chunk's parent: None)
            for hashes, run_parent, depth, engine in stored_runs(list(sub), new_pos, None, depth0,
                                                                 [fold_engine_hash(eh)]):
                out.append(BlocksStored(tier, group, hashes, run_parent, depth, engine, kind, window))
        missed = self.stats["placeholder_unknown"] - unknown
        if missed:
            self.set_aside.append(SetAside(at, "stored", UNKNOWN_HASH, f"tokenless store: {missed} of "
                                           f"{len(ev.block_hashes)} engine hashes never seen with tokens"))

    def _removed(self, ev: BlockRemoved, out: list[Event], at: list[int] | None = None) -> None:
        """`at`: each hash's event position in the batch (removals are merged), for set-asides."""
        tier = normalize_tier(ev.medium)
        if tier not in KNOWN_TIERS:  # a tier this mirror does not know: the blocks could be anywhere
            self.drop_everywhere(ev.block_hashes, out)
            for p in dict.fromkeys(at or ()):
                self.set_aside.append(SetAside(p, "removed", UNKNOWN_MEDIUM, f"BlockRemoved on medium "
                                               f"{str(ev.medium)[:40]!r}", "dropped_everywhere"))
            return
        group = ev.group_idx or 0
        hashes: list[int] = []
        engine: list[int] = []
        dynamo_gone: list[int] = []
        unknown: dict[int, int] = {}  # event position -> its hashes not held
        for j, eh in enumerate(ev.block_hashes):
            key = (eh, tier, group)
            entry = self.live.get(key)
            if entry is None:
                self.stats["remove_unknown"] += 1
                if at is not None:
                    unknown[at[j]] = unknown.get(at[j], 0) + 1
                continue
            if entry[0] > 1:
                entry[0] -= 1
                self.copies_removed.setdefault(group, []).extend(entry[1])
                continue
            del self.live[key]
            self.stats["removed"] += 1
            engine.append(fold_engine_hash(eh))
            release(self.refs, entry[1], tier, group, hashes)
            if eh in self.dynamo:
                dynamo_gone.append(self.dynamo[eh])
        if hashes:
            out.append(BlocksRemoved(tier, group, hashes, engine))
        if dynamo_gone:
            out.append(BlocksRemoved(tier, group, dynamo_gone, router_keys=True))
        for p, n in unknown.items():
            self.set_aside.append(SetAside(p, "removed", UNKNOWN_HASH, f"{n} engine hashes not held in "
                                                                       f"{tier} group {group}"))

    def drop_everywhere(self, engine_hashes: list, out: list[Event]) -> None:
        """Drop engine blocks from every tier and group, every copy: what a removal the mirror cannot
        place could have referred to."""
        live = self.live
        for tier, group in {(t, g) for (_, t, g) in live}:
            gone = [eh for eh in engine_hashes if (eh, tier, group) in live]
            for eh in gone:
                live[(eh, tier, group)][0] = 1
            if gone:
                self._removed(BlockRemoved(gone, tier, group), out)

    def _remember(self, eh: EngineHash, sub: tuple[int, ...], depth: int) -> None:
        memo = self.memo
        if memo.pop(eh, None) is None and len(memo) >= self.memo_limit:
            # forget the least recently stored hashes that no live copy needs (live ones are kept:
            # their removal must still find their canonical hashes, which `live` holds anyway)
            tier_groups = {(t, g) for (_, t, g) in self.live}
            budget = max(1, self.memo_limit // 8)
            for old in [h for h, _ in zip(memo, range(4 * budget), strict=False)]:
                if not any((old, t, g) in self.live for t, g in tier_groups):
                    del memo[old]
                    budget -= 1
                    if not budget:
                        break
        memo[eh] = (sub, depth)  # (re)inserted at the end: the memo is kept in LRU order

    def clear(self) -> None:
        self.live.clear()
        self.dynamo_meta.clear()
        self.refs.clear()
        self.lmcache.clear()
        self.dynamo.clear()

    def live_blocks(self) -> int:
        return len(self.live)

    def dynamo_blocks(self) -> list[tuple[str, int, int, int | None, int]]:
        """The live engine blocks with Dynamo keys, as Dynamo's indexer would hold them (its GET /dump):
        (tier, engine hash, Dynamo tokens_hash, parent engine hash or None, depth in index blocks),
        shallowest first (a parent before its children). Engine hashes as Dynamo reads them: u64."""
        out = []
        meta, memo = self.dynamo_meta, self.memo
        for eh, tier, _ in list(self.live):  # a copy: the relay's thread goes on
            m = meta.get(eh)
            if m is None or not isinstance(eh, int):
                continue
            up = m[1]
            out.append((tier, eh & _M64, m[0], up & _M64 if isinstance(up, int) else None,
                        memo.get(eh, ((), 0))[1]))
        out.sort(key=lambda b: b[4])
        return out

    def replay_keys(self) -> list[Event]:
        """The Dynamo keys of the live engine blocks, for a mirror replay (SequencedRelay.resync)."""
        keys: dict[tuple[str, int], list[int]] = {}
        for eh, tier, group in self.live:
            key = self.dynamo.get(eh)
            if key is not None:
                keys.setdefault((tier, group), []).append(key)
        return [BlocksStored(tier, group, ks, None, 0, router_keys=True)
                for (tier, group), ks in keys.items()]


def _index_block_extras(extra_keys: list | None, lora_name: str | None, blocks: list[int], n_blocks: int,
                        k: int, ibs: int = 0, ebs: int = 0) -> list[object] | None:
    """Per index block extra keys, by the canonical rule (kvidx.core.hashing.mm_start_extras): an
    engine block's plain keys (minus the LoRA name, which namespaces the whole chain: the cache salt,
    older releases' bare mm hashes, prompt-embeds digests) go to its first index sub-block; a vLLM 0.32
    mm pair [identifier, offset] goes, as ["mm", identifier, offset % ibs], to the index block holding
    the item's start (a negative offset continues an item that started in an earlier block)."""
    if not extra_keys:
        return None
    out: list[object] = [None] * (n_blocks * k)
    any_key = False
    for j, keys in enumerate(extra_keys[:len(blocks)]):  # one per listed block (`blocks`: its engine block)
        if not keys:
            continue
        base = blocks[j] * k
        plain: list[object] = []
        mm: list[tuple[int, list]] = []
        lora_left = bool(lora_name)
        for x in keys:
            if (isinstance(x, list | tuple) and len(x) == 2 and isinstance(x[1], int)
                    and not isinstance(x[1], bool) and ibs):
                off = x[1]
                if off < 0 or (ebs and off >= ebs):
                    continue
                mm.append((base + off // ibs, ["mm", x[0], off % ibs]))
            elif lora_left and x == lora_name:
                lora_left = False
            else:
                plain.append(x)
        if plain:
            out[base] = plain
            any_key = True
        for pos, key in mm:
            cur = out[pos]
            out[pos] = [*(cur or []), key]
            any_key = True
    return out if any_key else None


def _dense_positions(events: list) -> dict[EngineHash, tuple[EngineHash | None, int, int]] | None:
    """engine hash -> (parent, block size, engine block in the token range) from the batch's stores
    that list every block of their range (full attention); None unless some store skips blocks (its
    hashes are placed by them: VllmMirror._positions)."""
    stores = [ev for ev in events if isinstance(ev, BlockStored) and ev.block_size > 0 and ev.block_hashes]
    if not any(len(ev.token_ids) // ev.block_size > len(ev.block_hashes) for ev in stores):
        return None
    out: dict[EngineHash, tuple[EngineHash | None, int, int]] = {}
    for ev in stores:
        if len(ev.token_ids) // ev.block_size == len(ev.block_hashes):
            for j, eh in enumerate(ev.block_hashes):
                out.setdefault(eh, (ev.parent_block_hash, ev.block_size, j))
    return out


def _merge_removals(events: Iterable) -> tuple[list, list[list[int]]]:
    """vLLM sends one BlockRemoved per evicted block: consecutive ones of one tier and group become one
    event, so the mirror's per-event work is paid once per run, not once per block. Also each merged
    event's origin: the positions in `events` (per hash for a removal run, else the event's own)."""
    out: list = []
    origins: list[list[int]] = []
    run: list | None = None  # the block hashes of the BlockRemoved run being merged
    for i, ev in enumerate(events):
        if isinstance(ev, BlockRemoved):
            last = out[-1] if out else None
            if (run is not None and isinstance(last, BlockRemoved) and last.medium == ev.medium
                    and last.group_idx == ev.group_idx):
                run.extend(ev.block_hashes)
                origins[-1].extend([i] * len(ev.block_hashes))
                continue
            run = list(ev.block_hashes)
            out.append(msgspec.structs.replace(ev, block_hashes=run))
            origins.append([i] * len(run) if run else [i])
        else:
            run = None
            out.append(ev)
            origins.append([i])
    return out, origins
