"""The query pipeline of the lookup service, without HTTP: a prompt (token ids, packed bytes or block
hashes) -> its shard and canonical block hashes -> the shard's lookup (pending routed credit included)
-> audit feedback caps -> prefix price -> rank -> top_k -> the answer (kvidx.core.answers.LookupAnswer).
The HTTP handlers (index_service.lookup_routes, routing_routes) only read the body and encode what
this returns (the simulator's --http runs go through them).

This is the routers' hot path: nothing here loops over tokens in Python, and per replica there is only
the price (and the feedback cap where the audit set one).
"""

from __future__ import annotations

import time
from typing import NoReturn

import msgspec

from index_service.store import ShardStore
from index_service.wire import (
    MAX_TOP_K,
    LookupRequest,
    Reject,
    RouteRequest,
    UsageRequest,
    check_hashes,
    pack_tokens,
)
from kvidx import index
from kvidx.core.answers import LookupAnswer, PrefetchHint, ReplicaAnswer
from kvidx.core.hashing import prompt_hashes
from kvidx.core.hints import prefetch_hint
from kvidx.core.price import Pricer
from kvidx.core.sessions import SessionTracker, advice_seconds
from kvidx.core.shard import ModelShard
from schemas.hints import HINTS_VERSION, HintRecord, PrefetchRunRecord
from schemas.routes import ROUTES_VERSION, RouteDecision
from schemas.usage import USAGE_VERSION, UsageReport

MAX_MODELS_LISTED = 10  # in the 404 for an unknown model
_encode = msgspec.json.Encoder().encode


def _by_price(answer: ReplicaAnswer) -> float:
    return answer.price.total_s


