"""Runs the load matrix against both servers, interleaved: for each round, each form and each load
mode, kvidx then Dynamo (odd rounds) or Dynamo then kvidx (even rounds). One loadgen process per run
(loadgen/: std-only Rust, one thread per keep-alive connection). Writes one JSON per run under
--out/round<r>/<form>_<server>_<mode>.json, with the machine's other CPU use during the run."""
import argparse
import json
import os
import subprocess
import time

# the load generator binary (loadgen/, built by run.sh into $CARGO_TARGET_DIR/release)
LG = os.environ.get("LOADGEN", "loadgen")

# form -> {server: request file}; "bin" pairs kvidx's binary form with Dynamo's only token form
FORMS = {
    "hash": {"kvidx": "kvidx_hash", "dyn": "dyn_hash"},
    "tok": {"kvidx": "kvidx_tok", "dyn": "dyn_tok"},
    "bin": {"kvidx": "kvidx_bin"},
}


def cpu_jiffies():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v[:8]) - idle, sum(v[:8])


def proc_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        s = f.read()
    rest = s[s.rfind(")") + 2:].split()
    return int(rest[11]) + int(rest[12])


def gc_pauses(port: int) -> tuple[float, float]:
    """kvidx serve's generation-2 collections so far: (count, seconds), from /metrics."""
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    got = {}
    for line in text.splitlines():
        for name in ("count", "sum"):
            if line.startswith(f'kvidx_gc_pause_seconds_{name}{{generation="2"}}'):
                got[name] = float(line.split()[-1])
    return got.get("count", 0.0), got.get("sum", 0.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--qdir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--forms", default="hash,tok,bin")
    ap.add_argument("--conns", default="1,4,16")
    ap.add_argument("--rates", default="500,1000,2000")
    ap.add_argument("--open-conns", type=int, default=16)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--kvidx-port", type=int, required=True)
    ap.add_argument("--kvidx-pid", type=int, required=True)
    ap.add_argument("--dyn-port", type=int, required=True)
    ap.add_argument("--dyn-pid", type=int, required=True)
    a = ap.parse_args()
    assert a.warmup + a.duration <= 25, "each run is bounded to 30 s"
    srv = {"kvidx": (a.kvidx_port, a.kvidx_pid), "dyn": (a.dyn_port, a.dyn_pid)}
    modes = ([("closed", int(c)) for c in a.conns.split(",") if c]
             + [("open", int(r)) for r in a.rates.split(",") if r])
    for r in range(1, a.rounds + 1):
        od = os.path.join(a.out, f"round{r}")
        os.makedirs(od, exist_ok=True)
        order = ["kvidx", "dyn"] if r % 2 else ["dyn", "kvidx"]
        for form in a.forms.split(","):
            for kind, val in modes:
                for s in order:
                    if s not in FORMS[form]:
                        continue
                    port, pid = srv[s]
                    conns = val if kind == "closed" else a.open_conns
                    rate = 0 if kind == "closed" else val
                    mode = f"c{val}" if kind == "closed" else f"r{val}"
                    cmd = [LG, "--port", str(port), "--reqs", os.path.join(a.qdir, FORMS[form][s] + ".reqs"),
                           "--conns", str(conns), "--rate", str(rate), "--warmup", str(a.warmup),
                           "--duration", str(a.duration), "--pid", str(pid)]
                    with open("/proc/loadavg") as f:
                        load1 = float(f.read().split()[0])
                    gc0 = gc_pauses(port) if s == "kvidx" else None
                    b0, t0 = cpu_jiffies()
                    p0 = proc_ticks(pid)
                    w0 = time.time()
                    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
                    w1 = time.time()
                    b1, t1 = cpu_jiffies()
                    p1 = proc_ticks(pid)
                    if p.returncode != 0:
                        raise SystemExit(f"loadgen failed: {p.stderr}")
                    res = json.loads(p.stdout)
                    # CPU of everything but this server and the loadgen, over the whole run (cores)
                    ncpu = os.cpu_count()
                    busy_cores = (b1 - b0) / (t1 - t0) * ncpu if t1 > t0 else 0
                    res.update({"server": s, "form": form, "mode": mode, "round": r, "load1_before": load1,
                                "wall_s": round(w1 - w0, 2), "machine_busy_cores": round(busy_cores, 2),
                                "server_cores_whole_run": round((p1 - p0) / 100 / (w1 - w0), 2),
                                "reqs": FORMS[form][s]})
                    if gc0 is not None:  # the service's full collections during the run (stalls)
                        gc1 = gc_pauses(port)
                        res["gc2_pauses"] = gc1[0] - gc0[0]
                        res["gc2_pause_ms"] = round((gc1[1] - gc0[1]) * 1e3, 1)
                    res["other_cores_approx"] = round(busy_cores - res["server_cores_whole_run"]
                                                      - res["client_cpu_s"] / a.duration, 2)
                    with open(os.path.join(od, f"{form}_{s}_{mode}.json"), "w") as f:
                        json.dump(res, f)
                    print(f"[bench] r{r} {form:4s} {mode:6s} {s:5s}: {res['throughput']:9.1f}/s "
                          f"p50 {res['p50_us']:9.1f} p99 {res['p99_us']:10.1f} us  "
                          f"cpu/req {res['server_cpu_us_per_req']:7.1f} us err {res['errors']} "
                          f"non200 {res['non200']} unsent {res['unsent']} other {res['other_cores_approx']}"
                          + (f" gc2 {res['gc2_pauses']:.0f} ({res['gc2_pause_ms']} ms)"
                             if "gc2_pauses" in res else ""),
                          flush=True)
                    time.sleep(0.5)


if __name__ == "__main__":
    main()
