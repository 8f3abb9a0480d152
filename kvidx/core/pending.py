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

# pending credit's per-block bookkeeping compiled where built (native/src/credits.rs; a route adds and a
# store confirms every block of the prompt: the Python loops were most of the production fold's time)
_native = native_module() if hasattr(native_module(), "credits_add") else None


class _Credits:
    """Block hash -> the slots it is pending on, with a count of the live routes crediting each."""

    __slots__ = ("masks", "refs")

    def __init__(self) -> None:
        self.masks: dict[int, int] = {}
        self.refs: dict[tuple[int, int], int] = {}  # (hash, slot) -> live routes crediting it

    def add(self, slot: int, hashes) -> None:
        if _native is not None:
            _native.credits_add(self.refs, self.masks, slot, hashes)
        else:
            self.add_reference(slot, hashes)

    def confirm(self, slot: int, hashes: list[int]) -> None:
        if _native is not None:
            _native.credits_confirm(self.refs, self.masks, slot, hashes)
        else:
            self.confirm_reference(slot, hashes)

    def release(self, slot: int, hashes) -> None:
        """One route crediting each of `hashes` on `slot` expired."""
        if _native is not None:
            _native.credits_release(self.refs, self.masks, slot, hashes)
        else:
            self.release_reference(slot, hashes)

    # the pure-Python reference of the compiled add, confirm and release (native/src/credits.rs)
    def release_reference(self, slot: int, hashes) -> None:
        for h in hashes:
            self.drop(h, slot, 1)

    def add_reference(self, slot: int, hashes) -> None:
        bit = 1 << slot
        refs, masks = self.refs, self.masks
        for h in hashes:
            key = (h, slot)
            refs[key] = refs.get(key, 0) + 1
            masks[h] = masks.get(h, 0) | bit

    def confirm_reference(self, slot: int, hashes: list[int]) -> None:
        refs = self.refs
        for h in hashes:
            r = refs.get((h, slot))
            if r:
                self.drop(h, slot, r)

    def drop(self, h: int, slot: int, n: int) -> None:
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


class PendingCredits:
    def __init__(self) -> None:
        self._blocks = _Credits()
        self._window = _Credits()
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
