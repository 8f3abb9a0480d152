"""Mooncake conductor's KV indexer API (kvcache-ai/Mooncake, branch dev/conductor, mooncake-conductor/
src/kvevent/event_manager.cpp and hash_strategy.cpp; its docs/source/design/conductor/indexer-api-
design.md where the code agrees), served by `kvidx serve` over the same index: a router written for the
conductor points at kvidx unchanged.

msgpack only, requests and answers (`Content-Type: application/msgpack`): POST /register, /unregister
and /query share their paths with Dynamo's JSON API (index_service/dynamo_api.py) and are told apart by
the request's content type, as the conductor itself refuses anything but msgpack there.

- `POST /register {endpoint, type, modelname, instance_id, block_size, dp_rank, hash_profile{strategy,
  algorithm, python_hash_seed, index_projection}, replay_endpoint?, lora_name?, tenant_id?,
  cache_group?}`: 200 `{status, instance_id}`; kvidx starts a relay for the vLLM engine's ZMQ publisher
  (the replica is named after its endpoint), publishing to the events topic like every relay. The
  conductor's checks in its order, with its error bodies `{error, reason, field?, index?}`; an identical
  registration again is a no-op, a different one on the same key or endpoint is refused.
- `type "Mooncake"`: a Mooncake Store master's KV-event publisher, the context's shared pool: kvidx
  follows it (kvidx.engines.mooncake, the pool replica named after its endpoint), placing its tokenless
  objects through the context's vLLM engines' own streams (subscribed to as key feeds), and the pool
  counts for every vLLM service of the context (ShardStore.set_registered_pool): in /query's cpu
  ("cpu" medium) and disk phases, and in kvidx's own lookups; a pool counts only for its readers.
- `POST /unregister {instance_id, dp_rank, tenant_id?}`: stops the relay and retracts the replica.
- `POST /query {model, block_size, token_ids (bin of int32 LE, or an array), tenant_id?, lora_name?,
  cache_salt?, instance_id?}`: per registered instance and DP rank one cursor over the prompt's blocks of
  the registered size: the GPU blocks that rank holds, then blocks any replica of the model holds in host
  memory (`cpu`), then on disk (`disk` = `longest_matched`), cumulative token counts; the instance's
  gpu/cpu/disk are the best of its ranks. A model split in replica groups: the other groups' holders
  answer their part (`?local=1&groups=...`), merged before the cursors are read.
- `GET /services`, `GET /global_view`: the registrations and the contexts (tenant, model, LoRA, block
  size), with each context's hash profile and its root digest (kvidx.engines.vllm.hashing).

Differences, by design: kvidx refuses more (ConductorRegistry: endpoints outside the allow-list, 403;
a takeover of a replica another source feeds, 409; block sizes above 65,536 and names with control
characters, index_service.guard); kvidx keys blocks canonically (kvidx.core.hashing) and re-hashes
the engine's tokens, so the hash profile is checked and reported but not needed to match; the cpu
phase also counts blocks vLLM's own CPU offloading reports (the conductor reads only GPU events from
vLLM), and host memory includes shared pools;
`prefix_count` is the model's distinct indexed blocks. Registrations are kept on the compacted
registrations topic (as Dynamo's): every instance knows them, the one that took a registration runs its
relay and takes it up again after a restart (the conductor keeps them in its process only).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

import msgspec
import numpy as np
from fastapi.responses import Response

from index_service.dynamo_api import MAX_MODELS, MAX_REGISTRATIONS, Listener, live_replica
from index_service.fanout import local_groups
from index_service.guard import MAX_BLOCK_SIZE, MAX_DEPTH_ERROR, EndpointAllowList, bounded, name_error
from index_service.store import ShardStore
from index_service.wire import Reject
from kvidx import index
from kvidx.core.hashing import prompt_hashes
from kvidx.engines.vllm.hashing import ALGORITHMS, root_digest
from schemas.registrations import REGISTRATIONS_VERSION, ConductorService

log = logging.getLogger("kvidx.conductor_api")

MSGPACK = "application/msgpack"
TYPES = ("vLLM", "Mooncake")
_I64 = (1 << 63) - 1
_I32 = (-(1 << 31), (1 << 31) - 1)
REGISTER_FIELDS = ("block_size", "cache_group", "dp_rank", "endpoint", "hash_profile", "instance_id",
                   "lora_name", "modelname", "replay_endpoint", "tenant_id", "type")
PROFILE_FIELDS = ("strategy", "algorithm", "python_hash_seed", "index_projection")
QUERY_FIELDS = ("model", "block_size", "token_ids", "tenant_id", "lora_name", "cache_salt", "instance_id")
UNREGISTER_FIELDS = ("dp_rank", "instance_id", "tenant_id")
MAX_QUERY_TOKENS = 1 << 22  # token ids in one /query (a 16 MiB prompt): more is refused before use


class Invalid(Exception):
    """The conductor's HttpValidationError: 400 {error, reason, field?, index?}."""

    def __init__(self, error: str, reason: str, field: str | None = None, index: int | None = None,
                 status: int = 400):
        super().__init__(error)
        self.status = status  # 400 as the conductor's; 403, 409, 413 for what kvidx refuses besides
        self.body: dict[str, Any] = {"error": error, "reason": reason}
        if field is not None:
            self.body["field"] = field
        if index is not None:
            self.body["index"] = index


