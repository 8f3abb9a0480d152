"""A per-model index shard: the fold of relay events and the lookup walk. Pure: no I/O.

Layout (memory is the budget): each (replica, DP rank) gets a slot number; per KV-cache group and
tier, one dict maps a canonical block hash to the bitmask of slots holding it. A lookup walks the
prompt's hashes once for all replicas, AND-ing masks: a slot drops out at its first missing block
(a block is reusable only if every block before it is). With one tier (the common case) the "any
tier" map is the tier's own dict, so a block held by several replicas costs one dict entry.

Idempotence: a batch is applied only if its (epoch, seq) is newer than the slot's last applied one,
so Kafka redeliveries change nothing.
"""

from __future__ import annotations

import msgspec
import numpy as np

from schemas.events import TIER_IDS, TIERS, BlocksRemoved, BlocksStored, EventBatch, ReplicaCleared


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


class GroupIndex:
    def __init__(self, kind: str = "full_attention", window: int | None = None):
        self.kind = kind
        self.window = window
        self.tiers: dict[int, dict[int, int]] = {}  # tier id -> block hash -> slot mask
        self.any: dict[int, int] = {}  # block hash -> slot mask over all tiers

    def tier_map(self, tier: int) -> dict[int, int]:
        d = self.tiers.get(tier)
        if d is None:
            d = {}
            if not self.tiers:
                self.any = d  # one tier: share the dict
            elif len(self.tiers) == 1:
                self.any = dict(self.any)  # a second tier: the union needs its own map
            self.tiers[tier] = d
        return d


