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
