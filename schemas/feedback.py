"""What the feedback job publishes on the compacted `kvidx.feedback.v1` (kvidx/ops/feedback.py) and
service instances follow (index_service/feedback.py): a credit factor per (model, replica, DP rank) and
per prefix on it."""

from __future__ import annotations

import msgspec

FEEDBACK_TOPIC = "kvidx.feedback.v1"
FEEDBACK_VERSION = 1


class CreditFactor(msgspec.Struct, array_like=True):
    v: int
    model: str
    replica: str
    dp_rank: int
    factor: float  # multiply the replica's resumable tokens by this (1.0: no cap)
    credited_tokens: int  # the evidence: window sums
    reused_tokens: int
    requests: int
    window_s: float
    ts: float
    expires_at: float
    prefix: int = 0  # the first canonical block of the prompts it covers; 0: the whole replica

    @property
    def key(self) -> tuple[str, str, int, int]:
        return (self.model, self.replica, self.dp_rank, self.prefix)


def factor_key(model: str, replica: str, dp_rank: int, prefix: int = 0) -> bytes:
    return msgspec.msgpack.encode([model, replica, dp_rank, prefix])
