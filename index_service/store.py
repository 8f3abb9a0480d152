"""The shards a service instance answers from, fed by a follower (Kafka) or by in-process relays,
plus the routing decisions it applies as pending credit."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from kvidx.config import Config, ShardSettings
from kvidx.core.fetch import EngineHashes
from kvidx.core.fold import Undecodable, fold_message
from kvidx.core.shard import ModelShard
from schemas.answers import PrefetchHint
from schemas.events import EventBatch
from schemas.hints import HintRecord
from schemas.routes import RouteDecision

_SEEN_ROUTES = 200_000  # request ids remembered to apply each decision once (local + Kafka echo)


class ShardStore:
    """model -> ModelShard. Writers hold the lock while folding a batch; lookups read without it
    (a dict read racing a fold sees the block either before or after: both are valid views).

    A model split in replica groups (kvidx.core.groups) is one shard here all the same: the groups'
    replicas are disjoint, so their events fold into one shard in any interleaving, and their
    snapshots are merged into it (ModelShard.absorb). `groups`: the replica groups this instance holds
    (None: all); batches of the others are skipped."""

    def __init__(self, index_block_size: int | None = None, block_sizes: dict[str, int] | None = None,
                 unreported_eviction_kinds: tuple[str, ...] | None = None, config: Config | None = None,
                 groups: frozenset[int] | None = None):
        self.settings = ShardSettings(config or Config(), index_block_size, block_sizes or {},
                                      unreported_eviction_kinds)
        self.groups = groups
        self.skipped_batches = 0  # batches of replica groups this instance does not hold
        self.config = self.settings.config
        self.shards: dict[str, ModelShard] = {}
        self.lock = threading.Lock()
        self.batches_applied = 0
        self.routes_applied = 0
        self.consumer_lag = 0  # event batches behind the topic's end (kept by the Kafka follower)
        self.events_lost = 0  # event batches retention deleted before a snapshot folded them
        self.ready = False  # set once the shards were rebuilt (snapshots + catch-up)
        self.not_ready_reason: str | None = None  # what /healthz says while not ready
        self.publish_route: Callable[[RouteDecision], None] | None = None  # set when routes go to Kafka
        self.publish_hint: Callable[[HintRecord], None] | None = None  # set when hints go to Kafka
        # set where a model's hints are acted on (an LMCache controller): (model, replica, hint, token ids)
        self.act_on_hint: Callable[[str, str, PrefetchHint, list[int]], None] | None = None
        self._seen_routes: OrderedDict[str, None] = OrderedDict()
        # per model: its engine hashes for fetch hints (kvidx.core.fetch), None where hints.fetch is off;
        # the fold looks only where some model has them on
        self._engine_hashes: dict[str, EngineHashes | None] = {}
        self._fetch_hints = any(m.hints.fetch for m in (self.config.default, *self.config.models.values()))
        # called under the lock after anything that may change a shard's maps or slots: the lookup
        # front's sync (index_service.lookup_front)
        self.on_change: Callable[[], None] | None = None

    def block_size(self, model: str) -> int:
        return self.settings.block_size(model)

    def set_registered_pool(self, pool: str, readers: list[str] | None) -> None:
        """A pool registered at run time (a Mooncake Store master through the conductor's API) and the
        replicas reading it (none once it is unregistered: it stays a pool, never an engine), or None to
        forget the name: every shard credits its blocks to them."""
        with self.lock:
            if readers is None:
                self.settings.registered_pools.pop(pool, None)
            else:
                self.settings.registered_pools[pool] = list(readers)
            for shard in self.shards.values():
                self.settings.configure(shard)
            self._changed()

    def shard(self, model: str) -> ModelShard:
        s = self.shards.get(model)
        if s is None:
            s = self.shards[model] = self.settings.new_shard(model)
        return s

    def holds(self, group: int) -> bool:
        return self.groups is None or group in self.groups

    def holds_replica(self, model: str, replica: str) -> bool:
        """This instance holds the replica group `replica` is in (always, when it holds every group)."""
        return self.groups is None or self.config.replica_group(model, replica) in self.groups

    def missing_groups(self, model: str) -> list[int]:
        """The replica groups of `model` (from the configuration) this instance does not hold."""
        if self.groups is None:
            return []
        return [g for g in range(self.config.model(model).replica_groups) if g not in self.groups]

    def holds_part_of(self, model: str) -> bool:
        """`model` is split in replica groups and some are held by other instances."""
        return bool(self.missing_groups(model))

    def engine_hashes(self, model: str) -> EngineHashes | None:
        """The model's engine hashes for fetch hints, kept from its batches; None where hints.fetch is off."""
        try:
            return self._engine_hashes[model]
        except KeyError:
            hints = self.config.model(model).hints
            t = self._engine_hashes[model] = EngineHashes(hints.fetch_hashes_max) if hints.fetch else None
            return t

    def _shard_of(self, batch: EventBatch) -> ModelShard | None:
        if self.groups is not None and batch.replica_group not in self.groups:
            self.skipped_batches += 1
            return None
        if self._fetch_hints and (table := self.engine_hashes(batch.model)) is not None:
            table.observe(batch)
        return self.shard(batch.model)

    def apply(self, batch: EventBatch, now: float | None = None) -> bool:
        with self.lock:
            shard = self._shard_of(batch)
            if shard is None:
                return False
            self.batches_applied += 1
            try:
                return shard.apply(batch, time.time() if now is None else now)
            finally:
                self._changed()

    def fold(self, raw: bytes, partition: int = -1, offset: int = -1, now: float | None = None) -> bool:
        """An events-topic message folded in (kvidx.core.fold); False if it was undecodable."""
        with self.lock:
            try:
                fold_message(self._shard_of, raw, time.time() if now is None else now, partition, offset)
            except Undecodable:
                return False
            finally:
                self._changed()
            self.batches_applied += 1
            return True

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def put(self, shard: ModelShard) -> None:
        self.settings.configure(shard)
        with self.lock:
            self.shards[shard.model] = shard
            self._changed()

    def put_group(self, shard: ModelShard) -> bool:
        """A replica group's shard (a snapshot): merged into its model's (the first one becomes it);
        False if this instance does not hold that group."""
        if not self.holds(shard.replica_group):
            return False
        with self.lock:
            mine = self.shards.get(shard.model)
            if mine is None:
                self.settings.configure(shard)
                self.shards[shard.model] = shard
            else:
                mine.absorb(shard)
            self._changed()
        return True

    def apply_route(self, d: RouteDecision) -> bool:
        """Credit a routed prompt to its replica until confirmed or expired; False if this decision
        was applied already (every instance sees its own decisions again through Kafka)."""
        with self.lock:
            if d.request_id in self._seen_routes:
                return False
            self._seen_routes[d.request_id] = None
            if len(self._seen_routes) > _SEEN_ROUTES:
                self._seen_routes.popitem(last=False)
            if not self.holds_replica(d.model, d.replica):
                return True  # its replica's group is held elsewhere: credited there (routes topic)
            self.routes_applied += 1
            self.shard(d.model).add_pending(d.replica, d.dp_rank, d.block_hashes, d.prompt_tokens,
                                            d.credited_tokens, d.ts + d.ttl_s)
            self._changed()
            return True
