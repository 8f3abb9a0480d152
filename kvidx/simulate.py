"""`kvidx simulate`: a simulated fleet (vLLM by default; `--engines vllm,sglang,trtllm` mixes engine kinds,
`--host-tier-blocks` gives TensorRT-LLM a host tier, `--pool-blocks` adds node-shared pools, `--hybrid
swa:W|mamba:K` makes the vLLM replicas hybrid models, `--cpu-offload-blocks` gives them vLLM's offloading
connector's CPU tier) on a real trace; index agreement (overall, per engine, per tier, per hybrid group
kind) and router comparison.

Runs, on one workload (the Mooncake conversation trace by default, or generated multi-turn chat):
- ``kv``: the KV-aware router (price = prefill tokens left after the index's resumable tokens + a
  load penalty: the prefill tokens already queued on the replica, times --load-weight) with realistic
  event delay and drops. Its agreement is the headline (the JSON's top-level keys). With --kafka its
  events go through a real broker (a KafkaSink per fleet, index_service's KafkaFollower), with --http
  its lookups go through the real FastAPI service;
- ``kv_zero_delay``: the same router, events delivered before the next request, no drops: the index
  must then agree exactly (recall 1, over-credit 0);
- the baselines ``random``, ``round_robin``, ``least_loaded`` (same delay and drops as ``kv``).
Each run gets a fresh fleet. Runs go in parallel processes (--jobs). See kvidx/sim/fleet.py for the
simulation model and kvidx/sim/workloads.py for the workloads.

Agreement (DESIGN.md): reuse_rate = reused / prompt tokens, recall = sum(min(credited, reused)) /
sum(reused), over_credit = sum(max(credited - reused, 0)) / sum(reused); credited = what the index
said the chosen replica could resume from at routing time, reused = the engine's cached_tokens.
Pending credit (the index crediting a routed prompt before its events arrive) is not built yet: with
event delay the index lags the engines and the ``kv`` run shows what that costs.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvidx.clihelp import HelpFormatter
from kvidx.config import DEFAULT_HINT_KINDS, HINT_KINDS
from kvidx.core.hints import WINDOW
from kvidx.shadow import Agreement
from kvidx.sim.fleet import (
    DEFAULT_POLICIES,
    ENGINES,
    POLICIES,
    POOL_TIERS,
    FleetConfig,
    RunResult,
    hybrid_spec,
    run_fleet,
)
from kvidx.sim.workloads import (
    MOONCAKE_TRACE,
    TRACE_BLOCK,
    SimRequest,
    agent_requests,
    chat_requests,
    load_trace,
    model_names,
    trace_requests,
)

ENGINE_LABELS = {"vllm": "vllm-0.32", "sglang": "sglang", "trtllm": "trtllm-1.2"}
KEYS = ("requests", "prompt_tokens", "reused_tokens", "credited_tokens", "reuse_rate", "recall",
        "over_credit")


# ---- workload and jobs ----------------------------------------------------------------------------
def build_workload(w: dict) -> list[SimRequest]:
    if w["kind"] == "chat":
        return chat_requests(w["requests"] or 2000, w["models"], w["chat_rate"], w["seed"])
    if w["kind"] == "agent":
        return agent_requests(w["requests"] or 2000, w["models"], w["chat_rate"], w["seed"],
                              concurrent=w.get("agents", 24))
    rows = load_trace(w["trace"], w["requests"])
    return trace_requests(rows, w["block_tokens"], w["models"])


_workload_cache: dict[str, list[SimRequest]] = {}
_progress: Any = None  # per-job request counters (shared memory in worker processes)


def _workload(w: dict) -> list[SimRequest]:
    key = json.dumps(w, sort_keys=True)
    if key not in _workload_cache:
        _workload_cache.clear()
        _workload_cache[key] = build_workload(w)
    return _workload_cache[key]


def _init_worker(counters) -> None:
    global _progress
    _progress = counters
    _quiet_relays()


def _quiet_relays() -> None:
    # a relay logs every gap it fills or clears: the run's counters report them instead
    logging.getLogger("kvidx.relay").setLevel(logging.ERROR)


def _run_job(job: dict) -> dict:
    reqs = _workload(job["workload"])
    cfg = FleetConfig(**job["fleet"])
    k = job["index"]

    def progress(n: int) -> None:
        if _progress is not None:
            _progress[k] = n
    return summarize(job["name"], run_fleet(reqs, cfg, job["policy"], progress), job)


# ---- report -----------------------------------------------------------------------------------
def _agreement(a: Agreement) -> dict:
    s = a.summary()
    s["prefill_tokens"] = a.prompt_tokens - a.reused_tokens
    return s


def summarize(name: str, r: RunResult, job: dict) -> dict:
    f = job["fleet"]
    ttft = r.ttft_s if len(r.ttft_s) else np.zeros(1)
    return {
        "name": name, "policy": r.policy, "transport": f["transport"], "lookup": f["lookup"],
        "delay_ms": list(f["delay_ms"]), "drop_rate": f["drop_rate"], "replay": f["replay"],
        **_agreement(r.overall),
        "prefill_tokens_saved": r.overall.reused_tokens,
        "ttft_est_s": {"mean": round(float(ttft.mean()), 4), "p50": round(float(np.percentile(ttft, 50)), 4),
                       "p99": round(float(np.percentile(ttft, 99)), 4)},
        "per_model": {m: _agreement(a) for m, a in r.per_model.items()},
        "per_engine": {k: _agreement(a) for k, a in r.per_engine.items()},
        "per_tier": {k: _agreement(a) for k, a in r.per_tier.items()},
        "per_group_kind": {k: _agreement(a) for k, a in r.per_group_kind.items()},
        "per_replica": {rep: {**_agreement(a), "routed": r.requests_per_replica[rep],
                              "engine": r.replica_kinds.get(rep, "vllm")}
                        for rep, a in r.per_replica.items()},
        "windows": [{"t0_s": w * f["window_s"], **_agreement(a)} for w, a in sorted(r.windows.items())],
        "mismatches": r.overall.mismatches[:10],
        "counters": r.counters,
        "wall_s": round(r.wall_s, 2),
    }


def _headline(primary: dict, zero: dict | None, runs: list[dict], config: dict, runtime: float) -> dict:
    out = {k: primary[k] for k in KEYS}
    out["exact_requests"] = primary["exact_requests"]
    out.update(policy=primary["policy"], transport=primary["transport"], lookup=primary["lookup"],
               delay_ms=primary["delay_ms"], drop_rate=primary["drop_rate"], replay=primary["replay"])
    if zero is not None:
        out["zero_delay"] = {k: zero[k] for k in (*KEYS, "exact_requests")}
    pol = {}
    for r in runs:
        if r["name"] == "kv_zero_delay":
            continue
        pol[r["name"]] = {"reuse_rate": r["reuse_rate"], "prefill_tokens_saved": r["prefill_tokens_saved"],
                          "prefill_tokens": r["prefill_tokens"], "recall": r["recall"],
                          "over_credit": r["over_credit"], "ttft_est_s": r["ttft_est_s"],
                          **r["counters"]["serving"]}
        if "hints" in r["counters"]:
            pol[r["name"]]["hints"] = r["counters"]["hints"]
    out["policies"] = pol
    brief = ("requests", "reuse_rate", "recall", "over_credit")
    out["per_engine"] = {k: {x: v[x] for x in brief} for k, v in primary["per_engine"].items()}
    out["per_tier"] = {k: {x: v[x] for x in ("reused_tokens", "credited_tokens", "reuse_rate", "recall",
                                            "over_credit")} for k, v in primary["per_tier"].items()}
    tier_keys = ("reused_tokens", "credited_tokens", "reuse_rate", "recall", "over_credit")
    if primary["per_group_kind"]:
        # hybrid replicas: each group's own hit within the full-attention hit, engine vs index
        out["per_group_kind"] = {k: {x: v[x] for x in tier_keys}
                                 for k, v in primary["per_group_kind"].items()}
    if zero is not None and len(zero["per_engine"]) > 1:
        out["zero_delay"]["per_engine"] = {k: {x: v[x] for x in brief} for k, v in zero["per_engine"].items()}
    if zero is not None and len(zero["per_tier"]) > 1:
        out["zero_delay"]["per_tier"] = {k: {x: v[x] for x in tier_keys} for k, v in zero["per_tier"].items()}
    if zero is not None and zero["per_group_kind"]:
        out["zero_delay"]["per_group_kind"] = {k: {x: v[x] for x in tier_keys}
                                               for k, v in zero["per_group_kind"].items()}
    if "foresight" in primary.get("counters", {}):
        out["foresight"] = primary["counters"]["foresight"]
    base = [v["reuse_rate"] for k, v in pol.items() if k not in ("kv", "kv_hints")]
    if "kv" in pol and base:
        out["kv_beats_baselines"] = all(pol["kv"]["reuse_rate"] > b for b in base)
    if primary.get("counters", {}).get("kafka_wait_ms_p99") is not None:
        c = primary["counters"]
        out["kafka_wait_ms"] = {"p50": c["kafka_wait_ms_p50"], "p99": c["kafka_wait_ms_p99"],
                                "timeouts": c["kafka_wait_timeouts"]}
    for key in ("instances", "fanout_lookup_us", "fanout_lookups", "fanout_mismatches", "blind_lookups",
                "credit_lost_tokens", "rolling_restart", "fanout_http_lookup_us", "fanout_http_lookups",
                "fanout_http_mismatches", "fanout_http_partial"):
        if key in primary.get("counters", {}):
            out[key] = primary["counters"][key]
    # the engines' own counts (TensorRT-LLM's offloads and self-evictions, pools, hybrid groups, CPU
    # offload): what a figure above comes from
    eng = {k: primary["counters"][k] for k in ("trtllm", "pools", "hybrid", "cpu_offload")
           if k in primary.get("counters", {})}
    if eng:
        out["engine_counters"] = eng
    out["config"] = config
    out["runtime_s"] = round(runtime, 2)
    return out


def _plots(out_dir: Path, runs: dict[str, dict]) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    # agreement over time
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for name, r in runs.items():
        if not name.startswith("kv"):
            continue
        t = [w["t0_s"] for w in r["windows"]]
        axes[0].plot(t, [w["recall"] for w in r["windows"]], label=name, marker=".")
        axes[1].plot(t, [w["over_credit"] for w in r["windows"]], label=name, marker=".")
        axes[2].plot(t, [w["reuse_rate"] for w in r["windows"]], label=name, marker=".")
    for ax, lab in zip(axes, ("recall", "over-credit", "reuse rate"), strict=True):
        ax.set_ylabel(lab)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].axhline(0.997, color="grey", ls="--", lw=0.8)
    axes[1].axhline(0.002, color="grey", ls="--", lw=0.8)
    axes[2].set_xlabel("simulated time (s)")
    fig.suptitle("index agreement over time (KV-aware router)")
    fig.tight_layout()
    fig.savefig(out_dir / "agreement_over_time.png", dpi=110)
    plt.close(fig)
    files.append("agreement_over_time.png")
    # routers
    names = [n for n in runs if n != "kv_zero_delay"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].bar(names, [runs[n]["reuse_rate"] for n in names], color="tab:blue")
    axes[0].set_ylabel("reuse rate (reused / prompt tokens)")
    axes[1].bar(names, [runs[n]["ttft_est_s"]["mean"] for n in names], color="tab:orange", label="mean")
    axes[1].plot(names, [runs[n]["ttft_est_s"]["p99"] for n in names], "k^", label="p99")
    axes[1].set_ylabel("estimated TTFT (s)")
    axes[1].legend()
    for ax in axes:
        ax.tick_params(axis="x", rotation=20)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("routers: prefix reuse and estimated time to first token")
    fig.tight_layout()
    fig.savefig(out_dir / "routers.png", dpi=110)
    plt.close(fig)
    files.append("routers.png")
    # per replica (primary)
    if "kv" in runs:
        reps = runs["kv"]["per_replica"]
        fig, ax = plt.subplots(figsize=(max(6, len(reps) * 0.5), 4))
        x = np.arange(len(reps))
        ax.bar(x - 0.2, [v["reuse_rate"] for v in reps.values()], 0.4, label="reuse rate")
        ax.bar(x + 0.2, [v["recall"] for v in reps.values()], 0.4, label="recall")
        ax.set_xticks(x, list(reps), rotation=60, fontsize=7)
        ax2 = ax.twinx()
        ax2.plot(x, [v["routed"] for v in reps.values()], "k.", label="requests")
        ax2.set_ylabel("requests routed")
        ax.legend(loc="lower left", fontsize=8)
        ax.set_title("KV-aware router, per replica")
        fig.tight_layout()
        fig.savefig(out_dir / "per_replica.png", dpi=110)
        plt.close(fig)
        files.append("per_replica.png")
    return files


class _Progress:
    def __init__(self, totals: list[int], names: list[str], enabled: bool) -> None:
        self.total = sum(totals)
        self.names = names
        self.enabled = enabled
        self.t0 = time.monotonic()
        self.last = 0.0

    def show(self, counts, done: int, force: bool = False) -> None:
        if not self.enabled:
            return
        t = time.monotonic()
        if not force and t - self.last < 0.25:
            return
        self.last = t
        n = sum(counts)
        frac = n / self.total if self.total else 1.0
        width = 30
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        el = t - self.t0
        eta = f"{el / frac - el:5.0f}s" if frac > 0.01 else "    ?"
        sys.stderr.write(f"\r[simulate] [{bar}] {frac * 100:5.1f}% {n}/{self.total} requests, "
                         f"{done}/{len(self.names)} runs, {el:5.0f}s elapsed, eta {eta} ")
        sys.stderr.flush()

    def end(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


# ---- main -------------------------------------------------------------------------------------
def _parse_delay(s: str) -> tuple[float, float]:
    parts = [float(x) for x in s.split(",")]
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or parts[0] < 0 or parts[1] < parts[0]:
        raise argparse.ArgumentTypeError("--delay-ms takes LO,HI (0 <= LO <= HI) or one value")
    return parts[0], parts[1]


Say = Callable[[str], None]  # a one-line message to the user


def _sayer(quiet: bool) -> Say:
    """The run's messages: one `[simulate]` line each on stderr, none with --quiet."""
    if quiet:
        return lambda m: None
    return lambda m: print(f"[simulate] {m}", file=sys.stderr, flush=True)


