"""Builds the query set (a seeded uniform sample of the trace's lookup queries) as raw HTTP requests,
one file per (server, form), all in the same query order:
  kvidx_hash : POST /v1/lookup        {"model","block_hashes":[canonical u64],"prompt_tokens":n*B}
  dyn_hash   : POST /query_by_hash    {"block_hashes":[Dynamo local hash as i64],"model_name"}
  kvidx_tok  : POST /v1/lookup        {"model","token_ids":[...]}          (server hashes)
  dyn_tok    : POST /query            {"token_ids":[...],"model_name"}      (server hashes)
  kvidx_bin  : POST /v1/lookup/binary?model=..  packed little-endian uint32 token ids
Token ids of a block = its hash_id repeated B times (the generator's convention).
Also writes queries.json: per query its canonical hashes, local hashes and ids (for the answer check)."""
import argparse
import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from evfile import load  # noqa: E402


def req(path, body, ctype="application/json"):
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    return head + body


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--model", default="bench-model")
    a = ap.parse_args()
    nw, B, recs = load(a.events)
    qs = [r for r in recs if r[0] == "Q"]
    rng = np.random.default_rng(a.seed)
    pick = sorted(rng.choice(len(qs), size=min(a.n, len(qs)), replace=False).tolist())
    sample = [qs[i] for i in pick]
    os.makedirs(a.out, exist_ok=True)
    files = {k: [] for k in ("kvidx_hash", "dyn_hash", "kvidx_tok", "dyn_tok", "kvidx_bin")}
    m = a.model
    for _, seq, loc, ids in sample:
        n_tok = B * len(seq)
        toks = np.repeat(np.asarray(ids, dtype="<u4"), B)
        tok_json = "[" + ",".join(map(str, toks.tolist())) + "]"
        files["kvidx_hash"].append(req("/v1/lookup", json.dumps(
            {"model": m, "block_hashes": seq, "prompt_tokens": n_tok}, separators=(",", ":")).encode()))
        signed = [h - (1 << 64) if h >= 1 << 63 else h for h in loc]
        files["dyn_hash"].append(req("/query_by_hash", json.dumps(
            {"block_hashes": signed, "model_name": m}, separators=(",", ":")).encode()))
        files["kvidx_tok"].append(req("/v1/lookup", f'{{"model":"{m}","token_ids":{tok_json}}}'.encode()))
        files["dyn_tok"].append(req("/query", f'{{"token_ids":{tok_json},"model_name":"{m}"}}'.encode()))
        files["kvidx_bin"].append(req(f"/v1/lookup/binary?model={m}", toks.tobytes(),
                                      "application/octet-stream"))
    stats = {}
    for k, reqs in files.items():
        with open(os.path.join(a.out, k + ".reqs"), "wb") as f:
            f.write(b"REQS0001" + struct.pack("<I", len(reqs)))
            for r in reqs:
                f.write(struct.pack("<I", len(r)) + r)
        stats[k] = {"mean_request_bytes": round(sum(map(len, reqs)) / len(reqs))}
    nb = np.array([len(q[1]) for q in sample])
    meta = {"queries": len(sample), "of_trace_queries": len(qs), "seed": a.seed, "block_tokens": B,
            "blocks_mean": float(nb.mean()), "blocks_p50": float(np.percentile(nb, 50)),
            "blocks_p99": float(np.percentile(nb, 99)), "blocks_max": int(nb.max()),
            "tokens_mean": float(nb.mean() * B), "files": stats}
    with open(os.path.join(a.out, "queries.json"), "w") as f:
        json.dump({"meta": meta, "queries": [{"seq": q[1], "local": q[2], "ids": q[3]} for q in sample]}, f)
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
