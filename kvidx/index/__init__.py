"""The read side of a model's index: what the routers' APIs (Dynamo's, the conductor's, SGLang's),
the service's metrics, the simulator and the tools ask of a shard, as functions over it. Nothing
outside kvidx/core and kvidx/index reaches into a shard's members (tests/unit/test_layout.py).

Every walk is over the shard's lookup group (its first full-attention group) and canonical block
hashes; callers hold the store's lock as for any read. The lookup answer itself (priced, ranked,
merged over instances) is kvidx/index/lookups.py, exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from kvidx.core import walk
from kvidx.core.masks import or_masks, run_end, slots_of
from kvidx.core.shard import ModelShard, ReplicaState
from kvidx.index.lookups import (  # noqa: F401 - the read side's one API
    Feedback,
    answer,
    answer_json,
    below_gpu,
    credited,
    lookup,
    merge,
    merge_answer,
    prefetch_plan,
    queues,
    replica_plan,
)
from schemas.events import TIER_IDS, TIERS

holders = slots_of  # the slots of a mask, lowest first
HOST = ("CPU", "NODE_SHARED", "POOL")  # host memory: an engine's own, a node's, a Mooncake Store's "cpu"
DISK = ("DISK",)


def replicas(shard: ModelShard) -> Iterator[ReplicaState]:
    """The shard's replicas (one per replica and DP rank), in slot order."""
    return (st for st in shard.by_slot if st is not None)


def replica_of(shard: ModelShard | None, replica: str, dp_rank: int = 0) -> ReplicaState | None:
    """A replica's state (its DP rank's), None if the shard has none of it."""
    return shard.replicas.get((replica, dp_rank)) if shard is not None else None


def replica_count(shard: ModelShard) -> int:
    """Replicas and DP ranks the shard has state for."""
    return len(shard.replicas)


def foresight(shard: ModelShard, now: float) -> tuple[int, int] | None:
    """(resumable tokens the eviction foresight withholds now, lookups it cut so far), None while it
    is off (no route reached the model)."""
    f = shard.foresight
    return (sum(f.doomed(now)[1].values()), f.discounted_lookups) if f.active else None


def replica_at(shard: ModelShard, slot: int) -> ReplicaState | None:
    """The replica of a slot (a bit of the masks the functions below return), None if it left."""
    return shard.by_slot[slot] if 0 <= slot < len(shard.by_slot) else None


def has_blocks(shard: ModelShard | None) -> bool:
    """Whether the shard has a lookup group (any block was ever stored)."""
    return shard is not None and shard._lookup_group(None) is not None


def key_count(shard: ModelShard | None) -> int:
    """Distinct block keys held in any tier of the lookup group."""
    g = shard._lookup_group(None) if shard is not None else None
    return len(g.any) if g is not None else 0


def keys_total(shard: ModelShard | None) -> int:
    """Distinct block keys held in any tier, summed over the groups."""
    return sum(n for _, n in keys_by_group(shard)) if shard is not None else 0


def keys_by_group(shard: ModelShard) -> list[tuple[int, int]]:
    """(group, distinct block keys it holds in any tier), by group."""
    return [(gid, len(g.any)) for gid, g in sorted(shard.groups.items())]


def working_set(shard: ModelShard) -> dict[str, int]:
    """tier -> distinct blocks of the lookup group (the first full-attention one) any replica holds
    there; "any": in some tier (pools as stored)."""
    g = shard._lookup_group(None)
    if g is None:
        return {}
    return {**{TIERS[t]: len(m) for t, m in sorted(g.tiers.items())}, "any": len(g.any)}


def prefix_hits(shard: ModelShard, hashes: list[int], tier: str | None = None) -> dict[int, int]:
    """slot -> the leading `hashes` it holds in `tier` (None: in any tier, pools as stored); slots
    holding none are left out."""
    g = shard._lookup_group(None)
    if g is None or not hashes:
        return {}
    m = g.any if tier is None else g.tiers.get(TIER_IDS[tier])
    return dict(m.walk(hashes)) if m is not None else {}


