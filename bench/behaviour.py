"""Behaviour figures through the stable CLI only, to show that a refactor changed no behaviour.

Runs `python -m kvidx.cli shadow --json` on every recording in tests/fixtures and `python -m kvidx.cli
simulate --json` on the shipped Mooncake trace for the fleets docs/simulator.md reports, each as a
subprocess with cwd = this repo's root and PYTHONPATH = that root. It never imports kvidx, so it runs
on any layout of the code. Prints one JSON object {"shadow": {name: summary}, "simulate": {name:
summary}}; progress goes to stderr.

    python bench/behaviour.py --out /tmp/before.json          # full trace: 30-45 min on 2 busy cores
    python bench/behaviour.py --quick --out /tmp/quick.json   # the trace's first 1000 requests only
    python bench/behaviour.py --compare /tmp/before.json /tmp/after.json   # exit 1 if a figure differs

Recordings: each directory under tests/fixtures with a request log (requests.jsonl) and a stream
(frames.jsonl, or events.jsonl for TensorRT-LLM); the engine comes from the directory's name
(vllm-*, trtllm-*, lmcache-*). Extra flag combinations come from the tests and RECORDINGS.md
(VARIANTS below). Only deterministic figures are kept: simulate's wall-clock `runtime_s` is dropped
(its `ttft_est_s` comes from the simulated load model, not the clock, and stays). PYTHONHASHSEED is
fixed for every subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path("tests") / "fixtures"  # relative to ROOT (the subprocesses' cwd)

# engine per fixture directory prefix (tests/fixtures/<engine>-<version>/...)
ENGINE_OF_PREFIX = {"vllm-": "vllm", "trtllm-": "trtllm", "lmcache-": "lmcache", "sglang-": "sglang"}
STREAM_FILES = ("frames.jsonl", "events.jsonl")

# extra shadow runs beside the default one of every recording: recording -> flag lists
# (tests/test_shadow.py: llama_c4 at index block 16 and 32; RECORDINGS.md: qwen3next_c1 at 32 too,
# llama_c4 with --pending-ttl 2; docs/routers.md: pending credit on gemma2 (hybrid: not applied);
# tests/test_trtllm.py: TensorRT-LLM fixtures at index block size 1; docs/hybrid-models.md:
# unreported mamba evictions)
VARIANTS: dict[str, list[list[str]]] = {
    "vllm-0.32/llama_c4": [["--index-block-size", "32"], ["--pending-ttl", "2"]],
    "vllm-0.32/gemma2_swa": [["--pending-ttl", "2"]],
    "vllm-0.32/qwen3next_c1": [["--index-block-size", "32"]],
    "vllm-0.32/qwen3next_c1_evict": [["--unreported-eviction-kinds", "mamba"]],
    "trtllm-1.2/gpu": [["--index-block-size", "1"]],
    "trtllm-1.2/host": [["--index-block-size", "1"]],
}

# the fleets of docs/simulator.md (README "Simulated fleet" before the docs split), full trace,
# delays 1-20 ms, 0.1 % drops (the defaults). The host-tier and pool sizes of the "mixed + host tier +
# node-shared pools" row are not written there: the sizes below are this tool's choice.
SIM_DELAY = ["--delay-ms", "1,20"]
FLEETS: dict[str, list[str]] = {
    "vllm": [],
    "mixed": ["--engines", "vllm,sglang,trtllm"],
    "mixed_host_tier_pools": ["--engines", "vllm,sglang,trtllm", "--host-tier-blocks", "8000",
                              "--pool-blocks", "16000"],
    "hybrid_swa_1024": ["--hybrid", "swa:1024"],
    "hybrid_mamba_4": ["--hybrid", "mamba:4"],
    "vllm_cpu_offload_8000": ["--cpu-offload-blocks", "8000"],
}
QUICK_REQUESTS = 1000
# keys whose values are wall-clock or run-local, dropped from simulate's JSON wherever they appear
DROP_KEYS = frozenset({"runtime_s", "wall_s", "out"})


def log(msg: str) -> None:
    print(f"[behaviour] {msg}", file=sys.stderr, flush=True)


class CliError(RuntimeError):
    pass


def run_cli(args: list[str], timeout: float | None) -> dict[str, Any]:
    """Runs `python -m kvidx.cli ARGS` in ROOT and returns the JSON object of its last stdout line."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED="0")
    cmd = [sys.executable, "-m", "kvidx.cli", *args]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise CliError(f"timed out after {timeout} s: kvidx {' '.join(args)}") from e
    lines = [x for x in p.stdout.splitlines() if x.strip()]
    if p.returncode != 0 or not lines:
        tail = "\n".join(p.stderr.strip().splitlines()[-15:])
        raise CliError(f"exit {p.returncode}: kvidx {' '.join(args)}\n{tail}")
    try:
        out = json.loads(lines[-1])
    except json.JSONDecodeError as e:
        raise CliError(f"last stdout line is not JSON: kvidx {' '.join(args)}: {lines[-1][:200]}") from e
    if not isinstance(out, dict):
        raise CliError(f"JSON is not an object: kvidx {' '.join(args)}")
    return out


