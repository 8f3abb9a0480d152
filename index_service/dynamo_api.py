"""Dynamo's standalone KV indexer API, served by `kvidx serve` beside kvidx's own routes, over the same
index: a router written for Dynamo's indexer (crate dynamo-kv-router 1.6.1, services/indexer/server.rs)
points at kvidx unchanged.

- `POST /register {instance_id, endpoint, model_name, block_size, dp_rank?, replay_endpoint?,
  routing_group?}` (201 `{"status":"ok"}`): kvidx starts a relay for that engine's vLLM ZMQ publisher
  (its replay endpoint fills gaps), publishing to the events topic like every `kvidx relay`; the
  replica is named after its endpoint. The same checks and 400/409 messages as Dynamo's, and kvidx's
  own (DynamoRegistry: the endpoint allow-list, 403; no takeover of a replica another source feeds,
  409; names and bounds, index_service.guard).
- `POST /unregister` (200, 404): stops the relay and retracts the replica (a ReplicaCleared).
- `GET /workers[?model_name=&routing_group=]`: the registrations, in Dynamo's WorkerInfo shape.
- `POST /query {token_ids, model_name, routing_group?, lora_name?, cache_salt?}`: Dynamo's
  ScoreResponse from kvidx's walk: per registered worker and DP rank the contiguous GPU prefix in
  whole blocks of the registered block size x block size (`scores`, `dp`, `gpu`), then the blocks that
  continue it in host memory (`cpu`) and on disk or a shared pool (`disk` = `longest_matched`);
  workers with no match are left out; `frequencies` is `[]`, as Dynamo 1.6.1 answers. Dynamo counts
  whole blocks without kvidx's last-token rule (kvidx's richer answer stays on /v1/lookup).
- `POST /query_by_hash {block_hashes, model_name, ...}`: the same answer from Dynamo's own per-block
  hashes (i64), which the relays /register starts also publish, chained, as Dynamo keys
  (kvidx.core.hashing.dynamo_keys, BlocksStored.router_keys: one entry more per engine block of the
  registered workers only); `GET /dump`: Dynamo's dump of the workers whose relays run here (what a
  Dynamo indexer started with `--peers` recovers from); `GET /health`: 200, empty.

Malformed bodies get axum's statuses and texts (415, 413, 400 "Failed to parse the request body as
JSON: ...", 422 "Failed to deserialize the JSON body into the target type: ..."; the detail after the
colon is msgspec's, not serde's). Registrations are kept on the compacted registrations topic
(index_service/registrations.py): every `kvidx serve` instance knows them all and answers alike; the
instance that took one runs its relay, and takes it up again after a restart (Dynamo's indexer
forgets its registrations when it restarts).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from index_service.fanout import local_groups
from index_service.guard import MAX_BLOCK_SIZE, MAX_DEPTH_ERROR, MAX_DP_RANK, EndpointAllowList, name_error
from index_service.store import ShardStore
from index_service.wire import Reject, read_split
from kvidx import index
from kvidx.core.hashing import dynamo_keys, prompt_hashes
from schemas.registrations import REGISTRATIONS_VERSION, Registration

log = logging.getLogger("kvidx.dynamo_api")

_M64 = (1 << 64) - 1
MAX_BODY = 64 << 10  # a registration is small (axum's default limit is 2 MiB); 8 MiB for the query routes
MAX_QUERY_BODY = 8 << 20
U32 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF_FFFF)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgspec bounds stop at int64: <= 2^64 - 1 in __post_init__
BlockSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)]
DpRank = Annotated[int, msgspec.Meta(ge=0, le=MAX_DP_RANK)]
MAX_REGISTRATIONS = 1024  # (instance, DP rank) pairs: each costs a relay thread
MAX_MODELS = 256  # models in the index: a registration of a new model beyond this is refused


def _check_u64(instance_id: int) -> None:
    if instance_id > _M64:  # msgspec's ValidationError, naming the field's path
        raise ValueError("Expected `int` <= 18446744073709551615 - at `$.instance_id`")


class RegisterRequest(msgspec.Struct):
    instance_id: U64
    endpoint: str
    model_name: str
    block_size: BlockSize
    routing_group: str = "default"
    tenant_id: str = "default"  # accepted and ignored, as Dynamo does
    dp_rank: DpRank | None = None
    replay_endpoint: str | None = None
    additional_salt: str | None = None  # accepted and ignored, as Dynamo does

    def __post_init__(self) -> None:
        _check_u64(self.instance_id)


class UnregisterRequest(msgspec.Struct):
    instance_id: U64
    model_name: str
    routing_group: str | None = None
    tenant_id: str | None = None
    dp_rank: DpRank | None = None

    def __post_init__(self) -> None:
        _check_u64(self.instance_id)


class QueryRequest(msgspec.Struct):
    token_ids: list[U32]
    model_name: str
    routing_group: str = "default"
    tenant_id: str = "default"
    lora_name: str | None = None
    cache_salt: str | None = None


I64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]


class QueryByHashRequest(msgspec.Struct):
    block_hashes: list[I64]  # Dynamo's local hashes as i64 (a u64 above 2^63 - 1 as its negative)
    model_name: str
    routing_group: str = "default"
    tenant_id: str = "default"
    cache_salt: str | None = None


class _QueryRest(QueryRequest, kw_only=True):
    """A /query body without its token ids (cut out and packed by the compiled parser)."""
    token_ids: list[U32] | None = None


def _query_rest(rest: bytes) -> _QueryRest:
    # decoded, then converted, as the ordinary path does (a typed decoder would skip unknown members
    # without checking them: invalid UTF-8 or 1e999 there must still be a 400)
    try:
        raw = msgspec.json.decode(rest)
    except RecursionError:
        raise msgspec.DecodeError(MAX_DEPTH_ERROR) from None
    return msgspec.convert(raw, _QueryRest)


def zmq_endpoint_error(endpoint: str) -> str | None:
    """Dynamo's endpoint check (services/common/zmq.rs validate_endpoint), with its messages."""
    scheme, sep, address = endpoint.partition("://")
    if not sep:
        return f"invalid ZMQ endpoint `{endpoint}`: missing scheme"
    if not address:
        return f"invalid ZMQ endpoint `{endpoint}`: missing address"
    if scheme == "tcp":
        host, sep, port = address.rpartition(":")
        if not sep:
            return f"invalid ZMQ endpoint `{endpoint}`: missing TCP port"
        if not host:
            return f"invalid ZMQ endpoint `{endpoint}`: missing TCP host"
        if host.startswith("["):
            if not host.endswith("]"):
                return f"invalid ZMQ endpoint `{endpoint}`: missing closing `]`"
        elif ":" in host:
            return f"invalid ZMQ endpoint `{endpoint}`: missing TCP port"
        # Rust's u16 parse errors
        why = ("cannot parse integer from empty string" if not port else
               "invalid digit found in string" if not port.isdigit() else
               "number too large to fit in target type" if int(port) > 65535 else None)
        return f"invalid ZMQ endpoint `{endpoint}`: invalid TCP port: {why}" if why else None
    if scheme in ("ipc", "inproc"):
        return None
    return f"invalid ZMQ endpoint `{endpoint}`: unsupported scheme `{scheme}`"


