"""Prefetch hints in the fleet simulator (issue #16): KV-aware routing alone (kv) against KV-aware
routing whose replicas follow the index's prefetch plans (kv_hints), on the same fleet and workload,
with host (CPU) and disk tiers under load, at several loads. Prints one markdown table.

    python bench/bench_hints.py [--requests 3000] [--rates 60,90,120] [--jobs 2]

Each row is one `kvidx simulate --policies kv,kv_hints` run (the command is printed with it), so a
figure can be rerun on its own. Nothing is asserted: the table is judged against the goal (TTFT p99
at least 20 % lower with hints) in README.md and RESULTS.md.
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


def run(args: list[str], jobs: int) -> dict:
    cmd = [sys.executable, "-m", "kvidx.cli", "simulate", *args, "--policies", "kv,kv_hints",
           "--no-zero-delay", "--json", "--no-progress", "--quiet", "--jobs", str(jobs)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def row(label: str, args: list[str], head: dict) -> str:
    kv, h = head["policies"]["kv"], head["policies"]["kv_hints"]
    p = h["hints"]["prefetch"]
    change = h["ttft_est_s"]["p99"] / kv["ttft_est_s"]["p99"] - 1
    return (f"| {label} | {kv['ttft_est_s']['p50']:.3f} / {h['ttft_est_s']['p50']:.3f} | "
            f"{kv['ttft_est_s']['p99']:.3f} / {h['ttft_est_s']['p99']:.3f} | **{change * 100:+.0f} %** | "
            f"{kv['reuse_rate']:.3f} / {h['reuse_rate']:.3f} | "
            f"{kv['gpu_share_of_reused']:.2f} / {h['gpu_share_of_reused']:.2f} | "
            f"{kv['bytes_moved'] / 1e9:.0f} / {h['bytes_moved'] / 1e9:.0f} | "
            f"{p['issued']} / {p['followed']} / {p['paid_off']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--requests", type=int, default=3000, help="requests per run")
    ap.add_argument("--rates", default="60,90,120", help="agent workload: arrival rates (requests/s)")
    ap.add_argument("--trace-speeds", default="1,3", help="Mooncake trace: time compressions")
    ap.add_argument("--jobs", type=int, default=2, help="runs of one row in parallel")
    a = ap.parse_args()
    print("| workload | TTFT p50 s, kv / kv_hints | TTFT p99 s, kv / kv_hints | p99 change | reuse rate | "
          "GPU share of reused | GB moved | prefetch issued / followed / paid off |")
    print("|---|---|---|---|---|---|---|---|")
    rows = [(f"agent loops, {r} req/s", [*AGENT, "--chat-rate", r]) for r in a.rates.split(",") if r]
    rows += [(f"Mooncake trace, speed {s}", [*TRACE, "--speed", s]) for s in a.trace_speeds.split(",") if s]
    for label, args in rows:
        args = [*args, "--requests", str(a.requests)]
        print(row(label, args, run(args, a.jobs)), flush=True)
        print(f"<!-- kvidx simulate {' '.join(args)} --policies kv,kv_hints -->", flush=True)


if __name__ == "__main__":
    main()
