"""Hints (topic `kvidx.hints.v1`, key = model): what the index advises an engine to do for a routed
request, for any consumer (an engine-side agent, a cache controller, the audit). Published by the
service for each routing decision (POST /v1/routes) on a model whose hints are on; hashes and counts
only, never tokens. Same evolution rule as schemas/events.py: fields are only added, with defaults;
a change in meaning is a new version and a new topic.

A prefetch hint names the prompt's canonical block hashes (the model's index block size) and, per run
of the prompt held below GPU memory, the tier and the token range [start, end) to load, with the load
time the wait can hide (`benefit_s`) by `deadline_s` seconds after `ts`. Eviction advice (kind
"eviction", `action` demote or drop) names a silent session's own blocks on `replica`; a placement
(kind "placement") a recurring session's blocks to copy from `replica` to `target` (`load_s`: the copy,
`benefit_s`: the wait its next prompt avoids); both come from kvidx.core.sessions, fed with the
routing decisions the instance records."""

from __future__ import annotations

import msgspec

from schemas.events import BlockHash

HINTS_VERSION = 1


class PrefetchRunRecord(msgspec.Struct, array_like=True):
    tier: str
    start: int
    end: int
    load_s: float


class HintRecord(msgspec.Struct, array_like=True):
    v: int
    kind: str  # "prefetch", "eviction" or "placement"
    request_id: str  # the routing decision's ("" for eviction advice: it follows no one decision)
    model: str
    replica: str
    dp_rank: int
    block_hashes: list[BlockHash]  # the prompt's canonical block hashes
    block_size: int  # the index block size they were made with
    runs: list[PrefetchRunRecord]
    tokens: int
    load_s: float  # prefetch: the load; placement: the copy; eviction advice: its expected cost
    deadline_s: float
    benefit_s: float  # the seconds of load or prefill it is expected to save
    bytes: int
    ts: float  # when the hint was issued (s since the epoch)
    # eviction advice: keep, demote or drop the named blocks (the session's own) on `replica`
    action: str = ""
    # placement: copy the named blocks (the session's prompt) from `replica` to `target`
    target: str = ""


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(HintRecord)


def encode_hint(h: HintRecord) -> bytes:
    return _enc.encode(h)


def decode_hint(data: bytes) -> HintRecord:
    h = _dec.decode(data)
    if h.v != HINTS_VERSION:
        raise ValueError(f"unsupported hints version {h.v} (this reader knows {HINTS_VERSION})")
    return h