class QueryPipeline:
    """Lookups and routing decisions against one store. Every method raises Reject (status, message)
    for a request it refuses; `max_tokens` bounds a prompt's length."""

    def __init__(self, store: ShardStore, max_tokens: int = 1_000_000):
        self.store = store
        self.max_tokens = max_tokens
        self.pricers: dict[str, Pricer] = {}  # per model, from the configuration
        self.trackers: dict[str, SessionTracker] = {}  # per model whose hints.sessions is on

    def shard(self, model: str) -> ModelShard:
        shard = self.store.shards.get(model)
        if shard is None and self.store.holds_part_of(model):
            # a replica group held elsewhere (fan-out): hashed and answered as an empty shard here
            return self.store.settings.new_shard(model)
        if shard is None:
            self.unknown_model(model)
        return shard

    def unknown_model(self, model: str) -> NoReturn:
        """Reject(404) naming the models this instance knows; Reject(503) while it is still rebuilding
        its shards (a 404 then would tell a router that nothing is cached anywhere, and it would route
        blind: found by bench/chaos.py, an instance restarted during a broker's outage)."""
        if not self.store.ready:
            raise Reject(503, f"not ready: {self.store.not_ready_reason or 'the shards are being rebuilt'} "
                              "(ask another instance, or again shortly)")
        known = sorted(self.store.shards)
        listed = ", ".join(repr(m) for m in known[:MAX_MODELS_LISTED]) or "none"
        more = f" (and {len(known) - MAX_MODELS_LISTED} more)" if len(known) > MAX_MODELS_LISTED else ""
        raise Reject(404, f"unknown model {model[:200]!r}: known models are {listed}{more}")

    def prompt(self, req: LookupRequest | RouteRequest) -> tuple[ModelShard, list[int], int]:
        """The shard, canonical block hashes and prompt length of a JSON request's prompt."""
        if req.token_ids is not None:
            if req.block_hashes is not None:
                raise Reject(422, "give either token_ids or block_hashes (+ prompt_tokens), not both")
            return self._token_prompt(req)
        if req.block_hashes is not None:
            return self._hashes_prompt(req)
        raise Reject(422, "give token_ids, or block_hashes and prompt_tokens")

    def _token_prompt(self, req: LookupRequest | RouteRequest) -> tuple[ModelShard, list[int], int]:
        ids = req.token_ids  # a list, or packed uint32 bytes (wire.read_lookup)
        n = len(ids) // 4 if isinstance(ids, bytes) else len(ids)
        if n == 0:
            raise Reject(422, "token_ids is empty: a prompt has at least one token")
        if n > self.max_tokens:
            raise Reject(413, f"token_ids has {n} tokens, more than max_tokens={self.max_tokens}")
        if req.prompt_tokens is not None and req.prompt_tokens != n:
            raise Reject(422, f"prompt_tokens={req.prompt_tokens} differs from the {n} token_ids")
        packed = pack_tokens(ids)
        shard = self.shard(req.model)
        return shard, prompt_hashes(packed, shard.block_size, req.lora_name, req.cache_salt,
                                    lookahead=shard.lookahead, tails=bool(shard.tail_keys), array=True), n

    def _hashes_prompt(self, req: LookupRequest | RouteRequest) -> tuple[ModelShard, list[int], int]:
        n = req.prompt_tokens
        if n is None:
            raise Reject(422, "block_hashes needs prompt_tokens (the prompt's length in tokens)")
        if n <= 0:
            raise Reject(422, f"prompt_tokens must be positive, got {n}")
        if n > self.max_tokens:
            raise Reject(413, f"prompt_tokens={n} is more than max_tokens={self.max_tokens}")
        shard = self.shard(req.model)
        hashes = req.block_hashes
        check_hashes(hashes)
        bs, la = shard.block_size, shard.lookahead
        if len(hashes) > (n - la) // bs:
            raise Reject(422, f"block_hashes has {len(hashes)} hashes but prompt_tokens={n} holds "
                              f"only {(n - la) // bs} full blocks of {bs} tokens"
                              + (f" followed by the {la} lookahead tokens their hashes cover" if la else ""))
        return shard, hashes, n

    def binary_prompt(self, model: str, body: bytes, lora_name: str | None = None,
                      cache_salt: str | None = None) -> tuple[ModelShard, list[int], int]:
        """The shard, canonical block hashes and length of a prompt given as packed little-endian
        uint32 token ids (hashed as they are: no per-token work)."""
        if len(body) % 4:
            raise Reject(400, f"binary body is {len(body)} bytes, not a multiple of 4: token ids "
                              "are packed little-endian uint32")
        if not body:
            raise Reject(422, "binary body is empty: a prompt has at least one token")
        shard = self.shard(model)
        return shard, prompt_hashes(body, shard.block_size, lora_name, cache_salt, lookahead=shard.lookahead,
                                    tails=bool(shard.tail_keys), array=True), len(body) // 4

    def pricer(self, model: str) -> Pricer:
        pricer = self.pricers.get(model)
        if pricer is None:
            pricer = self.pricers[model] = Pricer(self.store.config.model(model).price)
        return pricer

    def prefetch_on(self, model: str) -> bool:
        """Whether the operator turned prefetch hints on for `model` (hints.prefetch in its config)."""
        return self.store.config.model(model).hints.prefetch

    def prefetch_plan(self, model: str, answer: ReplicaAnswer) -> PrefetchHint | None:
        """`answer`'s replica's prefetch plan (kvidx.core.hints), expected to start the request after
        the prefill already routed there (its price's queue), or None (hints off, nothing below GPU)."""
        hints = self.store.config.model(model).hints
        if not hints.prefetch:
            return None
        queue_s = answer.price.queue_s if answer.price is not None else 0.0
        return prefetch_hint(answer, self.pricer(model), queue_s, hints.kv_bytes_per_token)

    def answer(self, shard: ModelShard, hashes: list[int], n_tokens: int, rank: bool = False,
               top_k: int | None = None, feedback=None, groups: frozenset[int] | None = None) -> LookupAnswer:
        """The answer: replicas by resumable tokens (`rank`: by
        prefix price), each priced, the best `top_k` only if given. `feedback`: an object whose
        `apply(model, replicas, block_size, prefix=)` caps replicas (kvidx.ops.feedback). `groups`: only
        the replicas of these replica groups (an instance answering another's fan-out)."""
        if top_k is not None and not 1 <= top_k <= MAX_TOP_K:
            raise Reject(422, f"top_k must be in 1..{MAX_TOP_K}, got {top_k}")
        # ranking by price, applying feedback or keeping some groups needs every replica first;
        # otherwise only the best k are described at all
        whole = (rank or groups is not None
                 or (feedback is not None and bool(feedback.by_model.get(shard.model))))
        replicas = shard.lookup(hashes, n_tokens, time.time(), None if whole else top_k)
        if groups is not None:
            states = shard.replicas
            replicas = [a for a in replicas if states[(a.replica, a.dp_rank)].group in groups]
        if feedback is not None:  # audit feedback: cap replicas whose engines reuse less
            replicas = feedback.apply(shard.model, replicas, shard.block_size,
                                      prefix=hashes[0] if hashes else None)
        if top_k is not None and not rank:
            del replicas[top_k:]  # ranked by resumable tokens: the rest need no price
        pricer = self.pricer(shard.model)
        for r in replicas:
            r.price = pricer(r, n_tokens)
        if rank:
            replicas.sort(key=_by_price)
        if top_k is not None:
            del replicas[top_k:]
        out = LookupAnswer(shard.model, n_tokens, shard.block_size, replicas)
        if rank and replicas:
            out.prefetch = self.prefetch_plan(shard.model, replicas[0])
        return out

    def answer_json(self, shard: ModelShard, hashes: list[int], n_tokens: int, rank: bool = False,
                    top_k: int | None = None, feedback=None) -> tuple[bytes, int, int]:
        """`answer` as JSON: (bytes, the first replica's resumable tokens, how many replicas). Written
        by the compiled core where the shard allows (ShardWalk.lookup_json), else the typed answer
        encoded; the same answer either way (tests/unit/index_service/test_answer_json.py)."""
        if top_k is not None and not 1 <= top_k <= MAX_TOP_K:
            raise Reject(422, f"top_k must be in 1..{MAX_TOP_K}, got {top_k}")
        # feedback caps, and a rank's prefetch plan, need the structs
        if (feedback is None or not feedback.by_model.get(shard.model)) and not (
                rank and self.prefetch_on(shard.model)):
            pricer = self.pricer(shard.model)
            fast = shard.lookup_json(hashes, n_tokens, time.time(), pricer.per_token, pricer.load_cost,
                                     rank, top_k)
            if fast is not None:
                return fast
        answer = self.answer(shard, hashes, n_tokens, rank, top_k, feedback)
        replicas = answer.replicas
        return _encode(answer), replicas[0].resumable_tokens if replicas else 0, len(replicas)

    def lookup(self, req: LookupRequest, rank: bool = False, feedback=None) -> LookupAnswer:
        """A JSON lookup request (token_ids or block_hashes + prompt_tokens) answered."""
        shard, hashes, n = self.prompt(req)
        return self.answer(shard, hashes, n, rank, req.top_k, feedback)

    def route(self, req: RouteRequest) -> tuple[RouteDecision, bool, PrefetchHint | None]:
        """Record a routing decision as pending credit on its replica (published when the store has
        a publisher); False with it if the request id was applied already; and the replica's prefetch
        plan where the model's hints are on (published on the hints topic when the store has one)."""
        if not req.request_id or not req.replica:
            raise Reject(422, "request_id and replica must not be empty")
        ttl = self.store.config.pending_ttl_s if req.ttl_s is None else req.ttl_s
        if not 0 < ttl <= 3600:
            raise Reject(422, f"ttl_s must be in (0, 3600], got {ttl}")
        if req.dp_rank < 0 or req.credited_tokens < 0 or req.evicting_tokens < 0:
            raise Reject(422, "dp_rank, credited_tokens and evicting_tokens must not be negative")
        shard, hashes, n = self.prompt(req)
        elsewhere = not self.store.holds_replica(req.model, req.replica)
        if not elsewhere and (req.replica, req.dp_rank) not in shard.replicas:
            # a relay announces its replica when it starts: an unknown name is a router's mistake,
            # and must not become a slot in every answer
            raise Reject(422, f"unknown replica {req.replica[:200]!r} (dp_rank {req.dp_rank}) for model "
                              f"{req.model!r}: the index has no events from it")
        d = RouteDecision(ROUTES_VERSION, req.request_id[:200], req.model, req.replica[:500], req.dp_rank,
                          list(hashes), n, req.credited_tokens, time.time(), ttl, req.router[:200],
                          req.evicting_tokens)
        hints = self.store.config.model(shard.model).hints
        # the plan and the queues from the replicas' state before this decision's own pending credit
        hint = self._route_prefetch(shard, d) if hints.prefetch and not elsewhere else None
        queues = self._queues(shard, d.ts) if hints.sessions and not elsewhere else {}
        applied = self.store.apply_route(d)
        if applied and self.store.publish_route is not None:
            self.store.publish_route(d)
        if applied and hint is not None and self.store.publish_hint is not None:
            self.store.publish_hint(hint_record(d, shard.block_size, hint))
        if applied and hint is not None and req.token_ids and self.store.act_on_hint is not None:
            self.store.act_on_hint(d.model, d.replica, hint, req.token_ids)  # the tokens are not kept
        if applied and hints.sessions:
            self._session_hints(d, shard.block_size, queues, hints.placement_tokens_per_s,
                                hints.kv_bytes_per_token)
        return d, applied, hint

    def _route_prefetch(self, shard: ModelShard, d: RouteDecision) -> PrefetchHint | None:
        """The decided replica's plan: its answer's tier runs, from the shard's lookup."""
        for a in shard.lookup(d.block_hashes, d.prompt_tokens, d.ts, None):
            if a.replica == d.replica and a.dp_rank == d.dp_rank:
                a.price = self.pricer(shard.model)(a, d.prompt_tokens)
                return self.prefetch_plan(shard.model, a)
        return None

    def _queues(self, shard: ModelShard, now: float) -> dict[str, float]:
        """Seconds of prefill routed to each replica (DP rank 0) and not yet confirmed: the price's queue,
        read from the pending credit without a lookup."""
        pending = shard.pending
        if len(pending):
            pending.expire(now)
        per_token = self.pricer(shard.model).per_token
        return {st.replica: pending.inflight.get(st.slot, 0) * per_token
                for st in index.replicas(shard) if st.dp_rank == 0}

    def _session_hints(self, d: RouteDecision, block_size: int, queues: dict[str, float],
                       copy_tps: float, bytes_per_token: int) -> None:
        """The decision's session tracked (kvidx.core.sessions); the eviction advice now due and this
        session's placement, if any, published on the hints topic."""
        tracker = self.trackers.get(d.model)
        if tracker is None:
            tracker = self.trackers[d.model] = SessionTracker(block_size)
        s = tracker.observe(d.block_hashes, d.replica, d.ts)
        publish = self.store.publish_hint
        if publish is None:
            return
        pricer = self.pricer(d.model)
        per_token = pricer.per_token
        cpu_s = pricer.load_cost.get("CPU", 0.0)
        for adv in tracker.eviction_advice(d.ts):
            # demoted blocks come back from host memory, dropped ones are recomputed; the room they free
            # spares as many tokens of active sessions a reload from host memory
            benefit_s, cost_s = advice_seconds(adv, cpu_s, per_token, cpu_s)
            publish(HintRecord(HINTS_VERSION, "eviction", "", d.model, adv.replica, 0, adv.hashes, block_size,
                               [], adv.tokens, cost_s, 0.0, benefit_s, adv.tokens * bytes_per_token, d.ts,
                               action=adv.action))
        p = tracker.placement(s, queues, copy_tps, bytes_per_token)
        if p is not None:
            publish(HintRecord(HINTS_VERSION, "placement", d.request_id, d.model, p.source, 0, p.hashes,
                               block_size, [], p.tokens, p.copy_s, 0.0, p.benefit_s, p.bytes, d.ts,
                               target=p.target))


