"""vLLM's relay logic: the sequenced relay with vLLM's decoder and mirror (one publisher = one replica
or one DP rank; vllm/distributed/kv_events.py ZmqEventPublisher: 3-frame PUB + ROUTER replay)."""

from __future__ import annotations

from kvidx.engines.contract import SequencedRelay
from kvidx.engines.vllm.mirror import VllmMirror
from kvidx.engines.vllm.wire import check_engine_version, decode_payload


class VllmPublisherRelay(SequencedRelay):
    engine = "vllm"

    def __init__(self, model: str, replica: str, index_block_size: int, dp_rank: int | None = None,
                 epoch: int | None = None, group_kinds: dict[int, tuple[str, int | None]] | None = None,
                 engine_version: str | None = None, allow_unchecked_version: bool = False, **mirror_options):
        """`engine_version`: the engine's vLLM release, checked against the pinned ones at start-up
        (kvidx.engines.vllm.wire.check_engine_version raises UnsupportedEngineVersion; with
        `allow_unchecked_version` an unpinned release is read as the nearest pinned one);
        `mirror_options` go to VllmMirror (cpu_chunk_blocks, lmcache)."""
        spec = (check_engine_version(engine_version, allow_unchecked_version)
                if engine_version is not None else None)
        self.engine_version = engine_version
        self.mirror = VllmMirror(index_block_size, group_kinds=group_kinds,
                                 lookahead=spec is None or spec.lookahead, **mirror_options)
        super().__init__(model, replica, index_block_size, dp_rank, epoch)
        self.controller = None  # LMCache's admit/evict feed, once a message came

    def decode(self, payload: bytes):
        return decode_payload(payload)

    def on_controller(self, payload: bytes, recv_ns: int):
        """LMCache's controller admit/evict messages: the same mirror, the same (epoch, seq) order."""
        if self.controller is None:
            from kvidx.engines.lmcache.controller import LmcacheControllerRelay

            self.controller = LmcacheControllerRelay(self)
        return self.controller.on_message(payload, recv_ns)