# numeric flags: the least value each takes, and those that take any value above 0
_FLAG_FLOORS: tuple[tuple[str, int], ...] = (
    ("--models", 1), ("--replicas", 1), ("--engine-block-size", 1), ("--index-block-size", 1),
    ("--cache-tokens", 1), ("--engine-blocks", 1), ("--requests", 1), ("--trace-block-tokens", 1),
    ("--host-tier-blocks", 0), ("--pool-blocks", 0), ("--pool-group", 1), ("--hybrid-group-blocks", 0),
    ("--hybrid-chunk-tokens", 1), ("--cpu-offload-blocks", 0), ("--disk-offload-blocks", 0),
    ("--replay-buffer", 0), ("--decode-ms-per-token", 0), ("--agents", 1), ("--jobs", 1),
    ("--kv-bytes-per-token", 0), ("--hint-delay-ms", 0))
_POSITIVE_FLAGS = ("--speed", "--chat-rate", "--prefill-tps", "--trtllm-poll-ms", "--placement-tps",
                   "--window-s")


def _check_args(args: argparse.Namespace, say: Say) -> tuple[tuple[str, ...], list[str], str]:
    """Refuse, with one line and before any work, the flags the simulator cannot run; returns the engine
    kinds, the policies and the trace's path."""
    for flag, least in (*_FLAG_FLOORS, *((f, None) for f in _POSITIVE_FLAGS)):
        v = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if v is not None and not (v > 0 if least is None else v >= least):  # NaN fails both
            raise SystemExit(f"error: {flag} must be {'> 0' if least is None else f'>= {least}'}, not {v}")
    if not 0.0 <= args.drop_rate < 1.0:  # NaN fails it
        raise SystemExit(f"error: --drop-rate takes a share in [0, 1), not {args.drop_rate}")
    if args.engine_block_size % args.index_block_size:
        raise SystemExit("error: --index-block-size must divide --engine-block-size")
    engines = tuple(k.strip() for k in args.engines.split(",") if k.strip())
    from kvidx import engines as registry

    for k in engines:
        if k not in registry.names():
            raise SystemExit(f"error: unknown engine {k!r} (registered: {', '.join(registry.names())})")
        if k not in ENGINES:  # registered, but the fleet simulator has no simulated engine of it yet
            raise SystemExit(f"error: engine {k!r} has no simulated engine (simulated: {', '.join(ENGINES)})")
    if not engines:
        raise SystemExit("error: --engines names no engine")
    if args.host_tier_blocks and "trtllm" not in engines:
        say("--host-tier-blocks applies to TensorRT-LLM replicas only (vLLM: --cpu-offload-blocks)")
    if args.hybrid:
        try:
            hybrid_spec(args.hybrid)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        if "vllm" not in engines:
            raise SystemExit("error: --hybrid applies to vLLM replicas: --engines names none")
        if args.pool_blocks or args.cpu_offload_blocks:
            raise SystemExit("error: --hybrid is simulated without --pool-blocks or --cpu-offload-blocks")
    if args.cpu_offload_blocks and "vllm" not in engines:
        raise SystemExit("error: --cpu-offload-blocks applies to vLLM replicas: --engines names none")
    if args.disk_offload_blocks and not args.cpu_offload_blocks:
        raise SystemExit("error: --disk-offload-blocks is the level under --cpu-offload-blocks: give both")
    kinds = [k.strip() for k in args.hints.split(",") if k.strip()]
    for k in kinds:
        if k not in HINT_KINDS:
            raise SystemExit(f"error: unknown hint kind {k!r} (known: {', '.join(HINT_KINDS)})")
    if not 0.0 <= args.hint_compliance <= 1.0:
        raise SystemExit(f"error: --hint-compliance takes a share in [0, 1], not {args.hint_compliance}")
    if args.replica_groups != 1 and (args.replica_groups < 1 or not args.kafka):
        raise SystemExit("error: --replica-groups takes a count >= 1, with --kafka (groups are Kafka keys)")
    n = args.service_instances
    if args.rolling_restart and not n:
        raise SystemExit("error: --rolling-restart needs --kafka and --service-instances")
    if n and (n < 2 or args.replica_groups < n):
        raise SystemExit("error: --service-instances takes N >= 2, at most --replica-groups (each instance "
                         "holds some groups)")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        if p not in POLICIES:
            raise SystemExit(f"error: unknown policy {p!r} (known: {', '.join(POLICIES)})")
    trace = args.trace or str(MOONCAKE_TRACE)
    if args.workload == "trace" and not os.path.exists(trace):
        raise SystemExit(f"error: no such trace file: {trace}")
    return engines, policies, trace


