"""SGLang's external KV indexer API (gRPC `kv_indexer.v1.KVIndexer`, schemas/proto/kv_indexer.proto),
served by `kvidx serve --sglang-indexer MODEL=[HOST:]PORT` over the same index as kvidx's own API: an
sgl-router started with `--kv-indexer-endpoint` and SGLang's kv-indexer bridges point at kvidx unchanged.

Read from sglang's experimental/sgl-kv-indexer (src/service.rs, the in-memory and Redis backends, the
bridge): the hashes are SGLang's block hashes as decimal strings, compared as strings; a worker's prefix
is the run of leading hashes it holds in any tier, stopping at the first it misses.

- `ApplyExternalKvBatch{worker_id, seq, actions, worker_address}` (the bridges' feed): each action
  becomes an event of the worker (replica `worker_id`, DP rank 0) - REPORT a store, REVOKE a removal,
  CLEAR_ALL_AT_TIER a one-tier clear - keyed by kvidx.core.hashing.sglang_key; the batch is published
  to the events topic like a relay's and the call answers only once the broker acknowledged it (nothing
  acknowledged is lost; SGLang's in-memory backend loses everything with its process). The worker's
  address is kept on the registrations topic (schemas/registrations.py): every instance knows it, and a
  restart does not forget it. Every batch is applied, as SGLang's indexer does (its `seq` is not a
  fence): kvidx orders a worker's batches by the receiving instance's clock, the epoch clock every
  writer shares (kvidx.core.shard.wall_epoch: milliseconds; batches of one millisecond counted in
  `seq`, never going back), so a bridge that moves to another instance goes on. A worker is fed either
  by a bridge or by a kvidx relay under one replica name, not both: a batch for a worker id whose
  replica a relay feeds (it holds blocks, and no bridge fed it before) is refused with ALREADY_EXISTS
  and changes nothing. `worker_address` must be within the endpoint allow-list (index_service.guard:
  the router sends the worker's requests there; INVALID_ARGUMENT, the address kept is unchanged) and
  worker ids are names (no control characters, at most 256 characters).
- `MatchExternalKvPrefix{hashes, max_blocks}`: per worker, the leading hashes it holds (any tier), longest
  first; workers without an address are left out (the router could not route to them). A worker known
  only from kvidx's own relays has its replica name as its address: name such replicas by the router's
  worker URL. `blocks_read` is the number of hashes considered (what SGLang's reference path reads).
- `MatchExternalKv{hashes, count_as_hit}`: per worker and tier, which of the hashes it holds.
- `GetExternalKvHitCounts{hashes}`: how many `count_as_hit` matches found each hash (hashes never found
  are left out); counted in this process, like SGLang's in-memory backend.

Checks and status codes are SGLang's (INVALID_ARGUMENT, RESOURCE_EXHAUSTED with its texts); a
message that is no protobuf of the method's request is INVALID_ARGUMENT, and at most
MAX_CONCURRENT_RPCS calls run at once (more: RESOURCE_EXHAUSTED). SGLang's
tiers map to kvidx's: HBM = GPU, DRAM = CPU, SSD = DISK (kvidx's shared tiers are not reported). A model
split in replica groups: the prefix query asks the other groups' holders over HTTP (`POST
/internal/sglang/{model}/match_prefix?local=1&groups=...`, index_service/fanout.py) and merges per worker
(a worker's prefix is its own).

With credentials (`kvidx serve --auth-token-file`) every call carries the metadata `authorization:
Bearer <token>`, checked by a server interceptor before the request is read: UNAUTHENTICATED without
or with a wrong token, PERMISSION_DENIED without the scope (the feed needs `write`, the queries `read`:
index_service.auth.RPC_SCOPES).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent import futures
from urllib.parse import quote

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import Response
from google.protobuf.message import DecodeError

from index_service.auth import RPC_SCOPES, Credentials, TlsFiles, rpc_scope_needed
from index_service.dynamo_api import live_replica
from index_service.fanout import LOCAL_ONLY, local_groups
from index_service.guard import EndpointAllowList, name_error
from index_service.sglang_pb import kv_indexer_pb2 as pb
from index_service.store import ShardStore
from index_service.wire import Reject
from kvidx import index
from kvidx.core.hashing import sglang_key
from kvidx.core.shard import MAX_EPOCH_SKEW_MS, wall_epoch
from schemas.events import (
    SCHEMA_VERSION,
    BlocksRemoved,
    BlocksStored,
    Event,
    EventBatch,
    ReplicaCleared,
)
from schemas.registrations import REGISTRATIONS_VERSION, SglangWorker

log = logging.getLogger("kvidx.sglang")

SERVICE = "kv_indexer.v1.KVIndexer"
MAX_HASHES_PER_REQUEST = 16_384  # SGLang's protocol bounds (service.rs)
MAX_ACTIONS_PER_BATCH = 256
MAX_HIT_ENTRIES = 1 << 20  # hit counters kept (oldest first out)
MAX_CONCURRENT_RPCS = 64  # calls in progress at once; more are refused (RESOURCE_EXHAUSTED)
MAX_WORKERS = 4096  # workers a model's feed may name (each is a replica of the index, in /metrics too)
MAX_PEER_BODY = 4 << 20  # a peer's MatchExternalKvPrefixRequest (16,384 hashes of <= 20 digits + framing)
TIERS = {pb.TIER_HBM: "GPU", pb.TIER_DRAM: "CPU", pb.TIER_SSD: "DISK"}
SGLANG_TIERS = {name: tier for tier, name in TIERS.items()}


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def check_hashes(hashes) -> None:
    if not hashes:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "hashes must not be empty")
    if len(hashes) > MAX_HASHES_PER_REQUEST:
        raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"request contains {len(hashes)} hashes; maximum is {MAX_HASHES_PER_REQUEST}")
    if not all(hashes):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "hashes must not contain empty values")


def check_actions(actions) -> None:
    if len(actions) > MAX_ACTIONS_PER_BATCH:
        raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"batch contains {len(actions)} actions; maximum is {MAX_ACTIONS_PER_BATCH}")
    total = sum(len(a.hashes) for a in actions)
    if total > MAX_HASHES_PER_REQUEST:
        raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"batch contains {total} hashes; maximum is {MAX_HASHES_PER_REQUEST}")
    for a in actions:
        if a.tier == pb.TIER_UNKNOWN:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "tier must not be TIER_UNKNOWN")
        if a.tier not in TIERS:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "tier is not supported")
        if a.type in (pb.ACTION_REPORT, pb.ACTION_REVOKE):
            check_hashes(a.hashes)
        elif a.type != pb.ACTION_CLEAR_ALL_AT_TIER:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "action type is not supported")


def action_events(actions) -> list[Event]:
    """An SGLang batch's actions as kvidx events of its worker, in order."""
    out: list[Event] = []
    for a in actions:
        tier = TIERS[a.tier]
        if a.type == pb.ACTION_CLEAR_ALL_AT_TIER:
            out.append(ReplicaCleared("sglang CLEAR_ALL_AT_TIER", tier=tier))
            continue
        keys = [sglang_key(h) for h in a.hashes]
        if a.type == pb.ACTION_REPORT:
            out.append(BlocksStored(tier, 0, keys, None, 0, router_keys=True))
        else:
            out.append(BlocksRemoved(tier, 0, keys, router_keys=True))
    return out


