"""Pending credit: a routed prompt counts as cached on its replica before the engine says so.

A router that sends a prompt to a replica knows the replica will hold its blocks a moment later, but
the engine's events arrive only after its step (and after the response: ENGINES.md obs. 13). Until
the events confirm a block, or a TTL passes, the block is credited to that replica for every router.
Sliding-window groups keep only the window before the prefill's end (vLLM allocates no block the
window has passed), so a route credits them apart: its prompt's last window.
Pure: no clocks (callers pass `now`), no I/O.
"""

from __future__ import annotations

from collections import deque

from kvidx.core.maskmap import native_module


class PyCredits:
    """Block hash -> the slots it is pending on, with a count of the live routes crediting each: the
    pure-Python reference of kvidx_native.Credits (native/src/credits.rs: the same methods, the masks
    a mask map; the compiled fold confirms a store's blocks there without a Python frame)."""

    __slots__ = ("masks", "refs")

    def __init__(self) -> None:
        self.masks: dict[int, int] = {}
        self.refs: dict[tuple[int, int], int] = {}  # (hash, slot) -> live routes crediting it

    def add(self, slot: int, hashes) -> None:
        bit = 1 << slot
        refs, masks = self.refs, self.masks
        for h in hashes:
            key = (h, slot)
            refs[key] = refs.get(key, 0) + 1
            masks[h] = masks.get(h, 0) | bit

    def confirm(self, slot: int, hashes: list[int]) -> None:
        refs = self.refs
        for h in hashes:
            r = refs.get((h, slot))
            if r:
                self._drop(h, slot, r)

    def release(self, slot: int, hashes) -> None:
        """One route crediting each of `hashes` on `slot` expired."""
        for h in hashes:
            self._drop(h, slot, 1)

    def _drop(self, h: int, slot: int, n: int) -> None:
        key = (h, slot)
        r = self.refs.get(key, 0) - n
        if r > 0:
            self.refs[key] = r
            return
        if key in self.refs:
            del self.refs[key]
            m = self.masks.get(h, 0) & ~(1 << slot)
            if m:
                self.masks[h] = m
            else:
                self.masks.pop(h, None)


_native = native_module()
# the credits class: the compiled one where built; property tests pin the pure-Python reference
Credits: type = getattr(_native, "Credits", None) or PyCredits


class PendingCredits:
    # fixed: the compiled fold reads the first three at their slots' offsets (native/src/fold.rs `P_NAMES`)
    __slots__ = ("masks", "window_masks", "_blocks", "_window", "_queue", "inflight")

    def __init__(self, credits: type | None = None) -> None:
        self._blocks = (credits or Credits)()
        self._window = (credits or Credits)()
        self.masks = self._blocks.masks  # block hash -> slots it is pending on
        self.window_masks = self._window.masks  # the same for sliding-window groups: last windows only
        # by expiry: (expires, slot, hashes, window hashes, prefill tokens)
        self._queue: deque[tuple[float, int, tuple[int, ...], tuple[int, ...], int]] = deque()
        self.inflight: dict[int, int] = {}  # slot -> prefill tokens of its routes still pending

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, slot: int, hashes: list[int] | tuple[int, ...], expires: float, prefill_tokens: int = 0,
            window: list[int] | tuple[int, ...] = ()) -> None:
        self._blocks.add(slot, hashes)
        self._window.add(slot, window)
        item = (expires, slot, tuple(hashes), tuple(window), prefill_tokens)
        if self._queue and expires < self._queue[-1][0]:  # keep the queue ordered by expiry
            self._queue = deque(sorted([*self._queue, item]))
        else:
            self._queue.append(item)
        self.inflight[slot] = self.inflight.get(slot, 0) + prefill_tokens

    def expire(self, now: float) -> int:
        n = 0
        q = self._queue
        while q and q[0][0] <= now:
            _, slot, hashes, window, prefill = q.popleft()
            self.inflight[slot] = self.inflight.get(slot, 0) - prefill
            self._blocks.release(slot, hashes)
            self._window.release(slot, window)
            n += 1
        return n

    def confirm(self, slot: int, hashes: list[int], window: bool = False) -> None:
        """The engine reported these blocks on `slot` (in a sliding-window group with `window`): they
        are no longer pending there (an eviction after this must not be hidden by the route's credit)."""
        (self._window if window else self._blocks).confirm(slot, hashes)
