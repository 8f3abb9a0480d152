"""Deployment configuration (`--config FILE`, JSON or TOML): per-model settings, the price model,
and the topology of shared caches. Everything has a default: no file is needed to start.
Every key with its type, default and meaning: docs/config.md (tested against the structs below by
reference_rows()); an example setting every key: docs/kvidx.example.toml.

```toml
pending_ttl_s = 10.0                      # how long a routed prompt counts as cached unconfirmed
allow_endpoints = ["10.0.0.0/8", "*.svc.cluster.local"]  # what /register may name (default: private)

[default]                                 # every model without its own section
index_block_size = 16
unreported_eviction_kinds = []            # e.g. ["mamba"]: credit relying on them is an upper bound

[default.price]
recompute_tokens_per_s = 8000.0           # a replica's prefill throughput
load_tokens_per_s = {GPU = 0.0, CPU = 150000.0, DISK = 40000.0, NODE_SHARED = 100000.0, POOL = 25000.0}

[models."llama-3-70b".price]              # per-model overrides
recompute_tokens_per_s = 2500.0

[models."gemma-2-27b".groups]             # groups an engine's events leave unnamed (older vLLM)
0 = {kind = "sliding_window", window = 4096}
1 = {kind = "full_attention"}

[models."llama-3-70b"]                    # its index split in 4 replica groups (Kafka keys, shards)
replica_groups = 4
replica_placement = {"node-a:5557" = 0}   # explicit groups; the rest by a stable hash of the name

[pools.rack-7-lmcache]                    # a shared cache: its relay publishes as replica "rack-7-lmcache"
tier = "NODE_SHARED"
replicas = ["rack7-node1:5557", "rack7-node2:5557"]
```
A load rate of 0 means free (the tier is where the engine computes from: GPU).
"""

from __future__ import annotations

import json
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from kvidx.core.groups import replica_group
from kvidx.core.price import PriceConfig
from kvidx.core.shard import ModelShard

__all__ = ["DEFAULT_HINT_KINDS", "HINT_KINDS", "Config", "GroupConfig", "HintsConfig", "ModelConfig",
           "PoolConfig", "PriceConfig", "ShardSettings", "load_config", "reference_rows"]

HINT_KINDS = ("prefetch", "placement", "eviction")  # the kinds of kvidx.hints.v1 (schemas/hints.py)


class GroupConfig(msgspec.Struct, forbid_unknown_fields=True):
    kind: str  # full_attention, sliding_window, mamba ...
    window: int | None = None  # sliding window length in tokens


class HintsConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Hints (issue #16) are off until the operator turns them on, per model."""
    prefetch: bool = False  # /v1/rank and /v1/routes answers carry the prefetch plan; the hints topic
    # the hints topic also gets eviction advice and placements, from the sessions of the routing decisions
    sessions: bool = False
    placement_tokens_per_s: float = 100_000.0  # a copy between replicas, for placements
    kv_bytes_per_token: int = 0  # for the bytes a hint moves (0: not reported)
    # the prefetch gate (kvidx.core.hints.PrefetchGate, issue #41): a plan is issued only when the load it
    # hides before the request's turn, net of the turn's wait for a late one, beats the margin; the delay
    # is the decision to the engine loading (the hints topic and the actuator; `kvidx simulate
    # --hint-delay-ms`'s default): measure yours with `kvidx audit` and raise it if it is longer
    prefetch_delay_ms: float = 2.0
    prefetch_margin_ms: float = 1.0  # kvidx.core.hints.MARGIN_S says why 1 ms
    # an LMCache controller that acts on the prefetch hints (kvidx/engines/lmcache/actuator.py): its
    # PULL socket, tcp://host:port; the LMCache instance id of each replica (default: the replica's name),
    # also for LMCache's POST /lookup (index_service/lmcache_api.py)
    lmcache_controller: str = ""
    lmcache_instances: dict[str, str] = {}
    # fetch hints (kvidx.core.fetch): a /v1/routes answer carries `kv_hint`, Dynamo's KvHint (kv.fetch@1.0),
    # when another replica holds more of the prompt on GPU than the chosen one and copying it
    # (at placement_tokens_per_s) beats recomputing it; sources are the replicas named here, each with
    # its KV connector's control endpoint (Dynamo's `router_hint_source_control_endpoints`; "REPLICA#RANK"
    # for a DP rank other than 0)
    fetch: bool = False
    fetch_endpoints: dict[str, str] = {}
    fetch_hashes_max: int = 2_000_000  # engine hashes kept for the hints (kvidx.core.fetch.EngineHashes)

    def kinds(self) -> tuple[str, ...]:
        """The hint kinds the service issues with these settings (index_service/query.py): prefetch plans
        with `prefetch`; placements and eviction advice with `sessions`."""
        on = (self.prefetch, self.sessions, self.sessions)
        return tuple(k for k, k_on in zip(HINT_KINDS, on, strict=True) if k_on)


# The kinds a model's hints issue once turned on the documented way (docs/routers.md: `prefetch = true`;
# `sessions` stays off, docs/simulator.md says why): `kvidx simulate --hints`'s default, so that its
# kv_hints policy is the one the service deploys (tests/unit/kvidx/test_config.py holds them equal)
DEFAULT_HINT_KINDS = HintsConfig(prefetch=True).kinds()


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True):
    index_block_size: int = 16
    unreported_eviction_kinds: list[str] = []
    # tiers whose evictions are not published (LMCache chunks through vLLM without its controller feed)
    unreported_eviction_tiers: list[str] = []
    price: PriceConfig = msgspec.field(default_factory=PriceConfig)
    # KV-cache groups by index, for engines whose events do not carry the group's kind or window
    groups: dict[int, GroupConfig] = {}
    # replica groups (kvidx.core.groups): the model's index as this many shards, each a Kafka key
    # folded and snapshotted on its own; a replica's group from `replica_placement`, else its pool's,
    # else a stable hash of its name
    replica_groups: int = 1
    replica_placement: dict[str, int] = {}
    hints: HintsConfig = msgspec.field(default_factory=HintsConfig)

    def group_kinds(self) -> dict[int, tuple[str, int | None]]:
        return {g: (c.kind, c.window) for g, c in self.groups.items()}