class SglangIndexer:
    """One model's SGLang indexer API over the store. `publish(EventBatch)` hands the batch on, in
    order, and returns None or a function that returns once the batch is durable (KafkaSink.
    publish_acked; a ShardStore's apply in process); `keep_address(SglangWorker)` records a worker's
    address durably (RegistrationLog.publish_sglang_worker), or None."""

    def __init__(self, store: ShardStore, model: str, publish: Callable[[EventBatch], None] | None = None,
                 keep_address: Callable[[SglangWorker], None] | None = None, count=None,
                 allow: EndpointAllowList | None = None):
        self.store = store
        self.allow = allow if allow is not None else EndpointAllowList()
        self.model = model
        self.publish = publish
        self.keep_address = keep_address
        self.count = count  # count(method, status code name): the service's lookup counter, or None
        # remote(groups, request) -> the prefix answers of those groups' holders (a split model), or None
        self.remote: Callable[[list[int], pb.MatchExternalKvPrefixRequest], list] | None = None
        self.addresses: dict[str, str] = {}  # worker id -> address (the registrations topic's)
        self.hits: OrderedDict[str, int] = OrderedDict()  # least recently matched first
        self.hits_lock = threading.Lock()
        self.clock: dict[str, tuple[int, int]] = {}  # worker -> its last batch's (epoch ms, seq)
        self.lock = threading.Lock()  # a batch's (epoch, seq) is its order: taken and produced under it

    # ---- queries ------------------------------------------------------------------------------------
    def _address(self, worker: str) -> str:
        return self.addresses.get(worker, worker)

    def match_prefix(self, req: pb.MatchExternalKvPrefixRequest, only: frozenset[int] | None = None
                     ) -> pb.MatchExternalKvPrefixResponse:
        """`only`: the workers of these replica groups (another instance's fan-out; empty: all of this
        instance's); None: every worker, those of the groups held elsewhere asked of their holders
        (`remote`)."""
        check_hashes(req.hashes)
        hashes = req.hashes if not req.max_blocks else req.hashes[:req.max_blocks]
        out = pb.MatchExternalKvPrefixResponse(blocks_read=len(hashes))
        missing = self.store.missing_groups(self.model) if self.remote is not None and only is None else []
        best: dict[str, int] = {}  # worker -> its longest prefix over its DP ranks
        shard = self.store.shards.get(self.model)
        if index.has_blocks(shard):
            for slot, n in index.prefix_hits(shard, [sglang_key(h) for h in hashes]).items():
                st = index.replica_at(shard, slot)
                if st is not None and n > best.get(st.replica, 0) and (not only or st.group in only):
                    best[st.replica] = n
        peer_address: dict[str, str] = {}
        if missing:  # a worker's prefix is its own: the holders' answers merge per worker
            for part in self.remote(missing, pb.MatchExternalKvPrefixRequest(hashes=hashes)):
                for m in part.matches:
                    if m.matched_prefix_blocks > best.get(m.worker_id, 0):
                        best[m.worker_id] = m.matched_prefix_blocks
                        peer_address[m.worker_id] = m.worker_address
        ranked = sorted(((n, w, self.addresses.get(w) if w in self.addresses else peer_address.get(w, w))
                         for w, n in best.items()), key=lambda t: (-t[0], t[1]))
        out.matches.extend(pb.ExternalKvPrefixMatch(worker_address=a, matched_prefix_blocks=n, worker_id=w)
                           for n, w, a in ranked if a)
        out.best_prefix_blocks = out.matches[0].matched_prefix_blocks if out.matches else 0
        return out

    def match(self, req: pb.MatchExternalKvRequest) -> pb.MatchExternalKvResponse:
        check_hashes(req.hashes)
        out = pb.MatchExternalKvResponse()
        shard = self.store.shards.get(self.model)
        if not index.has_blocks(shard):
            return out
        keys = [sglang_key(h) for h in req.hashes]
        held: dict[str, dict[int, list]] = {}  # worker -> SGLang tier -> (index, hash), in request order
        matched = [False] * len(keys)
        for name, tier in SGLANG_TIERS.items():
            for i, m in enumerate(index.held_in(shard, (name,), keys)):
                if m:
                    matched[i] = True
                for slot in index.holders(m):  # each slot holding the hash
                    st = index.replica_at(shard, slot)
                    row = held.setdefault(st.replica, {}).setdefault(tier, []) if st is not None else None
                    if row is not None and (not row or row[-1][0] != i):  # DP ranks: once per worker
                        row.append((i, req.hashes[i]))
        for w in sorted(held):
            node = out.matches.add(worker_id=w, address=self._address(w))
            for tier in sorted(held[w]):
                node.hashes_by_tier.add(tier=tier, hashes=[h for _, h in held[w][tier]])
        if req.count_as_hit:
            hits = self.hits
            with self.hits_lock:
                for h, hit in zip(req.hashes, matched, strict=True):
                    if hit:
                        hits[h] = hits.get(h, 0) + 1
                        hits.move_to_end(h)
                while len(hits) > MAX_HIT_ENTRIES:
                    hits.popitem(last=False)
        return out

    def hit_counts(self, req: pb.GetExternalKvHitCountsRequest) -> pb.GetExternalKvHitCountsResponse:
        check_hashes(req.hashes)
        out = pb.GetExternalKvHitCountsResponse()
        for h in req.hashes:
            c = self.hits.get(h)
            if c is not None:
                out.entries.add(hash=h, hit_count_total=c)
        return out

    # ---- the feed -----------------------------------------------------------------------------------
    def apply(self, req: pb.ApplyExternalKvBatchRequest) -> pb.ApplyExternalKvBatchResponse:
        if not req.worker_id:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "worker_id must not be empty")
        bad = name_error("worker_id", req.worker_id) or (
            self.allow.error("worker_address", req.worker_address) if req.worker_address else None)
        if bad is not None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, bad)
        check_actions(req.actions)
        if self.publish is None:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          "this kvidx instance takes no feed (it has no events topic to publish to)")
        w = req.worker_id
        known = self.addresses.get(w)
        if known is None and len(self.addresses) >= MAX_WORKERS:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"worker_id {w!r}: model {self.model} is fed for {MAX_WORKERS} workers already")
        if known is None and live_replica(self.store, self.model, w):
            raise Refused(grpc.StatusCode.ALREADY_EXISTS,
                          f"worker_id {w!r}: replica {w} of model {self.model} is fed by a kvidx relay; a "
                          "feed cannot take it over (name the bridge's worker differently)")
        if known != req.worker_address:  # every batch sets it (empty: unroutable)
            if self.keep_address is not None:  # kept before the batch is acknowledged
                try:
                    self.keep_address(SglangWorker(REGISTRATIONS_VERSION, self.model, w, req.worker_address))
                except Exception as e:  # noqa: BLE001 - the bridge retries the batch
                    raise RuntimeError(f"the worker's address could not be kept: {e}") from None
            self.addresses[w] = req.worker_address
        if not req.actions:
            return pb.ApplyExternalKvBatchResponse()  # SGLang: a no-op that refreshes the address
        events = action_events(req.actions)
        with self.lock:  # only the order is taken here; the broker's acknowledgement is awaited outside
            epoch, seq = self.clock[w] = self._next(w)
            now = time.time()
            wait = self.publish(EventBatch(SCHEMA_VERSION, self.model, w, 0, epoch, seq, now, now, 0, events))
        if callable(wait):  # a ShardStore's apply answers a bool: applied already
            wait()
        return pb.ApplyExternalKvBatchResponse()

    def _next(self, w: str) -> tuple[int, int]:
        """Under the lock: the (epoch, seq) of the worker's next batch: this millisecond's epoch (seq 0),
        or its last epoch's next seq where the clock has not moved on (or went back). A worker this
        process has not fed yet goes on from what the index applied of it (an epoch that is no
        milliseconds, ahead of the clock, does not count)."""
        now = wall_epoch()
        last = self.clock.get(w)
        if last is None:
            shard = self.store.shards.get(self.model)
            st = index.replica_of(shard, w)
            last = (st.epoch, st.seq) if st is not None and st.epoch <= now + MAX_EPOCH_SKEW_MS else (-1, -1)
        return (now, 0) if now > last[0] else (last[0], last[1] + 1)

    def learn_address(self, w: SglangWorker) -> None:
        """A record of the registrations topic (any instance's)."""
        if w.model == self.model:
            with self.lock:
                self.addresses[w.worker_id] = w.address


