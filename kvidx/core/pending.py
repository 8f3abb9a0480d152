"""Pending credit: a routed prompt counts as cached on its replica before the engine says so.

A router that sends a prompt to a replica knows the replica will hold its blocks a moment later, but
the engine's events arrive only after its step (and after the response: ENGINES.md obs. 13). Until
the events confirm a block, or a TTL passes, the block is credited to that replica for every router.
Pure: no clocks (callers pass `now`), no I/O.
"""

from __future__ import annotations

from collections import deque


class PendingCredits:
    def __init__(self) -> None:
        self.masks: dict[int, int] = {}  # block hash -> slots it is pending on
        self._refs: dict[tuple[int, int], int] = {}  # (hash, slot) -> live routes crediting it
        self._queue: deque[tuple[float, int, tuple[int, ...], int]] = deque()  # by expiry
        self.inflight: dict[int, int] = {}  # slot -> prefill tokens of its routes still pending

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, slot: int, hashes: list[int] | tuple[int, ...], expires: float, prefill_tokens: int = 0
            ) -> None:
        bit = 1 << slot
        refs, masks = self._refs, self.masks
        for h in hashes:
            key = (h, slot)
            refs[key] = refs.get(key, 0) + 1
            masks[h] = masks.get(h, 0) | bit
        if self._queue and expires < self._queue[-1][0]:  # keep the queue ordered by expiry
            items = sorted([*self._queue, (expires, slot, tuple(hashes), prefill_tokens)])
            self._queue = deque(items)
        else:
            self._queue.append((expires, slot, tuple(hashes), prefill_tokens))
        self.inflight[slot] = self.inflight.get(slot, 0) + prefill_tokens

    def expire(self, now: float) -> int:
        n = 0
        q = self._queue
        while q and q[0][0] <= now:
            _, slot, hashes, prefill = q.popleft()
            self.inflight[slot] = self.inflight.get(slot, 0) - prefill
            for h in hashes:
                self._drop(h, slot, 1)
            n += 1
        return n

    def confirm(self, slot: int, hashes: list[int]) -> None:
        """The engine reported these blocks on `slot`: they are no longer pending there (an eviction
        after this must not be hidden by the route's credit)."""
        refs = self._refs
        for h in hashes:
            r = refs.get((h, slot))
            if r:
                self._drop(h, slot, r)

    def _drop(self, h: int, slot: int, n: int) -> None:
        key = (h, slot)
        r = self._refs.get(key, 0) - n
        if r > 0:
            self._refs[key] = r
            return
        if key in self._refs:
            del self._refs[key]
            m = self.masks.get(h, 0) & ~(1 << slot)
            if m:
                self.masks[h] = m
            else:
                self.masks.pop(h, None)
