"""Where the slow answers of one open-loop run came from: reads a load generator trace (`loadgen
--trace`: conn, due, sent, done[, index, written] on CLOCK_MONOTONIC) and, if given, a system-wide
record of the scheduler's context switches taken during the run:

    perf record -a -k CLOCK_MONOTONIC -e dummy --switch-events -o sw.data -- sleep 11

It prints how much of the latency was the client's (sent after its due time) and how much the
server's (sent to answered), then each burst of slow answers with what the server's thread did
meanwhile (ran, waited for a CPU while runnable = preempted, slept) and which threads held the CPUs.
Used for bench/RESULTS.md, "Where the tail at 2,000/s came from"."""

from __future__ import annotations

import argparse
import collections
import re
import subprocess

SWITCH = re.compile(r"^\s*(.*?)\s+(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+): PERF_RECORD_SWITCH_CPU_WIDE (IN|OUT)"
                    r"\s*(preempt)?")


def read_trace(path: str) -> list[tuple[int, int, int, int]]:
    with open(path) as f:
        return sorted((tuple(map(int, line.split())) for line in f if line.strip()), key=lambda r: r[1])


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, round(q / 100 * (len(v) - 1)))]


def read_switches(path: str, tid: int) -> tuple[list, list, dict]:
    """The server thread's states over time ((t, run|preempted|sleep)), every thread's on-CPU
    segments ((tid, start, end)) and thread names, from `perf script` of a --switch-events record."""
    cmd = ["perf", "script", "-i", path, "--show-switch-events", "-F", "pid,tid,cpu,time,event,comm"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    states, segments, names, running = [], [], {}, {}
    for line in out.splitlines():
        m = SWITCH.match(line)
        if not m:
            continue
        comm, _pid, t_id, cpu, t, kind, preempt = m.groups()
        t_id, cpu, t = int(t_id), int(cpu), float(t)
        names[t_id] = comm.strip()
        if kind == "IN":
            running[cpu] = (t_id, t)
            if t_id == tid:
                states.append((t, "run"))
        else:
            if cpu in running and running[cpu][0] == t_id:
                segments.append((t_id, running[cpu][1], t))
            if t_id == tid:
                states.append((t, "preempted" if preempt else "sleep"))
    return states, segments, names


def time_in(states: list[tuple[float, str]], a: float, b: float) -> collections.Counter:
    acc: collections.Counter = collections.Counter()
    for (t0, s), (t1, _) in zip(states, states[1:], strict=False):
        lo, hi = max(t0, a), min(t1, b)
        if hi > lo:
            acc[s] += hi - lo
    return acc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True, help="loadgen --trace file")
    ap.add_argument("--switches", help="perf record --switch-events data file (system-wide, CLOCK_MONOTONIC)")
    ap.add_argument("--tid", type=int, help="the server thread to follow (Python: its PID)")
    ap.add_argument("--slow-ms", type=float, default=1.5, help="slow answer, ms (1.5)")
    ap.add_argument("--bursts", type=int, default=12, help="bursts to list, largest first (default 12)")
    a = ap.parse_args()

    rows = read_trace(a.trace)
    late = [(r[2] - r[1]) / 1e3 for r in rows]
    served = [(r[3] - r[2]) / 1e3 for r in rows]
    total = [(r[3] - r[1]) / 1e3 for r in rows]
    parts = [("due -> answered", total), ("due -> sent (client)", late), ("sent -> answered", served)]
    if len(rows[0]) > 5:  # loadgen's "written" stamp: the body's write vs the server's answer
        parts += [("sent -> written (client)", [(r[5] - r[2]) / 1e3 for r in rows]),
                  ("written -> answered", [(r[3] - r[5]) / 1e3 for r in rows])]
    for name, v in parts:
        print(f"{name:26s} p50 {pct(v, 50):7.0f}  p99 {pct(v, 99):7.0f}  p99.9 {pct(v, 99.9):7.0f}  "
              f"max {max(v):7.0f} us")
    slow = [r for r in rows if r[3] - r[1] > a.slow_ms * 1e6]
    bursts: list[list[tuple[int, int, int, int]]] = []
    for r in slow:  # slow answers due within 20 ms of the last one form one burst
        if bursts and r[1] - bursts[-1][-1][1] < 20e6:
            bursts[-1].append(r)
        else:
            bursts.append([r])
    print(f"{len(slow)} answers slower than {a.slow_ms} ms of {len(rows)}, in {len(bursts)} bursts")
    if not a.switches or a.tid is None:
        return
    states, segments, names = read_switches(a.switches, a.tid)
    why: collections.Counter = collections.Counter()
    for i, burst in enumerate(sorted(bursts, key=len, reverse=True)):
        lo, hi = burst[0][1] / 1e9 - 0.002, max(r[3] for r in burst) / 1e9
        span = hi - lo
        acc = time_in(states, lo, hi)
        on_cpu: collections.Counter = collections.Counter()
        for t_id, s, e in segments:
            if t_id and min(e, hi) > max(s, lo) and t_id != a.tid:
                on_cpu[f"{names.get(t_id, '?')}/{t_id}"] += min(e, hi) - max(s, lo)
        why["preempted" if acc["preempted"] > 0.25 * span else "other"] += len(burst)
        if i < a.bursts:
            ran, pre, slept = (acc[k] / span for k in ("run", "preempted", "sleep"))
            late_us = sum(r[2] - r[1] for r in burst) / len(burst) / 1e3
            print(f"  {len(burst):3d} slow over {span * 1e3:5.1f} ms: server ran {ran:4.0%}, preempted "
                  f"{pre:4.0%}, slept {slept:4.0%}; client late {late_us:5.0f} us on average; others on CPU: "
                  + ", ".join(f"{k} {v / span:.0%}" for k, v in on_cpu.most_common(3)))
    print("slow answers in bursts where the server thread was preempted > 25% of the time:",
          why["preempted"], "of", sum(why.values()))


if __name__ == "__main__":
    main()