def _handler(indexer: SglangIndexer, method: str, call, request_type):
    def handle(request, context: grpc.ServicerContext):
        code, message, reply = grpc.StatusCode.OK, "", None
        try:
            if isinstance(request, _Undecodable):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"the message is no {request_type.DESCRIPTOR.name}: {request.why}"[:300])
            reply = call(request)
        except Refused as e:
            code, message = e.code, str(e)
        except RuntimeError as e:  # the broker did not acknowledge a feed batch: the bridge retries
            log.error("event=sglang_feed_failed method=%s error=%s", method, e)
            code, message = grpc.StatusCode.UNAVAILABLE, str(e)
        except Exception as e:  # noqa: BLE001 - one line for the caller and the log, not a traceback
            log.error("event=sglang_rpc_failed method=%s error=%s: %s", method, type(e).__name__, e)
            code, message = grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"[:300]
        if indexer.count is not None:
            indexer.count(method, code.name)
        if code is not grpc.StatusCode.OK:
            context.abort(code, message)
        return reply

    def deserialize(raw: bytes):
        try:
            return request_type.FromString(raw)
        except (DecodeError, RecursionError, ValueError) as e:  # answered INVALID_ARGUMENT, not INTERNAL
            return _Undecodable(str(e) or type(e).__name__)

    return grpc.unary_unary_rpc_method_handler(handle, request_deserializer=deserialize,
                                               response_serializer=lambda m: m.SerializeToString())


