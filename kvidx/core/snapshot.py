"""Shard snapshots, a codec of the shard's state (kvidx.core.shard.ModelShard): the bytes a worker
persists (RocksDB, the compacted topic) and a restarted worker or a new service instance rebuilds
from. Versioned; tiers by name.

Two forms:
- `encode_snapshot` / `decode_snapshot`: the whole shard as one blob (formats 1-2; replay's
  checkpoints, tools);
- parts (format 3), what the worker writes so that durability costs what changed, not what is held:
  a *delta* (`encode_delta`) carries the current masks of the keys the fold touched since the last
  one (the ChangeJournal; an all-zero mask: deleted) and the slots cleared meanwhile; a *base piece*
  (`encode_segments`) carries every key of some segments of the key space (segment: the top
  SEGMENT_BITS bits of maskmap.mix(key), so a piece is a range of the map's sorted table). Every part
  also carries the shard's small state (replicas, counters) as of its writing.
  `decode_parts(base pieces, then the deltas since the base began)` is exact even though the pieces
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


def encode_snapshot(shard: ModelShard) -> bytes:
    """The shard as bytes, format SNAPSHOT_FORMAT: tiers stored by name (a tier added to the
    speed order later cannot shift what a stored id means)."""
    words = shard._words()
    groups = {}
    for gid, g in shard.groups.items():
        tiers = {}
        for tid, d in g.tiers.items():
            keys, masks = d.export(words)  # keys as uint64, masks as `words` uint64 words each
            tiers[TIERS[tid]] = (keys, (words, masks))
        groups[gid] = (g.kind, g.window, tiers)
    return msgspec.msgpack.encode({"format": SNAPSHOT_FORMAT, **_state(shard), "groups": groups})


def encode_delta(shard: ModelShard) -> bytes:
    """A delta part: the current masks of every key changed since the journal (re)started (0 for
    one no longer held) and the slots cleared. The journal goes on: `delta_written` restarts it
    once the delta is durable (a failed write is retried with everything in it)."""
    j = shard.journal
    if j is None:
        raise RuntimeError("encode_delta needs the shard's track_changes() first")
    words = shard._words()
    groups = {}
    for gid, g in shard.groups.items():
        tiers = {}
        for tid, d in g.tiers.items():
            lists = j.touched.get((gid, tid))
            if lists:
                keys = np.unique(np.fromiter(chain.from_iterable(lists), dtype=np.uint64,
                                             count=sum(map(len, lists)))).astype("<u8").tobytes()
                tiers[TIERS[tid]] = (keys, (words, d.export_keys(keys, words)))
        groups[gid] = (g.kind, g.window, tiers)
    return _part(shard, "delta", groups, j.cleared)


def encode_segments(shard: ModelShard, first: int, last: int) -> bytes:
    """A base piece: every key of segments [first, last) of SEGMENTS, with its mask."""
    words = shard._words()
    groups = {}
    for gid, g in shard.groups.items():
        tiers = {}
        for tid, d in g.tiers.items():
            keys, masks = d.export_segments(first, last, SEGMENT_BITS, words)
            if keys:
                tiers[TIERS[tid]] = (keys, (words, masks))
        groups[gid] = (g.kind, g.window, tiers)
    return _part(shard, "base", groups, segments=(first, last))


def segment_bytes(shard: ModelShard) -> float:
    """About what one segment of a base piece takes (for sizing the pieces)."""
    entries = sum(len(d) for g in shard.groups.values() for d in g.tiers.values())
    return entries * 8 * (1 + shard._words()) / SEGMENTS


def decode_parts(parts: Iterable[bytes], cls: type[ModelShard] | None = None) -> ModelShard:
    """A shard from a base's pieces followed by the deltas since it began (in the order written);
    SnapshotFormatError for a part this code cannot read."""
    cls = cls or _shard_class()
    shard = None
    for data in parts:
        raw = msgspec.msgpack.decode(data)
        if raw.get("format") != PART_FORMAT:
            raise SnapshotFormatError(f"snapshot part of model {raw.get('model')!r} has format "
                                      f"{raw.get('format')}; this kvidx reads format {PART_FORMAT} "
                                      f"parts: upgrade kvidx to read it")
        if shard is None:
            shard = cls(raw["model"], raw["block_size"], raw["unreported_eviction_kinds"])
        _apply_part(shard, raw)
    if shard is None:
        raise SnapshotFormatError("a snapshot without parts")
    shard._rebuild_unions()
    return shard


def decode_snapshot(data: bytes, cls: type[ModelShard] | None = None) -> ModelShard:
    """A shard from `encode_snapshot` bytes of any format this code knows; SnapshotFormatError (a clear
    message, nothing half-read) for a newer format or a tier this code does not know."""
    cls = cls or _shard_class()
    raw = msgspec.msgpack.decode(data)
    fmt = raw.get("format", 1)  # format 1 had no field: tiers by position in V1_TIERS
    if fmt not in (1, SNAPSHOT_FORMAT):
        raise SnapshotFormatError(f"snapshot of model {raw.get('model')!r} has format {fmt}; this kvidx "
                                  f"reads formats 1-{SNAPSHOT_FORMAT}: upgrade kvidx to read it")
    shard = cls(raw["model"], raw["block_size"], raw.get("unreported_eviction_kinds", ()))
    _set_state(shard, raw)
    for gid, (kind, window, tiers) in raw["groups"].items():
        g = shard._group(int(gid), kind, window)
        for name, (keys, masks) in sorted(tiers.items(), key=lambda kv: _tier_id(kv[0], fmt)):
            words, packed = masks
            g.tier_map(_tier_id(name, fmt)).load(keys, packed, words)
    shard._rebuild_unions()
    return shard


def _shard_class() -> type[ModelShard]:
    from kvidx.core.shard import ModelShard  # the state imports this codec: not at module level

    return ModelShard


def _state(shard: ModelShard) -> dict:
    """What every form carries besides the masks."""
    return {"model": shard.model, "block_size": shard.block_size, "replica_group": shard.replica_group,
            "replicas": [st for st in shard.by_slot if st is not None],
            "blocks_applied": shard.blocks_applied, "events_offset": shard.events_offset,
            "unreported_eviction_kinds": sorted(shard.unreported_eviction_kinds)}


def _part(shard: ModelShard, kind: str, groups: dict, cleared: Iterable[int] = (),
          segments: tuple[int, int] = (0, 0)) -> bytes:
    return msgspec.msgpack.encode({"format": PART_FORMAT, "kind": kind, **_state(shard),
                                   "cleared": sorted(cleared), "segments": segments, "groups": groups})


def _set_state(shard: ModelShard, raw: dict) -> None:
    from kvidx.core.shard import ReplicaState

    shard.blocks_applied = raw["blocks_applied"]
    shard.events_offset = raw.get("events_offset", 0)
    shard.replica_group = raw.get("replica_group", 0)
    shard.by_slot, shard.replicas = [], {}
    for r in raw["replicas"]:
        st = msgspec.convert(r, ReplicaState)
        while len(shard.by_slot) <= st.slot:
            shard.by_slot.append(None)
        shard.by_slot[st.slot] = st
        shard.replicas[(st.replica, st.dp_rank)] = st
    shard._pool_cache = None
    shard._lookahead_changed()
    shard.tail_keys = sum(st.tails for st in shard.by_slot if st is not None)


def _apply_part(shard: ModelShard, raw: dict) -> None:
    _set_state(shard, raw)
    for slot in raw["cleared"]:  # before the masks: those are the values after the clear
        for g in shard.groups.values():
            for d in g.tiers.values():
                d.clear_slot(slot)
    first, last = raw["segments"]
    for gid, (kind, window, tiers) in raw["groups"].items():
        g = shard._group(int(gid), kind, window)
        for name, (keys, (words, masks)) in tiers.items():
            d = g.tier_map(_tier_id(name, PART_FORMAT))
            if last > first and not d:  # a base's first piece: room for the whole base (the keys
                # are spread evenly over the segments), or later pieces would crowd the table
                d.reserve(len(keys) // 8 * SEGMENTS // (last - first))
            d.assign(keys, masks, words)
