"""Shard snapshots (mixed into ModelShard): the bytes a worker persists (RocksDB, the compacted
topic) and a restarted worker or a new service instance rebuilds from. Versioned; tiers by name.

Two forms:
- `snapshot()` / `restore()`: the whole shard as one blob (formats 1-2; replay's checkpoints, tools);
- parts (format 3), what the worker writes so that durability costs what changed, not what is held:
  a *delta* (`snapshot_delta`) carries the current masks of the keys the fold touched since the last
  one (the ChangeJournal; an all-zero mask: deleted) and the slots cleared meanwhile; a *base piece*
  (`snapshot_segments`) carries every key of some segments of the key space (segment: the top
  SEGMENT_BITS bits of maskmap.mix(key), so a piece is a range of the map's sorted table). Every part
  also carries the shard's small state (replicas, counters) as of its writing.
  `from_parts(base pieces, then the deltas since the base began)` is exact even though the pieces
  were taken at different times (a fuzzy checkpoint): a key changed after the base began is set by
  the last delta that touched it, any other key has had one value since then, its piece's.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from schemas.events import TIER_IDS, TIERS

if TYPE_CHECKING:
    from kvidx.core.shard import ModelShard

# Snapshot formats: 1 stored tiers by their position in the speed order of the time (V1_TIERS, frozen
# here so that a tier added to TIERS later cannot shift them); 2 stores them by name; 3 is a part.
SNAPSHOT_FORMAT = 2
PART_FORMAT = 3
SEGMENT_BITS = 12
SEGMENTS = 1 << SEGMENT_BITS


V1_TIERS = ("GPU", "CPU", "DISK", "NODE_SHARED", "POOL")


class SnapshotFormatError(ValueError):
    pass


def _tier_id(stored: int | str, fmt: int) -> int:
    name = V1_TIERS[int(stored)] if fmt == 1 and int(stored) < len(V1_TIERS) else stored
    tid = TIER_IDS.get(name) if isinstance(name, str) else None
    if tid is None:
        raise SnapshotFormatError(f"snapshot (format {fmt}) holds tier {stored!r}, which this kvidx does "
                                  f"not know (tiers: {', '.join(TIERS)}): upgrade kvidx to read it")
    return tid


def shift_masks(masks: bytes, words_in: int, shift: int, words_out: int, drop: int = 0) -> bytes:
    """Slot masks (n masks of `words_in` little-endian u64 words) with the bits of `drop` cleared and
    every bit moved up by `shift` slots, as masks of `words_out` words (vectorized: no loop per key)."""
    n = len(masks) // (8 * words_in)
    m = np.frombuffer(masks, dtype="<u8").reshape(n, words_in).copy()
    if drop:
        for w in range(words_in):
            keep = ~np.uint64((drop >> (64 * w)) & 0xFFFF_FFFF_FFFF_FFFF)
            m[:, w] &= keep
    out = np.zeros((n, words_out), dtype="<u8")
    q, r = divmod(shift, 64)
    for w in range(words_in):
        if q + w < words_out:
            out[:, q + w] |= m[:, w] << np.uint64(r) if r else m[:, w]
        if r and q + w + 1 < words_out:
            out[:, q + w + 1] |= m[:, w] >> np.uint64(64 - r)
    return out.tobytes()


class ChangeJournal:
    """What the fold changed since the last delta: the hash lists it stored or removed per (group,
    tier) (kept as they came; deduplicated when the delta is written) and the slots it cleared."""

    __slots__ = ("touched", "cleared")

    def __init__(self):
        self.touched: dict[tuple[int, int], list[list[int]]] = {}
        self.cleared: set[int] = set()

    def touch(self, gid: int, tid: int, hashes: list[int]) -> None:
        lists = self.touched.get((gid, tid))
        if lists is None:
            self.touched[(gid, tid)] = [hashes]
        else:
            lists.append(hashes)


class ShardSnapshot:
    """snapshot() / restore() and the parts of ModelShard."""

    journal: ChangeJournal | None = None  # kept only where deltas are written (the worker)

    # ---- snapshot (what a worker persists and a restarted one rebuilds from) ----------------
    def _words(self) -> int:
        return max(1, (len(self.by_slot) + 63) // 64)

    def _state(self) -> dict:
        """What every form carries besides the masks."""
        return {"model": self.model, "block_size": self.block_size, "replica_group": self.replica_group,
                "replicas": [st for st in self.by_slot if st is not None],
                "blocks_applied": self.blocks_applied, "events_offset": self.events_offset,
                "unreported_eviction_kinds": sorted(self.unreported_eviction_kinds)}

    def snapshot(self) -> bytes:
        """The shard as bytes, format SNAPSHOT_FORMAT: tiers stored by name (a tier added to the
        speed order later cannot shift what a stored id means)."""
        words = self._words()
        groups = {}
        for gid, g in self.groups.items():
            tiers = {}
            for tid, d in g.tiers.items():
                keys, masks = d.export(words)  # keys as uint64, masks as `words` uint64 words each
                tiers[TIERS[tid]] = (keys, (words, masks))
            groups[gid] = (g.kind, g.window, tiers)
        return msgspec.msgpack.encode({"format": SNAPSHOT_FORMAT, **self._state(), "groups": groups})

    # ---- parts (format 3) ------------------------------------------------------------------------
    def track_changes(self) -> None:
        """Start the journal: from now on `snapshot_delta` can say what changed."""
        self.journal = ChangeJournal()

    def _part(self, kind: str, groups: dict, cleared: Iterable[int] = (), segments: tuple[int, int] = (0, 0)
              ) -> bytes:
        return msgspec.msgpack.encode({"format": PART_FORMAT, "kind": kind, **self._state(),
                                       "cleared": sorted(cleared), "segments": segments, "groups": groups})

    def snapshot_delta(self) -> bytes:
        """A delta part: the current masks of every key changed since the journal (re)started (0 for
        one no longer held) and the slots cleared. The journal goes on: `delta_written` restarts it
        once the delta is durable (a failed write is retried with everything in it)."""
        j = self.journal
        if j is None:
            raise RuntimeError("snapshot_delta needs track_changes() first")
        words = self._words()
        groups = {}
        for gid, g in self.groups.items():
            tiers = {}
            for tid, d in g.tiers.items():
                lists = j.touched.get((gid, tid))
                if lists:
                    keys = np.unique(np.fromiter(chain.from_iterable(lists), dtype=np.uint64,
                                                 count=sum(map(len, lists)))).astype("<u8").tobytes()
                    tiers[TIERS[tid]] = (keys, (words, d.export_keys(keys, words)))
            groups[gid] = (g.kind, g.window, tiers)
        return self._part("delta", groups, j.cleared)

    def delta_written(self) -> None:
        self.journal = ChangeJournal()

    def snapshot_segments(self, first: int, last: int) -> bytes:
        """A base piece: every key of segments [first, last) of SEGMENTS, with its mask."""
        words = self._words()
        groups = {}
        for gid, g in self.groups.items():
            tiers = {}
            for tid, d in g.tiers.items():
                keys, masks = d.export_segments(first, last, SEGMENT_BITS, words)
                if keys:
                    tiers[TIERS[tid]] = (keys, (words, masks))
            groups[gid] = (g.kind, g.window, tiers)
        return self._part("base", groups, segments=(first, last))

    def segment_bytes(self) -> float:
        """About what one segment of a base piece takes (for sizing the pieces)."""
        entries = sum(len(d) for g in self.groups.values() for d in g.tiers.values())
        return entries * 8 * (1 + self._words()) / SEGMENTS

    @classmethod
    def from_parts(cls, parts: Iterable[bytes]) -> ModelShard:
        """A shard from a base's pieces followed by the deltas since it began (in the order written);
        SnapshotFormatError for a part this code cannot read."""
        shard = None
        for data in parts:
            raw = msgspec.msgpack.decode(data)
            if raw.get("format") != PART_FORMAT:
                raise SnapshotFormatError(f"snapshot part of model {raw.get('model')!r} has format "
                                          f"{raw.get('format')}; this kvidx reads format {PART_FORMAT} "
                                          f"parts: upgrade kvidx to read it")
            if shard is None:
                shard = cls(raw["model"], raw["block_size"], raw["unreported_eviction_kinds"])
            shard._apply_part(raw)
        if shard is None:
            raise SnapshotFormatError("a snapshot without parts")
        shard._rebuild_unions()
        return shard

    def _set_state(self, raw: dict) -> None:
        from kvidx.core.shard import ReplicaState

        self.blocks_applied = raw["blocks_applied"]
        self.events_offset = raw.get("events_offset", 0)
        self.replica_group = raw.get("replica_group", 0)
        self.by_slot, self.replicas = [], {}
        for r in raw["replicas"]:
            st = msgspec.convert(r, ReplicaState)
            while len(self.by_slot) <= st.slot:
                self.by_slot.append(None)
            self.by_slot[st.slot] = st
            self.replicas[(st.replica, st.dp_rank)] = st
        self._pool_cache = None
        self._lookahead_changed()
        self.tail_keys = sum(st.tails for st in self.by_slot if st is not None)

    def _apply_part(self, raw: dict) -> None:
        self._set_state(raw)
        for slot in raw["cleared"]:  # before the masks: those are the values after the clear
            for g in self.groups.values():
                for d in g.tiers.values():
                    d.clear_slot(slot)
        first, last = raw["segments"]
        for gid, (kind, window, tiers) in raw["groups"].items():
            g = self._group(int(gid), kind, window)
            for name, (keys, (words, masks)) in tiers.items():
                d = g.tier_map(_tier_id(name, PART_FORMAT))
                if last > first and not d:  # a base's first piece: room for the whole base (the keys
                    # are spread evenly over the segments), or later pieces would crowd the table
                    d.reserve(len(keys) // 8 * SEGMENTS // (last - first))
                d.assign(keys, masks, words)

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

    # ---- replica groups ---------------------------------------------------------------------------
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

    @classmethod
    def restore(cls, data: bytes) -> ModelShard:
        """A shard from `snapshot()` bytes of any format this code knows; SnapshotFormatError (a clear
        message, nothing half-read) for a newer format or a tier this code does not know."""
        raw = msgspec.msgpack.decode(data)
        fmt = raw.get("format", 1)  # format 1 had no field: tiers by position in V1_TIERS
        if fmt not in (1, SNAPSHOT_FORMAT):
            raise SnapshotFormatError(f"snapshot of model {raw.get('model')!r} has format {fmt}; this kvidx "
                                      f"reads formats 1-{SNAPSHOT_FORMAT}: upgrade kvidx to read it")
        shard = cls(raw["model"], raw["block_size"], raw.get("unreported_eviction_kinds", ()))
        shard._set_state(raw)
        for gid, (kind, window, tiers) in raw["groups"].items():
            g = shard._group(int(gid), kind, window)
            for name, (keys, masks) in sorted(tiers.items(), key=lambda kv: _tier_id(kv[0], fmt)):
                words, packed = masks
                g.tier_map(_tier_id(name, fmt)).load(keys, packed, words)
        shard._rebuild_unions()
        return shard
