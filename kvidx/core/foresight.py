"""Eviction foresight: which cached blocks a replica will have evicted by the time a routed request
reaches it. Pure: no clocks (callers pass `now`), no I/O.

Events arrive after the engine's step. A router that sends two prompts to one replica in a burst
looks the second up before the first one's prefill is reported: the index still holds the blocks
that prefill is about to evict, and credits them (late evictions: the over-credit that pending
credit, which covers late stores, cannot cover). Foresight keeps, per (replica slot, KV-cache group),
the replica's blocks in the order its engine will evict them, and the blocks routed prompts will
add there before the engine reports them (`routed`, from the routes routers record). Once the
replica is known to be full (it has evicted a block), its capacity is the most blocks it was seen
holding; live + incoming - capacity blocks will go, oldest first, and lookups discount them.

Eviction order: engines free a request's blocks deepest first (vLLM's free queue takes them tail
first; SGLang's and TensorRT-LLM's radix trees evict leaves before their parents), so a prompt's
last block is the oldest of its run and its first block the newest; shared pools (LMCache) keep
chunks in prompt order. A route touches the prompt's blocks the replica holds and adds the rest.

Hybrid models (`pooled`): vLLM's hybrid allocator gives all KV-cache groups (full attention, sliding
window, state space) one block pool, so a replica has one order and one capacity for all its groups,
keyed by (group, hash), in the order vLLM frees a prefill's blocks (settle). Per-group capacities and
orders do not follow that: on a real engine's recording (gemma2, sliding window 32, concurrency 4)
they cut recall from 0.990 to 0.848; the pooled order keeps every real recording's agreement. Extra
physical copies of a block (vLLM recomputes the last block of a fully cached prompt) take room and
refresh its place: the relay publishes them (BlocksStored.copy, EventBatch.copies_removed).

Foresight starts with a model's first route: without routes nothing is known to be coming, and the
order costs the fold ~110 ns per block event (kvidx_native.Order; bench/RESULTS.md). Where the order
is not known (a replica that held blocks before foresight started, or before a restore from a
snapshot), the slot is not discounted until it has been cleared or has turned its cache over.
"""

from __future__ import annotations

from collections import deque
from itertools import islice, repeat

from kvidx.core.maskmap import native_module


class PyOrder:
    """Blocks in eviction order, oldest first: the pure-Python reference of kvidx_native.Order (a
    linked list over a slab, no object per block), a dict whose order is the eviction order."""

    __slots__ = ("d",)

    def __init__(self) -> None:
        self.d: dict[int, None] = {}

    def append(self, hashes, reverse: bool = False, move_existing: bool = False) -> int:
        """The hashes not present appended (reversed with `reverse`); present ones moved along with
        `move_existing`. How many were added."""
        d, n0 = self.d, len(self.d)
        run = list(reversed(hashes)) if reverse else hashes
        if move_existing:
            _drain(map(d.pop, run, repeat(None)))
        d.update(dict.fromkeys(run))
        return len(d) - n0

    def touch(self, hashes, reverse: bool = False) -> None:
        """The present hashes moved to the tail (reversed with `reverse`)."""
        d = self.d
        run = [h for h in (reversed(hashes) if reverse else hashes) if h in d]
        _drain(map(d.pop, run, repeat(None)))
        d.update(dict.fromkeys(run))

    def discard(self, hashes) -> int:
        d, n0 = self.d, len(self.d)
        _drain(map(d.pop, hashes, repeat(None)))
        return n0 - len(d)

    def head(self, k: int) -> list[int]:
        return list(islice(self.d, k))

    def __len__(self) -> int:
        return len(self.d)

    def __contains__(self, h: int) -> bool:
        return h in self.d


_native = native_module()
# the order class: the compiled one where built; property tests pin the pure-Python reference
Order: type = getattr(_native, "Order", None) or PyOrder


