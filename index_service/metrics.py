"""Prometheus metrics of one lookup service app, on a registry of its own (several apps can live in one
process, e.g. in tests, without their metrics clashing in the global registry).

Series:
- kvidx_lookup_latency_seconds{form}        histogram of the handler time of answered (200) lookups
- kvidx_lookups_total{form,status}          lookups by HTTP status code (forms sglang_<RPC>: by gRPC
                                            status name, e.g. OK, INVALID_ARGUMENT)
- kvidx_lookup_prompt_tokens_total{model}   prompt tokens looked up
- kvidx_lookup_best_resumable_tokens_total{model}  best replica's resumable tokens, summed (hit rate =
                                            this / prompt tokens)
- kvidx_lookup_below_gpu_tokens_total{model}  prompt tokens cached on some replica answered but on none
                                            in GPU memory (the longest cached prefix minus the longest
                                            GPU-resident one), summed: reuse served from below GPU
- kvidx_working_set_blocks{model,tier}      distinct blocks any replica holds in the tier (the model's
                                            lookup group; tier "any": in some tier), read at scrape
- kvidx_working_set_tokens{model,tier}      the same in tokens (index blocks of the model's block size)
- kvidx_index_blocks{model,group}           distinct blocks indexed (read from the shards at scrape)
- kvidx_index_bytes{model}                  memory of the model's mask maps (compiled core only)
- kvidx_replicas{model}                     replicas (replica, DP rank) known per model
- kvidx_partial_keys{model}                 live partial-block keys (engines resuming inside blocks:
                                            docs/engines.md "Partial blocks")
- kvidx_replica_event_age_max_seconds{model}  age of the stalest replica's last applied engine batch
- kvidx_batches_applied_total               batches the store folded
- kvidx_fold_compiled_batches_total         of those (and of redeliveries), the ones the compiled fold
                                            took (kvidx.core.shard.NATIVE_FOLD); the rest: the Python fold
- kvidx_fold_reference_batches_total{reason}  those it handed to the Python fold: new_replica,
                                            new_group_or_tier, future_epoch, other
- kvidx_ready                               1 once the store was rebuilt
- kvidx_core_info{maskmap}                  1, labelled with the index core that runs: native (the
                                            compiled mask map) or python (the reference fallback)
- kvidx_consumer_lag_messages               event batches published but not yet applied here
- kvidx_events_lost_total                   event batches the events topic's retention deleted before
                                            the snapshot this instance rebuilt from had folded them
Per replica (model, replica, dp_rank; only replicas that sent events, so routes to unknown replicas do
not add series; at most MAX_REPLICA_SERIES replicas, the freshest, the rest counted in
kvidx_replica_series_omitted), read from the shards at scrape:
- kvidx_replica_batches_applied_total       engine batches applied (rate = the replica's batches/s)
- kvidx_replica_blocks                      live (block, tier, group) entries
- kvidx_replica_event_age_seconds           age of the last applied engine batch (freshness)
- kvidx_replica_apply_lag_seconds           engine time to applied here, of the last batch
- kvidx_replica_seq_gaps_total              batches missing between applied ones
- kvidx_replica_blocks_removed_total        live entries its removal events took out (clears aside):
                                            the rate is the replica's cache pressure
- kvidx_replica_series_omitted              replicas left out of the per-replica series (over the cap)
Label values: model and replica names come from the index (the engines' events, registrations and
SGLang's feed: writers holding a token of scope write or admin when credentials are set, names checked
by index_service.guard), never from a lookup's or a route's fields (unknown models count as "other").
Replica groups held by other instances (index_service.fanout):
- kvidx_fanout_seconds                      histogram of the wait for the other instances' answers
- kvidx_fanout_partial_total                lookups answered without some groups (no live holder,
                                            an error or the timeout: the answer says `partial`)
--lookup-port (index_service.lookup_front), when it is on:
- kvidx_lookup_front_requests_total{answered}  requests on it, by who answered: the compiled threads
                                            (query, query_by_hash) or the Python handler (fallback)
- kvidx_lookup_front_connections            connections open on it (a thread each)
- kvidx_lookup_front_refused_connections_total  connections refused past its limit (1,024)
Hints (the gates, kvidx.core.hints.PrefetchGate; per model and kind whose hints are on):
- kvidx_hints_issued_total{model,kind}      hints issued (kind: prefetch; fetch: Dynamo kv.fetch hints;
                                            placement and eviction: hints.sessions' kinds)
- kvidx_hints_declined_total{model,kind}    plans not issued: they could not pay (net gain <= margin)
- kvidx_hints_throttled_total{model,kind}   plans that could, withheld while the kind's bets lose
- kvidx_hint_payoff_ratio{model,kind}       paid-off share of the last 64 issued plans whose usage
                                            report came (POST /v1/usage: the engine reused their tokens)
Abuse:
- kvidx_rate_limited_total{scope}           write and admin requests refused (429) past a client's
                                            budget (index_service.limits; scope: write or admin)
Agreement (live; the offline audit joins request by request):
- kvidx_routes_credited_tokens_total{model} tokens the index credited on the replicas routed to
- kvidx_usage_prompt_tokens_total{model}    prompt tokens of the engine usage reports (POST /v1/usage)
- kvidx_usage_reused_tokens_total{model}    tokens the engines reported reused (cached_tokens)
  reused / credited over a window ~ agreement; model is "other" for models the index does not hold
The process (every collection since it started, whichever app observes it):
- kvidx_gc_pause_seconds{generation}        histogram of the garbage collector's generation 1 and 2
                                            collections: the event loop stops for them (a full one over
                                            the service's objects was ~40 ms before gc.freeze)
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from index_service.store import ShardStore
from kvidx import index
from kvidx.core.hints import PrefetchGate
from kvidx.core.maskmap import IMPLEMENTATION as MASKMAP_IMPLEMENTATION
from kvidx.fold_metrics import compiled_fold_families

MAX_REPLICA_SERIES = 2048  # replicas with per-replica series (five each): beyond, the stalest are left out
FORMS = ("json", "binary", "rank", "routes", "lmcache")  # lmcache: LMCache's POST /lookup
# Lookups take ~50 us (short prompt, binary) to a few ms (32k tokens as JSON on a loaded box).
LATENCY_BUCKETS = (50e-6, 100e-6, 200e-6, 300e-6, 500e-6, 750e-6, 1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3,
                   10e-3, 20e-3, 50e-3)


class _HintCollector:
    """The hint gates' counts and pay-off ratios, read at scrape time (ServiceMetrics.hint_gates: the query
    pipeline's, per model and kind)."""

    def __init__(self, metrics: ServiceMetrics):
        self.metrics = metrics

    def collect(self):
        labels = ["model", "kind"]
        issued = CounterMetricFamily("kvidx_hints_issued", "Hints issued", labels=labels)
        declined = CounterMetricFamily("kvidx_hints_declined", "Hints not issued: they could not pay "
                                       "(net gain at most the margin)", labels=labels)
        throttled = CounterMetricFamily("kvidx_hints_throttled", "Hints that could pay, withheld while the "
                                        "kind's recent bets lose", labels=labels)
        ratio = GaugeMetricFamily("kvidx_hint_payoff_ratio", "Paid-off share of the last issued hints whose "
                                  "outcome is known", labels=labels)
        for (model, kind), gate in sorted(self.metrics.hint_gates().items()):
            key = [model, kind]
            issued.add_metric(key, gate.issued)
            declined.add_metric(key, gate.declined)
            throttled.add_metric(key, gate.throttled)
            r = gate.payoff_ratio
            if r is not None:
                ratio.add_metric(key, r)
        yield from (issued, declined, throttled, ratio)