@dataclass
class _Sizes:
    """The sizes the flags leave to the workload: its token scale, GPU and pool blocks per replica (raised
    so that the longest request fits), its simulated duration, the agreement window, the event delay."""

    scale: float
    num_blocks: int
    pool_blocks: int
    duration: float
    window: float
    delay: tuple[float, float]

    @classmethod
    def of(cls, args: argparse.Namespace, reqs: list[SimRequest], say: Say) -> _Sizes:
        scale = args.trace_block_tokens / TRACE_BLOCK if args.workload == "trace" else 1.0
        max_blocks = max(math.ceil((len(r.prompt) + len(r.output)) / args.engine_block_size) for r in reqs)
        num_blocks = args.engine_blocks or max(1, round(args.cache_tokens * scale / args.engine_block_size))
        if num_blocks <= max_blocks:
            say(f"engine blocks raised from {num_blocks} to {max_blocks + 1}: "
                f"the longest request needs {max_blocks}")
            num_blocks = max_blocks + 1
        pool_blocks = args.pool_blocks
        if pool_blocks and pool_blocks <= max_blocks:
            say(f"pool blocks raised from {pool_blocks} to {max_blocks + 1}: "
                f"the longest request needs {max_blocks}")
            pool_blocks = max_blocks + 1
        duration = max(r.t for r in reqs) / args.speed
        window = args.window_s or max(1.0, round(duration / 40, 1))
        delay = _parse_delay(args.delay_ms)
        return cls(scale, num_blocks, pool_blocks, duration, window, delay)


