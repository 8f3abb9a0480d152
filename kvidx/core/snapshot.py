"""Shard snapshots (mixed into ModelShard): the bytes a worker persists (RocksDB, the compacted
topic) and a restarted worker or a new service instance rebuilds from. Versioned; tiers by name."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from schemas.events import TIER_IDS, TIERS

if TYPE_CHECKING:
    from kvidx.core.shard import ModelShard

# Snapshot formats: 1 stored tiers by their position in the speed order of the time (V1_TIERS, frozen
# here so that a tier added to TIERS later cannot shift them); 2 stores them by name.
SNAPSHOT_FORMAT = 2


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


class ShardSnapshot:
    """snapshot() / restore() of ModelShard."""

    # ---- snapshot (what a worker persists and a restarted one rebuilds from) ----------------
    def snapshot(self) -> bytes:
        """The shard as bytes, format SNAPSHOT_FORMAT: tiers stored by name (a tier added to the
        speed order later cannot shift what a stored id means)."""
        groups = {}
        words = max(1, (len(self.by_slot) + 63) // 64)
        for gid, g in self.groups.items():
            tiers = {}
            for tid, d in g.tiers.items():
                keys, masks = d.export(words)  # keys as uint64, masks as `words` uint64 words each
                tiers[TIERS[tid]] = (keys, (words, masks))
            groups[gid] = (g.kind, g.window, tiers)
        return msgspec.msgpack.encode({
            "format": SNAPSHOT_FORMAT, "model": self.model, "block_size": self.block_size,
            "replicas": [st for st in self.by_slot if st is not None],
            "groups": groups, "blocks_applied": self.blocks_applied,
            "events_offset": self.events_offset,
            "unreported_eviction_kinds": sorted(self.unreported_eviction_kinds),
        })

    @classmethod
    def restore(cls, data: bytes) -> ModelShard:
        """A shard from `snapshot()` bytes of any format this code knows; SnapshotFormatError (a clear
        message, nothing half-read) for a newer format or a tier this code does not know."""
        from kvidx.core.shard import ReplicaState

        raw = msgspec.msgpack.decode(data)
        fmt = raw.get("format", 1)  # format 1 had no field: tiers by position in V1_TIERS
        if fmt not in (1, SNAPSHOT_FORMAT):
            raise SnapshotFormatError(f"snapshot of model {raw.get('model')!r} has format {fmt}; this kvidx "
                                      f"reads formats 1-{SNAPSHOT_FORMAT}: upgrade kvidx to read it")
        shard = cls(raw["model"], raw["block_size"], raw.get("unreported_eviction_kinds", ()))
        shard.blocks_applied = raw["blocks_applied"]
        shard.events_offset = raw.get("events_offset", 0)
        for r in raw["replicas"]:
            st = msgspec.convert(r, ReplicaState)
            while len(shard.by_slot) <= st.slot:
                shard.by_slot.append(None)
            shard.by_slot[st.slot] = st
            shard.replicas[(st.replica, st.dp_rank)] = st
        for gid, (kind, window, tiers) in raw["groups"].items():
            g = shard._group(int(gid), kind, window)
            for name, (keys, masks) in sorted(tiers.items(), key=lambda kv: _tier_id(kv[0], fmt)):
                words, packed = masks
                g.tier_map(_tier_id(name, fmt)).load(keys, packed, words)
            if len(g.tiers) > 1:  # the union of the tiers, as the fold keeps it
                a = shard.new_map()
                for d in g.tiers.values():
                    d.or_into(a)
                g.any = a
        return shard