class _StoreCollector:
    """Gauges read from the shards at scrape time (nothing to update on the hot path)."""

    def __init__(self, store: ShardStore):
        self.store = store

    def collect(self):
        store = self.store
        blocks = GaugeMetricFamily("kvidx_index_blocks", "Distinct blocks indexed (any tier)",
                                   labels=["model", "group"])
        replicas = GaugeMetricFamily("kvidx_replicas", "Replicas (replica, DP rank) known",
                                     labels=["model"])
        partial = GaugeMetricFamily("kvidx_partial_keys", "Live partial-block keys (all replicas)",
                                    labels=["model"])
        age = GaugeMetricFamily("kvidx_replica_event_age_max_seconds",
                                "Age of the stalest replica's last applied engine batch",
                                labels=["model"])
        evicting = GaugeMetricFamily("kvidx_foresight_evicting_blocks", "Cached blocks that prefills "
                                     "routed and not yet reported will evict (eviction foresight)",
                                     labels=["model"])
        cut = CounterMetricFamily("kvidx_foresight_discounted_lookups", "Lookups where eviction "
                                  "foresight (or a replica's own host loads) cut a replica's credit",
                                  labels=["model"])
        working = GaugeMetricFamily("kvidx_working_set_blocks", "Distinct blocks held in the tier by any "
                                    "replica, of the model's lookup group (full attention)",
                                    labels=["model", "tier"])
        working_tokens = GaugeMetricFamily("kvidx_working_set_tokens", "kvidx_working_set_blocks in tokens "
                                           "(index blocks of the model's block size)",
                                           labels=["model", "tier"])
        nbytes = GaugeMetricFamily("kvidx_index_bytes", "Memory of the index's mask maps (compiled core "
                                   "only: the Python reference would be walked to measure)", labels=["model"])
        now = time.time()
        with store.lock:  # scrapes are rare: a consistent view is worth a short wait
            for model, shard in sorted(store.shards.items()):
                for gid, n in index.keys_by_group(shard):
                    blocks.add_metric([model, str(gid)], n)
                replicas.add_metric([model], index.replica_count(shard))
                for tier, n in index.working_set(shard).items():
                    working.add_metric([model, tier], n)
                    working_tokens.add_metric([model, tier], n * shard.block_size)
                partial.add_metric([model], shard.tail_keys)
                if MASKMAP_IMPLEMENTATION == "native":
                    nbytes.add_metric([model], index.index_size([shard])[1])
                ages = [now - st.engine_ts for st in index.replicas(shard) if st.batches]
                if ages:
                    age.add_metric([model], max(ages))
                if (seen := index.foresight(shard, now)) is not None:
                    evicting.add_metric([model], seen[0])
                    cut.add_metric([model], seen[1])
            applied = store.batches_applied
        yield blocks
        yield replicas
        yield partial
        yield age
        yield evicting
        yield cut
        yield working
        yield working_tokens
        yield nbytes
        yield CounterMetricFamily("kvidx_batches_applied", "Event batches folded by the store",
                                  value=applied)
        yield from compiled_fold_families("kvidx")
        yield GaugeMetricFamily("kvidx_ready", "1 once the store was rebuilt", value=int(store.ready))
        core = GaugeMetricFamily("kvidx_core_info", "The index core that runs (maskmap: native | python)",
                                 labels=["maskmap"])
        core.add_metric([MASKMAP_IMPLEMENTATION], 1)
        yield core
        yield from self._replicas(now)
        yield GaugeMetricFamily("kvidx_consumer_lag_messages",
                                "Event batches published but not yet applied here (all partitions)",
                                value=store.consumer_lag)
        yield CounterMetricFamily("kvidx_events_lost", "Event batches deleted by the events topic's "
                                  "retention before a snapshot folded them", value=store.events_lost)


    def _replicas(self, now: float):
        """The per-replica series, of the MAX_REPLICA_SERIES replicas that applied a batch last (a
        registration or feed of many replica names cannot make a scrape grow without bound)."""
        labels = ["model", "replica", "dp_rank"]
        batches = CounterMetricFamily("kvidx_replica_batches_applied", "Engine batches applied, per replica",
                                      labels=labels)
        blocks = GaugeMetricFamily("kvidx_replica_blocks", "Live (block, tier, group) entries, per replica",
                                   labels=labels)
        age = GaugeMetricFamily("kvidx_replica_event_age_seconds",
                                "Age of the replica's last applied engine batch", labels=labels)
        lag = GaugeMetricFamily("kvidx_replica_apply_lag_seconds",
                                "Engine time to applied here, of the replica's last batch", labels=labels)
        gaps = CounterMetricFamily("kvidx_replica_seq_gaps", "Engine batches missing between applied ones",
                                   labels=labels)
        removed = CounterMetricFamily("kvidx_replica_blocks_removed", "Live (block, tier, group) entries the "
                                      "replica's removal events took out (rate: its cache pressure)",
                                      labels=labels)
        with self.store.lock:
            live = [(model, st) for model, shard in self.store.shards.items()
                    for st in index.replicas(shard) if st.batches]
            if len(live) > MAX_REPLICA_SERIES:
                live.sort(key=lambda ms: -ms[1].applied_ts)
            omitted = max(0, len(live) - MAX_REPLICA_SERIES)
            for model, st in sorted(live[:MAX_REPLICA_SERIES], key=lambda ms: (ms[0], ms[1].replica)):
                key = [model, st.replica, str(st.dp_rank)]
                batches.add_metric(key, st.batches)
                blocks.add_metric(key, st.blocks)
                age.add_metric(key, max(0.0, now - st.engine_ts))
                lag.add_metric(key, max(0.0, st.applied_ts - st.engine_ts))
                gaps.add_metric(key, st.seq_gaps)
                removed.add_metric(key, st.removed)
        yield from (batches, blocks, age, lag, gaps, removed)
        yield GaugeMetricFamily("kvidx_replica_series_omitted", "Replicas left out of the per-replica "
                                "series (more than MAX_REPLICA_SERIES applied batches)", value=omitted)