def _load_rates(spec: str) -> dict[str, float]:
    """--load-tps TIER=RATE,...: the service's default price rates, with those named replaced."""
    from kvidx.core.price import PriceConfig
    rates = dict(PriceConfig().load_tokens_per_s)
    for part in filter(None, (p.strip() for p in spec.split(","))):
        tier, _, v = part.partition("=")
        try:
            rate = float(v)
        except ValueError:
            rate = -1.0
        if not tier or rate < 0:
            raise SystemExit(f"error: --load-tps takes TIER=TOKENS_PER_S,... (e.g. CPU=150000), not {part!r}")
        rates[tier.strip().upper()] = rate
    return rates


def _fleet_options(args: argparse.Namespace, engines: tuple[str, ...], sz: _Sizes) -> dict[str, Any]:
    """FleetConfig's fields for every run (a job overrides transport, lookup, delays): a plain dict, so
    that a job pickles to a worker process as is."""
    return {"models": model_names(args.models), "replicas": args.replicas,
            "engine_block": args.engine_block_size, "index_block": args.index_block_size,
            "num_blocks": sz.num_blocks, "delay_ms": sz.delay, "drop_rate": args.drop_rate,
            "replay": not args.no_replay, "replay_buffer": args.replay_buffer, "speed": args.speed,
            "token_scale": sz.scale, "prefill_tps": args.prefill_tps,
            "decode_ms_per_token": args.decode_ms_per_token, "load_weight": args.load_weight,
            "window_s": sz.window, "seed": args.seed, "engines": engines,
            "sglang_version": args.sglang_version, "host_tier_blocks": args.host_tier_blocks,
            "trtllm_poll_ms": args.trtllm_poll_ms, "pool_blocks": sz.pool_blocks,
            "pool_group": args.pool_group, "pool_tier": args.pool_tier, "hybrid": args.hybrid or "",
            "hybrid_group_blocks": args.hybrid_group_blocks, "hybrid_chunk_tokens": args.hybrid_chunk_tokens,
            "cpu_offload_blocks": args.cpu_offload_blocks, "disk_offload_blocks": args.disk_offload_blocks,
            "load_tps": _load_rates(args.load_tps), "kv_bytes_per_token": args.kv_bytes_per_token,
            "hints": tuple(k.strip() for k in args.hints.split(",") if k.strip()),
            "hint_compliance": args.hint_compliance, "hint_delay_ms": args.hint_delay_ms,
            "placement_tps": args.placement_tps, "record_routes": not args.no_routes,
            "replica_groups": args.replica_groups, "service_instances": args.service_instances,
            "rolling_restart": args.rolling_restart}