def hint_record(d: RouteDecision, block_size: int, hint: PrefetchHint) -> HintRecord:
    """A routing decision's prefetch plan as the hints topic carries it."""
    return HintRecord(HINTS_VERSION, "prefetch", d.request_id, d.model, d.replica, d.dp_rank, d.block_hashes,
                      block_size, [PrefetchRunRecord(r.tier, r.start, r.end, r.load_s) for r in hint.runs],
                      hint.tokens, hint.load_s, hint.deadline_s, hint.benefit_s, hint.bytes, d.ts)


def usage_report(req: UsageRequest) -> UsageReport:
    """What an engine reused for a routed request, checked and bounded, as the audit's report."""
    if not req.request_id or not req.replica or not req.model:
        raise Reject(422, "request_id, model and replica must not be empty")
    if req.prompt_tokens <= 0 or req.dp_rank < 0 or not 0 <= req.cached_tokens <= req.prompt_tokens:
        raise Reject(422, "need prompt_tokens > 0, dp_rank >= 0 and "
                          "0 <= cached_tokens <= prompt_tokens")
    return UsageReport(USAGE_VERSION, req.request_id[:200], req.model[:500], req.replica[:500], req.dp_rank,
                       req.prompt_tokens, req.cached_tokens, time.time(), req.engine[:100],
                       req.tier[:20], req.router[:200])
