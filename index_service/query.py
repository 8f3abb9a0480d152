"""The query pipeline of the lookup service, without HTTP: a prompt (token ids, packed bytes or block
hashes) checked and bounded -> its shard and canonical block hashes -> the Index's answer
(kvidx.index.answer: the lookup, the audit's caps, the price, rank, top_k, the prefetch plan) with the
model's rates from the configuration; and a routing decision recorded as pending credit, with its
hints. The HTTP handlers (index_service.lookup_routes, routing_routes) only read the body and encode
what this returns (the simulator's --http runs go through them).

This is the routers' hot path: nothing here loops over tokens in Python.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import NoReturn

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
from kvidx.core.fetch import FetchPlan, dynamo_kv_hint, fetch_plan
from kvidx.core.hashing import prompt_hashes
from kvidx.core.hints import PrefetchGate
from kvidx.core.price import Pricer
from kvidx.core.sessions import SessionTracker
from kvidx.core.shard import ModelShard
from schemas.answers import LookupAnswer, PrefetchHint, ReplicaAnswer
from schemas.hints import HINTS_VERSION, HintRecord, PrefetchRunRecord
from schemas.routes import ROUTES_VERSION, RouteDecision
from schemas.service import KvHint
from schemas.usage import USAGE_VERSION, UsageReport

MAX_MODELS_LISTED = 10  # in the 404 for an unknown model
# issued prefetch plans remembered for their usage reports: a few seconds of routing at thousands of
# decisions a second (a report comes after the request's prefill); the oldest are forgotten first
MAX_PREFETCHED = 10_000


class QueryPipeline:
    """Lookups and routing decisions against one store. Every method raises Reject (status, message)
    for a request it refuses; `max_tokens` bounds a prompt's length."""

    def __init__(self, store: ShardStore, max_tokens: int = 1_000_000):
        self.store = store
        self.max_tokens = max_tokens
        self.pricers: dict[str, Pricer] = {}  # per model, from the configuration
        self.trackers: dict[str, SessionTracker] = {}  # per model whose hints.sessions is on
        self.gates: dict[tuple[str, str], PrefetchGate] = {}  # per (model, kind) whose hints are on
        # issued plans and fetch hints awaiting their usage report: request id -> (model, last token)
        self.prefetched: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self.fetched: OrderedDict[str, tuple[str, int]] = OrderedDict()

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

    def gate(self, model: str, kind: str = "prefetch") -> PrefetchGate:
        """The model's gate for a hint kind (kvidx.core.hints.PrefetchGate: prefetch plans, fetch hints),
        with its configured delay and margin."""
        gate = self.gates.get((model, kind))
        if gate is None:
            hints = self.store.config.model(model).hints
            gate = self.gates[model, kind] = PrefetchGate(hints.prefetch_delay_ms / 1000.0,
                                                          hints.prefetch_margin_ms / 1000.0)
        return gate

    def hint_gates(self) -> dict[tuple[str, str], PrefetchGate]:
        """(model, kind) -> its gate: prefetch and fetch here, placement and eviction in the model's
        session tracker (their counts and pay-off ratios on /metrics)."""
        out = dict(self.gates)
        for model, t in self.trackers.items():
            out[model, "placement"], out[model, "eviction"] = t.placement_gate, t.eviction_gate
        return out

    def hint_outcome(self, u: UsageReport) -> None:
        """An engine's usage report for a request whose plan or fetch hint was issued: it paid off when the
        engine reused the hint's tokens (the audit's rule, without the events: `kvidx audit` also checks
        that the engine loaded them ahead); the kind's gate learns it."""
        for kind, issued in (("prefetch", self.prefetched), ("fetch", self.fetched)):
            hint = issued.pop(u.request_id, None)
            if hint is not None and hint[0] == u.model:
                self.gate(u.model, kind).outcome(u.cached_tokens >= hint[1])

    def prefetch_bytes(self, model: str) -> int | None:
        """The model's KV bytes per token where the operator turned its prefetch hints on (hints.prefetch
        in its config: ranked answers then carry a plan), else None."""
        hints = self.store.config.model(model).hints
        return hints.kv_bytes_per_token if hints.prefetch else None

    @staticmethod
    def check_top_k(top_k: int | None) -> None:
        if top_k is not None and not 1 <= top_k <= MAX_TOP_K:
            raise Reject(422, f"top_k must be in 1..{MAX_TOP_K}, got {top_k}")

    def answer(self, shard: ModelShard, hashes: list[int], n_tokens: int, rank: bool = False,
               top_k: int | None = None, feedback: index.Feedback | None = None,
               groups: frozenset[int] | None = None) -> LookupAnswer:
        """The Index's answer (kvidx.index.answer) priced with the model's rates, now."""
        self.check_top_k(top_k)
        model = shard.model
        return index.answer(shard, hashes, n_tokens, self.pricer(model), time.time(), rank=rank, top_k=top_k,
                            feedback=feedback, groups=groups, prefetch_bytes=self.prefetch_bytes(model))

    def answer_json(self, shard: ModelShard, hashes: list[int], n_tokens: int, rank: bool = False,
                    top_k: int | None = None, feedback: index.Feedback | None = None
                    ) -> tuple[bytes, int, int, int]:
        """`answer` as JSON (kvidx.index.answer_json): (bytes, best resumable tokens, replicas, tokens
        below GPU memory)."""
        self.check_top_k(top_k)
        model = shard.model
        return index.answer_json(shard, hashes, n_tokens, self.pricer(model), time.time(), rank=rank,
                                 top_k=top_k, feedback=feedback, prefetch_bytes=self.prefetch_bytes(model))

    def lookup(self, req: LookupRequest, rank: bool = False, feedback=None) -> LookupAnswer:
        """A JSON lookup request (token_ids or block_hashes + prompt_tokens) answered."""
        shard, hashes, n = self.prompt(req)
        return self.answer(shard, hashes, n, rank, req.top_k, feedback)

    def route(self, req: RouteRequest) -> tuple[RouteDecision, bool, PrefetchHint | None, KvHint | None]:
        """Record a routing decision as pending credit on its replica (published when the store has
        a publisher); False with it if the request id was applied already; the replica's prefetch
        plan where the model's hints are on and the model's gate issues it (published on the hints topic
        when the store has one); and its fetch hint in Dynamo's KvHint form where hints.fetch is on and
        another replica's longer prefix is worth copying (kvidx.core.fetch)."""
        if not req.request_id or not req.replica:
            raise Reject(422, "request_id and replica must not be empty")
        ttl = self.store.config.pending_ttl_s if req.ttl_s is None else req.ttl_s
        if not 0 < ttl <= 3600:
            raise Reject(422, f"ttl_s must be in (0, 3600], got {ttl}")
        if req.dp_rank < 0 or req.credited_tokens < 0 or req.evicting_tokens < 0:
            raise Reject(422, "dp_rank, credited_tokens and evicting_tokens must not be negative")
        shard, hashes, n = self.prompt(req)
        elsewhere = not self.store.holds_replica(req.model, req.replica)
        if not elsewhere and index.replica_of(shard, req.replica, req.dp_rank) is None:
            # a relay announces its replica when it starts: an unknown name is a router's mistake,
            # and must not become a slot in every answer
            raise Reject(422, f"unknown replica {req.replica[:200]!r} (dp_rank {req.dp_rank}) for model "
                              f"{req.model!r}: the index has no events from it")
        d = RouteDecision(ROUTES_VERSION, req.request_id[:200], req.model, req.replica[:500], req.dp_rank,
                          list(hashes), n, req.credited_tokens, time.time(), ttl, req.router[:200],
                          req.evicting_tokens)
        hints = self.store.config.model(shard.model).hints
        # the plan and the queues from the replicas' state before this decision's own pending credit
        pricer = self.pricer(shard.model)
        answers = (index.lookup(shard, d.block_hashes, d.prompt_tokens, d.ts)
                   if (hints.prefetch or hints.fetch) and not elsewhere else None)  # one lookup, both plans
        hint = None
        if hints.prefetch and answers is not None:
            hint = index.replica_plan(answers, d.prompt_tokens, d.replica, d.dp_rank, pricer,
                                      hints.kv_bytes_per_token)
        queues = index.queues(shard, d.ts, pricer) if hints.sessions and not elsewhere else {}
        fetch = self._fetch_plan(shard, d, pricer, answers) if hints.fetch and answers is not None else None
        applied = self.store.apply_route(d)
        kv_hint = None
        if fetch is not None and applied and self.gate(d.model, "fetch").admit_net(fetch.net_s):
            kv_hint = dynamo_kv_hint(d.request_id, fetch)
            self._remember(self.fetched, d, fetch.tokens)
        if hint is not None and not (applied and self.gate(d.model).admit(hint, d.ts)):
            hint = None  # a plan that cannot pay, or throttled (or a duplicate's: issued the first time)
        if hint is not None:
            self._remember(self.prefetched, d, max(r.end for r in hint.runs))
        if applied and self.store.publish_route is not None:
            self.store.publish_route(d)
        if applied and hint is not None and self.store.publish_hint is not None:
            self.store.publish_hint(hint_record(d, shard.block_size, hint))
        if applied and hint is not None and req.token_ids and self.store.act_on_hint is not None:
            self.store.act_on_hint(d.model, d.replica, hint, req.token_ids)  # the tokens are not kept
        if applied and hints.sessions:
            self._session_hints(d, shard.block_size, queues, hints.placement_tokens_per_s,
                                hints.kv_bytes_per_token)
        return d, applied, hint, kv_hint

    def _fetch_plan(self, shard: ModelShard, d: RouteDecision, pricer: Pricer,
                    answers: list[ReplicaAnswer]) -> FetchPlan | None:
        table = self.store.engine_hashes(d.model)
        if table is None or not len(table):
            return None
        hints = self.store.config.model(d.model).hints
        return fetch_plan(answers, d.replica, d.dp_rank, hints.fetch_endpoints, table, d.block_hashes,
                          shard.block_size, pricer, hints.placement_tokens_per_s)

    @staticmethod
    def _remember(issued: OrderedDict[str, tuple[str, int]], d: RouteDecision, end: int) -> None:
        """An issued hint kept for its usage report (the oldest forgotten past MAX_PREFETCHED)."""
        issued[d.request_id] = (d.model, end)
        if len(issued) > MAX_PREFETCHED:
            issued.popitem(last=False)

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
            # spares as many tokens of active sessions a reload from host memory; issued where worth it
            seconds = tracker.worth_advising(adv, cpu_s, per_token, cpu_s)
            if seconds is None:
                continue
            benefit_s, cost_s = seconds
            publish(HintRecord(HINTS_VERSION, "eviction", "", d.model, adv.replica, 0, adv.hashes, block_size,
                               [], adv.tokens, cost_s, 0.0, benefit_s, adv.tokens * bytes_per_token, d.ts,
                               action=adv.action))
        p = tracker.placement(s, queues, copy_tps, bytes_per_token, room_s=cpu_s)
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