def is_msgpack(content_type: str | None) -> bool:
    return MSGPACK in (content_type or "")


def reply(status: int, body: Any) -> Response:
    return Response(msgspec.msgpack.encode(body), status_code=status, media_type=MSGPACK)


def decode_map(body: bytes, allowed: tuple[str, ...]) -> dict:
    """A request body: a msgpack map with string keys, none outside `allowed` (in the request's order)."""
    try:
        obj = bounded(msgspec.msgpack.decode, body)
    except msgspec.DecodeError as e:
        raise Invalid("Invalid msgpack object" + (f": {e}" if str(e) == MAX_DEPTH_ERROR else ""),
                      "invalid_msgpack") from None
    if not isinstance(obj, dict):
        raise Invalid("request body must be a msgpack map", "invalid_msgpack")
    for k in obj:
        if not isinstance(k, str):
            raise Invalid("map keys must be strings", "invalid_msgpack")
        if k not in allowed:
            raise Invalid(f"unsupported request field: {k}", "unknown_field", k)
    return obj


def _text(obj: dict, name: str, required: bool = True, default: str = "") -> str:
    if name not in obj:
        if required:
            raise Invalid(f"{name} is required", "missing", name)
        return default
    v = obj[name]
    if not isinstance(v, str):
        raise Invalid(f"{name} must be a string", "invalid_type", name)
    if required and not v:
        raise Invalid(f"{name} must not be empty", "invalid_value", name)
    bad = name_error(name, v, empty_ok=True)
    if bad is not None:  # before it reaches a log line, a metric or the registrations topic
        raise Invalid(bad, "invalid_value", name)
    return v


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def resolve_profile(p: Any) -> dict[str, str]:
    """hash_profile checked as the conductor resolves it; with its root digest (lowercase hex)."""
    if p is None:
        raise Invalid("hash_profile is required", "missing", "hash_profile")
    if not isinstance(p, dict):
        raise Invalid("hash_profile must be a map", "invalid_type", "hash_profile")
    for k in p:
        if k not in PROFILE_FIELDS:
            raise Invalid(f"unsupported request field: {k}", "unknown_field", str(k))
    vals = {k: _text(p, k) for k in PROFILE_FIELDS}
    if vals["algorithm"] not in ALGORITHMS:
        raise Invalid(f"unsupported hash algorithm: {vals['algorithm']}", "invalid_value", "algorithm")
    if vals["strategy"] != "vllm_v1":
        raise Invalid(f"unsupported hash strategy: {vals['strategy']}", "invalid_value", "strategy")
    if vals["index_projection"] != "low64_be":
        raise Invalid(f"unsupported index projection: {vals['index_projection']}", "invalid_value",
                      "index_projection")
    seed = vals["python_hash_seed"]
    if seed != "random":
        if not (seed.isascii() and seed.isdigit()):
            raise Invalid('python_hash_seed must be "random" or ASCII decimal text in 0..4294967295',
                          "invalid_value", "python_hash_seed")
        if int(seed) > 0xFFFF_FFFF:
            raise Invalid("python_hash_seed must be in range 0..4294967295", "invalid_value",
                          "python_hash_seed")
    return {"strategy": vals["strategy"], "algorithm": vals["algorithm"], "python_hash_seed": seed,
            "root_digest": root_digest(vals["algorithm"], seed).hex(),
            "index_projection": vals["index_projection"]}


@dataclass
class Service:
    endpoint: str
    replay_endpoint: str
    type: str
    model: str
    lora_name: str
    tenant_id: str
    instance_id: str
    block_size: int
    dp_rank: int
    cache_group: int | None
    profile: dict[str, str]
    owner: str = field(compare=False, default="local")  # the instance that runs its relay
    listener: Listener = field(compare=False, default_factory=lambda: Listener("", None))

    def record(self) -> ConductorService:
        return ConductorService(REGISTRATIONS_VERSION, self.endpoint, self.replay_endpoint, self.type,
                                self.model, self.lora_name, self.tenant_id, self.instance_id, self.block_size,
                                self.dp_rank, self.cache_group, self.profile, self.owner)

    @property
    def key(self) -> str:
        return f"{self.instance_id}|{self.tenant_id}|{self.dp_rank}"

    @property
    def context(self) -> tuple[str, str, str, int]:
        return (self.tenant_id, self.model, self.lora_name, self.block_size)


@dataclass
class Context:
    profile: dict[str, str]
    instances: dict[str, set[int]] = field(default_factory=dict)