class ModelShard:
    def __init__(self, model: str, block_size: int):
        self.model = model
        self.block_size = block_size  # the index block size (tokens per canonical hash)
        self.replicas: dict[tuple[str, int], ReplicaState] = {}
        self.by_slot: list[ReplicaState | None] = []
        self.groups: dict[int, GroupIndex] = {}
        self.blocks_applied = 0
        self.snapshot_id = 0  # the last durable snapshot this shard was written as or rebuilt from
        self.events_offset = 0  # next offset of the events partition after what is folded in
        self.events_partition = -1  # the events partition the model's key maps to, once known

    # ---- fold -------------------------------------------------------------------------------
    def replica(self, replica: str, dp_rank: int) -> ReplicaState:
        st = self.replicas.get((replica, dp_rank))
        if st is None:
            st = ReplicaState(len(self.by_slot), replica, dp_rank)
            self.replicas[(replica, dp_rank)] = st
            self.by_slot.append(st)
        return st

    def apply(self, batch: EventBatch, now: float) -> bool:
        """Fold one batch; False if it was already applied (a redelivery)."""
        st = self.replica(batch.replica, batch.dp_rank)
        if (batch.epoch, batch.seq) <= (st.epoch, st.seq):
            st.duplicates += 1
            return False
        if batch.epoch == st.epoch and batch.seq > st.seq + 1:
            st.seq_gaps += batch.seq - st.seq - 1
        bit = 1 << st.slot
        for ev in batch.events:
            if isinstance(ev, BlocksStored):
                self._store(ev, bit, st)
            elif isinstance(ev, BlocksRemoved):
                self._remove(ev, bit, st)
            elif isinstance(ev, ReplicaCleared):
                self._clear(bit, st)
        st.epoch, st.seq = batch.epoch, batch.seq
        st.block_size = batch.block_size or st.block_size
        st.engine_ts, st.relay_ts, st.applied_ts = batch.engine_ts, batch.relay_ts, now
        st.batches += 1
        return True

    def _group(self, gid: int, kind: str = "full_attention", window: int | None = None) -> GroupIndex:
        g = self.groups.get(gid)
        if g is None:
            g = self.groups[gid] = GroupIndex(kind, window)
        return g

    def _store(self, ev: BlocksStored, bit: int, st: ReplicaState) -> None:
        g = self._group(ev.group, ev.group_kind, ev.sliding_window)
        d = g.tier_map(TIER_IDS.get(ev.tier, len(TIERS) - 1))
        get = d.get
        new = 0
        for h in ev.hashes:
            m = get(h, 0)
            if not m & bit:
                d[h] = m | bit
                new += 1
        if g.any is not d:
            a = g.any
            for h in ev.hashes:
                a[h] = a.get(h, 0) | bit
        st.blocks += new
        self.blocks_applied += len(ev.hashes)

    def _remove(self, ev: BlocksRemoved, bit: int, st: ReplicaState) -> None:
        g = self.groups.get(ev.group)
        if g is None:
            return
        tid = TIER_IDS.get(ev.tier, len(TIERS) - 1)
        d = g.tiers.get(tid)
        if d is None:
            return
        others = [m for t, m in g.tiers.items() if t != tid]
        clear = ~bit
        gone = 0
        for h in ev.hashes:
            m = d.get(h, 0)
            if not m & bit:
                continue
            gone += 1
            m &= clear
            if m:
                d[h] = m
            else:
                del d[h]
            if others and not any(o.get(h, 0) & bit for o in others):
                a = g.any.get(h, 0) & clear  # retract only when the last tier drops it
                if a:
                    g.any[h] = a
                else:
                    g.any.pop(h, None)
        st.blocks -= gone
        self.blocks_applied += len(ev.hashes)

    def _clear(self, bit: int, st: ReplicaState) -> None:
        clear = ~bit
        for g in self.groups.values():
            maps = list(g.tiers.values())
            if g.any is not (maps[0] if maps else None):
                maps.append(g.any)
            for d in maps:
                held = [h for h, m in d.items() if m & bit]
                for h in held:
                    m = d[h] & clear
                    if m:
                        d[h] = m
                    else:
                        del d[h]
        st.blocks = 0

    # ---- lookup -----------------------------------------------------------------------------
    def prefix_blocks(self, hashes: list[int], group: int | None = None) -> dict[int, int]:
        """slot -> number of leading blocks it holds (in any tier) in `group` (default: the first
        full-attention group). Slots that hold nothing are left out."""
        g = self._lookup_group(group)
        if g is None or not hashes:
            return {}
        d = g.any
        alive = d.get(hashes[0], 0)
        out: dict[int, int] = {}
        if not alive:
            return out
        i = 1
        n = len(hashes)
        while i < n:
            m = d.get(hashes[i], 0) & alive
            if m != alive:
                lost = alive & ~m
                while lost:
                    low = lost & -lost
                    out[low.bit_length() - 1] = i
                    lost ^= low
                alive = m
                if not alive:
                    return out
            i += 1
        while alive:
            low = alive & -alive
            out[low.bit_length() - 1] = n
            alive ^= low
        return out

    def _lookup_group(self, group: int | None) -> GroupIndex | None:
        if group is not None:
            return self.groups.get(group)
        for gid in sorted(self.groups):
            if self.groups[gid].kind == "full_attention":
                return self.groups[gid]
        return next(iter(self.groups.values()), None)

    def tier_runs(self, hashes: list[int], slot: int, n_blocks: int, group: int | None = None
                  ) -> list[tuple[str, int]]:
        """The hit prefix of one slot split into runs by the fastest tier holding each block:
        [(tier, tokens), ...] in prompt order."""
        g = self._lookup_group(group)
        if g is None or n_blocks == 0:
            return []
        if len(g.tiers) == 1:
            (tid,) = g.tiers
            return [(TIERS[tid], n_blocks * self.block_size)]
        bit = 1 << slot
        order = sorted(g.tiers.items())
        runs: list[tuple[str, int]] = []
        for h in hashes[:n_blocks]:
            tier = next((TIERS[t] for t, d in order if d.get(h, 0) & bit), TIERS[-1])
            if runs and runs[-1][0] == tier:
                runs[-1] = (tier, runs[-1][1] + self.block_size)
            else:
                runs.append((tier, self.block_size))
        return runs

    def lookup(self, hashes: list[int], n_tokens: int, now: float) -> list[dict]:
        """Per replica and DP rank: tokens cached along the prefix (by tier), the tokens the engine
        can resume from, and how fresh the view is. Sorted by resumable tokens, best first."""
        hits = self.prefix_blocks(hashes)
        answers = []
        for st in self.by_slot:
            if st is None:
                continue
            nb = hits.get(st.slot, 0)
            cached = min(nb * self.block_size, n_tokens)
            answers.append({
                "replica": st.replica,
                "dp_rank": st.dp_rank,
                "cached_tokens": cached,
                "tiers": [{"tier": t, "tokens": k} for t, k in self.tier_runs(hashes, st.slot, nb)],
                "resumable_tokens": self.resume_point(hashes, n_tokens, st, cached),
                "freshness": {
                    "last_event_age_ms": round((now - st.engine_ts) * 1000, 3) if st.batches else None,
                    "apply_lag_ms": round((st.applied_ts - st.engine_ts) * 1000, 3) if st.batches else None,
                    "epoch": st.epoch,
                    "seq": st.seq,
                    "seq_gaps": st.seq_gaps,
                },
            })
        answers.sort(key=lambda a: -a["resumable_tokens"])
        return answers

    def credited(self, hashes: list[int], n_tokens: int, replica: str | None = None,
                 dp_rank: int | None = None) -> int:
        """Resumable tokens on one replica and DP rank (None: the best of any): what the shadow
        audit credits."""
        hits = self.prefix_blocks(hashes)
        best = 0
        for (rep, rank), st in self.replicas.items():
            if (replica is None or rep == replica) and (dp_rank is None or rank == dp_rank):
                cached = min(hits.get(st.slot, 0) * self.block_size, n_tokens)
                best = max(best, self.resume_point(hashes, n_tokens, st, cached))
        return best

    def resume_point(self, hashes: list[int], n_tokens: int, st: ReplicaState, cached: int) -> int:
        """The tokens the engine can resume from on one replica: the full-attention hit, capped below
        the last prompt token at an engine block boundary, then moved left until every
        sliding-window group holds the blocks covering the window before it (vLLM's hybrid rule:
        ceil((w-1)/B) contiguous blocks right before the resume point, or all blocks from 0)."""
        ebs = st.block_size or self.block_size
        p = resumable(cached, n_tokens, ebs)
        windows = [g for g in self.groups.values() if g.kind == "sliding_window" and g.window]
        if not p or not windows:
            return p
        bit = 1 << st.slot
        k = max(1, ebs // self.block_size)  # index blocks per engine block
        need = [(g.any, -(-(g.window - 1) // ebs) * k) for g in windows]  # index blocks per window
        while p > 0:
            end = (p // ebs) * k  # index blocks before the resume point
            if all(all(held.get(h, 0) & bit for h in hashes[max(0, end - n):end]) for held, n in need):
                return p
            p -= ebs
        return 0

    def stats(self) -> dict:
        return {
            "replicas": len(self.replicas),
            "groups": {gid: {"kind": g.kind, "blocks": len(g.any),
                             "entries": sum(len(d) for d in g.tiers.values())}
                       for gid, g in self.groups.items()},
            "blocks_applied": self.blocks_applied,
        }

    # ---- snapshot (what a worker persists and a restarted one rebuilds from) ----------------
    def snapshot(self) -> bytes:
        groups = {}
        for gid, g in self.groups.items():
            tiers = {}
            for tid, d in g.tiers.items():
                keys = np.fromiter(d.keys(), dtype=np.uint64, count=len(d))
                tiers[tid] = (keys.tobytes(), _pack_masks(d.values(), len(d), len(self.by_slot)))
            groups[gid] = (g.kind, g.window, tiers)
        return msgspec.msgpack.encode({
            "model": self.model, "block_size": self.block_size,
            "replicas": [st for st in self.by_slot if st is not None],
            "groups": groups, "blocks_applied": self.blocks_applied,
            "events_offset": self.events_offset,
        })

    @classmethod
    def restore(cls, data: bytes) -> ModelShard:
        raw = msgspec.msgpack.decode(data)
        shard = cls(raw["model"], raw["block_size"])
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
            for tid, (keys, masks) in sorted(tiers.items()):
                d = g.tier_map(int(tid))
                hashes = np.frombuffer(keys, dtype=np.uint64).tolist()
                d.update(zip(hashes, _unpack_masks(masks), strict=True))
            if len(g.tiers) > 1:
                a: dict[int, int] = {}
                for d in g.tiers.values():
                    for h, m in d.items():
                        a[h] = a.get(h, 0) | m
                g.any = a
        return shard


def resumable(cached: int, n_tokens: int, engine_block_size: int) -> int:
    """Engines never serve the last prompt token from cache and resume at a block boundary:
    at most floor((n-1)/B)*B of n prompt tokens."""
    if n_tokens <= 1 or engine_block_size <= 0:
        return 0
    return (min(cached, n_tokens - 1) // engine_block_size) * engine_block_size


def _pack_masks(values, n: int, n_slots: int) -> tuple[int, bytes]:
    """Slot masks as `words` little-endian uint64 words each."""
    words = max(1, (n_slots + 63) // 64)
    if words == 1:
        return 1, np.fromiter(values, dtype=np.uint64, count=n).tobytes()
    buf = bytearray()
    for m in values:
        buf += m.to_bytes(words * 8, "little")
    return words, bytes(buf)


def _unpack_masks(packed) -> list[int]:
    words, data = packed
    if words == 1:
        return np.frombuffer(data, dtype=np.uint64).tolist()
    w = words * 8
    return [int.from_bytes(data[i:i + w], "little") for i in range(0, len(data), w)]