def prefix_walk(shard: ModelShard) -> Callable[[list[int]], dict[int, int]]:
    """The shard's prefix walk, bound once for a loop of many prompts: hashes -> slot -> the leading
    blocks it holds in any tier or in a pool it reads (the hit a lookup starts from)."""
    return walk.prefix_walker(shard)


def held_in(shard: ModelShard, tiers: Sequence[str], hashes: list[int]) -> list[int]:
    """Per block of `hashes`: the mask of the slots holding it in one of `tiers` (0s where the shard
    has none of them)."""
    g = shard._lookup_group(None)
    return or_masks([g.tiers[TIER_IDS[t]] for t in tiers if TIER_IDS[t] in g.tiers] if g is not None else [],
                    hashes)


def tier_reach(shard: ModelShard, hashes: list[int], lower_levels: Sequence[Sequence[str]] = (HOST, DISK)
               ) -> dict[int, list[int]]:
    """slot -> how far into `hashes` its blocks reach on the GPU, then through each lower level in
    turn, each continuing where the faster ones stopped (Dynamo's and the conductor's GPU, host
    memory, disk): nondecreasing, for every slot that reaches a block in some level."""
    first = prefix_hits(shard, hashes, "GPU")
    lower = [held_in(shard, tiers, hashes) for tiers in lower_levels]
    out: dict[int, list[int]] = {}
    for st in replicas(shard):
        bit, pos = 1 << st.slot, first.get(st.slot, 0)
        reach = [pos]
        for masks in lower:
            pos = run_end(masks, bit, pos)
            reach.append(pos)
        if pos:
            out[st.slot] = reach
    return out


def tier_maps(shard: ModelShard, lower_levels: Sequence[Sequence[str]] = (HOST, DISK)):
    """(the lookup group's GPU map or None, each lower level's maps): what `tier_reach` reads, for a
    reader of the maps themselves (index_service.lookup_front); None without a lookup group."""
    g = shard._lookup_group(None)
    if g is None:
        return None
    return (g.tiers.get(TIER_IDS["GPU"]),
            [[g.tiers[TIER_IDS[t]] for t in tiers if TIER_IDS[t] in g.tiers] for tiers in lower_levels])


def slot_table(shard: ModelShard) -> list[tuple[str, int] | None]:
    """slot -> (replica, DP rank), None for a free slot."""
    return [(st.replica, st.dp_rank) if st is not None else None for st in shard.by_slot]


def view_signature(shard: ModelShard) -> tuple:
    """(lookup group, its tier maps, slot list, pools' readers, slot count, block size): objects
    (compared with `is`) and sizes that change whenever `tier_maps`, `slot_table` or `has_pools` would
    answer differently."""
    g = shard._lookup_group(None)
    return (g, tuple(g.tiers.values()) if g is not None else (), shard.by_slot, shard.pool_readers,
            len(shard.by_slot), shard.block_size)


def has_pools(shard: ModelShard) -> bool:
    """Whether the model has shared pools (the deployment's [pools] or a registered Mooncake Store)."""
    return bool(shard.pool_readers)


def pool_slots(shard: ModelShard) -> int:
    """The mask of the slots that are shared pools (the deployment's [pools]), 0 without pools."""
    return shard._pools()[0] if shard.pool_readers else 0


def pools_read_by(shard: ModelShard, replica: str) -> list[str]:
    """The pools a replica reads."""
    return [p for p, readers in shard.pool_readers.items() if replica in readers]


def index_size(shards: Iterable[ModelShard], union_maps: bool = True) -> tuple[int, int]:
    """(live block entries per tier and group, bytes of the mask maps holding them: each tier's map
    and, with several tiers and `union_maps`, the group's union map) over `shards`."""
    shards = list(shards)
    maps = {id(m): m for s in shards for g in s.groups.values()
            for m in (*g.tiers.values(), *((g.any,) if union_maps else ()))}
    entries = sum(len(m) for s in shards for g in s.groups.values() for m in g.tiers.values())
    return entries, sum(m.memory_bytes() for m in maps.values())