GC_BUCKETS = (1e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 1.0)


class _GcPauses:
    """The collector's generation 1 and 2 pauses, timed by a gc callback (one per process): bucket
    counts and sums, read at scrape. Generation 0 collections (microseconds each, hundreds a second
    under load) are not timed."""

    def __init__(self):
        self.counts = {g: [0] * (len(GC_BUCKETS) + 1) for g in (1, 2)}
        self.sums = {1: 0.0, 2: 0.0}
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        generation = info["generation"]
        if generation == 0:
            return
        if phase == "start":
            self._started = time.perf_counter()
            return
        seconds = time.perf_counter() - self._started
        self.sums[generation] += seconds
        counts = self.counts[generation]
        for k, bound in enumerate(GC_BUCKETS):
            if seconds <= bound:
                counts[k] += 1
                return
        counts[-1] += 1

    def collect(self):
        family = HistogramMetricFamily("kvidx_gc_pause_seconds", "Garbage collector pauses (generations 1 "
                                       "and 2) of this process", labels=["generation"])
        for generation, counts in self.counts.items():
            cumulative, buckets = 0, []
            for bound, n in zip((*map(str, GC_BUCKETS), "+Inf"), counts, strict=True):
                cumulative += n
                buckets.append((bound, cumulative))
            family.add_metric([str(generation)], buckets, self.sums[generation])
        yield family


