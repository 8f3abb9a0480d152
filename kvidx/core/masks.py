"""Slot masks: one int object per single-slot mask, shared by every block one replica alone holds
(most blocks): a mask of a slot >= 8 is otherwise a new 28-32 byte int per block."""

from __future__ import annotations

_BITS = [1 << i for i in range(4096)]


def slot_bit(slot: int) -> int:
    return _BITS[slot] if slot < len(_BITS) else 1 << slot


def shared_mask(mask: int) -> int:
    """The shared object for a single-slot mask; other masks as they are."""
    if mask & (mask - 1):
        return mask
    return slot_bit(mask.bit_length() - 1)


def slots_of(mask: int):
    """The slots (set bits) of a mask, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def or_masks(maps, hashes: list[int]) -> list[int]:
    """Per hash: the OR of its masks in `maps` (0s without maps)."""
    if not maps:
        return [0] * len(hashes)
    held = maps[0].masks(hashes)
    for m in maps[1:]:
        held = [a | b for a, b in zip(held, m.masks(hashes), strict=True)]
    return held


def run_end(masks: list[int], bit: int, pos: int, stop: int | None = None) -> int:
    """The first position from `pos` (before `stop`, else the end) whose mask lacks `bit`: where a
    run that continues in these masks stops."""
    stop = len(masks) if stop is None else stop
    while pos < stop and masks[pos] & bit:
        pos += 1
    return pos