def _config_report(args: argparse.Namespace, engines: tuple[str, ...], trace: str, reqs: list[SimRequest],
                   sz: _Sizes) -> dict[str, Any]:
    """The headline's `config`: what was simulated, in the flags' terms, so that a figure can be rerun."""
    return {"workload": args.workload,
            "trace": os.path.basename(trace) if args.workload == "trace" else None,
            "requests": len(reqs), "models": args.models, "replicas_per_model": args.replicas,
            "engine": ", ".join(ENGINE_LABELS[k] + (f"-{args.sglang_version}" if k == "sglang" else "")
                                for k in engines) + " (simulated)",
            "engines": list(engines), "host_tier_blocks": args.host_tier_blocks,
            "pool_blocks": sz.pool_blocks, "pool_group": args.pool_group if sz.pool_blocks else None,
            "pool_tier": args.pool_tier if sz.pool_blocks else None, "hybrid": args.hybrid,
            "cpu_offload_blocks": args.cpu_offload_blocks, "disk_offload_blocks": args.disk_offload_blocks,
            "load_tps": _load_rates(args.load_tps), "kv_bytes_per_token": args.kv_bytes_per_token,
            "hints": args.hints, "hint_compliance": args.hint_compliance, "hint_delay_ms": args.hint_delay_ms,
            "engine_block_size": args.engine_block_size,
            "index_block_size": args.index_block_size, "engine_blocks": sz.num_blocks,
            "trace_block_tokens": args.trace_block_tokens if args.workload == "trace" else None,
            "token_scale": sz.scale, "speed": args.speed, "delay_ms": list(sz.delay),
            "drop_rate": args.drop_rate,
            "replay": not args.no_replay, "prefill_tps": args.prefill_tps, "load_weight": args.load_weight,
            "window_s": sz.window, "seed": args.seed, "routes": not args.no_routes,
            "replica_groups": args.replica_groups, "service_instances": args.service_instances,
            "rolling_restart": args.rolling_restart}


def _fleet_line(args: argparse.Namespace, engines: tuple[str, ...], reqs: list[SimRequest],
                sz: _Sizes) -> str:
    """One line saying what is about to be simulated."""
    pools = ", pools of " + str(sz.pool_blocks) + " blocks" if sz.pool_blocks else ""
    return (f"{len(reqs)} requests ({sum(len(r.prompt) for r in reqs)} prompt tokens, "
            f"{sz.duration:.0f} s simulated) on {args.models} model(s) x {args.replicas} replicas "
            f"({'/'.join(engines)}{pools}), "
            f"{sz.num_blocks} blocks of {args.engine_block_size} tokens each; "
            f"index block {args.index_block_size}")


def _best_effort(stop: Callable[[], Any]) -> None:
    try:
        stop()
    except Exception:
        pass


def _kafka_overrides(args: argparse.Namespace, say: Say, stack: ExitStack) -> dict[str, Any]:
    """--kafka: the broker the kv run's events go through (a local one in a temporary directory, both gone
    when `stack` closes, unless --bootstrap or $KAFKA_BOOTSTRAP_SERVERS name one) and its topics (unique
    per run unless --topic-prefix); returns the kv job's fleet overrides."""
    from kvidx.kafka.topics import ensure_topics
    from schemas.events import topic_names
    bootstrap = args.bootstrap or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if not bootstrap:
        from kvidx.kafka.local import LocalKafka
        tmp = Path(tempfile.mkdtemp(prefix="kvidx-simulate-"))
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        broker = LocalKafka(log=lambda m: say(f"kafka: {m}"))
        bootstrap = broker.start(tmp / "kafka")
        stack.callback(_best_effort, broker.stop)
    prefix = args.topic_prefix or f"sim{time.time_ns()}."
    ensure_topics(bootstrap, topic_names(prefix))
    say(f"Kafka at {bootstrap}, topics {topic_names(prefix)['events']} ...: the kv run's events go "
        f"through the broker")
    return {"transport": "kafka", "bootstrap": bootstrap, "topic_prefix": prefix}


def _plan_jobs(args: argparse.Namespace, policies: list[str], wl: dict, fleet: dict[str, Any],
               primary_over: dict[str, Any]) -> list[dict]:
    """One job per run, each with a fresh fleet: the kv router (through Kafka and/or HTTP if asked), its
    zero-delay twin (no delay, drops or poll wait: agreement must be exact), then each baseline."""
    jobs: list[dict] = []

    def job(name: str, policy: str, **over: Any) -> None:
        jobs.append({"name": name, "policy": policy, "workload": wl, "index": len(jobs),
                     "fleet": {**fleet, "transport": "embedded", "lookup": "inproc", **over}})

    if "kv" in policies:
        job("kv", "kv", **primary_over)
    if not args.no_zero_delay:
        job("kv_zero_delay", "kv", delay_ms=(0.0, 0.0), drop_rate=0.0, trtllm_poll_ms=0.0)
    for p in policies:
        if p != "kv":
            job(p, p)
    if not jobs:
        raise SystemExit("error: nothing to run")
    return jobs


def _run_jobs_here(jobs: list[dict], reqs: list[SimRequest], prog: _Progress) -> list[dict]:
    """--jobs 1: the runs one after the other in this process (no workload rebuilt, no pickling)."""
    results: list[dict] = []
    counts = [0] * len(jobs)
    _init_worker(counts)
    for j in jobs:
        def tick(n: int, k: int = j["index"]) -> None:
            counts[k] = n
            prog.show(counts, len(results))
        results.append(summarize(j["name"], run_fleet(reqs, FleetConfig(**j["fleet"]), j["policy"], tick), j))
    prog.show(counts, len(results), force=True)
    return results


def _run_jobs_in_processes(jobs: list[dict], reqs: list[SimRequest], n_jobs: int,
                           prog: _Progress) -> list[dict]:
    """The runs in `n_jobs` spawned processes (each builds the workload once); their request counters in
    shared memory feed the progress bar."""
    ctx = mp.get_context("spawn")
    counts = ctx.Array("q", len(jobs), lock=False)
    with ProcessPoolExecutor(n_jobs, mp_context=ctx, initializer=_init_worker, initargs=(counts,)) as pool:
        futs = [pool.submit(_run_job, j) for j in jobs]
        while not all(f.done() for f in futs):
            prog.show(list(counts), sum(f.done() for f in futs))
            time.sleep(0.1)
        results = [f.result() for f in futs]
    prog.show([len(reqs)] * len(jobs), len(jobs), force=True)
    return results


def _run_jobs(jobs: list[dict], reqs: list[SimRequest], args: argparse.Namespace) -> list[dict]:
    """Every job's summary, in job order: in this process with --jobs 1 (or one job), else in parallel."""
    n_jobs = max(1, min(args.jobs or os.cpu_count() or 1, len(jobs)))
    prog = _Progress([len(reqs)] * len(jobs), [j["name"] for j in jobs], not args.no_progress)
    if n_jobs == 1:
        results = _run_jobs_here(jobs, reqs, prog)
    else:
        results = _run_jobs_in_processes(jobs, reqs, n_jobs, prog)
    prog.end()
    return results