_GC_PAUSES = _GcPauses()
_gc_lock = threading.Lock()


def _timing_gc() -> _GcPauses:
    """The process's GC pause timer, its callback installed on first use."""
    with _gc_lock:
        if _GC_PAUSES not in gc.callbacks:
            gc.callbacks.append(_GC_PAUSES)
    return _GC_PAUSES


class ServiceMetrics:
    def __init__(self, store: ShardStore):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_timing_gc())
        self.latency = Histogram("kvidx_lookup_latency_seconds",
                                 "Handler time of answered lookups (body read to response encoded)",
                                 ["form"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.lookups = Counter("kvidx_lookups", "Lookups by form and HTTP status code",
                               ["form", "status"], registry=self.registry)
        self.prompt_tokens = Counter("kvidx_lookup_prompt_tokens", "Prompt tokens looked up",
                                     ["model"], registry=self.registry)
        self.best_resumable = Counter("kvidx_lookup_best_resumable_tokens",
                                      "Resumable tokens of the best replica, summed over lookups",
                                      ["model"], registry=self.registry)
        self.below_gpu = Counter("kvidx_lookup_below_gpu_tokens", "Prompt tokens cached on some replica "
                                 "but on none in GPU memory (host memory, disk, a shared cache), summed "
                                 "over lookups", ["model"], registry=self.registry)
        self.credited = Counter("kvidx_routes_credited_tokens", "Tokens credited on the replicas routed to",
                                ["model"], registry=self.registry)
        self.usage_prompt = Counter("kvidx_usage_prompt_tokens", "Prompt tokens of engine usage reports",
                                    ["model"], registry=self.registry)
        self.usage_reused = Counter("kvidx_usage_reused_tokens", "Tokens the engines reported reused",
                                    ["model"], registry=self.registry)
        self.fanout_seconds = Histogram("kvidx_fanout_seconds", "Wait for the instances holding the other "
                                        "replica groups", buckets=LATENCY_BUCKETS + (0.1, 0.25, 0.5, 1.0),
                                        registry=self.registry)
        self.fanout_partial = Counter("kvidx_fanout_partial", "Lookups answered without some replica groups",
                                      registry=self.registry)
        self.rate_limited = Counter("kvidx_rate_limited", "Requests refused (429) by the per-client rate "
                                    "limits of the write and admin routes, by scope", ["scope"],
                                    registry=self.registry)
        self.store = store
        self.registry.register(_StoreCollector(store))
        # (model, kind) -> gate, read at scrape time: the query pipeline's (ServiceContext)
        self.hint_gates: Callable[[], dict[tuple[str, str], PrefetchGate]] = dict
        self.registry.register(_HintCollector(self))
        self._latency = {f: self.latency.labels(form=f) for f in FORMS}
        self._counts: dict[tuple[str, int], Counter] = {}
        self._per_model: dict[str, tuple[Counter, Counter, Counter]] = {}

    def observe(self, form: str, status: int, seconds: float | None = None) -> None:
        c = self._counts.get((form, status))
        if c is None:
            c = self._counts[(form, status)] = self.lookups.labels(form=form, status=str(status))
        c.inc()
        if seconds is not None:
            self._latency[form].observe(seconds)

    def answered(self, model: str, prompt_tokens: int, best_resumable: int, below_gpu: int = 0) -> None:
        """Only called for known models: label values never come from unchecked client input."""
        pm = self._per_model.get(model)
        if pm is None:
            pm = self._per_model[model] = (self.prompt_tokens.labels(model=model),
                                           self.best_resumable.labels(model=model),
                                           self.below_gpu.labels(model=model))
        pm[0].inc(prompt_tokens)
        pm[1].inc(best_resumable)
        if below_gpu:
            pm[2].inc(below_gpu)

    def model_totals(self) -> dict[str, dict[str, int]]:
        """Per model, the token counters this instance kept since it started (GET /v1/models shows
        them beside the working set): prompt tokens looked up, the best replica's resumable ones, those
        cached below GPU memory only, credited on routes and reported reused by the engines."""
        out: dict[str, dict[str, int]] = {}
        for key, counter in (("lookup_prompt_tokens", self.prompt_tokens),
                             ("lookup_best_resumable_tokens", self.best_resumable),
                             ("lookup_below_gpu_tokens", self.below_gpu),
                             ("routes_credited_tokens", self.credited),
                             ("usage_prompt_tokens", self.usage_prompt),
                             ("usage_reused_tokens", self.usage_reused)):
            for family in counter.collect():
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        out.setdefault(sample.labels["model"], {})[key] = int(sample.value)
        return out

    def fanout(self, seconds: float, missing_groups: int) -> None:
        self.fanout_seconds.observe(seconds)
        if missing_groups:
            self.fanout_partial.inc()

    def routed(self, model: str, credited_tokens: int) -> None:
        self.credited.labels(model=self._known(model)).inc(max(0, credited_tokens))

    def usage(self, model: str, prompt_tokens: int, reused_tokens: int) -> None:
        m = self._known(model)
        self.usage_prompt.labels(model=m).inc(max(0, prompt_tokens))
        self.usage_reused.labels(model=m).inc(max(0, reused_tokens))

    def _known(self, model: str) -> str:
        """Label values never come from unchecked client input: unknown models count as "other"."""
        return model if model in self.store.shards else "other"

    def render(self) -> bytes:
        return generate_latest(self.registry)