@dataclass
class Listener:
    """One registered (instance, DP rank): its engine endpoints and the relay that follows them (on the
    instance named `owner`; elsewhere only known, from the registrations topic)."""
    endpoint: str
    replay_endpoint: str | None
    owner: str = ""
    status: str = "pending"
    last_error: str | None = None
    stop: Callable[..., None] | None = None
    mirror: Any = None  # the relay's mirror of the engine (VllmMirror), where the relay runs here


@dataclass
class Worker:
    model_name: str
    routing_group: str
    listeners: dict[int, Listener] = field(default_factory=dict)


class DynamoRegistry:
    """Dynamo's worker registry (services/indexer/registry.rs), with relays for listeners.

    `start_relay(model, replica, dp_rank, endpoint, replay_endpoint, listener, block_size)` starts
    following an engine and returns `stop(retract=True)`, which stops it and retracts the replica from
    the index (None: registrations only, for tests of the bookkeeping); a relay that fails sets
    `listener.status`. `log` (index_service/registrations.py: the compacted registrations topic) keeps
    the registrations beyond this process: `publish(Registration)`, `remove(instance_id, dp_rank)`;
    every instance applies the topic's records (`apply_record`), and the instance named `owner` runs
    the relays of the registrations it took.

    What a caller may not do (checked in `register` only: the topic's records were checked when taken):
    give an endpoint outside `allow` (index_service.guard.EndpointAllowList; 403, and no connection is
    made), a name with a control character or too long (400), take over a replica another source feeds
    (409: the endpoint registered under another key here or in `others` - the conductor's registry -,
    or a replica of that name holding blocks in `store`'s index), or register more than
    `max_registrations` pairs or a model beyond `max_models` in the index (409)."""

    def __init__(self, start_relay=None, owner: str = "local", log=None,
                 allow: EndpointAllowList | None = None, store: ShardStore | None = None,
                 max_registrations: int = MAX_REGISTRATIONS, max_models: int = MAX_MODELS):
        self.start_relay = start_relay
        self.owner = owner
        self.log = log
        self.allow = allow if allow is not None else EndpointAllowList()
        self.store = store
        self.others: list = []  # registries whose endpoints are taken too (`feeds(endpoint)`)
        self.max_registrations = max_registrations
        self.max_models = max_models
        self.workers: dict[int, Worker] = {}
        self.block_sizes: dict[tuple[str, str], int] = {}  # (model, routing group) -> block size
        self.lock = threading.Lock()
        # called (under the lock) after a worker or DP rank is added or dropped: the lookup front's sync
        self.on_change: Callable[[], None] | None = None

    # ---- registration ---------------------------------------------------------------------------
    def register(self, req: RegisterRequest) -> tuple[int, dict]:
        names = (("model_name", req.model_name), ("routing_group", req.routing_group),
                 ("tenant_id", req.tenant_id), ("endpoint", req.endpoint),
                 ("replay_endpoint", req.replay_endpoint or "-"))
        err = next((e for f, v in names if (e := name_error(f, v)) is not None), None)
        if err is not None:
            return 400, {"error": err}
        err = zmq_endpoint_error(req.endpoint)
        if err is None and req.replay_endpoint is not None:
            rerr = zmq_endpoint_error(req.replay_endpoint)
            err = f"invalid replay endpoint `{req.replay_endpoint}`: {rerr}" if rerr else None
        if err is not None:
            return 400, {"error": err}
        err = self.allow.error("endpoint", req.endpoint) or (
            self.allow.error("replay_endpoint", req.replay_endpoint) if req.replay_endpoint else None)
        if err is not None:
            return 403, {"error": err}
        reg = Registration(REGISTRATIONS_VERSION, req.instance_id, req.dp_rank or 0, req.model_name,
                           req.routing_group, req.block_size, req.endpoint, req.replay_endpoint, self.owner)
        with self.lock:
            conflict = self._conflict(reg) or self._taken(reg)
            if conflict is not None:
                return 409, {"error": conflict}
            listener = self._add(reg)
        if self.log is not None:
            try:
                self.log.publish(reg)
            except Exception as e:  # noqa: BLE001 - the registration is not kept: it does not happen
                with self.lock:
                    self._drop(reg.instance_id, reg.dp_rank)
                return 503, {"error": f"the registration could not be kept (registrations topic): {e}"}
        self._start(reg, listener)
        log.info("event=dynamo_register instance=%d dp_rank=%d model=%s endpoint=%s", reg.instance_id,
                 reg.dp_rank, reg.model_name, reg.endpoint)
        return 201, {"status": "ok"}

    def _conflict(self, reg: Registration) -> str | None:
        iid, rank, key = reg.instance_id, reg.dp_rank, (reg.model_name, reg.routing_group)
        w = self.workers.get(iid)
        if w is not None:
            if (w.model_name, w.routing_group) != key:
                return (f"instance {iid} is already registered for model={w.model_name} "
                        f"routing_group={w.routing_group}")
            if rank in w.listeners:
                return f"instance {iid} dp_rank {rank} already registered"
        bs = self.block_sizes.get(key, reg.block_size)
        if bs != reg.block_size:
            return (f"block_size mismatch for model={key[0]} routing_group={key[1]}: "
                    f"existing={bs}, requested={reg.block_size}")
        return None

    def _taken(self, reg: Registration) -> str | None:
        """Under the lock: why `reg` would take over a replica another source feeds, or go beyond the
        bounds (None: it does not)."""
        for iid, w in self.workers.items():
            for rank, x in w.listeners.items():
                if x.endpoint == reg.endpoint:
                    return (f"endpoint {reg.endpoint} is registered already (instance {iid} dp_rank {rank}): "
                            "unregister it first")
        for other in self.others:
            who = other.feeds(reg.endpoint)
            if who is not None:
                return f"endpoint {reg.endpoint} is fed already ({who})"
        if self.store is not None and live_replica(self.store, reg.model_name, reg.endpoint):
            return (f"endpoint: replica {reg.endpoint} of model {reg.model_name} is fed by another source "
                    "(a relay publishing its events): a registration cannot take it over")
        count = sum(len(w.listeners) for w in self.workers.values())
        if count >= self.max_registrations:
            return (f"at most {self.max_registrations} registrations (instance, dp_rank): "
                    "unregister some first")
        models = set(self.store.shards if self.store is not None else ()) | {
            w.model_name for w in self.workers.values()}  # indexed, or registered (no events yet)
        if reg.model_name not in models and len(models) >= self.max_models:
            return f"model_name: the index holds {len(models)} models, at most {self.max_models}"
        return None

    def feeds(self, endpoint: str) -> str | None:
        """Which registration here follows `endpoint` (None: none)."""
        with self.lock:
            for iid, w in self.workers.items():
                for rank, x in w.listeners.items():
                    if x.endpoint == endpoint:
                        return f"Dynamo registration of instance {iid} dp_rank {rank}"
        return None

    def _add(self, reg: Registration) -> Listener:
        key = (reg.model_name, reg.routing_group)
        self.block_sizes.setdefault(key, reg.block_size)
        listener = Listener(reg.endpoint, reg.replay_endpoint, reg.owner,
                            "pending" if reg.owner == self.owner else "active")
        self.workers.setdefault(reg.instance_id, Worker(*key)).listeners[reg.dp_rank] = listener
        if self.on_change is not None:
            self.on_change()
        return listener

    def _drop(self, iid: int, rank: int) -> Listener | None:
        w = self.workers.get(iid)
        listener = w.listeners.pop(rank, None) if w is not None else None
        if w is not None and not w.listeners:
            del self.workers[iid]
            key = (w.model_name, w.routing_group)
            if not any((x.model_name, x.routing_group) == key for x in self.workers.values()):
                self.block_sizes.pop(key, None)  # Dynamo drops the indexer with its last worker
        if listener is not None and self.on_change is not None:
            self.on_change()
        return listener

    def _start(self, reg: Registration, listener: Listener) -> None:
        """The relay of a registration this instance owns."""
        if reg.owner != self.owner or listener.stop is not None:
            return
        refused = self.allow.error("endpoint", reg.endpoint) or (
            self.allow.error("replay_endpoint", reg.replay_endpoint) if reg.replay_endpoint else None)
        if refused is not None:  # taken before the allow-list was narrowed: kept, never connected to
            listener.status, listener.last_error = "failed", refused[:300]
            log.warning("event=dynamo_listener_refused instance=%d dp_rank=%d error=%s", reg.instance_id,
                        reg.dp_rank, listener.last_error)
            return
        if self.start_relay is None:
            listener.status = "active"
            return
        try:
            listener.stop = self.start_relay(reg.model_name, reg.endpoint, reg.dp_rank, reg.endpoint,
                                             reg.replay_endpoint, listener, reg.block_size)
            listener.status = "active"
        except Exception as e:  # noqa: BLE001 - reported on /workers, as Dynamo reports listener errors
            listener.status, listener.last_error = "failed", str(e)[:300]
            log.warning("event=dynamo_listener_failed instance=%d endpoint=%s error=%s", reg.instance_id,
                        reg.endpoint, listener.last_error)

    def unregister(self, req: UnregisterRequest) -> tuple[int, dict]:
        iid = req.instance_id
        with self.lock:
            w = self.workers.get(iid)
            if w is None:
                return 404, {"error": f"instance {iid} not found"}
            mismatch = {"error": f"instance {iid} is registered for model={w.model_name} "
                                 f"routing_group={w.routing_group}"}
            if w.model_name != req.model_name:
                return 404, mismatch
            if req.routing_group is not None and w.routing_group != req.routing_group:
                return 404, mismatch
            if req.routing_group is not None and req.dp_rank is not None:  # Dynamo: rank only with a group
                if req.dp_rank not in w.listeners:
                    return 404, {"error": f"instance {iid} dp_rank {req.dp_rank} not found"}
                ranks = [req.dp_rank]
            else:
                ranks = list(w.listeners)
        if self.log is not None:  # the tombstones first: a registration not removed for good stays
            try:
                for rank in ranks:
                    self.log.remove(iid, rank)
            except Exception as e:  # noqa: BLE001 - nothing is removed: the caller retries
                return 503, {"error": f"the unregistration could not be kept (registrations topic): {e}"}
        with self.lock:
            gone = {rank: x for rank in ranks if (x := self._drop(iid, rank)) is not None}
        for listener in gone.values():
            if listener.stop is not None:  # this instance's relay (another's stops on the tombstone)
                listener.stop()
        log.info("event=dynamo_unregister instance=%d ranks=%s model=%s", iid, sorted(gone), w.model_name)
        return 200, {"status": "ok"}

    def apply_record(self, key: bytes, reg: Registration | None) -> None:
        """A record of the registrations topic (every instance's, this one's echoes included): a
        registration known from elsewhere, or one this instance owns and takes up again after a
        restart (its relay starts); a tombstone drops it (and stops this instance's relay)."""
        iid_text, _, rank_text = key.decode().partition("/")
        iid, rank = int(iid_text), int(rank_text)
        if reg is None:
            with self.lock:
                listener = self._drop(iid, rank)
            if listener is not None and listener.stop is not None:
                listener.stop()
            return
        with self.lock:
            w = self.workers.get(iid)
            known = w.listeners.get(rank) if w is not None else None
            if known is not None:
                return  # this instance's own registration, or one already applied
            if self._conflict(reg) is not None:
                log.warning("event=dynamo_registration_conflict instance=%d dp_rank=%d", iid, rank)
                return
            listener = self._add(reg)
        self._start(reg, listener)

    def worker_infos(self, model_name: str | None, routing_group: str | None) -> list[dict]:
        out = []
        with self.lock:
            for iid, w in self.workers.items():
                if not w.listeners or (model_name is not None and w.model_name != model_name) or (
                        routing_group is not None and w.routing_group != routing_group):
                    continue
                states = [x.status for x in w.listeners.values()]
                status = next((s for s in ("failed", "pending", "active") if s in states), "paused")
                listeners = {}
                for rank, x in sorted(w.listeners.items()):
                    info = {"endpoint": x.endpoint, "status": x.status}
                    if x.last_error:
                        info["last_error"] = x.last_error
                    listeners[str(rank)] = info
                out.append({"instance_id": iid, "source": "zmq", "status": status, "model_name": w.model_name,
                            "routing_group": w.routing_group,
                            "block_size": self.block_sizes[(w.model_name, w.routing_group)],
                            "endpoints": {str(r): x.endpoint for r, x in sorted(w.listeners.items())},
                            "listeners": listeners})
        return out

    def instances(self, model_name: str, routing_group: str) -> dict[str, int]:
        """kvidx replica name (the endpoint) -> instance id, for the workers of one (model, group)."""
        with self.lock:
            return self._instances(model_name, routing_group)

    def _instances(self, model_name: str, routing_group: str) -> dict[str, int]:
        return {x.endpoint: iid for iid, w in self.workers.items()
                if (w.model_name, w.routing_group) == (model_name, routing_group)
                for x in w.listeners.values()}

    def groups(self) -> list[tuple[str, str, int, dict[str, int]]]:
        """Every (model, routing group) with workers: (model, group, block size, replica -> instance
        id). Called under the lock (`on_change`) or takes it."""
        return [(m, g, bs, self._instances(m, g)) for (m, g), bs in self.block_sizes.items()]

    def dump(self) -> dict[str, dict]:
        """Dynamo's GET /dump (services/indexer/server.rs dump_registry): per "model:routing_group" the
        block size and RouterEvents re-creating the blocks of the workers whose relays run here, one
        stored event per block, device tier first, parents before children (the shape its --peers
        recovery reads: recovery.rs)."""
        with self.lock:
            workers = [(iid, w, dict(w.listeners)) for iid, w in self.workers.items()]
            sizes = dict(self.block_sizes)
        out: dict[str, dict] = {}
        per_key: dict[tuple[str, str], list] = {}
        for iid, w, listeners in workers:
            for rank, listener in sorted(listeners.items()):
                if listener.mirror is None:
                    continue
                blocks = per_key.setdefault((w.model_name, w.routing_group), [])
                for tier, eh, tokens_hash, up, depth in listener.mirror.dynamo_blocks():
                    dtier = _DYNAMO_TIERS.get(tier, "external")
                    blocks.append((dtier != "device", depth, iid, rank, dtier, eh, tokens_hash, up))
        for (model, group), blocks in per_key.items():
            blocks.sort(key=lambda b: b[:2])
            out[f"{model}:{group}"] = {"block_size": sizes.get((model, group), 0), "events": [
                {"worker_id": iid, "storage_tier": tier, "residency_domain": "worker",
                 "event": {"event_id": n, "data": {"stored": {
                     "parent_hash": up, "start_position": None,
                     "blocks": [{"block_hash": eh, "tokens_hash": th, "mm_extra_info": None}]}},
                     "dp_rank": rank}}
                for n, (_, _, iid, rank, tier, eh, th, up) in enumerate(blocks)]}
        return out

    def stop_all(self) -> None:
        """The service shuts down: its relays stop; the replicas stay in the index (their engines run
        on, and other instances follow the same events)."""
        with self.lock:
            listeners = [x for w in self.workers.values() for x in w.listeners.values()]
        for x in listeners:
            if x.stop is not None:
                x.stop(False)
                x.stop = None