class PoolConfig(msgspec.Struct, forbid_unknown_fields=True):
    replicas: list[str]
    tier: str = "POOL"


class Config(msgspec.Struct, forbid_unknown_fields=True):
    default: ModelConfig = msgspec.field(default_factory=ModelConfig)
    models: dict[str, ModelConfig] = {}
    pools: dict[str, PoolConfig] = {}
    pending_ttl_s: float = 10.0
    # the endpoints registrations and feeds may name (CIDRs, host patterns: index_service.guard);
    # None: the default (loopback, private ranges); `kvidx serve --allow-endpoints` overrides
    allow_endpoints: list[str] | None = None

    def model(self, name: str) -> ModelConfig:
        return self.models.get(name, self.default)

    def pool_readers(self) -> dict[str, list[str]]:
        return {name: p.replicas for name, p in self.pools.items()}

    def replica_group(self, model: str, replica: str, groups: int | None = None) -> int:
        """The replica group of `replica`'s events and state in `model`'s index (kvidx.core.groups);
        `groups`: among that many instead of the configured count (re-grouping), the explicit
        placement kept where it fits."""
        m = self.model(model)
        n = m.replica_groups if groups is None else groups
        if n <= 1:
            return 0
        pool_of = {r: name for name, p in self.pools.items() for r in p.replicas}
        placement = {r: g for r, g in m.replica_placement.items() if g < n}
        return replica_group(replica, n, placement, pool_of)

    def check(self) -> None:
        """ValueError naming the first setting that cannot work."""
        for name, m in [("default", self.default), *self.models.items()]:
            if m.replica_groups < 1:
                raise ValueError(f"model {name!r}: replica_groups must be at least 1, got {m.replica_groups}")
            for replica, g in m.replica_placement.items():
                if not 0 <= g < m.replica_groups:
                    raise ValueError(f"model {name!r}: replica_placement puts {replica!r} in group {g}, "
                                     f"outside 0..{m.replica_groups - 1}")
            h = m.hints
            if h.placement_tokens_per_s <= 0 or h.kv_bytes_per_token < 0:
                raise ValueError(f"model {name!r}: hints.placement_tokens_per_s must be > 0 and "
                                 "hints.kv_bytes_per_token >= 0")
            if h.lmcache_controller and not h.lmcache_controller.startswith(("tcp://", "ipc://")):
                raise ValueError(f"model {name!r}: hints.lmcache_controller must be a ZMQ address "
                                 "(tcp://HOST:PORT, the controller's pull port), not "
                                 f"{h.lmcache_controller!r}")
            if h.lmcache_controller and not h.prefetch:
                raise ValueError(f"model {name!r}: hints.lmcache_controller acts on prefetch plans: turn on "
                                 "hints.prefetch too")
            if h.fetch and not h.fetch_endpoints:
                raise ValueError(f"model {name!r}: hints.fetch needs hints.fetch_endpoints, each source "
                                 "replica's control endpoint ({\"REPLICA\" = \"tcp://HOST:PORT\"})")
            if h.fetch_hashes_max < 2:
                raise ValueError(f"model {name!r}: hints.fetch_hashes_max must be at least 2")