class ConductorRegistry:
    """The conductor's services and prefix contexts, with a relay per vLLM service (`start_relay` as in
    DynamoRegistry: start(model, replica, dp_rank, endpoint, replay_endpoint, listener, 0) -> stop).
    A registration is refused, as DynamoRegistry's are, with an endpoint outside `allow` (403), one
    that another source feeds (409: registered here under another key, in `others`, or a replica
    holding blocks in `store`), or beyond `max_registrations` or `max_models` (409); block_size is in
    1..MAX_BLOCK_SIZE."""

    def __init__(self, start_relay=None, owner: str = "local", log=None, start_pool_relay=None,
                 set_pool=None, replica_groups=None, allow: EndpointAllowList | None = None,
                 store: ShardStore | None = None, max_registrations: int = MAX_REGISTRATIONS,
                 max_models: int = MAX_MODELS):
        """`owner`: this instance's name; `log`: the registrations topic (index_service/registrations.py
        RegistrationLog), where registrations are kept beyond the process, or None. Type "Mooncake"
        services: `start_pool_relay` (relays/managed.py mooncake_relay_starter) follows the master,
        `set_pool(pool, readers)` (ShardStore.set_registered_pool) attaches the context's vLLM services to
        its pool; `replica_groups(model)`: the model's group count (pools need one group)."""
        self.start_relay = start_relay
        self.start_pool_relay = start_pool_relay
        self.set_pool = set_pool
        self.replica_groups = replica_groups
        self.pool_lock = threading.Lock()  # readers computed and applied as one step
        self.owner = owner
        self.log = log
        self.services: dict[str, Service] = {}
        # a context goes with its last service (the conductor keeps its contexts: kvidx bounds them)
        self.contexts: dict[tuple[str, str, str, int], Context] = {}
        self.lock = threading.Lock()
        self.allow = allow if allow is not None else EndpointAllowList()
        self.store = store
        self.others: list = []  # registries whose endpoints are taken too (`feeds(endpoint)`)
        self.max_registrations = max_registrations
        self.max_models = max_models
        # called (under the lock) after a service is added or dropped: the lookup front's sync
        self.on_change: Callable[[], None] | None = None

    # ---- registration ---------------------------------------------------------------------------
    def register(self, body: bytes) -> tuple[int, dict]:
        obj = decode_map(body, REGISTER_FIELDS)
        endpoint, typ, model, iid = (_text(obj, f) for f in ("endpoint", "type", "modelname", "instance_id"))
        if "block_size" not in obj:
            raise Invalid("block_size is required", "missing", "block_size")
        bs = obj["block_size"]
        if not _int(bs) or bs > _I64:
            raise Invalid("block_size must be an integer", "invalid_type", "block_size")
        if bs <= 0:
            raise Invalid("block_size must be greater than zero", "out_of_range", "block_size")
        if bs > MAX_BLOCK_SIZE:
            raise Invalid(f"block_size must be at most {MAX_BLOCK_SIZE}", "out_of_range", "block_size",
                          status=422)
        replay = _text(obj, "replay_endpoint", required=False)
        lora = _text(obj, "lora_name", required=False)
        tenant = _text(obj, "tenant_id", required=False) or "default"
        group = obj.get("cache_group")
        if group is not None:
            if not _int(group):
                raise Invalid("cache_group must be an integer or null", "invalid_type", "cache_group")
            if group != 0:
                raise Invalid("only cache group zero is supported", "unsupported", "cache_group")
        profile = resolve_profile(obj.get("hash_profile"))
        if typ not in TYPES:
            raise Invalid("type must be vLLM or Mooncake", "invalid_value", "type")
        if "dp_rank" not in obj:
            raise Invalid("dp_rank is required", "missing", "dp_rank")
        rank = obj["dp_rank"]
        if not _int(rank):
            raise Invalid("dp_rank must be an integer", "invalid_type", "dp_rank")
        if not 0 <= rank <= _I32[1]:
            raise Invalid("dp_rank must be a non-negative int", "out_of_range", "dp_rank")
        if typ == "Mooncake" and self.replica_groups is not None and self.replica_groups(model) > 1:
            raise Invalid(f"type Mooncake: model {model} is split in replica groups, and kvidx credits a "
                          "registered pool within one group only", "unsupported", "type")
        for name, value in (("endpoint", endpoint), ("replay_endpoint", replay)):
            err = self.allow.error(name, value) if value else None
            if err is not None:
                raise Invalid(err, "forbidden_endpoint", name, status=403)
        svc = Service(endpoint, replay, typ, model, lora, tenant, iid, bs, rank, group, profile, self.owner)
        ok = {"status": "registered successfully", "instance_id": iid}
        with self.lock:
            old = self.services.get(svc.key)
            if old is not None and old == svc:
                return 200, ok  # the same registration again: nothing new
            self._taken(svc)
            self._add(svc)
        if self.log is not None:
            try:
                self.log.publish_conductor(svc.record())
            except Exception as e:  # noqa: BLE001 - the registration is not kept: it does not happen
                with self.lock:
                    self._drop(svc.key)
                return 503, {"error": f"the registration could not be kept (registrations topic): {e}",
                             "reason": "unavailable"}
        self._start(svc)
        log.info("event=conductor_register instance=%s dp_rank=%d model=%s endpoint=%s", iid, rank, model,
                 endpoint)
        return 200, ok

    def _taken(self, svc: Service) -> None:
        """Under the lock: Invalid (409) where `svc` would take over a replica another source feeds or go
        beyond the bounds. The conductor's own conflicts (same key, same endpoint) are `_add`'s."""
        mine = svc.key in self.services or any(s.endpoint == svc.endpoint for s in self.services.values())
        if not mine:  # (a conflict here is the conductor's own, _add's)
            for other in self.others:
                who = other.feeds(svc.endpoint)
                if who is not None:
                    raise Invalid(f"endpoint {svc.endpoint} is fed already ({who})", "conflict", "endpoint",
                                  status=409)
            if self.store is not None and live_replica(self.store, svc.model, svc.endpoint):
                raise Invalid(f"replica {svc.endpoint} of model {svc.model} is fed by another source (a "
                              "relay publishing its events): a registration cannot take it over", "conflict",
                              "endpoint", status=409)
        if len(self.services) >= self.max_registrations:
            raise Invalid(f"at most {self.max_registrations} registrations: unregister some first",
                          "limit", status=409)
        models = set(self.store.shards if self.store is not None else ()) | {
            s.model for s in self.services.values()}  # indexed, or registered (no events yet)
        if svc.model not in models and len(models) >= self.max_models:
            raise Invalid(f"the index holds {len(models)} models, at most {self.max_models}", "limit",
                          "modelname", status=409)

    def feeds(self, endpoint: str) -> str | None:
        """Which registration here follows `endpoint` (None: none)."""
        with self.lock:
            return next((f"conductor registration {s.key}" for s in self.services.values()
                         if s.endpoint == endpoint), None)

    def _add(self, svc: Service) -> None:
        """Under the lock: the conductor's conflict checks (Invalid), then the service and its context."""
        if svc.key in self.services:
            raise Invalid(f"conflicting registration for service key: {svc.key}", "invalid_registration")
        if any(s.endpoint == svc.endpoint for s in self.services.values()):
            raise Invalid(f"conflicting active registration for endpoint: {svc.endpoint}",
                          "invalid_registration")
        ctx = self.contexts.get(svc.context)
        if ctx is not None and ctx.profile != svc.profile:
            what = "bind shared-cache profile" if svc.type == "Mooncake" else "register prefix context"
            raise Invalid(f"failed to {what}: registration conflicts with the ContextKey hash profile",
                          "invalid_registration")
        if svc.type == "Mooncake":  # a shared cache of the context, not an engine answered by /query
            self.services[svc.key] = svc
            return
        if ctx is None:
            ctx = self.contexts[svc.context] = Context(svc.profile)
        ctx.instances.setdefault(svc.instance_id, set()).add(svc.dp_rank)
        self.services[svc.key] = svc
        if self.on_change is not None:
            self.on_change()

    def _drop(self, key: str) -> Service | None:
        """Under the lock: the service gone from the registry and its context."""
        svc = self.services.pop(key, None)
        if svc is not None and svc.type != "Mooncake":
            ranks = self.contexts[svc.context].instances.get(svc.instance_id, set())
            ranks.discard(svc.dp_rank)
            if not ranks:
                self.contexts[svc.context].instances.pop(svc.instance_id, None)
        if svc is not None and not any(s.context == svc.context for s in self.services.values()):
            self.contexts.pop(svc.context, None)  # reclaimed with its last service
        if svc is not None and self.on_change is not None:
            self.on_change()
        return svc

    def _endpoints(self, context: tuple[str, str, str, int]) -> dict[tuple[str, int], str]:
        """(instance id, DP rank) -> its service's endpoint, for one context. Under the lock."""
        return {(s.instance_id, s.dp_rank): s.endpoint for s in self.services.values()
                if s.context == context}

    def context_table(self) -> list[tuple]:
        """Every prefix context as `answer` reads it: (tenant, model, LoRA, block size, [(instance id,
        [(DP rank, its service's endpoint or None)])]), ids in answer order. Under the lock."""
        out = []
        for (tenant, model, lora, bs), ctx in self.contexts.items():
            endpoints = self._endpoints((tenant, model, lora, bs))
            ids = sorted(ctx.instances, key=str.encode)
            out.append((tenant, model, lora, bs,
                        [(i, [(r, endpoints.get((i, r))) for r in sorted(ctx.instances[i])]) for i in ids]))
        return out

    def apply_record(self, key: str, rec: ConductorService | None) -> None:
        """A conductor record of the registrations topic (every instance's, this one's echoes included): a
        registration from elsewhere, or one this instance owns and takes up again after a restart (its
        relay starts); a tombstone drops it (and stops this instance's relay)."""
        if rec is None:
            with self.lock:
                svc = self._drop(key)
            if svc is not None:
                self._gone(svc)
            return
        svc = Service(rec.endpoint, rec.replay_endpoint, rec.type, rec.model, rec.lora_name, rec.tenant_id,
                      rec.instance_id, rec.block_size, rec.dp_rank, rec.cache_group, dict(rec.profile),
                      rec.owner)
        with self.lock:
            if svc.key in self.services:
                return  # this instance's own registration, or one already applied
            try:
                self._add(svc)
            except Invalid as e:
                log.warning("event=conductor_registration_conflict key=%s error=%s", key, e.body["error"])
                return
        if svc.owner == self.owner:
            self._start(svc)
        else:
            self._sync_pools(svc.context)
            svc.listener.status = "active"  # its relay runs on the instance that took it

    # ---- Mooncake Store pools: a master's objects count for the context's vLLM services -----------------
    def _engines_of(self, context) -> list[str]:
        """The endpoints (replica names) of the vLLM services of a context."""
        with self.lock:
            return sorted(s.endpoint for s in self.services.values()
                          if s.type == "vLLM" and s.context == context)

    def _sync_pools(self, context) -> None:
        """Every Mooncake service of `context` is read by the context's vLLM services (on every instance:
        the shards credit a pool's blocks to its readers)."""
        if self.set_pool is None:
            return
        with self.pool_lock:  # the HTTP thread and the registrations follower: the newest view wins
            readers = self._engines_of(context)
            with self.lock:
                pools = [s.endpoint for s in self.services.values()
                         if s.type == "Mooncake" and s.context == context]
            for pool in pools:
                self.set_pool(pool, readers)

    def _start(self, svc: Service) -> None:
        """The service's relay: a vLLM engine's publisher, or a Mooncake Store master's (the pool, replica
        = its endpoint, its objects placed through the context's vLLM engines' own streams: key feeds)."""
        self._sync_pools(svc.context)
        listener = svc.listener
        refused = self.allow.error("endpoint", svc.endpoint) or (
            self.allow.error("replay_endpoint", svc.replay_endpoint) if svc.replay_endpoint else None)
        if refused is not None:  # taken before the allow-list was narrowed: kept, never connected to
            listener.status, listener.last_error = "failed", refused[:300]
            log.warning("event=conductor_listener_refused key=%s error=%s", svc.key, listener.last_error)
            return
        try:
            if svc.type == "Mooncake" and self.start_pool_relay is not None:
                listener.stop = self.start_pool_relay(svc.model, svc.endpoint, svc.endpoint, listener,
                                                      lambda: self._engines_of(svc.context), svc.tenant_id,
                                                      svc.block_size)
            elif svc.type != "Mooncake" and self.start_relay is not None:
                listener.stop = self.start_relay(svc.model, svc.endpoint, svc.dp_rank, svc.endpoint,
                                                 svc.replay_endpoint or None, listener, 0)
            listener.status = "active"
        except Exception as e:  # noqa: BLE001 - the conductor registers even when nothing listens yet
            listener.status, listener.last_error = "failed", str(e)[:300]
            log.warning("event=conductor_listener_failed instance=%s endpoint=%s error=%s", svc.instance_id,
                        svc.endpoint, listener.last_error)

    def _gone(self, svc: Service) -> None:
        """After a service left the registry: its relay stops (retracting its replica), the pools follow."""
        if svc.listener.stop is not None:
            svc.listener.stop()
        if svc.type == "Mooncake" and self.set_pool is not None:
            with self.pool_lock:  # still a pool (read by none): its blocks never count as an engine's
                self.set_pool(svc.endpoint, [])
        else:
            self._sync_pools(svc.context)

    def unregister(self, body: bytes) -> tuple[int, dict]:
        obj = decode_map(body, UNREGISTER_FIELDS)
        iid = _text(obj, "instance_id")
        tenant = _text(obj, "tenant_id", required=False) or "default"
        if "dp_rank" not in obj:
            raise Invalid("dp_rank is required", "missing", "dp_rank")
        rank = obj["dp_rank"]
        if not _int(rank) or not 0 <= rank <= _I32[1]:
            raise Invalid("dp_rank must be a non-negative int", "invalid_value", "dp_rank")
        key = f"{iid}|{tenant}|{rank}"
        with self.lock:
            if key not in self.services:
                return 404, {"error": f"service not found: {key}"}
        if self.log is not None:  # the tombstone first: a registration not removed for good stays
            try:
                self.log.remove_conductor(key)
            except Exception as e:  # noqa: BLE001 - nothing is removed: the caller retries
                return 503, {"error": f"the unregistration could not be kept (registrations topic): {e}",
                             "reason": "unavailable"}
        with self.lock:
            svc = self._drop(key)
        if svc is not None:
            self._gone(svc)  # another instance's relay stops on the tombstone
        log.info("event=conductor_unregister key=%s", key)
        return 200, {"status": "unregistered successfully", "removed_instances": [key]}

    def stop_all(self) -> None:
        """The service shuts down: relays end, the index's view of the engines stays."""
        for svc in list(self.services.values()):
            if svc.listener.stop is not None:
                try:
                    svc.listener.stop(False)
                except Exception:  # noqa: BLE001 - best effort at shutdown
                    pass

    # ---- views ----------------------------------------------------------------------------------
    def services_view(self) -> dict:
        with self.lock:
            svcs = [self.services[k] for k in sorted(self.services)]
        return {"count": len(svcs), "services": [
            {"Endpoint": s.endpoint, "ReplayEndpoint": s.replay_endpoint, "Type": s.type,
             "ModelName": s.model, "LoraName": s.lora_name, "TenantID": s.tenant_id,
             "InstanceID": s.instance_id, "BlockSize": s.block_size, "DPRank": s.dp_rank,
             "CacheGroup": s.cache_group, "HashProfile": s.profile} for s in svcs]}

    def global_view(self, store: ShardStore) -> dict:
        with self.lock:
            ctxs = [(k, c.profile, {i: sorted(r) for i, r in c.instances.items()})
                    for k, c in self.contexts.items()]
        out = []
        for (tenant, model, lora, bs), profile, instances in ctxs:
            out.append({"model_name": model, "lora_name": lora, "block_size": bs, "tenant_id": tenant,
                        "prefix_count": index.key_count(store.shards.get(model)), "hash_profile": profile,
                        "instances": {i: instances[i] for i in sorted(instances, key=str.encode)}})
        return {"context_count": len(out), "contexts": out}

    # ---- query ----------------------------------------------------------------------------------
    def parse_query(self, body: bytes) -> QueryArgs:
        obj = decode_map(body, QUERY_FIELDS)
        model = bs = tokens = None
        tenant, lora, salt, only = "default", "", None, None
        for k, v in obj.items():  # the conductor checks the fields in the request's order
            if k == "model":
                if not isinstance(v, str):
                    raise Invalid("model must be a string", "invalid_type", k)
                if not v:
                    raise Invalid("model must not be empty", "invalid_value", k)
                bad = name_error(k, v)
                if bad is not None:  # it is logged where a fan-out misses a group
                    raise Invalid(bad, "invalid_value", k)
                model = v
            elif k == "block_size":
                if not _int(v) or v > _I64:
                    raise Invalid("block_size must be an integer", "invalid_type", k)
                if v <= 0:
                    raise Invalid("block_size must be a positive integer", "out_of_range", k)
                if v > MAX_BLOCK_SIZE:
                    raise Invalid(f"block_size must be at most {MAX_BLOCK_SIZE}", "out_of_range", k,
                                  status=422)
                bs = v
            elif k == "token_ids":
                tokens = _tokens(v)
            elif k in ("tenant_id", "lora_name", "instance_id"):
                if not isinstance(v, str):
                    raise Invalid(f"{k} must be a string", "invalid_type", k)
                if k == "tenant_id":
                    tenant = v or "default"
                elif k == "lora_name":
                    lora = v
                else:
                    only = v
            elif k == "cache_salt":
                if v is not None and not isinstance(v, str):
                    raise Invalid("cache_salt must be a string or null", "invalid_type", k)
                salt = v or None
        for name, v in (("model", model), ("block_size", bs), ("token_ids", tokens)):
            if v is None:
                raise Invalid(f"{name} is required", "missing", name)
        return QueryArgs(model, bs, tokens, tenant, lora, salt, only)

    def query(self, store: ShardStore, body: bytes) -> dict:
        """POST /query answered from this instance's index alone (a model it holds whole)."""
        return self.answer(store, self.parse_query(body))

    def knows(self, q: QueryArgs) -> bool:
        """The query's context (tenant, model, LoRA, block size) has registrations."""
        with self.lock:
            return (q.tenant, q.model, q.lora, q.block_size) in self.contexts

    def answer(self, store: ShardStore, q: QueryArgs, parts: list[_PartBody] = ()) -> dict:
        """The conductor's answer: per registered instance and DP rank, the cursors over this instance's
        index merged with `parts`, the other replica groups' (`Reach.part` on their holders)."""
        with self.lock:
            ctx = self.contexts.get((q.tenant, q.model, q.lora, q.block_size))
            if ctx is None:
                return {"instances": {}}
            ids = sorted(ctx.instances, key=str.encode) if q.instance is None else \
                ([q.instance] if q.instance in ctx.instances else [])
            ranks = {i: sorted(ctx.instances[i]) for i in ids}
            endpoints = self._endpoints((q.tenant, q.model, q.lora, q.block_size))
        reach = Reach(store, q)
        for part in parts:
            reach.merge(part)
        out = {}
        for iid in ids:
            per = {r: reach.rank(endpoints.get((iid, r)), r) for r in ranks[iid]}
            out[iid] = {"longest_matched": max(p[2] for p in per.values()),
                        "dp": {str(r): p[0] for r, p in per.items()},
                        "rank_matches": {str(r): {"gpu": p[0], "cpu": p[1], "disk": p[2]}
                                         for r, p in per.items()},
                        "gpu": max(p[0] for p in per.values()), "cpu": max(p[1] for p in per.values()),
                        "disk": max(p[2] for p in per.values())}
        return {"instances": out}


