"""Prefetch hints in the fleet simulator (issue #16): KV-aware routing alone (kv) against KV-aware
routing whose replicas follow the index's prefetch plans (kv_hints), on the same fleet and workload,
with host (CPU) and disk tiers under load, at several loads. Prints one markdown table.

    python bench/bench_hints.py [--requests 3000] [--rates 60,90,120] [--kinds prefetch,placement,...]
    python bench/bench_hints.py --grid [--requests 2000] [--root DIR]

--grid (issue #41 item 3): kv against kv_hints with the default hint kinds (the service's) on every
workload of GRID (the Mooncake trace, generated chat and agent loops at three loads each, and this
script's own agent and trace settings), one `kvidx simulate --policies kv,kv_hints` run per cell: mean,
p50 and p99 TTFT and reuse of both, kv_hints' change, and whether the cell meets the bar (kv_hints within
1 % of kv or better on all four; on the saturated agent loops also p99 at least 20 % lower). --root: the
source tree whose code runs (a worktree of an older commit, for a before/after).

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
# issue #41's grid: (label, simulate arguments, saturated: p99 must drop 20 %; the README's 120 req/s row,
# where kv's p99 is 5x the lighter loads'). The CPU tier of 20,000 blocks is the issue's first command's;
# loads doubling from each workload's default
CPU = ["--cpu-offload-blocks", "20000"]
GRID = [
    *[(f"Mooncake trace, speed {s}", [*CPU, "--speed", s], False) for s in ("1", "2", "4")],
    *[(f"chat, {r} req/s", [*CPU, "--workload", "chat", "--chat-rate", r], False)
      for r in ("20", "40", "80")],
    *[(f"agent loops, {r} req/s", [*CPU, "--workload", "agent", "--chat-rate", r], False)
      for r in ("20", "40", "80")],
    # generated chat on GPU caches small enough that its reuse comes from the CPU and disk tiers too
    *[(f"chat (tiers under load), {r} req/s", [*AGENT[4:], "--workload", "chat", "--chat-rate", r], False)
      for r in ("20", "40", "80")],
    *[(f"bench agent loops (tiers under load), {r} req/s", [*AGENT, "--chat-rate", r], r == "120")
      for r in ("60", "90", "120")],
    ("bench Mooncake trace (tiers under load)", [*TRACE, "--speed", "1"], False),
]


def run(args: list[str], policy: str, jobs: int, root: Path = ROOT) -> dict:
    """One `kvidx simulate` run's policies.<policy> (comma-separated policies: the policies dict)."""
    cmd = [sys.executable, "-m", "kvidx.cli", "simulate", *args, "--policies", policy, "--no-zero-delay",
           "--json", "--no-progress", "--quiet", "--jobs", str(jobs)]
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=True).stdout
    policies = json.loads(out.strip().splitlines()[-1])["policies"]
    return policies if "," in policy else policies[policy]


BAR = 0.01  # kv_hints may be at most 1 % worse than kv on a cell's mean, p50, p99 TTFT and reuse
SATURATED_P99 = 0.20  # and at least 20 % lower p99 where loads bind


def grid_row(label: str, kv: dict, hinted: dict, saturated: bool) -> str:
    """A cell: both policies' mean/p50/p99 TTFT and reuse, kv_hints' change, the bar met or what missed."""
    figures = [(q, kv["ttft_est_s"][q], hinted["ttft_est_s"][q]) for q in ("mean", "p50", "p99")]
    changes = {q: h / k - 1 if k else 0.0 for q, k, h in figures}
    changes["reuse"] = kv["reuse_rate"] / hinted["reuse_rate"] - 1 if hinted["reuse_rate"] else 0.0
    missed = [f"{q} {c * 100:+.1f} %" for q, c in changes.items() if c > BAR]
    if saturated and changes["p99"] > -SATURATED_P99:
        missed.append(f"p99 not 20 % lower ({changes['p99'] * 100:+.1f} %)")
    pre = hinted.get("hints", {}).get("prefetch", {})
    issued = f"{pre.get('issued', 0)}/{pre.get('paid_off', 0)}/{pre.get('regretted', 0)}"
    cells = " | ".join(f"{k:.3f} / {h:.3f} ({changes[q] * 100:+.1f} %)" for q, k, h in figures)
    return (f"| {label} | {cells} | {kv['reuse_rate']:.3f} / {hinted['reuse_rate']:.3f} | {issued} | "
            f"{'met' if not missed else 'missed: ' + ', '.join(missed)} |")


def grid(requests: int, jobs: int, root: Path, only: str = "") -> None:
    """The grid's cells whose label contains `only` (all by default), one markdown row each."""
    cells = [c for c in GRID if only in c[0]]
    print("| workload | mean s kv / kv_hints | p50 s | p99 s | reuse kv / kv_hints "
          "| prefetch issued/paid off/regretted | bar |")
    print("|---|---|---|---|---|---|---|")
    for label, args, saturated in cells:
        both = run([*args, "--requests", str(requests)], "kv,kv_hints", jobs, root)
        print(grid_row(label, both["kv"], both["kv_hints"], saturated), flush=True)
    for label, args, _ in cells:
        print(f"<!-- {label}: kvidx simulate {' '.join(args)} --requests {requests} --policies kv,kv_hints "
              "--no-zero-delay -->")


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
    ap.add_argument("--grid", action="store_true", help="issue #41's grid of kv vs kv_hints (default kinds)")
    ap.add_argument("--root", type=Path, default=ROOT, help="--grid: the source tree whose code runs")
    ap.add_argument("--cells", default="", help="--grid: only the cells whose label contains this")
    a = ap.parse_args()
    if a.grid:
        grid(a.requests, a.jobs, a.root, a.cells)
        return
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
