"""The Mooncake Store relay's logic: one master's frames in, the pool's event batches out (the
sequenced relay with Mooncake's decoder and mirror), plus a key feed from the attached engines.

The master's stream (wire.py): ZMQ PUB, 3 frames (empty topic, 8-byte big-endian seq, msgpack), no
replay endpoint, so every gap is unfilled: the pool's view is cleared (ReplicaCleared "gap_unfilled"),
the contract's rule (a warm pool seen as cold costs a recompute; a cold one seen as warm, a slow
request; Dynamo's Mooncake indexer also clears on a gap: ai-dynamo/dynamo#11239 shared_cache.rs).
Three adjustments to kvidx.engines.contract.SequencedRelay:
- the master numbers batches from 1 (kv_event_publisher.h l. 82): the relay counts from 0 (seq - 1),
  so the contract's restart rule (seq 0 after a later one) sees a master restart (its metadata is
  gone: the pool is cleared);
- kvidx/engines/sniff.py tells the master's stream by RFC #1527's `event_type` (vLLM's and SGLang's
  never carry it), before its legacy `block_hashes` (int64, negative above 2^63) could read as
  SGLang's signed page hashes;
- frames with src "keyfeed" are not the master's: they are an attached engine's own stream (vLLM's,
  pinned by `key_feed_version`), decoded by a vLLM relay of their own (one per endpoint, never
  published: that engine's relay publishes it) only to learn what its block hashes name
  (engine hash, folded to u64 as vLLM does = the master's seq hash -> canonical index blocks).
  Without a key feed, the master's tokenless objects cannot be placed (mirror.py). Recordings mark
  those frames src "keyfeed"; a live relay needs a source that delivers them so.

The relay is pinned to one publisher version at start-up (`engine_version`): an unknown version is a
clear error (UnsupportedEngineVersion), never a silent misreading.
"""

from __future__ import annotations

import dataclasses

from kvidx.engines.contract import DeadLetter, Frame, RelayOutput, SequencedRelay
from kvidx.engines.mooncake.mirror import MooncakeMirror
from kvidx.engines.mooncake.wire import DEFAULT_VERSION, check_version, decode_payload
from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.engines.vllm.wire import BlockStored, check_engine_version, fold_engine_hash

KEY_FEED_SRC = "keyfeed"
KEY_FEED_VERSION = "0.32.0"


class _KeyFeedRelay(VllmPublisherRelay):
    """An attached vLLM engine's relay, kept only for its engine-hash memo: remembers the last batch it
    decoded so the pool relay can read which hashes it named."""

    last = None

    def decode(self, payload: bytes):
        self.last = super().decode(payload)
        return self.last


class MooncakeStoreRelay(SequencedRelay):
    engine = "mooncake"

    def __init__(self, model: str, replica: str, index_block_size: int, dp_rank: int | None = None,
                 engine_version: str = DEFAULT_VERSION, epoch: int | None = None, *,
                 tenant_id: str = "default", tiers: dict[str, str] | None = None,
                 model_names: tuple[str, ...] = (), engine_block_size: int | None = None,
                 key_feed_version: str = KEY_FEED_VERSION, park_limit: int = 1 << 16):
        """`replica`: the pool's name ([pools.NAME]); `tiers` override the version's medium -> tier
        map; `model_names`: other names the stream may give this model."""
        removal, default_tiers = check_version(engine_version)
        check_engine_version(key_feed_version)
        self.engine_version = engine_version
        self.key_feed_version = key_feed_version
        self.index_block_size = index_block_size
        self.mirror = MooncakeMirror(index_block_size, removal, {**default_tiers, **(tiers or {})}, tenant_id,
                                     (model, *model_names), engine_block_size, park_limit=park_limit)
        super().__init__(model, replica, index_block_size, dp_rank, epoch)
        self.feeds: dict[str, _KeyFeedRelay] = {}
        self.counters["key_feed_frames"] = 0

    def decode(self, payload: bytes):
        return decode_payload(payload)

    def on_frame(self, frame: Frame, check_gap: bool = True) -> RelayOutput:
        if frame.src == KEY_FEED_SRC:
            return self.key_feed(frame)
        shifted = dataclasses.replace(frame, seq=frame.seq - 1)
        out = super().on_frame(shifted, check_gap)
        for dl in out.dead:
            dl.frame = frame
        for dl in out.set_aside:
            dl.frame = dataclasses.replace(dl.frame, seq=frame.seq)
        if out.gap is not None:
            out.gap = (out.gap[0] + 1, out.gap[1] + 1)  # in the master's numbering
        return out

    def key_feed(self, frame: Frame) -> RelayOutput:
        """An attached engine's frame: learn what its stored block hashes name. Nothing is published
        (that engine's own relay does); its bad frames are dead letters "key_feed_<reason>"."""
        self.counters["key_feed_frames"] += 1
        feed = self.feeds.get(frame.endpoint)
        if feed is None:
            feed = _KeyFeedRelay(self.model, frame.endpoint, self.index_block_size, epoch=0,
                                 engine_version=self.key_feed_version)
            self.feeds[frame.endpoint] = feed
        pub = dataclasses.replace(frame, src="pub")  # its own restarts count as restarts
        feed.last = None
        out = feed.on_frame(pub)
        if out.gap is not None:  # engine hashes are content hashes: a gap loses keys, nothing else
            out = feed.gap_unfilled(pub)
        dead = [DeadLetter(f"key_feed_{d.reason}", d.detail, frame) for d in out.dead]
        if feed.last is not None and not dead:
            memo = feed.mirror.memo
            for ev in feed.last.events:
                if isinstance(ev, BlockStored) and ev.token_ids:
                    for eh in ev.block_hashes:
                        known = memo.get(eh)
                        if known is not None:
                            self.mirror.learn(fold_engine_hash(eh), known[0], known[1])
        return RelayOutput(dead=dead)