class PyRecency:
    """One (slot, group): its blocks oldest first (an Order), those routed but not yet reported
    (hash -> expiry, also in the order), their extra physical copies, and what the slot showed of its
    capacity. The pure-Python reference of kvidx_native.Recency (the same methods; the compiled fold
    calls that one's without a Python frame), and the one a pooled slot keeps (its keys carry the
    group in bits above 64)."""

    __slots__ = ("order", "unconfirmed", "peak", "full", "untrusted", "copies", "extra", "transient",
                 "markers", "evicting")

    def __init__(self, untrusted: int = 0, order: type = PyOrder) -> None:
        self.order = order()
        self.unconfirmed: dict[int, float] = {}
        self.peak = 0  # the most blocks held at once (reported blocks and extra copies)
        self.copies: dict[int, int] = {}  # hash -> extra physical copies (BlocksStored.copy)
        self.extra = 0  # their sum
        self.full = False  # an eviction seen: the slot is at capacity
        # an eviction in the batch being folded: a pooled slot's capacity is what it holds at its end
        # (its pool also holds blocks no event shows, freed by prefills that moved on: the most it
        # ever held overstates the room left)
        self.evicting = False
        # blocks held before the order was known: discounts wait until that many have gone
        self.untrusted = untrusted
        # blocks in-flight prefills take for their step and do not keep (a sliding-window group's
        # blocks behind its window), until the route's first incoming block (its marker) is reported
        self.transient = 0
        self.markers: dict[int, int] = {}  # marker key -> transient blocks

    def overflow(self) -> int:
        """How much room in-flight prefills will take from the oldest blocks (in blocks; a block
        with extra copies takes one per copy)."""
        if not self.full or self.untrusted > 0 or not (self.unconfirmed or self.transient):
            return 0
        return max(0, len(self.order) + self.extra + self.transient - self.peak)

    def release(self, keys) -> None:
        """Routes whose marker is among `keys` were reported (or expired): their transient room is free."""
        for h in keys:
            c = self.markers.pop(h, 0)
            if c:
                self.transient -= c

    def held(self) -> int:
        """The room the slot's blocks take: reported blocks and their extra copies."""
        return len(self.order) - len(self.unconfirmed) + self.extra

    def stored(self, hashes: list[int], deepest_first: bool) -> None:
        """The engine reported these blocks (Foresight.stored)."""
        if self.unconfirmed:  # routed blocks keep the place the route gave them
            _drain(map(self.unconfirmed.pop, hashes, repeat(None)))
        if self.markers:
            self.release(hashes)
        self.order.append(hashes, deepest_first)

    def removed(self, hashes: list[int]) -> None:
        """These blocks left the slot (Foresight.removed)."""
        gone = self.order.discard(hashes)
        if self.untrusted:  # blocks the order never saw are going: once all have, the order is whole
            self.untrusted = max(0, self.untrusted - (len(hashes) - gone))
        if self.unconfirmed:
            _drain(map(self.unconfirmed.pop, hashes, repeat(None)))
        if self.markers:
            self.release(hashes)
        if self.copies:  # the last copy went: any extra ones left uncounted go with it
            for h in hashes:
                self.extra -= self.copies.pop(h, 0)
        self.full = True
        self.evicting = True

    def copied(self, hashes: list[int], deepest_first: bool) -> None:
        """Extra physical copies of held blocks (Foresight.copied)."""
        order, copies = self.order, self.copies
        run = [h for h in hashes if h in order]
        for h in run:
            copies[h] = copies.get(h, 0) + 1
        self.extra += len(run)
        order.touch(run, deepest_first)

    def uncopied(self, hashes: list[int]) -> None:
        """An extra copy of each of these blocks was evicted (Foresight.uncopied)."""
        copies = self.copies
        for h in hashes:
            c = copies.get(h)
            if c:
                self.extra -= 1
                if c > 1:
                    copies[h] = c - 1
                else:
                    del copies[h]

    def routed(self, touched: list[int], incoming: list[int], expires: float, deepest_first: bool,
               transient: int = 0) -> list[int]:
        """A route (Foresight.routed); the incoming blocks not already reported here, now unconfirmed."""
        order, un = self.order, self.unconfirmed
        if self.untrusted:  # held blocks the order had not seen: known now
            self.untrusted = max(0, self.untrusted - sum(1 for h in touched if h not in order))
        new = [h for h in incoming if h in un or h not in order]  # not already reported there
        order.append(touched + incoming, deepest_first, move_existing=True)
        for h in new:
            un[h] = max(un.get(h, 0.0), expires)
        if new and transient > 0:
            self.markers[new[0]] = self.markers.get(new[0], 0) + transient
            self.transient += transient
        return new

    def expire(self, hashes, now: float) -> None:
        """A route's unconfirmed blocks whose expiry passed leave the order."""
        un = self.unconfirmed
        gone = [h for h in hashes if (t := un.get(h)) is not None and t <= now]
        for h in gone:
            del un[h]
        if self.markers:
            self.release(gone)
        self.order.discard(gone)

    def settle(self, pooled: bool) -> None:
        """At a batch's end (Foresight.settle): the most the slot was seen holding."""
        if self.held() > self.peak or (self.evicting and pooled):
            self.peak = self.held()
        self.evicting = False

    def doomed(self, room: int) -> list[int]:
        """The held blocks in-flight prefills taking `room` (overflow()) will evict, oldest first (a
        block goes once all its copies have)."""
        out: list[int] = []
        un, copies = self.unconfirmed, self.copies
        for h in self.order.head(room + len(un)):  # routed blocks are not held yet
            if h in un:
                continue
            room -= 1 + copies.get(h, 0)
            if room < 0:
                break
            out.append(h)
            if not room:
                break
        return out