def _write_out(out: Path, head: dict, by_name: dict[str, dict], say: Say) -> None:
    """--out: summary.json (the headline, every run in full, the notes) and the PNG plots beside it."""
    out.mkdir(parents=True, exist_ok=True)
    plots = _plots(out, by_name)
    full = {"summary": head, "runs": by_name, "plots": plots,
            "notes": NOTES}
    (out / "summary.json").write_text(json.dumps(full, indent=1))
    head["out"] = str(out)
    if not plots:
        say("no PNG plots: matplotlib is not installed (pip install -e '.[plots]'); summary.json written")


def run(args: argparse.Namespace) -> dict:
    """`kvidx simulate`: check the flags, build the workload and size the fleet, run every job (the kv
    router, its zero-delay twin, the baselines; the kv one through Kafka/HTTP if asked) and return the
    headline, written with the runs and plots to --out if given."""
    t_start = time.monotonic()
    _quiet_relays()
    say = _sayer(args.quiet)
    engines, policies, trace = _check_args(args, say)
    given = args.bootstrap or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if args.kafka and given:  # an operator's broker that does not answer: say so before the workload
        from kvidx.kafka.reach import require_broker
        require_broker(given)
    wl = {"kind": args.workload, "trace": trace, "requests": args.requests, "models": args.models,
          "block_tokens": args.trace_block_tokens, "chat_rate": args.chat_rate, "seed": args.seed}
    if args.workload == "agent":
        wl["agents"] = args.agents
    reqs = _workload(wl)
    if not reqs:
        raise SystemExit("error: the workload is empty")
    sizes = _Sizes.of(args, reqs, say)
    fleet = _fleet_options(args, engines, sizes)
    config = _config_report(args, engines, trace, reqs, sizes)
    say(_fleet_line(args, engines, reqs, sizes))

    with ExitStack() as stack:  # a local Kafka broker, if the kv run needs one
        primary_over = _kafka_overrides(args, say, stack) if args.kafka else {}
        if args.http:
            primary_over["lookup"] = "http"
        jobs = _plan_jobs(args, policies, wl, fleet, primary_over)
        results = _run_jobs(jobs, reqs, args)

    by_name = {r["name"]: r for r in results}
    primary = by_name.get("kv") or results[0]
    head = _headline(primary, by_name.get("kv_zero_delay"), results, config, time.monotonic() - t_start)
    if args.out:
        _write_out(Path(args.out), head, by_name, say)
    return head


NOTES = [
    "engines: --engines vllm,sglang,trtllm assigns a model's replicas round-robin to the kinds; each "
    "publishes its real wire format (vLLM 0.32 ZMQ, SGLang ZMQ per --sglang-version, TensorRT-LLM pull-API "
    "polls every --trtllm-poll-ms) through its own relay",
    "tiers: GPU; TensorRT-LLM host tier with --host-tier-blocks (reuse split primary/secondary by the "
    "engine); shared pools with --pool-blocks; vLLM's offloading connector with --cpu-offload-blocks (GPU "
    "evictions move to a CPU LRU, published as the connector's placeholder events; CPU hits after the GPU "
    "hit are reused and counted in the CPU tier)",
    "hybrid groups with --hybrid swa:W or mamba:K (vLLM replicas only; vLLM 0.32 hybrid events, reuse by "
    "vLLM's hybrid rule; per_group_kind compares each group's own hit within the full-attention hit); "
    "hybrid replicas cache their prompts only (not decode blocks)",
    "TensorRT-LLM polls are HTTP responses: never dropped (drops apply to ZMQ streams)",
    "pending credit is not used: with event delay the index lags the engines",
]


def _print_human(head: dict) -> None:
    def pct(x: float) -> str:
        return f"{x * 100:.3f}%"
    print(f"requests {head['requests']}, prompt tokens {head['prompt_tokens']}, "
          f"runtime {head['runtime_s']} s")
    print(f"agreement, KV-aware router, delay {head['delay_ms']} ms, drops {head['drop_rate']}: reuse rate "
          f"{pct(head['reuse_rate'])}, recall {pct(head['recall'])}, over-credit {pct(head['over_credit'])}"
          f" (transport {head['transport']}, lookup {head['lookup']})")
    z = head.get("zero_delay")
    if z:
        print(f"agreement, zero delay: recall {pct(z['recall'])}, over-credit {pct(z['over_credit'])}, "
              f"exact {z['exact_requests']}/{z['requests']}")
    print(f"{'router':>14} {'reuse rate':>10} {'prefill saved':>14} {'recall':>9} {'over-cr.':>9} "
          f"{'TTFT mean':>10} {'TTFT p99':>9} {'GPU share':>9} {'GB moved':>9}")
    for name, p in head["policies"].items():
        print(f"{name:>14} {p['reuse_rate']:>10.4f} {p['prefill_tokens_saved']:>14} {p['recall']:>9.5f} "
              f"{p['over_credit']:>9.5f} {p['ttft_est_s']['mean']:>9.3f}s {p['ttft_est_s']['p99']:>8.3f}s "
              f"{p['gpu_share_of_reused']:>9.3f} {p['bytes_moved'] / 1e9:>9.1f}")
        for kind, h in p.get("hints", {}).items():
            won = "not measured" if h["saved_s"] is None else f"{h['saved_s']:.3f} s"
            print(f"{'':>14} {kind} hints: {h['issued']} issued, {h['followed']} followed, "
                  f"{h['paid_off']} paid off, {h['regretted']} regretted")
            print(f"{'':>17}seconds won {won}, lost {h['lost_s']:.3f} s; wasted {h['wasted_tokens']} tokens, "
                  f"{h['wasted_s']:.3f} s of load channel")
            if "payoff_ratio" in h:  # the prefetch gate (kvidx.core.hints.PrefetchGate)
                ratio = "none yet" if h["payoff_ratio"] is None else f"{h['payoff_ratio']:.2f}"
                print(f"{'':>17}not issued: {h['declined']} could not pay, {h['throttled']} throttled; "
                      f"pay-off ratio of the last {WINDOW} {ratio}")
            elif "declined" in h:  # eviction advice (kvidx.core.sessions.worth_advising)
                print(f"{'':>17}not issued: {h['declined']} not worth their class's return probability")
    if len(head.get("per_engine", {})) > 1 or len(head.get("per_tier", {})) > 1:
        for label, d in (("engine", head["per_engine"]), ("tier", head["per_tier"])):
            for k, v in d.items():
                print(f"  {label} {k:>12}: reuse rate {pct(v['reuse_rate'])}, recall {pct(v['recall'])}, "
                      f"over-credit {pct(v['over_credit'])}")
    for k, v in head.get("per_group_kind", {}).items():
        print(f"  group {k:>12}: hit rate {pct(v['reuse_rate'])}, recall {pct(v['recall'])}, "
              f"over-credit {pct(v['over_credit'])}")
    if "out" in head:
        print(f"summary and plots in {head['out']}")