class _PartBody(msgspec.Struct):
    gpu: list[tuple[str, int, int]]
    reads: list[tuple[str, int, list[str]]]
    lower: list[bytes]
    pools: dict[str, list[bytes]]


class _ReachPart(msgspec.Struct):
    """What a holder of other replica groups answers to `POST /query?local=1&groups=...`."""
    reach: _PartBody


@dataclass
class QueryArgs:
    """A conductor /query, checked."""
    model: str
    block_size: int
    tokens: np.ndarray
    tenant: str
    lora: str
    salt: str | None
    instance: str | None


def _tokens(v: Any) -> np.ndarray:
    """token_ids: a bin of little-endian int32, or an array of ints in the int32 range."""
    if isinstance(v, (bytes, list)) and len(v) > MAX_QUERY_TOKENS * (4 if isinstance(v, bytes) else 1):
        raise Invalid(f"token_ids: at most {MAX_QUERY_TOKENS} token ids", "out_of_range", "token_ids",
                      status=413)
    if isinstance(v, bytes):
        if len(v) % 4:
            raise Invalid("token_ids bin size must be a multiple of 4", "invalid_value", "token_ids")
        return np.frombuffer(v, dtype="<i4")
    if isinstance(v, list):
        for i, t in enumerate(v):
            if not _int(t):
                raise Invalid("token_ids element must be an integer", "invalid_type", "token_ids", i)
            if not _I32[0] <= t <= _I32[1]:
                raise Invalid("token_ids element is outside the int32 range", "out_of_range", "token_ids", i)
        return np.asarray(v, dtype="<i4")
    raise Invalid("token_ids must be a bin or an array", "invalid_type", "token_ids")