def strip_keys(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: strip_keys(v) for k, v in x.items() if k not in DROP_KEYS}
    if isinstance(x, list):
        return [strip_keys(v) for v in x]
    return x


# ---- the runs ----------------------------------------------------------------------------------------
def recordings(fixtures: Path) -> list[tuple[str, str, Path, Path]]:
    """(name, engine, stream, requests) of every recording under `fixtures` (paths relative to ROOT)."""
    found = []
    for req in sorted((ROOT / fixtures).glob("**/requests.jsonl")):
        d = req.parent
        rel = d.relative_to(ROOT / fixtures).as_posix()
        engine = next((e for p, e in ENGINE_OF_PREFIX.items() if rel.startswith(p)), None)
        stream = next((d / f for f in STREAM_FILES if (d / f).exists()), None)
        if engine is None or stream is None:
            log(f"skipped {rel}: no engine for the directory name or no stream file")
            continue
        found.append((rel, engine, stream.relative_to(ROOT), req.relative_to(ROOT)))
    return found


def shadow_runs(fixtures: Path) -> list[tuple[str, list[str]]]:
    runs = []
    recs = recordings(fixtures)
    for rel, engine, stream, req in recs:
        base = ["shadow", "--json", "--engine", engine, "--recording", str(stream), "--requests", str(req)]
        runs.append((rel, base))
        for flags in VARIANTS.get(rel, []):
            runs.append((f"{rel} {' '.join(flags)}", [*base, *flags]))
    known = {r[0] for r in recs}
    for rel in VARIANTS:
        if rel not in known:
            log(f"warning: no recording {rel} under {fixtures}: its variants are not run")
    return runs


def simulate_runs(requests: int | None, jobs: int | None) -> list[tuple[str, list[str]]]:
    extra = ["--no-progress", *SIM_DELAY]
    if requests:
        extra += ["--requests", str(requests)]
    if jobs:
        extra += ["--jobs", str(jobs)]
    return [(name, ["simulate", "--json", *extra, *flags]) for name, flags in FLEETS.items()]


def run_all(kind: str, runs: list[tuple[str, list[str]]], keep_going: bool,
            timeout: float | None) -> tuple[dict[str, Any], float]:
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    for i, (name, args) in enumerate(runs, 1):
        t = time.monotonic()
        log(f"{kind} {i}/{len(runs)} {name} ...")
        try:
            res = run_cli(args, timeout)
        except CliError as e:
            if not keep_going:
                raise
            log(f"FAILED {name}: {e}")
            out[name] = {"error": str(e).splitlines()[0]}
            continue
        out[name] = strip_keys(res) if kind == "simulate" else res
        log(f"{kind} {name}: {time.monotonic() - t:.1f} s")
    return out, time.monotonic() - t0


