"""A per-model index shard: the fold of relay events and the lookup walk. Pure: no I/O (but the log
line of a refused batch).

Layout (memory is the budget): each (replica, DP rank) gets a slot number; per KV-cache group and
tier, one mask map (kvidx.core.maskmap: compiled where built, else a dict) maps a canonical block hash
to the bitmask of slots holding it. A lookup walks the prompt's hashes once for all replicas, AND-ing
masks: a slot drops out at its first missing block (a block is reusable only if every block before
it is). With one tier (the common case) the "any tier" map is the tier's own map, so a block held by
several replicas costs one entry. The fold hands each event's hashes to the map in one call.

Idempotence: a batch is applied only if its (epoch, seq) is newer than the slot's last applied one,
so Kafka redeliveries change nothing.

Epochs are one clock for every writer (`wall_epoch`: wall-clock milliseconds, a relay's at its start,
the SGLang feed's per batch): a batch whose epoch is more than MAX_EPOCH_SKEW_MS ahead of this
process's clock is refused (counted in `future_epochs`), and a slot's epoch that far ahead (written
under another rule, e.g. nanoseconds) no longer orders it, so no writer can make a replica's real
events stale for ever.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import msgspec
import numpy as np

from kvidx.core import walk
from kvidx.core.foresight import Foresight, HostLoads, PyRecency
from kvidx.core.maskmap import MaskMap, native_module
from kvidx.core.pending import PendingCredits, PyCredits
from kvidx.core.snapshot import ChangeJournal, shift_masks
from kvidx.core.walk import FULL_KINDS, STATE_KINDS, WINDOW_KINDS, window_blocks
from schemas.answers import Tier
from schemas.events import TIER_IDS, TIERS, BlocksRemoved, BlocksStored, EventBatch, ReplicaCleared

_LAST_TIER = len(TIERS) - 1  # where an unknown tier name is filed (the slowest)
_CPU = TIER_IDS["CPU"]
_GPU = TIER_IDS["GPU"]
_native = native_module()
MAX_EPOCH_SKEW_MS = 300_000  # how far a writer's clock may run ahead of this one (Kerberos's 5 minutes)
log = logging.getLogger("kvidx.shard")


def wall_epoch() -> int:
    """The epoch clock every writer stamps batches with: wall-clock milliseconds."""
    return int(time.time() * 1000)


class ReplicaState(msgspec.Struct):
    slot: int
    replica: str
    dp_rank: int
    epoch: int = -1
    seq: int = -1
    block_size: int = 0  # the engine's block size: the granularity it resumes at
    engine_ts: float = 0.0  # engine timestamp of the last applied batch
    relay_ts: float = 0.0
    applied_ts: float = 0.0  # when the last batch was applied here
    batches: int = 0
    duplicates: int = 0  # redelivered batches skipped
    seq_gaps: int = 0  # batches missing between applied ones (the relay fills or clears them)
    blocks: int = 0  # live (block, tier, group) entries
    group_blocks: dict[int, int] = {}  # group -> live (block, tier) entries of that group
    # the finest partial block size the engine announced (--prefix-match-unit), 0: none; 1: the engine
    # resumes at any token inside a block (TensorRT-LLM partial reuse)
    unit: int = 0
    part: int = 0  # the last mirror-replay part applied after batch `seq` (see EventBatch.part)
    recompute: int = 1  # prompt tokens the engine always recomputes at the end (EventBatch)
    lookahead: int = 0  # tokens after a block its engine's hash covers (EventBatch.lookahead_tokens)
    tails: int = 0  # live partial-block keys (BlocksStored.tail): the engine resumes inside blocks
    # live router keys (BlocksStored.router_keys): Dynamo's and SGLang's hashes (snapshots: "dynamo_keys")
    router_keys: int = msgspec.field(default=0, name="dynamo_keys")
    group: int = 0  # the replica group its events come in (EventBatch.replica_group; kvidx.core.groups)
    host_tier: int = 0  # EventBatch.host_tier_blocks: loading a host block frees the host's oldest
    external_after_local: int = 0  # EventBatch.external_after_local, once seen (a sticky engine trait)
    # (block, tier, group) entries its removal events took out, clears aside: the rate is the replica's
    # cache pressure (evictions and demotions per second)
    removed: int = 0


class GroupIndex:
    __slots__ = ("gid", "kind", "window", "new_map", "tiers", "any")  # fixed: the compiled fold reads them

    def __init__(self, kind: str = "full_attention", window: int | None = None, new_map: type = MaskMap,
                 gid: int = 0):
        self.gid = gid
        self.kind = kind
        self.window = window
        self.new_map = new_map
        self.tiers: dict[int, MaskMap] = {}  # tier id -> block hash -> slot mask
        self.any = new_map()  # block hash -> slot mask over all tiers

    def tier_map(self, tier: int) -> MaskMap:
        d = self.tiers.get(tier)
        if d is None:
            d = self.new_map()
            if not self.tiers:
                self.any = d  # one tier: share the map
            elif len(self.tiers) == 1:
                self.any = self.any.copy()  # a second tier: the union needs its own map
            self.tiers[tier] = d
        return d


class ModelShard:
    # fixed: the compiled fold reads the first ten at their slots' offsets (native/src/fold.rs `SH_NAMES`);
    # the instance dict holds the compiled `apply` bound in __init__
    __slots__ = ("replicas", "groups", "pending", "foresight", "host_orders", "journal", "pool_readers",
                 "blocks_applied", "tail_keys", "by_slot", "model", "block_size", "unreported_eviction_kinds",
                 "unreported_eviction_tiers", "future_epochs", "snapshot_id", "events_offset",
                 "events_partition", "replica_group", "_pool_cache", "lookahead", "_lookup_cache", "__dict__",
                 "__weakref__")
    # the mask map class: the compiled one where built; property tests pin the pure-Python reference
    new_map: type = MaskMap
    replica_fields = _native.ReplicaFields(ReplicaState) if _native is not None else None

    def __init__(self, model: str, block_size: int, unreported_eviction_kinds: Iterable[str] = ()):
        self.model = model
        self.block_size = block_size  # the index block size (tokens per canonical hash)
        # group kinds whose evictions the engines of this model do not report (e.g. {"mamba"} where
        # state copies are dropped silently): a credit relying on them is an upper bound
        self.unreported_eviction_kinds = frozenset(unreported_eviction_kinds)
        # tiers whose evictions go unpublished (e.g. LMCache's chunks re-published through vLLM): a
        # credit relying on them is an upper bound too
        self.unreported_eviction_tiers: frozenset[str] = frozenset()
        self.replicas: dict[tuple[str, int], ReplicaState] = {}
        self.by_slot: list[ReplicaState | None] = []
        self.groups: dict[int, GroupIndex] = {}
        self.blocks_applied = 0
        self.future_epochs = 0  # batches refused: their epoch ran ahead of the clock (MAX_EPOCH_SKEW_MS)
        self.snapshot_id = 0  # the last durable snapshot this shard was written as or rebuilt from
        self.events_offset = 0  # next offset of the events partition after what is folded in
        self.events_partition = -1  # the events partition the model's key maps to, once known
        self.replica_group = 0  # the model's replica group this shard folds (kvidx.core.groups)
        # shared caches: a pool publishes its blocks as a replica of its own (its name) and counts for
        # every replica attached to it (topology from configuration)
        self.pool_readers: dict[str, frozenset[str]] = {}
        self._pool_cache: tuple[int, dict[int, int]] | None = None  # (pool slot mask, pool bits -> readers)
        # pending credit and foresight compiled on a shard of compiled maps (the compiled fold keeps
        # them without a Python frame); a shard of reference maps keeps the references of all three
        native = _native is not None and self.new_map is _native.MaskMap
        self.pending = PendingCredits(None if native else PyCredits)
        self.foresight = Foresight()  # what in-flight prefills will evict (kvidx.core.foresight)
        if not native:
            self.foresight.recency_type = PyRecency
        # slot -> its host tier in offload order, for replicas whose host loads free the host's oldest
        # (EventBatch.host_tier_blocks; kvidx.core.walk.onboard_cut). Kept from a replica's start only: after
        # a restore the order is unknown and nothing is cut
        self.host_orders: dict[int, HostLoads] = {}
        self.lookahead = 0  # see _lookahead_changed
        self.tail_keys = 0  # live partial-block keys of all replicas: lookups key the partial block
        self.journal: ChangeJournal | None = None  # kept only where deltas are written (the worker)
        self._lookup_cache: tuple[GroupIndex | None] | None = None  # the default lookup group, once known
        if NATIVE_FOLD is not None and self.new_map is _native.MaskMap:
            # the compiled fold stands in for `apply` (which see): no Python frame for a batch
            self.apply = NATIVE_FOLD.bind(self).apply

    # ---- topology ---------------------------------------------------------------------------
    def _lookup_group(self, group: int | None) -> GroupIndex | None:
        """`group`, or by default the first full-attention group (else the first group)."""
        if group is not None:
            return self.groups.get(group)
        cached = self._lookup_cache
        if cached is None:
            fa = [self.groups[gid] for gid in sorted(self.groups) if self.groups[gid].kind in FULL_KINDS]
            cached = self._lookup_cache = (fa[0] if fa else next(iter(self.groups.values()), None),)
        return cached[0]

    def set_pools(self, pools: dict[str, Iterable[str]]) -> None:
        """pool name (the `replica` its relay publishes as) -> the replicas that can read it."""
        self.pool_readers = {p: frozenset(r) for p, r in pools.items()}
        self._pool_cache = None

    def _pools(self) -> tuple[int, dict[int, int]]:
        """(mask of the pool slots, pool slot bit -> mask of the slots reading that pool)."""
        if self._pool_cache is None:
            pool_mask, readers = 0, {}
            for st in self.by_slot:
                if st is not None and st.replica in self.pool_readers:
                    names = self.pool_readers[st.replica]
                    pool_mask |= 1 << st.slot
                    readers[1 << st.slot] = sum(1 << r.slot for r in self.by_slot
                                                if r is not None and r.replica in names)
            self._pool_cache = (pool_mask, readers)
        return self._pool_cache

    def is_pool(self, st: ReplicaState) -> bool:
        return st.replica in self.pool_readers

    def _pending_applies(self) -> bool:
        """Pending credit counts in full-attention and sliding-window models (a window group keeps a
        routed prompt's last window: PendingCredits.window_masks). Not with state groups: the engine
        keeps state at chunk ends, which the router does not know."""
        return bool(self.pending.masks or self.pending.window_masks) and all(
            g.kind in FULL_KINDS or g.kind in WINDOW_KINDS for g in self.groups.values())

    def _upper_bound_tiers(self, tiers: list[Tier]) -> bool:
        return bool(self.unreported_eviction_tiers) and any(
            t.tier in self.unreported_eviction_tiers for t in tiers)

    def _lookahead_changed(self) -> None:
        """`lookahead`: the L of the model's lookahead block hashing (vLLM >= 0.33 with EAGLE or MTP),
        which prompts are hashed with (kvidx.core.hashing.prompt_hashes): the largest any replica
        announced (the engines of one model share their speculative config; one that differs has
        keys a prompt hashed this way does not reach: it is credited nothing rather than too much)."""
        self.lookahead = max((st.lookahead for st in self.by_slot if st is not None), default=0)

    def engine_block_size(self, st: ReplicaState) -> int:
        """The block size the replica's engine resumes at; before its first event, the model's."""
        if st.block_size:
            return st.block_size
        return max((r.block_size for r in self.by_slot if r is not None), default=0) or self.block_size

    # ---- fold -------------------------------------------------------------------------------
    def replica(self, replica: str, dp_rank: int) -> ReplicaState:
        st = self.replicas.get((replica, dp_rank))
        if st is None:
            st = ReplicaState(len(self.by_slot), replica, dp_rank)
            self.replicas[(replica, dp_rank)] = st
            self.by_slot.append(st)
            self._pool_cache = None
        return st

    def add_pending(self, replica: str, dp_rank: int, hashes: list[int], n_tokens: int, credited: int,
                    expires: float) -> None:
        """A router sent this prompt to (replica, dp_rank): credit its blocks there until the engine's
        events confirm them or `expires` passes, and count what the prefill will add to the replica's
        cache (and its pools') until then (eviction foresight)."""
        st = self.replica(replica, dp_rank)
        fa = self._lookup_group(None)
        pend = hashes
        if fa is not None:  # blocks the replica already holds are the index's, not pending: an
            pend = fa.any.lacking(hashes, st.slot)  # eviction of one must show at once
        self.pending.add(st.slot, pend, expires, max(0, n_tokens - credited),
                         self._last_window(st, hashes, n_tokens))
        self.foresight.active = True
        if self.foresight.slots and hashes:
            self._foresee_route(st, hashes, n_tokens, credited, expires)

    def _last_window(self, st: ReplicaState, hashes: list[int], n_tokens: int) -> list[int]:
        """The index blocks a routed prompt leaves in its replica's sliding-window groups: the widest
        window before the last engine block boundary it can resume at (those it does not hold yet)."""
        wins = [g for g in self.groups.values() if g.kind in WINDOW_KINDS and g.window]
        if not wins:
            return []
        ebs = self.engine_block_size(st)
        k = max(1, ebs // self.block_size)
        need = max(window_blocks(g.window, ebs, k) for g in wins)
        end = max(0, min(len(hashes), (n_tokens - 1) // ebs * k))
        return wins[0].any.lacking(hashes[max(0, end - need):end], st.slot)

    def _foresee_route(self, st: ReplicaState, hashes: list[int], n_tokens: int, credited: int,
                       expires: float) -> None:
        """The blocks a routed prompt will touch and add on its replica and on the pools it reads
        (kvidx.core.foresight). A hybrid model's groups share the replica's pool: full-attention
        groups touch the prefix the engine resumes from (what the replica holds, whatever foresight
        credited: a discounted block the engine still has is touched, not lost) and add the rest of
        the prompt's whole engine blocks; sliding-window and state groups touch the window or
        checkpoint at the resume point and add nothing (what they keep of a prefill is engine
        policy; the events say it), but a window group's prefill takes room for its step (transient)."""
        resume_b = min(credited, len(hashes) * self.block_size) // self.block_size  # blocks resumed from
        if len(self.groups) == 1:
            ((gid, g),) = self.groups.items()
            if g.kind not in FULL_KINDS:
                return
            self.foresight.routed(st.slot, gid, hashes[:resume_b], hashes[resume_b:], expires, True)
            for r in self.by_slot if self.pool_readers else ():  # a pool it reads stores the whole prompt
                if r is not None and st.replica in self.pool_readers.get(r.replica, ()):
                    self.foresight.routed(r.slot, gid, [], hashes, expires, deepest_first=False)
            return
        held = walk.resume_points(self, hashes, n_tokens, walk.prefix_blocks(self, hashes), {st.slot})
        resume_b = max(resume_b, held.get(st.slot, (0, 0))[1] // self.block_size)
        ebs = st.block_size or self.block_size
        per = max(1, ebs // self.block_size)  # index blocks per engine block
        whole = len(hashes) // per * per
        # a window group's prefill takes a block per position and keeps only its windows: the rest is
        # transient room, counted with the first full-attention group until the step is reported
        window = {gid: window_blocks(g.window, ebs, per) for gid, g in self.groups.items()
                  if g.kind in WINDOW_KINDS and g.window}
        transient = sum(max(0, whole - resume_b - need) for need in window.values())
        for gid, g in self.groups.items():
            if g.kind in FULL_KINDS:
                touched, incoming = hashes[:resume_b], hashes[resume_b:whole]
                self.foresight.routed(st.slot, gid, touched, incoming, expires, True, transient)
                transient = 0
                continue
            if gid in window:
                touched = hashes[max(0, resume_b - window[gid]):resume_b]
            elif g.kind in STATE_KINDS:
                touched = hashes[resume_b - 1:resume_b] if resume_b else []
            else:
                continue
            self.foresight.routed(st.slot, gid, touched, [], expires, True)

    def apply(self, batch: EventBatch, now: float) -> bool:
        """Fold one batch; False if it was already applied (a redelivery). On a shard of compiled maps
        the compiled fold (NATIVE_FOLD.apply, bound in __init__) stands in for this method: it folds every
        batch of a known replica into groups and tiers the shard has (the rare events through their
        Python methods, `_copied`, `_clear`, `_host_queue`...; routes compiled or through the hooks)
        and hands any other to `fold_reference` (kvidx_fold_reference_batches_total{reason})."""
        return self.fold_reference(batch, now)

    def fold_reference(self, batch: EventBatch, now: float) -> bool:
        """The fold in Python: the reference of the compiled one, and the fold of what it declines."""
        latest = wall_epoch() + MAX_EPOCH_SKEW_MS
        if batch.epoch > latest:
            self.future_epochs += 1
            if self.future_epochs & (self.future_epochs - 1) == 0:  # 1, 2, 4 ...: loud, never a flood
                log.warning("event=batch_refused reason=future_epoch model=%s replica=%r dp_rank=%d epoch=%d "
                            "refused=%d", self.model, batch.replica[:200], batch.dp_rank, batch.epoch,
                            self.future_epochs)
            return False
        st = self.replicas.get((batch.replica, batch.dp_rank)) or self.replica(batch.replica, batch.dp_rank)
        if st.epoch > latest:  # another clock's epoch (a feed's nanoseconds): it orders nothing
            st.epoch, st.seq, st.part = -1, -1, 0
        epoch, seq = batch.epoch, batch.seq
        # (epoch, seq, part) <= the slot's, compared without building the tuples (the hot path)
        if epoch <= st.epoch and (epoch < st.epoch or seq < st.seq
                                  or (seq == st.seq and batch.part <= st.part)):
            st.duplicates += 1
            return False
        if epoch == st.epoch and seq > st.seq + 1:
            st.seq_gaps += seq - st.seq - 1
        if batch.host_tier_blocks != st.host_tier:
            self._host_tier(st, batch.host_tier_blocks)
        for ev in batch.events:
            kind = type(ev)  # the event structs are final: no subclass to miss
            if kind is BlocksStored:
                self._store(ev, st)
            elif kind is BlocksRemoved:
                self._remove(ev, st)
            elif kind is ReplicaCleared:
                if ev.tier:
                    self._clear_tier(st, ev.tier)
                else:
                    self._clear(st)
        if self.foresight.slots:
            for gid, hashes in batch.copies_removed.items():
                self.foresight.uncopied(st.slot, gid, hashes)
            if self.foresight.grown:
                self.foresight.settle()
        st.epoch, st.seq, st.part = epoch, seq, batch.part
        st.group = batch.replica_group
        st.recompute = batch.recompute_tokens
        if batch.external_after_local > st.external_after_local:
            st.external_after_local = batch.external_after_local
        if batch.lookahead_tokens != st.lookahead:
            st.lookahead = batch.lookahead_tokens
            self._lookahead_changed()
        st.block_size = batch.block_size or st.block_size
        st.engine_ts, st.relay_ts, st.applied_ts = batch.engine_ts, batch.relay_ts, now
        st.batches += 1
        return True

    def _group(self, gid: int, kind: str = "full_attention", window: int | None = None) -> GroupIndex:
        g = self.groups.get(gid)
        if g is None:
            g = self.groups[gid] = GroupIndex(kind, window, self.new_map, gid)
            self._lookup_cache = None
        return g

    def _store(self, ev: BlocksStored, st: ReplicaState) -> None:
        gid, hashes = ev.group, ev.hashes
        if ev.copy:
            self._copied(st, gid, hashes)
            return
        g = self.groups.get(gid) or self._group(gid, ev.group_kind, ev.sliding_window)
        tid = TIER_IDS.get(ev.tier, _LAST_TIER)
        d = g.tiers.get(tid) or g.tier_map(tid)
        new = d.store(hashes, st.slot)
        if self.host_orders and not ev.tail and not ev.router_keys:
            self._host_queue(st, tid, ev)
        if self.journal is not None:
            self.journal.touch(gid, tid, hashes)
        if g.any is not d:
            g.any.store(hashes, st.slot)
        if ev.tail or ev.router_keys:  # keys no block hash reaches, in the same maps, counted apart
            if ev.tail:
                st.tails += new
                self.tail_keys += new
            else:
                st.router_keys += new
            self.blocks_applied += len(hashes)
            return
        gb = st.group_blocks
        self._stored_hooks(st, gid, g, hashes, st.blocks, gb.get(gid, 0))
        if new:
            st.blocks += new
            gb[gid] = gb.get(gid, 0) + new
        if ev.block_size and (not st.unit or ev.block_size < st.unit):
            st.unit = ev.block_size
        self.blocks_applied += len(hashes)

    def _copied(self, st: ReplicaState, gid: int, hashes: list[int]) -> None:
        """Held blocks stored again (BlocksStored.copy): only their room and place in the eviction
        order change. Called by both folds."""
        if self.foresight.slots:
            self.foresight.copied(st.slot, gid, hashes, st.replica not in self.pool_readers)
        self.blocks_applied += len(hashes)

    def _host_queue(self, st: ReplicaState, tid: int, ev: BlocksStored | BlocksRemoved) -> None:
        """A store (after it) or removal (before it) of whole blocks, in the replica's host queue
        where it is kept (HostLoads). Called by both folds."""
        ho = self.host_orders.get(st.slot)
        if ho is None:
            return
        if type(ev) is BlocksRemoved:
            if tid == _CPU:
                ho.removed(ev.engine_hashes)
        elif tid == _CPU:
            ho.stored(ev.engine_hashes, ev.hashes)
        elif tid == _GPU:
            ho.raised(ev.engine_hashes)

    def _stored_hooks(self, st: ReplicaState, gid: int, g: GroupIndex, hashes: list[int], held: int,
                      held_in_group: int) -> None:
        """What a store of whole blocks tells the routes' side: they are no longer pending there, and
        they take their place in the replica's eviction order (`held`, `held_in_group`: its live blocks
        before the event). Called by both folds (the compiled one, NATIVE_FOLD, while routes are kept)."""
        if self.pending.masks and g.kind in FULL_KINDS:
            self.pending.confirm(st.slot, hashes)
        elif self.pending.window_masks and g.kind in WINDOW_KINDS:
            self.pending.confirm(st.slot, hashes, window=True)
        if self.foresight.active and (len(self.groups) > 1 or g.kind in FULL_KINDS):
            if len(self.groups) > 1 and not self.foresight.pooled:
                self.foresight.pool()  # a hybrid model: its groups share each replica's block pool
            self.foresight.stored(st.slot, gid, hashes, st.replica not in self.pool_readers,
                                  held if self.foresight.pooled else held_in_group,
                                  g.kind in STATE_KINDS or (g.kind in WINDOW_KINDS and bool(g.window)))

    def _removed_hooks(self, st: ReplicaState, gid: int, g: GroupIndex, hashes: list[int]) -> None:
        """Blocks whose removal took entries out (`gone`): foresight drops those gone from every tier.
        Called by both folds."""
        # foresight orders the union: only blocks gone from every tier
        self.foresight.removed(st.slot, gid, g.any.lacking(hashes, st.slot) if len(g.tiers) > 1 else hashes)

    def _remove(self, ev: BlocksRemoved, st: ReplicaState) -> None:
        g = self.groups.get(ev.group)
        if g is None:
            return
        tid = TIER_IDS.get(ev.tier, _LAST_TIER)
        d = g.tiers.get(tid)
        if d is None:
            return
        if self.journal is not None:
            self.journal.touch(ev.group, tid, ev.hashes)
        if self.host_orders and not ev.tail and not ev.router_keys:
            self._host_queue(st, tid, ev)
        if len(g.tiers) == 1:
            gone = d.remove(ev.hashes, st.slot)  # the map is its own union
        else:  # retract from the union only where no other tier still holds the block there
            gone = d.remove(ev.hashes, st.slot, [m for t, m in g.tiers.items() if t != tid], g.any)
        if gone and self.foresight.slots and not ev.tail and not ev.router_keys:
            self._removed_hooks(st, ev.group, g, ev.hashes)
        if ev.tail:
            st.tails -= gone
            self.tail_keys -= gone
        elif ev.router_keys:
            st.router_keys -= gone
        elif gone:
            st.blocks -= gone
            st.removed += gone
            st.group_blocks[ev.group] = st.group_blocks.get(ev.group, 0) - gone
        self.blocks_applied += len(ev.hashes)

    def _host_tier(self, st: ReplicaState, blocks: int) -> None:
        """The replica's host tier frees its oldest block for every host block loaded (or no longer):
        its order is kept from a start with nothing held (before that, the oldest are not known)."""
        st.host_tier = blocks
        if not blocks:
            self.host_orders.pop(st.slot, None)
        elif st.blocks == 0:
            self.host_orders[st.slot] = HostLoads(blocks)

    def _clear(self, st: ReplicaState) -> None:
        if self.journal is not None:
            self.journal.cleared.add(st.slot)
        self.foresight.cleared(st.slot)
        if st.host_tier:
            self.host_orders[st.slot] = HostLoads(st.host_tier)
        self._drop_slot_blocks(st.slot)
        st.blocks = 0
        st.group_blocks = {}
        self.tail_keys -= st.tails
        st.tails = st.router_keys = 0

    def _clear_tier(self, st: ReplicaState, tier: str) -> None:
        """Everything the replica held in one tier is gone: removed key by key (the slot's keys are read
        from the tier's maps: a rare event, SGLang's CLEAR_ALL_AT_TIER), so that the union, the counts
        and the snapshot journal follow as for any removal."""
        tid = TIER_IDS.get(tier, _LAST_TIER)
        if tid == _CPU and st.slot in self.host_orders:
            self.host_orders[st.slot] = HostLoads(st.host_tier)
        words, (w, b) = self._words(), divmod(st.slot, 64)
        # a replica fed SGLang's hashes (its external-indexer feed) holds router keys and nothing else;
        # a relay's replica never clears one tier (a bridge sharing its name: counted as blocks)
        router = st.blocks == 0 and st.tails == 0
        for gid, g in list(self.groups.items()):
            d = g.tiers.get(tid)
            if d is None:
                continue
            keys, masks = d.export(words)
            held = np.frombuffer(masks, dtype="<u8").reshape(-1, words)[:, w] >> np.uint64(b) & np.uint64(1)
            mine = np.frombuffer(keys, dtype="<u8")[held.astype(bool)].tolist()
            if mine:
                self._remove(BlocksRemoved(tier, gid, mine, router_keys=router), st)

    def _drop_slot_blocks(self, slot: int) -> None:
        for g in self.groups.values():
            for d in g.tiers.values():
                d.clear_slot(slot)
            if len(g.tiers) != 1:
                g.any.clear_slot(slot)

    def stats(self) -> dict:
        return {
            "replicas": len(self.replicas),
            # per tier, the distinct blocks held there by any replica: the working set by tier
            "groups": {gid: {"kind": g.kind, "blocks": len(g.any),
                             "entries": sum(len(d) for d in g.tiers.values()),
                             "tiers": {TIERS[t]: len(d) for t, d in sorted(g.tiers.items())}}
                       for gid, g in self.groups.items()},
            "blocks_applied": self.blocks_applied,
            "tail_keys": self.tail_keys,
        }

    # ---- the journal of changes (what a snapshot delta carries), union maps, replica groups -----------
    def _words(self) -> int:
        return max(1, (len(self.by_slot) + 63) // 64)

    def track_changes(self) -> None:
        """Start the journal: from now on `encode_delta` can say what changed."""
        self.journal = ChangeJournal()

    def delta_written(self) -> None:
        """The last delta is durable: the journal starts again."""
        self.journal = ChangeJournal()

    def _rebuild_unions(self) -> None:
        """The "any tier" map of every group with more than one tier, from its tiers (as the fold
        keeps it)."""
        for g in self.groups.values():
            if len(g.tiers) > 1:
                a = self.new_map()
                for d in g.tiers.values():
                    d.or_into(a)
                g.any = a
            elif g.tiers:
                g.any = next(iter(g.tiers.values()))

    def absorb(self, other: ModelShard) -> None:
        """Take in another shard of the same model (another replica group's, kvidx.core.groups): its
        replicas get slots after this shard's, its masks shifted to them. Replicas are disjoint across
        groups; one found in both (it moved between groups) keeps the newer state, by (epoch, seq,
        part), and the other copy's blocks are dropped. Pending credit and foresight are not in
        snapshots and are not moved."""
        if other.block_size != self.block_size:
            raise ValueError(f"model {self.model!r}: replica groups with index block sizes "
                             f"{self.block_size} and {other.block_size} cannot be merged")
        base = len(self.by_slot)
        drop = 0  # other's slots whose state is older than this shard's copy of the replica
        for st in other.by_slot:
            if st is None:
                continue
            mine = self.replicas.get((st.replica, st.dp_rank))
            if mine is not None:
                if (mine.epoch, mine.seq, mine.part) >= (st.epoch, st.seq, st.part):
                    drop |= 1 << st.slot
                    continue
                self._drop_slot_blocks(mine.slot)
                self.by_slot[mine.slot] = None
            moved = msgspec.structs.replace(st, slot=base + st.slot, group_blocks=dict(st.group_blocks))
            self.replicas[(st.replica, st.dp_rank)] = moved
        self.by_slot.extend([None] * len(other.by_slot))
        for st in self.replicas.values():
            if st.slot >= base:
                self.by_slot[st.slot] = st
        words_in = other._words()
        words_out = self._words()
        for gid, og in other.groups.items():
            g = self._group(gid, og.kind, og.window)
            for tid, d in og.tiers.items():
                keys, masks = d.export(words_in)
                shifted = shift_masks(masks, words_in, base, words_out, drop)
                g.tier_map(tid).load(keys, shifted, words_out)
        self.blocks_applied += other.blocks_applied
        self._pool_cache = None
        self._lookup_cache = None
        self._lookahead_changed()
        self.tail_keys = sum(st.tails for st in self.by_slot if st is not None)
        self._rebuild_unions()


# the compiled fold (native/src/fold.rs), on shards of compiled maps; `ModelShard.apply` is the
# reference, and folds whatever it declines
NATIVE_FOLD = (_native.Folder(EventBatch, ReplicaState, BlocksStored, BlocksRemoved, ReplicaCleared,
                              GroupIndex, ModelShard, Foresight, PendingCredits, TIER_IDS, _LAST_TIER,
                              MAX_EPOCH_SKEW_MS, FULL_KINDS)
               if _native is not None else None)
