"""What every engine adapter's mirror shares: the error that names a dead-letter reason, the one
mapping of engine media to index tiers, the per-tier reference counts of index blocks (a block is
cached in a tier while any engine block there holds it: several engine blocks can hold one index
block), the split of newly cached blocks into contiguous runs, and the one rule for events a mirror
cannot place (`SetAside`, `Unreadable`, `place_unreadable`; the table is in docs/engines.md).

Events are placed one by one: an event that cannot be placed is set aside on its own (its position
in the engine batch, a bounded reason and its kind), and the batch's other events are applied in
order. Setting an event aside never credits more: a store is simply not indexed; a removal that
names known engine hashes in a way the mirror cannot place (an unknown medium, an undecodable body)
drops those hashes from every tier and group (`drop_everywhere`); a clear clears; an event whose
kind or hashes cannot be read at all may have removed anything, so the replica is cleared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvidx.core.hashing import tail_key as _tail_key
from schemas.events import TIERS, Event, ReplicaCleared

# the tiers the index knows (a node-shared pool's relay publishes as NODE_SHARED or POOL); a medium
# mapping elsewhere is unknown (set aside)
KNOWN_TIERS = frozenset(TIERS)
# the bounded values of the set-aside counters' `event` label
EVENT_KINDS = ("stored", "removed", "cleared", "updated", "created", "other")
# the bounded values of their `reason` label besides MirrorError reasons (code literals)
UNDECODABLE = "undecodable_event"
UNKNOWN_HASH = "unknown_hash"
UNKNOWN_PARENT = "unknown_parent"
UNKNOWN_MEDIUM = "unknown_medium"


@dataclass
class SetAside:
    """One engine event a mirror could not place: its position in the engine batch, its kind (one
    of EVENT_KINDS), why (a bounded reason), a one-line detail, and what the mirror did instead."""
    position: int
    event: str
    reason: str
    detail: str
    action: str = "skipped"  # "skipped" | "dropped_everywhere" | "cleared"
    raw: bytes | None = None  # the event's own bytes when it could not be decoded


@dataclass
class Unreadable:
    """An event of an engine batch that did not decode (the batch's other events did): what could
    be read of it loosely (its kind, its block hashes), for the conservative rule."""
    raw: bytes
    kind: str  # one of EVENT_KINDS
    hashes: list | None  # its block hashes if they could be read (ints or bytes), else None
    detail: str


def read_unreadable(raw: bytes, detail: str, kinds: dict[str, str], hash_fields: tuple[str, ...] = (
        "block_hashes",), tag_fields: tuple[str, ...] = ("type",), positional_hashes: int = 1) -> Unreadable:
    """An undecodable event read loosely: the kind from its tag (`kinds`: the engine's tag -> one of
    EVENT_KINDS), its hashes from the first of `hash_fields` that is a list of ints or bytes (a
    positional event: element `positional_hashes` after the tag)."""
    try:
        obj = msgspec.msgpack.decode(raw)
    except (msgspec.DecodeError, RecursionError, ValueError, TypeError):
        obj = None
    tag: Any = None
    hashes: Any = None
    if isinstance(obj, dict):
        tag = next((obj[f] for f in tag_fields if isinstance(obj.get(f), str)), None)
        hashes = next((obj[f] for f in hash_fields if f in obj), None)
    elif isinstance(obj, list) and obj and isinstance(obj[0], str):
        tag = obj[0]
        hashes = obj[positional_hashes] if len(obj) > positional_hashes else None
    ok = isinstance(hashes, list) and all(isinstance(h, int | bytes) and not isinstance(h, bool)
                                          for h in hashes)
    return Unreadable(raw, kinds.get(tag, "other") if isinstance(tag, str) else "other",
                      hashes if ok else None, detail[:300])


def per_event(raws: list, decode) -> list:
    """`decode(raw)` of each raw event of a batch that did not decode as a whole, once per distinct
    event (a hostile batch of a million copies of one bad value costs one decoding)."""
    seen: dict[bytes, object] = {}
    out = []
    for r in raws:
        key = r if type(r) is bytes else bytes(r)
        ev = seen.get(key)
        if ev is None:
            ev = seen[key] = decode(r)
        out.append(ev)
    return out


def place_unreadable(mirror, ev: Unreadable, position: int, out: list[Event]) -> SetAside:
    """The conservative rule for an event that did not decode: a store is not indexed; a clear
    clears; a removal (or an update, or an event of a kind this adapter does not know) whose hashes
    could be read drops those hashes from every tier and group (`mirror.drop_everywhere`); one whose
    hashes could not be read may have removed anything: the replica is cleared."""
    if ev.kind in ("stored", "created"):
        action = "skipped"
    elif ev.kind == "cleared":
        engine_cache_reset(mirror, out)
        action = "cleared"
    elif ev.hashes is not None:
        mirror.drop_everywhere(ev.hashes, out)
        action = "dropped_everywhere"
    else:
        mirror.clear()
        mirror.stats["cleared"] = mirror.stats.get("cleared", 0) + 1
        if not (out and out[-1] == ReplicaCleared("unplaceable_event")):  # one clear for a run of them
            out.append(ReplicaCleared("unplaceable_event"))
        action = "cleared"
    return SetAside(position, ev.kind, UNDECODABLE, ev.detail, action, ev.raw)


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


class PartialTails:
    """Partial-block keys of one engine cache that resumes inside blocks (SGLang pages below the index
    block, TensorRT-LLM partial reuse): what lets the index credit to the token without keying every
    token.

    Under each index block's parent, the engine's cache is a small token trie; its *ends* are the
    full index blocks (already indexed by their hashes) and the open tails (a sequence that stops
    inside a block). A prompt that leaves the trie inside a block is reusable up to where it left.
    The key of a prefix (kvidx.core.hashing.tail_key) is published unless the prefix lies on the one
    path to a single full block: an open tail's prefixes and the shared part of branches are keyed,
    so a tail costs at most one key per token of it (per unit), and a full block alone costs nothing
    more. A prompt diverging inside a full block that nothing else shares is credited to the block
    boundary before it (the engine reuses a few tokens more: the safe side).

    Ends are reference counted per tier (copies); changes are collected per batch and `flush` gives
    the net keys stored and removed per tier."""

    def __init__(self, index_block_size: int, unit: int = 1):
        self.ibs = index_block_size
        self.unit = unit  # the engine's resume granularity (page size; 1: any token)
        self.ends: dict[tuple[int, str], int] = {}  # (end key, tier) -> holders
        self.prefixes: dict[tuple[int, str], list[int]] = {}  # (key, tier) -> [ends below, full ends]
        self._was: dict[tuple[int, str], bool] = {}  # published before this batch, for touched keys

    @staticmethod
    def _published(c: list[int] | None) -> bool:
        return c is not None and c[0] > 0 and not (c[0] == 1 and c[1] == 1)

    def _keys(self, seed: int, packed: bytes, full: bool) -> list[int]:
        n = len(packed) // 4
        top = self.ibs - 1 if full else n
        return [_tail_key(seed, packed[:4 * k]) for k in range(self.unit, top + 1, self.unit)]

    def add(self, tier: str, seed: int, packed: bytes, full: bool) -> None:
        """One more holder of the end `packed` (a block's first tokens, or all of them if `full`)
        under parent `seed`."""
        ek = (_tail_key(seed, packed), tier)
        h = self.ends.get(ek, 0)
        self.ends[ek] = h + 1
        if not h:
            self._count(tier, self._keys(seed, packed, full), 1, 1 if full else 0)

    def drop(self, tier: str, seed: int, packed: bytes, full: bool) -> None:
        ek = (_tail_key(seed, packed), tier)
        h = self.ends.get(ek, 0)
        if h > 1:
            self.ends[ek] = h - 1
            return
        if not h:
            return
        del self.ends[ek]
        self._count(tier, self._keys(seed, packed, full), -1, -1 if full else 0)

    def _count(self, tier: str, keys: list[int], d_ends: int, d_full: int) -> None:
        prefixes, was = self.prefixes, self._was
        for k in keys:
            pk = (k, tier)
            c = prefixes.get(pk)
            if pk not in was:
                was[pk] = self._published(c)
            if c is None:
                c = prefixes[pk] = [0, 0]
            c[0] += d_ends
            c[1] += d_full
            if c[0] <= 0:
                del prefixes[pk]

    def flush(self) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """({tier: keys newly published}, {tier: keys no longer published}) since the last flush."""
        stored: dict[str, list[int]] = {}
        removed: dict[str, list[int]] = {}
        for pk, before in self._was.items():
            now = self._published(self.prefixes.get(pk))
            if now != before:
                (stored if now else removed).setdefault(pk[1], []).append(pk[0])
        self._was = {}
        return stored, removed

    def events(self, group: int = 0) -> list[Event]:
        """`flush` as index events (stores first)."""
        from schemas.events import BlocksRemoved, BlocksStored

        stored, removed = self.flush()
        return ([BlocksStored(t, group, ks, None, 0, tail=True) for t, ks in stored.items()]
                + [BlocksRemoved(t, group, ks, tail=True) for t, ks in removed.items()])

    def published(self) -> dict[str, list[int]]:
        """tier -> every key published now."""
        out: dict[str, list[int]] = {}
        for (k, tier), c in self.prefixes.items():
            if self._published(c):
                out.setdefault(tier, []).append(k)
        return out

    def replay(self, group: int = 0) -> list[Event]:
        """Every key published now, as stores (a mirror replay)."""
        from schemas.events import BlocksStored

        return [BlocksStored(t, group, ks, None, 0, tail=True) for t, ks in self.published().items()]

    def clear(self) -> None:
        self.ends.clear()
        self.prefixes.clear()
        self._was = {}
