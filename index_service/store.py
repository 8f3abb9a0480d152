"""The shards a service instance answers from, fed by a follower (Kafka) or by in-process relays."""

from __future__ import annotations

import threading
import time

from kvidx.core.shard import ModelShard
from schemas.events import EventBatch


class ShardStore:
    """model -> ModelShard. Writers hold the lock while folding a batch; lookups read without it
    (a dict read racing a fold sees the block either before or after: both are valid views)."""

    def __init__(self, index_block_size: int = 16, block_sizes: dict[str, int] | None = None,
                 unreported_eviction_kinds: tuple[str, ...] = ()):
        self.default_block_size = index_block_size
        self.unreported_eviction_kinds = unreported_eviction_kinds
        self.block_sizes = block_sizes or {}
        self.shards: dict[str, ModelShard] = {}
        self.lock = threading.Lock()
        self.batches_applied = 0
        self.ready = False  # set once the shards were rebuilt (snapshots + catch-up)

    def block_size(self, model: str) -> int:
        return self.block_sizes.get(model, self.default_block_size)

    def shard(self, model: str) -> ModelShard:
        s = self.shards.get(model)
        if s is None:
            s = self.shards[model] = ModelShard(model, self.block_size(model), self.unreported_eviction_kinds)
        return s

    def apply(self, batch: EventBatch, now: float | None = None) -> bool:
        with self.lock:
            self.batches_applied += 1
            return self.shard(batch.model).apply(batch, time.time() if now is None else now)

    def put(self, shard: ModelShard) -> None:
        if self.unreported_eviction_kinds:
            shard.unreported_eviction_kinds = frozenset(self.unreported_eviction_kinds)
        with self.lock:
            self.shards[shard.model] = shard
