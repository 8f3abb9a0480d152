"""Control messages to relays (topic `kvidx.control.v1`): ask them to replay their mirrors, or to move
their replicas to the replica groups of a new group count (re-grouping a live model)."""

from __future__ import annotations

import msgspec

CONTROL_VERSION = 1


class ResyncRequest(msgspec.Struct):
    v: int
    model: str  # "*" for every model
    replica: str = "*"  # "*" for every replica of the model
    reason: str = ""
    ts: float = 0.0
    # > 0: re-group: the model now has this many replica groups (kvidx.core.groups); a relay whose
    # replica changes group clears it in the old group and replays its mirror into the new one.
    # Relays before this field only replay their mirrors (into the group they publish to)
    replica_groups: int = 0

    def matches(self, model: str, replica: str) -> bool:
        return self.model in ("*", model) and self.replica in ("*", replica)


encode_control = msgspec.json.Encoder().encode
_dec = msgspec.json.Decoder(ResyncRequest)


def decode_control(data: bytes) -> ResyncRequest:
    r = _dec.decode(data)
    if r.v != CONTROL_VERSION:
        raise ValueError(f"unsupported control version {r.v}")
    return r