# ---- compare ----------------------------------------------------------------------------------------
def flatten(x: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of a JSON value by path: a.b[2].c -> value (empty dicts and lists are leaves too)."""
    if isinstance(x, dict) and x:
        out: dict[str, Any] = {}
        for k, v in x.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(x, list) and x:
        out = {}
        for i, v in enumerate(x):
            out.update(flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: x}


MISSING = object()


def _cell(v: Any) -> str:
    s = "(missing)" if v is MISSING else json.dumps(v)
    return s.replace("|", "\\|")


def _same(a: Any, b: Any) -> bool:
    """Equal and of one JSON type (1 and 1.0 are one number; true and 1 are not)."""
    if a is MISSING or b is MISSING:
        return False
    num = (int, float)
    if isinstance(a, num) and isinstance(b, num) and not isinstance(a, bool) and not isinstance(b, bool):
        return a == b
    return type(a) is type(b) and a == b


def compare(a_path: Path, b_path: Path, changed_only: bool) -> int:
    a = flatten(json.loads(a_path.read_text()))
    b = flatten(json.loads(b_path.read_text()))
    keys = list(a) + [k for k in b if k not in a]
    diff = 0
    print(f"| figure | before ({a_path.name}) | after ({b_path.name}) | same? |")
    print("|---|---|---|---|")
    for k in keys:
        va, vb = a.get(k, MISSING), b.get(k, MISSING)
        same = _same(va, vb)
        diff += not same
        if same and changed_only:
            continue
        print(f"| {k} | {_cell(va)} | {_cell(vb)} | {'yes' if same else '**NO**'} |")
    print(f"\n{len(keys)} figures, {diff} differ")
    return 1 if diff else 0


# ---- main -------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the JSON here (default: stdout)")
    ap.add_argument("--only", choices=("shadow", "simulate"), help="run one kind only")
    ap.add_argument("--quick", action="store_true",
                    help="simulate the trace's first --quick-requests requests only (not comparable with a "
                         "full run)")
    ap.add_argument("--quick-requests", type=int, default=QUICK_REQUESTS,
                    help=f"requests of the trace with --quick (default: {QUICK_REQUESTS})")
    ap.add_argument("--requests", type=int, default=None,
                    help="passed to simulate --requests (the trace's first N requests); overrides --quick")
    ap.add_argument("--jobs", type=int, default=None,
                    help="passed to simulate --jobs (default: simulate's own, the CPU count)")
    ap.add_argument("--fixtures", type=Path, default=FIXTURES,
                    help=f"the recordings' directory, relative to the repo root (default: {FIXTURES})")
    ap.add_argument("--keep-going", action="store_true",
                    help="record a failing command as {\"error\": ...} and go on (default: stop, exit 2)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per command (default: none)")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
                    help="print a markdown table of every figure of two outputs; exit 1 if any differs")
    ap.add_argument("--changed-only", action="store_true", help="with --compare: rows that differ only")
    args = ap.parse_args(argv)

    if args.compare:
        return compare(args.compare[0], args.compare[1], args.changed_only)

    requests = args.requests or (args.quick_requests if args.quick else None)
    result: dict[str, Any] = {}
    t_all = time.monotonic()
    try:
        if args.only in (None, "shadow"):
            result["shadow"], dt = run_all("shadow", shadow_runs(args.fixtures), args.keep_going,
                                           args.timeout)
            log(f"shadow: {len(result['shadow'])} runs in {dt:.1f} s")
        if args.only in (None, "simulate"):
            result["simulate"], dt = run_all("simulate", simulate_runs(requests, args.jobs), args.keep_going,
                                             args.timeout)
            log(f"simulate: {len(result['simulate'])} runs in {dt:.1f} s"
                + (f" (first {requests} requests)" if requests else " (full trace)"))
    except CliError as e:
        log(f"FAILED: {e}")
        return 2
    text = json.dumps(result, indent=1, sort_keys=True) + "\n"
    if args.out:
        args.out.write_text(text)
        log(f"wrote {args.out} ({time.monotonic() - t_all:.1f} s in all)")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
