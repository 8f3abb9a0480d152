"""Prefetch hints in the fleet simulator (issue #16): KV-aware routing alone (kv) against KV-aware
routing whose replicas follow the index's prefetch plans (kv_hints), on the same fleet and workload,
with host (CPU) and disk tiers under load, at several loads. Prints one markdown table.

    python bench/bench_hints.py [--requests 3000] [--rates 60,90,120] [--kinds prefetch,placement,...]

Each row is one `kvidx simulate` run of one router (KV-aware alone, or with one set of hint kinds; the
command is printed after each workload), so a figure can be rerun on its own; the runs are
deterministic, so kv is run once per workload. Nothing is asserted: the table is judged against the
goal (TTFT p99 at least 20 % lower with hints) in README.md and RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# tiers under load: GPU caches that hold about one long agent context, a CPU level of 2,000 blocks and a
# disk level of 40,000 (blocks of 16 tokens), 128 agent loops in flight on 8 replicas
AGENT = ["--workload", "agent", "--agents", "128", "--cache-tokens", "17000", "--cpu-offload-blocks", "2000",
         "--disk-offload-blocks", "40000"]
# the Mooncake trace with 64 tokens per hash id: GPU caches of 200,000 workload tokens, CPU 2,000 blocks,
# disk 20,000
TRACE = ["--cache-tokens", "200000", "--cpu-offload-blocks", "2000", "--disk-offload-blocks", "20000"]


def run(args: list[str], policy: str, jobs: int) -> dict:
    cmd = [sys.executable, "-m", "kvidx.cli", "simulate", *args, "--policies", policy, "--no-zero-delay",
           "--json", "--no-progress", "--quiet", "--jobs", str(jobs)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["policies"][policy]


def row(label: str, name: str, p: dict, kv: dict) -> str:
    change = p["ttft_est_s"]["p99"] / kv["ttft_est_s"]["p99"] - 1
    hints = " ".join(f"{k} {h['issued']}/{h['followed']}/{h['paid_off']}"
                     for k, h in p.get("hints", {}).items())
    return (f"| {label} | {name} | {p['ttft_est_s']['p50']:.3f} | {p['ttft_est_s']['p99']:.3f} | "
            f"{change * 100:+.0f} % | {p['reuse_rate']:.3f} | {p['gpu_share_of_reused']:.2f} | "
            f"{p['bytes_moved'] / 1e9:.0f} | {hints or '-'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--requests", type=int, default=3000, help="requests per run")
    ap.add_argument("--rates", default="60,90,120", help="agent workload: arrival rates (requests/s)")
    ap.add_argument("--trace-speeds", default="1", help="Mooncake trace: time compressions")
    ap.add_argument("--kinds", default="prefetch,placement,eviction,prefetch+placement+eviction",
                    help="the hint kinds of each kv_hints run (+ joins kinds in one run)")
    ap.add_argument("--jobs", type=int, default=1, help="processes per run")
    a = ap.parse_args()
    print("| workload | router (hints) | TTFT p50 s | TTFT p99 s | p99 vs kv | reuse rate "
          "| GPU share of reused | GB moved | hints issued/followed/paid off |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = [(f"agent loops, {r} req/s", [*AGENT, "--chat-rate", r]) for r in a.rates.split(",") if r]
    rows += [(f"Mooncake trace, speed {s}", [*TRACE, "--speed", s]) for s in a.trace_speeds.split(",") if s]
    for label, args in rows:
        args = [*args, "--requests", str(a.requests)]
        kv = run(args, "kv", a.jobs)
        print(row(label, "kv", kv, kv), flush=True)
        for kinds in a.kinds.split(","):
            hinted = run([*args, "--hints", kinds.replace("+", ",")], "kv_hints", a.jobs)
            print(row(label, f"kv_hints ({kinds.replace('+', ', ')})", hinted, kv), flush=True)
        print(f"<!-- kvidx simulate {' '.join(args)} --policies kv,kv_hints [--hints KINDS] -->", flush=True)


if __name__ == "__main__":
    main()