def live_replica(store: ShardStore, model: str, replica: str) -> bool:
    """The index holds blocks of `replica` (any DP rank) in `model`: some source feeds it."""
    shard = store.shards.get(model)
    return shard is not None and any(st.blocks > 0 for st in list(index.replicas(shard))
                                     if st.replica == replica)


# ---- the query --------------------------------------------------------------------------------------
# Dynamo's tiers below the GPU: host memory, disk + "external" (as Dynamo folds them)
LOWER_LEVELS = (("CPU",), ("DISK", "NODE_SHARED", "POOL"))  # Dynamo's host memory, then the rest


def dump_blocks(dump: dict) -> dict[str, list[list]]:
    """A GET /dump body (Dynamo's or kvidx's) block by block, to compare two: per "model:group" the sorted
    [worker_id, dp_rank, storage_tier, block_hash, tokens_hash, parent_hash] of every stored block
    (Dynamo's dump runs a chain's blocks in one event; kvidx's has one event per block)."""
    out = {}
    for key, entry in dump.items():
        rows = []
        for ev in entry.get("events", []):
            stored = ev["event"]["data"].get("stored") if isinstance(ev["event"]["data"], dict) else None
            if stored is None:
                continue
            up = stored["parent_hash"]
            for b in stored["blocks"]:
                rows.append([ev["worker_id"], ev["event"].get("dp_rank", 0), ev.get("storage_tier", "device"),
                             b["block_hash"], b["tokens_hash"], up])
                up = b["block_hash"]
        out[key] = sorted(rows, key=lambda r: (r[0], r[1], r[2], r[3], r[4], -1 if r[5] is None else r[5]))
    return out


