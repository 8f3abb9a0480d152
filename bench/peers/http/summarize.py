"""results/round*/<form>_<server>_<mode>.json -> summary.md (tables: medians over rounds with
min-max, and Dynamo/kvidx ratios computed within each round, then their median and min-max)."""
import glob
import json
import os
import statistics
import sys

FORM_NAMES = {
    "hash": ("block hashes (JSON)", "kvidx POST /v1/lookup {block_hashes, prompt_tokens}",
             "Dynamo POST /query_by_hash {block_hashes}"),
    "tok": ("token ids (JSON)", "kvidx POST /v1/lookup {token_ids}", "Dynamo POST /query {token_ids}"),
    "bin": ("token ids, kvidx binary vs Dynamo JSON", "kvidx POST /v1/lookup/binary (packed uint32)",
            "Dynamo POST /query {token_ids} (its only token form)"),
}


def fmt(v, nd=0):
    if v is None:
        return "n/a"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.{max(nd, 2)}f}"


def cell(vals, nd=0):
    vals = [v for v in vals if v is not None]
    if not vals:
        return "n/a"
    return f"**{fmt(statistics.median(vals), nd)}** ({fmt(min(vals), nd)}–{fmt(max(vals), nd)})"


def main():
    root = sys.argv[1]
    runs = {}
    for p in glob.glob(os.path.join(root, "round*", "*.json")):
        r = json.load(open(p))
        runs[(r["round"], r["form"], r["server"], r["mode"])] = r
    rounds = sorted({k[0] for k in runs})
    forms = [f for f in ("hash", "tok", "bin") if any(k[1] == f for k in runs)]
    modes_closed = sorted({k[3] for k in runs if k[3].startswith("c")}, key=lambda m: int(m[1:]))
    modes_open = sorted({k[3] for k in runs if k[3].startswith("r")}, key=lambda m: int(m[1:]))

    def get(r, form, server, mode):
        if form == "bin" and server == "dyn":
            form = "tok"
        return runs.get((r, form, server, mode))

    out = []
    if os.path.exists(os.path.join(root, "run.json")):
        with open(os.path.join(root, "run.json")) as f:
            info = json.load(f)
        nice = f", both servers at nice {info['nice']}" if "nice" in info else ""
        out.append(f"Run: {info['date']}, kvidx {info['kvidx']}, command `{info['command']}`{nice}\n")
    out += [f"rounds: {rounds}; cell = **median** (min–max) over rounds; ratio = Dynamo ÷ kvidx within a "
           "round, then median (min–max). Throughput ratio > 1: Dynamo serves more; latency and CPU ratios "
           "< 1: Dynamo is lower.\n"]
    # ---- closed loop ----
    out.append("### Closed loop (each connection sends its next request when the answer is in)\n")
    out.append("| query form | conns | kvidx lookups/s | Dynamo lookups/s | ratio | kvidx p50 µs "
               "| Dynamo p50 µs | kvidx p99 µs | Dynamo p99 µs | p99 ratio | kvidx CPU µs/lookup "
               "| Dynamo CPU µs/lookup | CPU ratio |")
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for form in forms:
        for m in modes_closed:
            K = [get(r, form, "kvidx", m) for r in rounds]
            D = [get(r, form, "dyn", m) for r in rounds]
            pairs = [(k, d) for k, d in zip(K, D, strict=True) if k and d]
            if not pairs:
                continue
            def col(lst, key):
                return [x[key] for x in lst if x]
            out.append("| " + " | ".join([
                FORM_NAMES[form][0], m[1:],
                cell(col(K, "throughput")), cell(col(D, "throughput")),
                cell([d["throughput"] / k["throughput"] for k, d in pairs], 2),
                cell(col(K, "p50_us")), cell(col(D, "p50_us")),
                cell(col(K, "p99_us")), cell(col(D, "p99_us")),
                cell([d["p99_us"] / k["p99_us"] for k, d in pairs], 2),
                cell(col(K, "server_cpu_us_per_req")), cell(col(D, "server_cpu_us_per_req")),
                cell([d["server_cpu_us_per_req"] / k["server_cpu_us_per_req"] for k, d in pairs], 2),
            ]) + " |")
    # ---- max sustained (closed loop, best connection count per round) ----
    out.append("\n### Max sustained throughput (closed loop: the best of 1/4/16 connections, per round)\n")
    out.append("| query form | kvidx lookups/s (best conns) | Dynamo lookups/s (best conns) | ratio |")
    out.append("|---|---:|---:|---:|")
    for form in forms:
        kb, db, rat, kc, dc = [], [], [], [], []
        for r in rounds:
            ks = [(get(r, form, "kvidx", m)["throughput"], m) for m in modes_closed
                  if get(r, form, "kvidx", m)]
            ds = [(get(r, form, "dyn", m)["throughput"], m) for m in modes_closed if get(r, form, "dyn", m)]
            if ks and ds:
                k, d = max(ks), max(ds)
                kb.append(k[0])
                db.append(d[0])
                rat.append(d[0] / k[0])
                kc.append(k[1][1:])
                dc.append(d[1][1:])
        if kb:
            out.append(f"| {FORM_NAMES[form][0]} | {cell(kb)} (conns {','.join(kc)}) "
                       f"| {cell(db)} (conns {','.join(dc)}) | {cell(rat, 2)} |")
    # ---- open loop ----
    out.append("\n### Open loop (fixed offered rate, 16 connections; latency from the scheduled send time)\n")
    out.append("| query form | offered /s | kvidx completed /s | Dynamo completed /s | kvidx p50 µs "
               "| Dynamo p50 µs | p50 ratio | kvidx p99 µs | Dynamo p99 µs | p99 ratio | kvidx CPU µs/lookup "
               "| Dynamo CPU µs/lookup | CPU ratio |")
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for form in forms:
        for m in modes_open:
            K = [get(r, form, "kvidx", m) for r in rounds]
            D = [get(r, form, "dyn", m) for r in rounds]
            pairs = [(k, d) for k, d in zip(K, D, strict=True) if k and d]
            if not pairs:
                continue
            def col(lst, key):
                return [x[key] for x in lst if x]
            out.append("| " + " | ".join([
                FORM_NAMES[form][0], m[1:],
                cell(col(K, "completion_rate")), cell(col(D, "completion_rate")),
                cell(col(K, "p50_us")), cell(col(D, "p50_us")),
                cell([d["p50_us"] / k["p50_us"] for k, d in pairs], 2),
                cell(col(K, "p99_us")), cell(col(D, "p99_us")),
                cell([d["p99_us"] / k["p99_us"] for k, d in pairs], 3),
                cell(col(K, "server_cpu_us_per_req")), cell(col(D, "server_cpu_us_per_req")),
                cell([d["server_cpu_us_per_req"] / k["server_cpu_us_per_req"] for k, d in pairs], 2),
            ]) + " |")
    # ---- response sizes and noise ----
    out.append("\n### Response sizes and machine noise\n")
    sizes = {}
    for r in runs.values():
        sizes.setdefault((r["reqs"]), []).append(r["resp_bytes_mean"])
    out.append("mean response bytes (headers + body): " + ", ".join(
        f"{k}: {statistics.median(v):,.0f}" for k, v in sorted(sizes.items())))
    others = [r["other_cores_approx"] for r in runs.values()]
    loads = [r["load1_before"] for r in runs.values()]
    errs = sum(r["errors"] + r["non200"] for r in runs.values())
    out.append(f"\nCPU used by other processes during the runs (cores, approx.): median "
               f"{statistics.median(others):.2f}, max {max(others):.2f}; 1-min load average before runs: "
               f"{min(loads):.2f}–{max(loads):.2f}; "
               f"errors + non-200 answers over all runs: {errs}; runs: {len(runs)}")
    unsent = {f"{k[1]}/{k[2]}/{k[3]}/r{k[0]}": r["unsent"] for k, r in runs.items() if r["unsent"]}
    if unsent:
        out.append(f"\nrequests not sent within the run (+5 s grace) because the server fell behind: "
                   f"{unsent}")
    text = "\n".join(out) + "\n"
    open(os.path.join(root, "summary.md"), "w").write(text)
    print(text)


if __name__ == "__main__":
    main()