def cmd_simulate(args: argparse.Namespace) -> int:
    head = run(args)
    if args.json:
        print(json.dumps(head), flush=True)
    else:
        _print_human(head)
    return 0


def _add_workload_flags(p: argparse.ArgumentParser) -> None:
    """The workload: the trace or a generated one, how much of it, how fast, its seed."""
    w = p.add_argument_group("workload")
    w.add_argument("--trace", help="a Mooncake-format trace (jsonl: timestamp ms, input_length, "
                   "output_length, hash_ids); default: the bundled mooncake_conversation_trace.jsonl")
    w.add_argument("--workload", choices=["trace", "chat", "agent"], default="trace",
                   help="the trace, generated multi-turn chat with shared system prompts, or agent loops "
                        "(long shared tool prompts, contexts growing by tool calls and results)")
    w.add_argument("--requests", type=int, default=None, help="use the first N requests (chat: default 2000)")
    w.add_argument("--trace-block-tokens", type=int, default=64,
                   help="tokens per trace hash id (the trace's are 512): every length is scaled by "
                        "this/512, which keeps the prefix structure and divides the work")
    w.add_argument("--speed", type=float, default=1.0,
                   help="time compression: arrivals come SPEED times faster")
    w.add_argument("--chat-rate", type=float, default=20.0, help="chat and agent workloads: requests/s "
                   "(Poisson)")
    w.add_argument("--agents", type=int, default=24, help="agent workload: agent loops in flight at once")
    w.add_argument("--seed", type=int, default=7,
                   help="random seed (generated workloads, delays, drops, random routing)")


def _add_fleet_flags(p: argparse.ArgumentParser) -> None:
    """The fleet: models, replicas and their engine kinds, tiers and pools, hybrid models, cache
    sizes, the events' delay and drops, the load model."""
    f = p.add_argument_group("fleet")
    f.add_argument("--models", type=int, default=1, help="models (trace requests spread by prefix)")
    f.add_argument("--replicas", type=int, default=8, help="replicas per model")
    from kvidx import engines as registry

    f.add_argument("--engines", default="vllm", metavar="E[,E...]",
                   help=f"engine kinds, comma-separated, of {', '.join(registry.names())} (simulated: "
                        f"{', '.join(e for e in registry.names() if registry.get(e).sim)}): a model's "
                        "replicas are assigned to them round-robin")
    f.add_argument("--sglang-version", default="0.5.23", help="the SGLang release whose wire format the "
                   "SGLang replicas publish")
    f.add_argument("--host-tier-blocks", type=int, default=0, help="TensorRT-LLM: host-tier (secondary) "
                   "blocks per replica (offload on eviction, onboard on reuse)")
    f.add_argument("--trtllm-poll-ms", type=float, default=50.0,
                   help="TensorRT-LLM relay: poll interval of POST /kv_cache_events")
    f.add_argument("--pool-blocks", type=int, default=0, help="a shared pool (LMCache-like) of N blocks per "
                   "--pool-group replicas, publishing as its own replica; engines reuse from it on a miss")
    f.add_argument("--pool-group", type=int, default=4, help="replicas attached to each pool")
    f.add_argument("--pool-tier", default="NODE_SHARED", choices=POOL_TIERS, help="the pool's tier")
    f.add_argument("--hybrid", default=None, metavar="SPEC", help="vLLM replicas as hybrid models: swa:W "
                   "(full attention + a sliding window of W tokens) or mamba:K (full attention + a "
                   "state-space group checkpointed every K engine blocks)")
    f.add_argument("--hybrid-group-blocks", type=int, default=0, help="blocks added to a hybrid "
                   "replica's pool for its second group (the groups share one pool; 0: GPU blocks / 4 "
                   "for swa, / (2K) for mamba)")
    f.add_argument("--hybrid-chunk-tokens", type=int, default=2048, help="swa: the scheduler's prefill chunk")
    f.add_argument("--cpu-offload-blocks", type=int, default=0, help="vLLM offloading connector: CPU blocks "
                   "per vLLM replica (blocks evicted from the GPU move there, LRU; CPU hits are reused)")
    f.add_argument("--disk-offload-blocks", type=int, default=0, help="a disk level under the CPU tier: "
                   "disk blocks per vLLM replica (CPU evictions move there, LRU; disk hits are reused)")
    f.add_argument("--load-tps", default="", metavar="TIER=RATE,...", help="load model: tokens/s (workload "
                   "tokens) at which a replica loads reused tokens from each tier (default: the service's "
                   "price rates, CPU=150000,DISK=40000,NODE_SHARED=100000,POOL=25000)")
    f.add_argument("--kv-bytes-per-token", type=int, default=131072,
                   help="KV cache bytes per workload token, for bytes moved (Llama-3-8B: 131072)")
    f.add_argument("--no-routes", action="store_true", help="the router does not record its decisions "
                   "(POST /v1/routes): no pending credit, no eviction foresight, the index from events alone")
    f.add_argument("--engine-block-size", type=int, default=16,
                   help="the simulated engines' tokens per block")
    f.add_argument("--index-block-size", type=int, default=16, help="must divide the engine block size")
    f.add_argument("--cache-tokens", type=int, default=1_000_000,
                   help="KV cache per replica, in workload tokens (before --trace-block-tokens scaling)")
    f.add_argument("--engine-blocks", type=int, default=None, help="GPU blocks per replica (overrides "
                   "--cache-tokens)")
    f.add_argument("--delay-ms", default="1,20", help="event delay after the engine step: LO,HI (uniform) "
                   "or one value; FIFO per replica, reordered across replicas")
    f.add_argument("--drop-rate", type=float, default=0.001, help="fraction of engine messages lost")
    f.add_argument("--no-replay", action="store_true",
                   help="do not fill gaps from the engine's replay buffer (the relay clears the replica)")
    f.add_argument("--replay-buffer", type=int, default=1000, help="engine messages kept for replay")
    f.add_argument("--prefill-tps", type=float, default=20000.0,
                   help="load model: prefill tokens/s per replica (workload tokens)")
    f.add_argument("--decode-ms-per-token", type=float, default=20.0,
                   help="load model: decode time per output token")


