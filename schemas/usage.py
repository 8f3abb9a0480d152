"""Engine usage reports (topic `kvidx.usage.v1`, key = model): what an engine really reused for a
request, as its response said (vLLM: `usage.prompt_tokens_details.cached_tokens`), forwarded by the
router through `POST /v1/usage`. The audit (kvidx/ops/audit.py) joins them with the routing decisions
(schemas/routes.py) by request id. Counts only, never tokens. Same evolution rule as schemas/events.py.
"""

from __future__ import annotations

import msgspec

USAGE_VERSION = 1


class UsageReport(msgspec.Struct, array_like=True):
    v: int
    request_id: str
    model: str
    replica: str
    dp_rank: int
    prompt_tokens: int
    cached_tokens: int  # what the engine reported it reused from its prefix cache
    ts: float  # when the report was received (s since the epoch)
    engine: str = ""  # e.g. "vllm-0.32"
    # the slowest tier of the prefix the router was credited for, as the lookup answer said ("" unknown)
    tier: str = ""
    router: str = ""


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(UsageReport)


def encode_usage(u: UsageReport) -> bytes:
    return _enc.encode(u)


def decode_usage(data: bytes) -> UsageReport:
    u = _dec.decode(data)
    if u.v != USAGE_VERSION:
        raise ValueError(f"unsupported usage version {u.v} (this reader knows {USAGE_VERSION})")
    return u