# kvidx tier -> Dynamo's StorageTier (protocols.rs, serde snake_case)
_DYNAMO_TIERS = {"GPU": "device", "CPU": "host_pinned", "DISK": "disk"}


def score_response(store: ShardStore, registry: DynamoRegistry, req: QueryRequest | QueryByHashRequest,
                   only: frozenset[int] | None = None) -> tuple[int, dict]:
    """POST /query (the prompt hashed canonically at kvidx's index block) or /query_by_hash (Dynamo's
    local hashes, chained into the Dynamo keys the registered relays publish: one per Dynamo block).
    `only`: the replicas of these replica groups (another instance's fan-out); empty: all."""
    key = (req.model_name, req.routing_group)
    block_size = registry.block_sizes.get(key)
    if block_size is None:
        return 404, {"error": f"no indexer for model={req.model_name} routing_group={req.routing_group}"}
    empty = {"frequencies": [], "instances": {}, "scores": {}}
    shard = store.shards.get(req.model_name)
    names = registry.instances(*key)
    if shard is None or not names or block_size <= 0:
        return 200, empty
    if not index.has_blocks(shard):
        return 200, empty
    if isinstance(req, QueryByHashRequest):
        hashes, tokens_per_key = dynamo_keys([h & _M64 for h in req.block_hashes]), block_size
    else:
        tokens_per_key = shard.block_size
        # Dynamo drops the trailing partial block of its own size; empty strings are no namespace
        tokens = req.token_ids  # a list, or packed uint32 bytes (the compiled parser's)
        n = (len(tokens) // 4 if isinstance(tokens, bytes) else len(tokens)) // block_size * block_size
        tokens = tokens[:4 * n] if isinstance(tokens, bytes) else tokens[:n]
        hashes = prompt_hashes(tokens, tokens_per_key, req.lora_name or None, req.cache_salt or None)
    if not hashes:
        return 200, empty
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, dict] = {}
    for slot, reach in index.tier_reach(shard, hashes, LOWER_LEVELS).items():  # each lower tier continues
        st = index.replica_at(shard, slot)
        if st is None or st.replica not in names or (only and st.group not in only):
            continue
        g_tok, c_tok, d_tok = (b * tokens_per_key // block_size * block_size for b in reach)
        if not d_tok:
            continue
        iid = str(names[st.replica])
        rank = str(st.dp_rank)
        if g_tok:
            scores.setdefault(iid, {})[rank] = g_tok
        inst = instances.setdefault(iid, {"cpu": 0, "disk": 0, "dp": {}, "gpu": 0, "longest_matched": 0})
        inst["dp"][rank] = g_tok
        inst["gpu"], inst["cpu"] = max(inst["gpu"], g_tok), max(inst["cpu"], c_tok)
        inst["disk"] = inst["longest_matched"] = max(inst["disk"], d_tok)
    return 200, {"frequencies": [], "instances": instances, "scores": scores}


# ---- HTTP -------------------------------------------------------------------------------------------
def _json(status: int, body) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


def _text(status: int, text: str) -> Response:
    return Response(text, status_code=status, media_type="text/plain; charset=utf-8")


async def _body(request: Request, typ: type, limit: int):
    """A JSON body as axum's Json<T> takes it: 415 -> 413 -> 400 -> 422, or the decoded struct."""
    body = await _raw_body(request, limit)
    return body if isinstance(body, Response) else _decode_body(body, typ)


def _media_error(content_type: str) -> Response | None:
    """415 as axum's Json<T> for a body that is not JSON, else None."""
    ctype = content_type.split(";")[0].strip().lower()
    if not (ctype == "application/json" or (ctype.startswith("application/") and ctype.endswith("+json"))):
        return _text(415, "Expected request with `Content-Type: application/json`")
    return None


async def _raw_body(request: Request, limit: int) -> bytes | Response:
    """The body's bytes (415 and 413 as axum's Json<T>)."""
    refused = _media_error(request.headers.get("content-type", ""))
    if refused is not None:
        return refused
    cl = request.headers.get("content-length", "")
    if cl.isascii() and cl.isdigit() and int(cl) > limit:
        return _too_large()  # refused before a byte of it is read
    whole = getattr(request, "whole_body", None)  # read in full already (index_service.hot_path)
    if whole is not None:
        return whole if len(whole) <= limit else _too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return _too_large()
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large() -> Response:
    return _text(413, "Failed to buffer the request body: length limit exceeded")


def _decode_body(body: bytes, typ: type):
    """400 -> 422 as axum's Json<T>, or the struct. A query's token ids go from JSON text to packed
    uint32 bytes where the compiled parser is built."""
    if typ is QueryRequest:
        req = read_split(_query_rest, body)
        if req is not None:
            return req  # else decoded the ordinary way below, for the ordinary error
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        return _text(400, f"Failed to parse the request body as JSON: {e}")
    except RecursionError:
        return _text(400, f"Failed to parse the request body as JSON: {MAX_DEPTH_ERROR}")
    try:
        return msgspec.convert(raw, typ)
    except msgspec.ValidationError as e:
        return _text(422, f"Failed to deserialize the JSON body into the target type: {e}")


async def query_handler(store: ShardStore, registry: DynamoRegistry, request, fanout=None,
                        typ: type = QueryRequest, metrics=None) -> Response:
    """POST /query or /query_by_hash (/query also taken straight from the ASGI scope by
    index_service.hot_path). A model split in replica groups: the groups this instance does not hold
    are asked of their holders (`fanout`, index_service.fanout), which answer `?local=1&groups=...`
    from their shards for those groups; a group no holder answered for in time is counted in
    kvidx_fanout_partial_total (`metrics`): Dynamo's answer has no field for it."""
    raw = await _raw_body(request, MAX_QUERY_BODY)
    read = raw if isinstance(raw, Response) else _read_query(raw, typ, request.query_params)
    if isinstance(read, Response):
        return read
    req, only = read
    missing = store.missing_groups(req.model_name) if fanout is not None and only is None else []
    t0 = time.perf_counter()
    asked = asyncio.ensure_future(fanout.gather_raw(request.scope["path"], missing, raw)) if missing else None
    for _ in range(3 if asked is not None else 0):  # the peers' requests written before walking here
        await asyncio.sleep(0)
    with store.lock:
        status, body = score_response(store, registry, req, only)
    if asked is not None:
        raws, gone, _ = await asked
        parts = [body]
        for r in raws:
            try:
                parts.append(msgspec.json.decode(r))
            except msgspec.DecodeError as e:  # a peer of another version: its part is missing
                log.warning("event=fanout_unreadable path=%s error=%s", request.scope["path"], e)
                gone = gone or missing
        if status == 200:
            body = merge_scores(parts)
        if metrics is not None:
            metrics.fanout(time.perf_counter() - t0, len(gone))
    return _json(status, body)


def _read_query(body: bytes, typ: type, query_params) -> tuple[Any, frozenset[int] | None] | Response:
    """A query body's request and the replica groups it asks of (`?local=1&groups=`), or its 400/422."""
    req = _decode_body(body, typ)
    if isinstance(req, Response):
        return req
    if typ is QueryByHashRequest and req.cache_salt is not None:  # Dynamo: the salt is in the hashes
        return _json(400, {"error": "cache_salt is not accepted by /query_by_hash; block_hashes must "
                                    "already include the intended cache salt"})
    try:
        return req, local_groups(query_params)
    except Reject as e:
        return _json(e.status, {"error": e.error})


def answer_query(store: ShardStore, registry: DynamoRegistry, typ: type, content_type: str, body: bytes,
                 query_params) -> Response:
    """POST /query (typ QueryRequest) or /query_by_hash (QueryByHashRequest) with its body read,
    answered from this instance's shards alone: `query_handler` without the fan-out (the lookup
    front's fallback, index_service.lookup_front)."""
    refused = _media_error(content_type) or (_too_large() if len(body) > MAX_QUERY_BODY else None)
    if refused is not None:
        return refused
    read = _read_query(body, typ, query_params)
    if isinstance(read, Response):
        return read
    with store.lock:
        status, out = score_response(store, registry, *read)
    return _json(status, out)


def merge_scores(parts: list[dict]) -> dict:
    """Dynamo ScoreResponses of disjoint replica groups as one: a worker's DP ranks may sit in several."""
    out: dict = {"frequencies": [], "instances": {}, "scores": {}}
    for p in parts:
        for iid, ranks in p.get("scores", {}).items():
            out["scores"].setdefault(iid, {}).update(ranks)
        for iid, inst in p.get("instances", {}).items():
            cur = out["instances"].get(iid)
            if cur is None:
                out["instances"][iid] = {**inst, "dp": dict(inst["dp"])}
                continue
            cur["dp"].update(inst["dp"])
            for k in ("cpu", "disk", "gpu", "longest_matched"):
                cur[k] = max(cur[k], inst[k])
    return out


def add_dynamo_routes(app: FastAPI, store: ShardStore, registry: DynamoRegistry, fanout=None,
                      metrics=None) -> None:
    """Dynamo's paths on `app` (outside /v1/: Dynamo's API has no auth); `fanout`: the instances holding
    a split model's other replica groups."""
    app.state.dynamo = registry

    @app.post("/register", include_in_schema=False)
    async def register(request: Request) -> Response:
        req = await _body(request, RegisterRequest, MAX_BODY)
        return req if isinstance(req, Response) else _json(*registry.register(req))

    @app.post("/unregister", include_in_schema=False)
    async def unregister(request: Request) -> Response:
        req = await _body(request, UnregisterRequest, MAX_BODY)
        return req if isinstance(req, Response) else _json(*registry.unregister(req))

    @app.get("/workers", include_in_schema=False)
    async def workers(model_name: str | None = None, routing_group: str | None = None) -> Response:
        return _json(200, registry.worker_infos(model_name, routing_group))

    @app.get("/dump", include_in_schema=False)
    async def dump() -> Response:
        return _json(200, registry.dump())

    @app.post("/query", include_in_schema=False)
    async def query(request: Request) -> Response:
        return await query_handler(store, registry, request, fanout, metrics=metrics)

    @app.post("/query_by_hash", include_in_schema=False)
    async def query_by_hash(request: Request) -> Response:
        return await query_handler(store, registry, request, fanout, QueryByHashRequest, metrics)

    @app.get("/health", include_in_schema=False)
    async def health() -> Response:
        return Response(status_code=200)