# the recency class: the compiled one where built (its order compiled too); property tests pin the
# pure-Python reference
Recency: type = getattr(_native, "Recency", None) or PyRecency

_POOL = -1  # a pooled slot's one Recency: its group id
_SHIFT = 64  # a pooled key: (group << 64) | hash
_LOW = (1 << _SHIFT) - 1


class Foresight:
    # fixed: the compiled fold reads the first five at their slots' offsets (native/src/fold.rs `F_NAMES`)
    __slots__ = ("active", "slots", "grown", "pooled", "version", "_runs", "recency_type", "_expiries",
                 "_doomed", "discounted_lookups")

    def __init__(self) -> None:
        self.active = False  # set by the model's first route (ModelShard.add_pending)
        self.pooled = False  # one order and capacity per slot for all groups (hybrid models; pool())
        self.grown: list[Recency] = []  # stored to in the batch being folded (settle)
        # pooled slots: the batch's stored runs, (slot key) -> group -> (freed early, runs) (settle)
        self._runs: dict[tuple[int, int], dict[int, tuple[bool, list[list[int]]]]] = {}
        self.recency_type: type = Recency  # a slot's Recency (pooled slots: PyRecency, whatever this is)
        self.slots: dict[tuple[int, int], Recency] = {}  # (slot, group) -> its order
        self._expiries: deque[tuple[float, tuple[int, int], tuple[int, ...]]] = deque()  # routes, by expiry
        self.version = 0  # bumped on every change: lookups reuse the doomed masks until then
        self._doomed: tuple[int, dict[int, dict[int, int]], dict[int, int]] | None = None
        self.discounted_lookups = 0  # lookups where some replica's credit was cut

    def pool(self) -> None:
        """From now on the model's groups share each slot's block pool (a hybrid model): orders kept
        per group so far are dropped (they were not a pool's)."""
        if not self.pooled:
            self.pooled = True
            self.slots.clear()
            self._runs.clear()
            self._expiries.clear()
            self.version += 1

    def _at(self, slot: int, gid: int, hashes):
        """(the slot's Recency key, the keys of `hashes` in it)."""
        if not self.pooled:
            return (slot, gid), hashes
        g = gid << _SHIFT
        return (slot, _POOL), [g | h for h in hashes]

    def recency(self, key: tuple[int, int], held: int) -> Recency:
        r = self.slots.get(key)
        if r is None:
            # pooled keys pass 64 bits: the dict order (compiled orders take one u64 hash)
            r = self.slots[key] = PyRecency(held) if self.pooled else self.recency_type(held)
        return r

    # ---- the fold ------------------------------------------------------------------------------
    def stored(self, slot: int, gid: int, hashes: list[int], deepest_first: bool, held_before: int,
               freed_early: bool = False) -> None:
        """The engine reported these blocks (a chain, in prompt order) in `gid` on `slot`; `held_before`:
        the slot's live blocks in the group (pooled: in all groups) before this event (for a slot seen
        for the first time); `freed_early`: a sliding-window or state group, whose blocks the engine
        frees as the prefill moves past them (pooled slots only)."""
        if not hashes:
            return
        key, hashes = self._at(slot, gid, hashes)
        r = self.recency(key, held_before)
        r.stored(hashes, deepest_first)
        if self.pooled:
            self._runs.setdefault(key, {}).setdefault(gid, (freed_early, []))[1].append(hashes)
        self.grown.append(r)
        self.version += 1

    def settle(self) -> None:
        """After one engine batch: the most each slot it stored to was seen holding. Only at batch
        ends: within a batch the evictions of copies (EventBatch.copies_removed) are not yet counted,
        and a peak taken there would be above its capacity.

        A pooled slot's blocks stored in the batch are put in the order vLLM frees them: the runs of
        sliding-window and state groups before their last, freed as the prefill moved on (each
        deepest first); then group by group (KVCacheCoordinator.free), each deepest first."""
        for key, groups in self._runs.items():
            r = self.slots.get(key)
            if r is None:
                continue
            early: list[int] = []
            finish: list[int] = []
            for gid in sorted(groups):
                freed_early, runs = groups[gid]
                if freed_early:
                    for run in runs[:-1]:
                        early.extend(reversed(run))
                    runs = runs[-1:]
                for run in reversed(runs):
                    finish.extend(reversed(run))
            r.order.touch(early + finish)
        self._runs.clear()
        for r in self.grown:
            r.settle(self.pooled)
        self.grown.clear()

    def copied(self, slot: int, gid: int, hashes: list[int], deepest_first: bool) -> None:
        """The engine stored blocks it holds again (extra physical copies): they take room, and the
        hash goes with its newest copy, after everything stored before it."""
        key, hashes = self._at(slot, gid, hashes)
        r = self.slots.get(key)
        if r is None or not hashes:
            return
        r.copied(hashes, deepest_first)
        self.grown.append(r)
        self.version += 1

    def uncopied(self, slot: int, gid: int, hashes: list[int]) -> None:
        """An extra copy of each of these blocks was evicted; another stays."""
        key, hashes = self._at(slot, gid, hashes)
        r = self.slots.get(key)
        if r is None:
            return
        r.uncopied(hashes)
        self.version += 1

    def removed(self, slot: int, gid: int, hashes: list[int]) -> None:
        """These blocks left the slot's group in every tier (evicted)."""
        key, hashes = self._at(slot, gid, hashes)
        r = self.slots.get(key)
        if r is None or not hashes:
            return
        r.removed(hashes)
        self.version += 1

    def cleared(self, slot: int) -> None:
        for key in [k for k in self.slots if k[0] == slot]:
            del self.slots[key]
        self.version += 1

    # ---- routes ---------------------------------------------------------------------------------
    def routed(self, slot: int, gid: int, touched: list[int], incoming: list[int], expires: float,
               deepest_first: bool, transient: int = 0) -> None:
        """A prompt was routed to `slot`: the engine touches `touched` (blocks the index holds there)
        and adds `incoming` (both in prompt order; incoming after touched); the incoming blocks count
        against the slot's capacity until its events report them or `expires` passes, and so do
        `transient` blocks its step takes and frees again, until its first incoming block is
        reported."""
        key, touched = self._at(slot, gid, touched)
        incoming = self._at(slot, gid, incoming)[1]
        r = self.slots.get(key)
        if r is None:
            return  # nothing reported there yet: no order to keep, no capacity known
        new = r.routed(touched, incoming, expires, deepest_first, transient)
        if new:
            self._expiries.append((expires, key, tuple(new)))
        self.version += 1

    def expire(self, now: float) -> None:
        q = self._expiries
        while q and q[0][0] <= now:
            _, key, hashes = q.popleft()
            r = self.slots.get(key)
            if r is None:
                continue
            r.expire(hashes, now)
            self.version += 1

    # ---- lookups ---------------------------------------------------------------------------------
    def doomed(self, now: float) -> tuple[dict[int, dict[int, int]], dict[int, int]]:
        """(group -> block hash -> slots whose copy in-flight prefills will evict first, slot -> how
        many blocks it will evict). Empty where no slot is under pressure."""
        self.expire(now)
        cached = self._doomed
        if cached is not None and cached[0] == self.version:
            return cached[1], cached[2]
        masks: dict[int, dict[int, int]] = {}
        pressure: dict[int, int] = {}
        for (slot, gid), r in self.slots.items():
            room = r.overflow()
            if not room:
                continue
            bit = 1 << slot
            g = masks.setdefault(gid, {}) if gid != _POOL else {}
            doomed = r.doomed(room)
            for h in doomed:
                if gid == _POOL:  # a pooled key: the group is in its high bits
                    g = masks.setdefault(h >> _SHIFT, {})
                    h &= _LOW
                g[h] = g.get(h, 0) | bit
            pressure[slot] = pressure.get(slot, 0) + len(doomed)
        self._doomed = (self.version, masks, pressure)
        return masks, pressure