def _add_routing_flags(p: argparse.ArgumentParser) -> None:
    """The routers to compare and the index's transport (in process, Kafka, HTTP lookups)."""
    r = p.add_argument_group("routing and index")
    r.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help=f"routers to run, of {', '.join(POLICIES)} (kv = KV-aware; kv_hints = KV-aware with "
                        "the index's hints, which the replicas follow)")
    r.add_argument("--hints", default=",".join(DEFAULT_HINT_KINDS), metavar="KIND[,KIND...]",
                   help=f"kv_hints: the hint kinds issued, of {', '.join(HINT_KINDS)} (prefetch: the chosen "
                        "replica loads the prompt's blocks held below GPU memory while the request is "
                        "queued; placement: a recurring session's prompt copied ahead of time to the replica "
                        "with the shortest queue; eviction: silent sessions' own blocks demoted, then "
                        "dropped); default: what the service issues once a model's hints are on "
                        f"(hints.prefetch), {','.join(DEFAULT_HINT_KINDS)}; placement and eviction need "
                        "hints.sessions too")
    r.add_argument("--placement-tps", type=float, default=100_000.0,
                   help="kv_hints: tokens/s (workload tokens) of a placement's copy between replicas")
    r.add_argument("--hint-compliance", type=float, default=1.0,
                   help="kv_hints: share of hints the replicas follow")
    r.add_argument("--hint-delay-ms", type=float, default=2.0,
                   help="kv_hints: time from the routing decision until a replica acts on its hint")
    r.add_argument("--load-weight", type=float, default=1.0,
                   help="kv router: price = prefill tokens left + the load time of the resumable tokens "
                        "below GPU memory (in prefill tokens) + WEIGHT x prefill tokens already queued on "
                        "the replica")
    r.add_argument("--no-zero-delay", action="store_true", help="skip the zero-delay agreement run")
    r.add_argument("--http", action="store_true", help="the kv run looks up through the real HTTP service")
    r.add_argument("--kafka", action="store_true", help="the kv run's events go through a Kafka broker "
                   "(a local one unless --bootstrap or $KAFKA_BOOTSTRAP_SERVERS)")
    r.add_argument("--bootstrap", help="Kafka bootstrap servers (with --kafka)")
    r.add_argument("--topic-prefix", default=None, help="topic prefix with --kafka (default: unique per run)")
    r.add_argument("--replica-groups", type=int, default=1, metavar="G",
                   help="with --kafka: each model's index split in G replica groups (Kafka keys and "
                        "partitions, as replica_groups in --config does; docs/scaling.md)")
    r.add_argument("--service-instances", type=int, default=0, metavar="N",
                   help="with --replica-groups: N service instances each holding ~1/N of the groups; every "
                        "lookup goes to one of them, which merges the others' answers (as `serve --groups` "
                        "does), compared with a full instance's (JSON: instances, fanout_lookup_us, "
                        "fanout_mismatches); at the end the same instances as `kvidx serve --groups` "
                        "processes: their RSS (instances[].rss_bytes) and the run's last 400 lookups over "
                        "HTTP through them (fanout_http_lookup_us, fanout_http_mismatches)")
    r.add_argument("--rolling-restart", action="store_true",
                   help="with --service-instances: two real `kvidx worker` processes, and every worker and "
                        "instance restarted once during the run, one at a time (JSON: blind_lookups, "
                        "credit_lost_tokens, rolling_restart)")


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    """What is written (JSON, summary and plots), the agreement window, parallel runs, messages."""
    o = p.add_argument_group("output")
    o.add_argument("--out", help="directory for summary.json and PNG plots")
    o.add_argument("--window-s", type=float, default=None,
                   help="agreement window in simulated seconds (default: the run split in ~40)")
    o.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    o.add_argument("--jobs", type=int, default=None, help="runs in parallel (default: the CPU count)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    o.add_argument("--quiet", action="store_true", help="no messages on stderr (but the progress bar)")


def add_cli(subparsers) -> argparse.ArgumentParser:
    """Register ``simulate``; its leaf sets ``func(args) -> int`` (exit code)."""
    p = subparsers.add_parser(
        "simulate", help="simulate a fleet (vLLM, SGLang, TensorRT-LLM) on a trace: index agreement and "
                         "KV-aware routing",
        description="Replays a workload (the Mooncake conversation trace by default) on a simulated fleet "
                    "of vLLM, SGLang and TensorRT-LLM replicas whose real-format KV events reach the index "
                    "through "
                    "the relay code "
                    "with delay, reordering across replicas and drops. Reports how the index's credit "
                    "agrees with what the engines reused (reuse rate, recall, over-credit; overall, per "
                    "model/replica, over time) and how a KV-aware router compares with random, "
                    "round-robin and least-loaded routing; per engine and per tier (host tier, shared "
                    "pools).",
        formatter_class=HelpFormatter)
    _add_workload_flags(p)
    _add_fleet_flags(p)
    _add_routing_flags(p)
    _add_output_flags(p)
    p.set_defaults(func=cmd_simulate)
    return p
