"""What every engine adapter's mirror shares: the error that names a dead-letter reason, the one
mapping of engine media to index tiers, the per-tier reference counts of index blocks (a block is
cached in a tier while any engine block there holds it: several engine blocks can hold one index
block), and the split of newly cached blocks into contiguous runs."""

from __future__ import annotations

from schemas.events import Event, ReplicaCleared


class MirrorError(ValueError):
    """An engine event that cannot be applied (its reason names a dead-letter counter)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def normalize_tier(medium: str | None) -> str:
    m = (medium or "GPU").upper()
    if m in ("CPU", "CPU_PINNED", "HOST", "CPU_TIER"):
        return "CPU"
    if m in ("DISK", "LOCAL_DISK", "SSD", "STORAGE"):  # vLLM's MEDIUM_STORAGE (offloading to files)
        return "DISK"
    return m


def stored_runs(canon: list[int], new_pos: list[int], parent: int, depth0: int, engine_new: list[int]
                ) -> list[tuple[list[int], int | None, int, list[int]]]:
    """The newly cached index blocks (positions `new_pos` in `canon`, chained from `parent` at depth
    `depth0`) as contiguous runs: (hashes, parent of the first or None at the root, depth, engine
    hashes (all on the first run)) — one BlocksStored each."""
    runs = []
    start = 0
    for i in range(1, len(new_pos) + 1):
        if i == len(new_pos) or new_pos[i] != new_pos[i - 1] + 1:
            p0 = new_pos[start]
            run_parent = canon[p0 - 1] if p0 else (None if depth0 == 0 else parent)
            engine = engine_new if start == 0 else []
            runs.append((canon[p0:new_pos[i - 1] + 1], run_parent, depth0 + p0, engine))
            start = i
    return runs


def hold(refs: dict, sub, tier: str, group: int, first: int, new_pos: list[int]) -> None:
    """One more holder of each index block of `sub` (at positions `first`, `first` + 1 ... of the
    chain) in `tier`/`group`; the positions of blocks that became cached there go to `new_pos`."""
    for i, c in enumerate(sub):
        rkey = (c, tier, group)
        r = refs.get(rkey, 0)
        refs[rkey] = r + 1
        if not r:
            new_pos.append(first + i)


def release(refs: dict, sub, tier: str, group: int, gone: list[int]) -> None:
    """One holder fewer of each index block of `sub`; blocks no engine block holds any more in
    `tier`/`group` go to `gone` (retracted only when the last holder drops them)."""
    for c in sub:
        rkey = (c, tier, group)
        r = refs.get(rkey, 0) - 1
        if r > 0:
            refs[rkey] = r
        else:
            refs.pop(rkey, None)
            gone.append(c)


def engine_cache_reset(mirror, out: list[Event]) -> None:
    """The engine dropped its whole cache (AllBlocksCleared): so does the mirror, and the index."""
    mirror.clear()
    mirror.stats["cleared"] += 1
    out.append(ReplicaCleared("engine_cache_reset"))