def _bits(held: list[int], mask: int) -> int:
    """Bit i set where block i is held by one of the slots in `mask`."""
    out = 0
    for i, m in enumerate(held):
        if m & mask:
            out |= 1 << i
    return out


class Reach:
    """One prompt against a model's index, by blocks of the registered size: per replica and DP rank,
    the cursor over its GPU blocks, then blocks any replica holds in host memory, then on disk. From
    this instance's shard (with `only`: its replicas of those replica groups), merged with the parts
    of the groups other instances hold (`part` there, `merge` here): per replica its GPU cursor and
    the pools it reads, per tier the blocks any replica that is no pool holds, per pool its blocks
    (a pool counts only for its readers)."""

    def __init__(self, store: ShardStore, q: QueryArgs, only: frozenset[int] | None = None):
        self.bs = q.block_size
        ibs = store.block_size(q.model)
        self.n = len(q.tokens) // q.block_size if q.block_size % ibs == 0 else 0  # whole registered blocks
        self.k = max(1, q.block_size // ibs)
        self.gpu: dict[tuple[str, int], int] = {}  # (replica, dp rank) -> leading index blocks on GPU
        self.reads: dict[tuple[str, int], list[str]] = {}  # (replica, dp rank) -> the pools it reads
        self.lower = [0, 0]  # host memory, disk: bit i = index block i held by a replica that is no pool
        self.pools: dict[str, list[int]] = {}  # pool -> [host memory, disk] bits
        shard = store.shards.get(q.model)
        if not index.has_blocks(shard) or not self.n:
            return
        packed = q.tokens[:self.n * self.bs].astype("<i4").view("<u4").tobytes()
        with store.lock:
            hashes = prompt_hashes(packed, ibs, q.lora or None, q.salt)
            mine = sum(1 << st.slot for st in index.replicas(shard) if not only or st.group in only)
            for slot, n in index.prefix_hits(shard, hashes, "GPU").items():
                st = index.replica_at(shard, slot)
                if mine >> slot & 1:
                    self.gpu[(st.replica, st.dp_rank)] = n
            pool_mask = index.pool_slots(shard)
            held = [index.held_in(shard, tiers, hashes) for tiers in (index.HOST, index.DISK)]
            self.lower = [_bits(h, mine & ~pool_mask) for h in held]
            for st in index.replicas(shard):
                if not mine >> st.slot & 1:
                    continue
                if pool_mask >> st.slot & 1:  # a pool's DP ranks: one pool
                    acc = self.pools.get(st.replica, [0, 0])
                    self.pools[st.replica] = [a | _bits(h, 1 << st.slot)
                                              for a, h in zip(acc, held, strict=True)]
                else:
                    read = index.pools_read_by(shard, st.replica)
                    if read:
                        self.reads[(st.replica, st.dp_rank)] = read

    def part(self) -> dict:
        """What another instance merges (msgpack: no int wider than 64 bits, so bits go as bytes)."""
        nb = (self.n * self.k + 7) // 8
        return {"gpu": [[r, d, n] for (r, d), n in self.gpu.items()],
                "reads": [[r, d, p] for (r, d), p in self.reads.items()],
                "lower": [b.to_bytes(nb, "little") for b in self.lower],
                "pools": {p: [b.to_bytes(nb, "little") for b in bits] for p, bits in self.pools.items()}}

    @staticmethod
    def decode(raw: bytes) -> _PartBody:
        """Another instance's part (`part`, msgpack); DecodeError or ValueError where it is malformed."""
        body = msgspec.msgpack.decode(raw, type=_ReachPart).reach
        if len(body.lower) != 2 or any(len(b) != 2 for b in body.pools.values()):
            raise ValueError("a part has two tiers: host memory and disk")
        return body

    def merge(self, part: _PartBody) -> None:
        self.gpu.update({(r, d): n for r, d, n in part.gpu})
        self.reads.update({(r, d): p for r, d, p in part.reads})
        self.lower = [a | int.from_bytes(b, "little") for a, b in zip(self.lower, part.lower, strict=True)]
        for p, bits in part.pools.items():
            acc = self.pools.get(p, [0, 0])
            self.pools[p] = [a | int.from_bytes(b, "little") for a, b in zip(acc, bits, strict=True)]

    def rank(self, endpoint: str | None, dp_rank: int) -> tuple[int, int, int]:
        key = (endpoint, dp_rank)
        k, full = self.k, (1 << self.k) - 1
        pos = self.gpu.get(key, 0) // k if self.n else 0  # whole blocks of the registered size
        out = [pos * self.bs]
        for tier, held in enumerate(self.lower):  # each tier continues where the faster ones stopped
            for p in self.reads.get(key, ()):  # a pool's blocks only where this rank reads it
                held |= self.pools.get(p, (0, 0))[tier]
            while pos < self.n and (held >> (pos * k)) & full == full:
                pos += 1
            out.append(pos * self.bs)
        return out[0], out[1], out[2]


MAX_BODY = 8 << 20  # a /query (4 bytes a token id); a registration is small: MAX_REGISTER_BODY
MAX_REGISTER_BODY = 64 << 10


class ConductorPaths:
    """ASGI middleware: the conductor's msgpack requests, before Dynamo's JSON routes on the same paths
    (POST /register, /unregister, /query with a msgpack content type) and its GET /services and
    /global_view; everything else passes on."""

    paths = (("POST", "/register"), ("POST", "/unregister"), ("POST", "/query"), ("GET", "/services"),
             ("GET", "/global_view"))

    def __init__(self, app, store: ShardStore, registry: ConductorRegistry, fanout=None, metrics=None):
        """`fanout` (index_service.fanout.Fanout): the instances holding a split model's other replica
        groups, asked for their part of a /query (`?local=1&groups=...` there); `metrics`: the
        service's (index_service.metrics.ServiceMetrics), where fan-outs are counted."""
        self.app, self.store, self.registry = app, store, registry
        self.fanout, self.metrics = fanout, metrics

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path") if scope["type"] == "http" else None
        if path in ("/register", "/unregister", "/query"):
            ctype = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"content-type"), "")
            if scope["method"] == "POST" and is_msgpack(ctype):
                body = await _read(receive, scope, MAX_BODY if path == "/query" else MAX_REGISTER_BODY)
                if body is None:
                    response = reply(413, {"error": "request body too large"})
                elif path == "/query":
                    params = dict(parse_qsl(scope.get("query_string", b"").decode()))
                    response = await self.query(body, params)
                else:
                    response = self.handle(path, body)
                await response(scope, receive, send)
                return
        elif path in ("/services", "/global_view"):
            if scope["method"] != "GET":
                response = reply(405, {"error": "Method not allowed"})
            elif path == "/services":
                response = reply(200, self.registry.services_view())
            else:
                response = reply(200, self.registry.global_view(self.store))
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def handle(self, path: str, body: bytes) -> Response:
        reg = self.registry
        try:
            if path == "/register":
                return reply(*reg.register(body))
            return reply(*reg.unregister(body))
        except Invalid as e:
            return reply(e.status, e.body)

    def _read_query(self, body: bytes, params: dict[str, str]
                    ) -> tuple[QueryArgs, frozenset[int] | None] | Response:
        """The query and the replica groups it asks of (`?local=1&groups=`), or its error."""
        try:
            only = local_groups(params)
        except Reject as e:
            return reply(422, {"error": e.error, "reason": "invalid_value", "field": "groups"})
        try:
            return self.registry.parse_query(body), only
        except Invalid as e:
            return reply(e.status, e.body)

    def query_here(self, body: bytes, params: dict[str, str]) -> Response:
        """POST /query answered from this instance's shards alone (`query` without the fan-out: the
        lookup front's fallback, index_service.lookup_front)."""
        read = self._read_query(body, params)
        if isinstance(read, Response):
            return read
        q, only = read
        if only:
            return reply(200, {"reach": Reach(self.store, q, only).part()})
        return reply(200, self.registry.answer(self.store, q))

    async def query(self, body: bytes, params: dict[str, str]) -> Response:
        """POST /query. A model split in replica groups: the groups this instance does not hold are asked
        of their holders, whose parts (per replica its GPU cursor, per tier the blocks held) are merged
        before the cursors are read; a group no holder answered for in time is left out, counted in
        kvidx_fanout_partial_total (the conductor's answer has no field for it)."""
        read = self._read_query(body, params)
        if isinstance(read, Response):
            return read
        q, only = read
        if only:  # another instance's fan-out: this instance's part, for those groups
            return reply(200, {"reach": Reach(self.store, q, only).part()})
        missing = (self.store.missing_groups(q.model) if self.fanout is not None and only is None
                   and self.registry.knows(q) else [])
        parts: list[_PartBody] = []
        if missing:
            t0 = time.perf_counter()
            raws, gone, _ = await self.fanout.gather_raw("/query", missing, body, MSGPACK)
            for raw in raws:
                try:
                    parts.append(Reach.decode(raw))
                except (msgspec.DecodeError, ValueError) as e:  # a peer of another version
                    log.warning("event=fanout_unreadable path=/query error=%s", e)
                    gone = list(missing)  # which of its groups it answered for is not known
            if gone:
                log.warning("event=conductor_query_partial model=%s missing_groups=%s", q.model, gone)
            if self.metrics is not None:
                self.metrics.fanout(time.perf_counter() - t0, len(gone))
        return reply(200, self.registry.answer(self.store, q, parts))


async def _read(receive, scope, limit: int) -> bytes | None:
    """The body, or None where it is (or says it is) more than `limit` bytes: not read further."""
    cl = next((v for k, v in scope["headers"] if k == b"content-length"), b"")
    if cl.isdigit() and int(cl) > limit:
        return None
    chunks, size = [], 0
    while True:
        msg = await receive()
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not msg.get("more_body"):
            return b"".join(chunks)