def load_config(path: str | Path | None) -> Config:
    """The configuration in `path` (.toml or .json); the defaults when None. Errors name the file and
    the field."""
    if path is None:
        return Config()
    p = Path(path)
    try:
        raw = tomllib.loads(p.read_text()) if p.suffix == ".toml" else msgspec.json.decode(p.read_bytes())
        config = msgspec.convert(raw, Config, strict=False)  # TOML keys are strings: groups 0, 1 ...
        config.check()
        return config
    except (OSError, tomllib.TOMLDecodeError, msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
        raise SystemExit(f"error: bad configuration {p}: {e}") from None


@dataclass
class ShardSettings:
    """How a model's shard is made, from one source for every process that folds events (the worker
    that writes the snapshots, every service instance that rebuilds from them, a replay): the
    deployment configuration, with the command line's overrides. Without it the worker built every
    shard with the default index block size while the service used the configured one."""

    config: Config = field(default_factory=Config)
    index_block_size: int | None = None  # --index-block-size: for models the configuration leaves out
    block_sizes: dict[str, int] = field(default_factory=dict)  # explicit per model (tests, simulator)
    unreported_eviction_kinds: tuple[str, ...] | None = None  # overrides the configuration's
    # pools registered at run time (Mooncake conductor's type "Mooncake" services): pool -> its readers
    registered_pools: dict[str, list[str]] = field(default_factory=dict)

    def block_size(self, model: str) -> int:
        if model in self.block_sizes:
            return self.block_sizes[model]
        if self.index_block_size is not None and model not in self.config.models:
            return self.index_block_size
        return self.config.model(model).index_block_size

    def configure(self, shard: ModelShard) -> ModelShard:
        """Settings a snapshot does not carry (they belong to the deployment): applied on every load."""
        kinds = self.unreported_eviction_kinds
        if kinds is None:
            kinds = tuple(self.config.model(shard.model).unreported_eviction_kinds)
        if kinds:
            shard.unreported_eviction_kinds = frozenset(kinds)
        tiers = self.config.model(shard.model).unreported_eviction_tiers
        if tiers:
            shard.unreported_eviction_tiers = frozenset(tiers)
        if self.config.pools or self.registered_pools or shard.pool_readers:
            shard.set_pools({**self.config.pool_readers(), **self.registered_pools})
        return shard

    def new_shard(self, model: str) -> ModelShard:
        return self.configure(ModelShard(model, self.block_size(model)))


# The reference (docs/config.md, checked against this by tests/unit/kvidx/test_config.py): every key a
# configuration file can set, with its type and default, walked from the structs above.
_PLACEHOLDERS = {("models",): "<model>", ("pools",): "<pool>", ("groups",): "<group>"}


def _type_name(t) -> str:
    if isinstance(t, type) and issubclass(t, msgspec.Struct):
        return "table"
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    if args:  # a union: X | None
        return " or ".join("none" if a is type(None) else _type_name(a) for a in args)
    return "none" if t is type(None) else t.__name__


def _default_text(f) -> str:
    if f.default is not msgspec.NODEFAULT:
        value = f.default
    elif f.default_factory is not msgspec.NODEFAULT:
        value = f.default_factory()
    else:
        return "required"
    if isinstance(value, msgspec.Struct):
        return "(its keys' defaults)"
    return "none" if value is None else json.dumps(msgspec.to_builtins(value))


def reference_rows(struct: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, type, default) for every key of a configuration file, dotted as TOML writes them, with
    <model>, <pool>, <group> for the names a file chooses; a model's keys once, under `default`
    (every `models.<model>` section takes the same keys)."""
    rows = []
    for f in msgspec.structs.fields(struct):
        key = prefix + f.encode_name
        t = f.type
        rows.append((key, _type_name(t), _default_text(f)))
        if isinstance(t, type) and issubclass(t, msgspec.Struct):
            rows += reference_rows(t, key + ".")
        elif f.name == "models":
            continue  # the same keys as `default`
        else:
            value = typing.get_args(t)[1] if typing.get_origin(t) is dict else None
            if isinstance(value, type) and issubclass(value, msgspec.Struct):
                rows += reference_rows(value, f"{key}.{_PLACEHOLDERS[(f.name,)]}.")
    return rows