class _Undecodable:
    """A request that is no protobuf of its method's message (what the deserializer hands the handler)."""

    def __init__(self, why: str):
        self.why = why


class RequireScope(grpc.ServerInterceptor):
    """Every call needs `authorization: Bearer <token>` metadata of a token with the method's scope."""

    def __init__(self, credentials: Credentials, count: Callable[[str, str], None] | None = None):
        self.credentials = credentials
        self.count = count

    def intercept_service(self, continuation, details):
        header = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        refused = self.credentials.refusal(header, rpc_scope_needed(details.method), f"rpc {details.method}")
        if refused is None:
            return continuation(details)
        code = grpc.StatusCode.UNAUTHENTICATED if refused.status == 401 else grpc.StatusCode.PERMISSION_DENIED
        method = details.method.rsplit("/", 1)[-1]
        if self.count is not None and method in RPC_SCOPES:  # no label from a name the caller chose
            self.count(method, code.name)

        def refuse(request, context: grpc.ServicerContext):
            context.abort(code, refused.error)

        return grpc.unary_unary_rpc_method_handler(refuse)


def start_server(indexer: SglangIndexer, address: str, workers: int = 8,
                 credentials: Credentials | None = None, tls: TlsFiles | None = None
                 ) -> tuple[grpc.Server, int]:
    """Serve `indexer` on `address` ("host:port"; port 0 picks one). Returns (server, bound port).
    `credentials`: the tokens every call must carry (RequireScope); None: open. `tls`: TLS (mTLS with
    its CA) instead of plaintext."""
    methods = {
        "ApplyExternalKvBatch": (indexer.apply, pb.ApplyExternalKvBatchRequest),
        "MatchExternalKv": (indexer.match, pb.MatchExternalKvRequest),
        "MatchExternalKvPrefix": (indexer.match_prefix, pb.MatchExternalKvPrefixRequest),
        "GetExternalKvHitCounts": (indexer.hit_counts, pb.GetExternalKvHitCountsRequest),
    }
    handlers = {name: _handler(indexer, name, call, typ) for name, (call, typ) in methods.items()}
    # SGLang's own bound on a message (16,384 hashes of up to 20 digits, with framing); at most
    # MAX_CONCURRENT_RPCS such messages are taken in at once
    limit = 64 << 20
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sglang-grpc"),
                         interceptors=[RequireScope(credentials, indexer.count)] if credentials else [],
                         maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
                         options=[("grpc.max_receive_message_length", limit),
                                  ("grpc.max_send_message_length", limit),
                                  ("grpc.so_reuseport", 0)])  # a port in use is an error, not shared
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    if tls is not None:
        port = server.add_secure_port(address, tls.grpc_credentials())
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address} for SGLang's indexer API")
    server.start()
    log.info("event=sglang_indexer_serving model=%s address=%s port=%d", indexer.model, address, port)
    return server, port