class HostLoads:
    """A replica's host tier as TensorRT-LLM queues it (EventBatch.host_tier_blocks), and what a
    prompt's own loads leave of its hit. Its slots oldest first, each an engine block held there or
    empty (kvCacheManager.cpp, evictionPolicy.cpp):
    - an offload (an engine block stored in the host) takes the front slot, freeing what it held with
      its subtree, and joins the tail;
    - a load (an engine block stored on the GPU, then removed from the host) leaves an empty slot at
      the tail: `onboardBlock` swaps the block with the GPU block it took, which joins the host queue;
    - an evicted host block (a subtree freed) leaves its slot empty where it was;
    - a removal of the front that no offload explains is the offload of a block outside the radix
      tree (no event): its slot goes to the tail, empty.
    The relay publishes every engine block entering or leaving the host with its engine hash, even
    with no index block of its own (kvidx.engines.trtllm.mirror `_host_queue`). A load takes a GPU
    block, whose victim is offloaded: each load is assumed to take the host's front slot (the safe
    side: a victim without a key, or of low priority, is not offloaded)."""

    __slots__ = ("order", "slot_of", "engine_of", "keys", "unit_of", "empty", "fresh", "up", "open", "ids",
                 "took")

    def __init__(self, capacity: int) -> None:
        self.order = PyOrder()  # slot ids, oldest first (the host's start: `fresh` empty slots before)
        self.slot_of: dict[int, int] = {}  # engine block hash -> its slot id
        self.engine_of: dict[int, int] = {}  # slot id -> the engine block it holds
        self.keys: dict[int, list[int]] = {}  # slot id -> its index blocks (what prompts' hashes reach)
        self.unit_of: dict[int, int] = {}  # index block -> the slot id holding it
        self.empty: set[int] = set()  # slot ids in the order that hold nothing
        self.fresh = capacity  # empty slots ahead of the order: the host's start (engine blocks)
        self.up: set[int] = set()  # engine blocks in the host just stored on the GPU: being loaded
        self.open: int | None = None  # the last offload's slot: the next runs of its index blocks join it
        self.ids = 0
        # the engine block the last offload's front slot held, and whether a front removal followed:
        # if that block turns out to be loaded next, the engine had claimed it (out of the queue) and
        # took the slot behind it
        self.took: list | None = None

    def stored(self, engine_hashes: list[int], hashes: list[int]) -> None:
        """Stored in the host: an engine block (its hash; its index blocks' later runs come without)."""
        if not engine_hashes:
            if self.open is not None:
                self._index(self.open, hashes)
            return
        for eh in engine_hashes:
            self.up.discard(eh)
            if eh in self.slot_of:  # stored again while there: no offload
                continue
            self.took = None
            self._take_front()
            u = self._slot()
            self.slot_of[eh], self.engine_of[u], self.keys[u] = u, eh, []
            self._index(u, hashes if len(engine_hashes) == 1 else [])
            self.open = u

    def raised(self, engine_hashes: list[int]) -> None:
        """Stored on the GPU: those in the host are being loaded (their removal from it follows)."""
        for eh in engine_hashes:
            if eh in self.slot_of:
                self.up.add(eh)
            elif self.took is not None and self.took[0] == eh:
                # the last offload took the slot behind this block (claimed for this load): an empty
                # one where no removal followed (a cached one's removal already went to the tail)
                if not self.took[1]:
                    self._take_front()
                    self.empty.add(self._slot())
                self.took = None

    def removed(self, engine_hashes: list[int]) -> None:
        """Gone from the host: loaded, evicted, or taken by an offload no event shows."""
        self.open = None
        for eh in engine_hashes:
            u = self.slot_of.get(eh)
            if u is None:  # freed by the offload that took its slot (or never seen)
                continue
            loaded = eh in self.up
            self._forget(u)
            if loaded or (not self.fresh and self.order.head(1) == [u]):
                if not loaded and self.took is not None:
                    self.took[1] = True
                self.order.discard([u])
                self.empty.add(self._slot())
            else:
                self.empty.add(u)

    def _index(self, u: int, hashes: list[int]) -> None:
        self.keys[u].extend(hashes)
        self.unit_of.update(dict.fromkeys(hashes, u))

    def _forget(self, u: int) -> None:
        """Slot `u`'s engine block is gone from the host."""
        eh = self.engine_of.pop(u)
        del self.slot_of[eh]
        self.up.discard(eh)
        for h in self.keys.pop(u):
            if self.unit_of.get(h) == u:
                del self.unit_of[h]

    def _slot(self) -> int:
        self.ids += 1
        self.order.append([self.ids])
        return self.ids

    def _take_front(self) -> None:
        if self.fresh:
            self.fresh -= 1
            return
        head = self.order.head(1)
        if not head:
            return
        u = head[0]
        self.order.discard(head)
        if u in self.empty:
            self.empty.discard(u)
        else:  # its engine block is freed: its removal follows the offload's store
            self.took = [self.engine_of[u], False]
            self._forget(u)

    def reach(self, hashes, loads: list[int]) -> int | None:
        """Where the engine's walk over a prompt ends when it loads the host blocks at positions
        `loads` (prompt order), one engine block at a time, each load taking the host's front slot
        (the blocks it already loaded are out of the queue); None: it gets through."""
        fresh = self.fresh
        front = self.order.head(2 * len(loads) + 1)
        unit_of, keys, empty = self.unit_of, self.keys, self.empty
        claimed: set[int] = set()
        freed: set[int] = set()
        fi = 0
        for i in loads:
            h = hashes[i]
            if h in freed:
                return i
            u = unit_of.get(h, -1 - i)
            if u in claimed:
                continue
            claimed.add(u)
            if fresh:
                fresh -= 1
                continue
            while fi < len(front):
                x = front[fi]
                fi += 1
                if x not in claimed:
                    if x not in empty:
                        freed.update(keys.get(x, ()))
                    break
        return None


def _drain(it) -> None:
    deque(it, maxlen=0)
