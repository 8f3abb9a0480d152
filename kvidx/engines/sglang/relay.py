"""The SGLang relay's logic: frames in, versioned event batches out (the sequenced relay's sequence,
gap, restart and dead-letter handling, with SGLang's decoder and mirror).

SGLang's publisher is the same ZMQ PUB (3 frames: topic, 8-byte big-endian seq from 0, msgpack
payload) + ROUTER replay design as vLLM's (sglang/srt/disaggregation/kv_events.py
ZmqEventPublisher, every checked version). With DP attention each rank publishes on port + rank
(`offset_endpoint_port`) and stamps `attn_dp_rank` on its batches.

The relay is pinned to one SGLang version at start-up (`make_relay(..., engine_version=...)`,
`kvidx relay --engine sglang --engine-version X`): an unknown version is a clear error
(UnsupportedEngineVersion), not a silent misreading; a payload in the other encoding than the pinned
version's is a dead letter with reason "version_mismatch".
"""

from __future__ import annotations

from kvidx.engines.contract import Frame, RelayOutput, SequencedRelay
from kvidx.engines.sglang.mirror import SglangMirror
from kvidx.engines.sglang.wire import (
    DEFAULT_VERSION,
    PY_EMPTY_TUPLE_HASH,
    SUPPORTED_VERSIONS,
    UnsupportedEngineVersion,
    check_version,
    decode_payload,
)

__all__ = ["SglangPublisherRelay", "make_relay", "SUPPORTED_VERSIONS", "DEFAULT_VERSION",
           "UnsupportedEngineVersion"]


class SglangPublisherRelay(SequencedRelay):
    engine = "sglang"

    def __init__(self, model: str, replica: str, index_block_size: int, dp_rank: int | None = None,
                 engine_version: str = DEFAULT_VERSION, epoch: int | None = None, router_keys: bool = False):
        """`router_keys`: also publish the engine's page hashes as SGLang keys (SglangMirror)."""
        self.encoding, self.hash_kind = check_version(engine_version)
        self.engine_version = engine_version
        roots = (PY_EMPTY_TUPLE_HASH,) if self.hash_kind == "py_tuple_hash" else ()
        self.mirror = SglangMirror(index_block_size, root_parents=roots, router_keys=router_keys)
        super().__init__(model, replica, index_block_size, dp_rank, epoch)
        self.counters["version_mismatch"] = 0

    def decode(self, payload: bytes):
        return decode_payload(payload, self.encoding)

    def on_frame(self, frame: Frame, check_gap: bool = True) -> RelayOutput:
        out = super().on_frame(frame, check_gap)
        for dl in out.dead:
            if dl.reason == "malformed_payload" and dl.detail.startswith("version_mismatch"):
                dl.reason = "version_mismatch"
                self.counters["version_mismatch"] += 1
        return out


def make_relay(model: str, replica: str, index_block_size: int, dp_rank: int | None = None,
               engine_version: str = DEFAULT_VERSION, epoch: int | None = None,
               router_keys: bool = False) -> SglangPublisherRelay:
    """What `kvidx relay --engine sglang` builds: raises UnsupportedEngineVersion (a ValueError whose
    message lists the checked versions) for a version this adapter was not checked against."""
    return SglangPublisherRelay(model, replica, index_block_size, dp_rank, engine_version, epoch, router_keys)