# ---- a model split in replica groups: instances ask each other over HTTP (index_service/fanout.py) ----
PROTOBUF = "application/x-protobuf"


def peer_path(model: str) -> str:
    return f"/internal/sglang/{quote(model, safe='')}/match_prefix"


def add_sglang_peer_route(app: FastAPI, indexers: dict[str, SglangIndexer]) -> None:
    """`POST /internal/sglang/{model}/match_prefix?local=1&groups=G,G`: a MatchExternalKvPrefixRequest
    answered from this instance's workers of those groups (what another instance's fan-out asks)."""
    @app.post("/internal/sglang/{model}/match_prefix", include_in_schema=False)
    async def match_prefix(model: str, request: Request) -> Response:
        indexer = indexers.get(model)
        if indexer is None:
            return Response(status_code=404)
        try:
            only = local_groups(request.query_params) or LOCAL_ONLY  # a peer's question: never fanned out
            body = await read_capped(request, MAX_PEER_BODY)
            if body is None:
                return Response(f"body: more than {MAX_PEER_BODY} bytes".encode(), status_code=413,
                                media_type="text/plain")
            req = pb.MatchExternalKvPrefixRequest.FromString(body)
            reply = indexer.match_prefix(req, only)
        except (Reject, Refused, DecodeError, RecursionError) as e:
            return Response(f"invalid request: {e}".encode()[:500], status_code=422, media_type="text/plain")
        return Response(reply.SerializeToString(), media_type=PROTOBUF)


async def read_capped(request: Request, limit: int) -> bytes | None:
    """The body, or None where it is (or says it is) more than `limit` bytes: not read further."""
    cl = request.headers.get("content-length", "")
    if cl.isascii() and cl.isdigit() and int(cl) > limit:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def remote_prefix(fanout, model: str, loop: asyncio.AbstractEventLoop):
    """SglangIndexer.remote for a split model: the holders asked from the gRPC thread through the
    service's event loop (where the fan-out's connections live), within its timeout."""

    def remote(groups: list[int], req: pb.MatchExternalKvPrefixRequest) -> list:
        coro = fanout.gather_raw(peer_path(model), groups, req.SerializeToString(), PROTOBUF)
        raws, gone, _ = asyncio.run_coroutine_threadsafe(coro, loop).result(fanout.timeout_s + 1.0)
        if gone:
            log.warning("event=sglang_prefix_partial model=%s missing_groups=%s", model, gone)
        return [pb.MatchExternalKvPrefixResponse.FromString(r) for r in raws]

    return remote
