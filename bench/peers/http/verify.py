"""Checks that both servers answer from the same state: for every query of the query set (hash form),
the per-worker matched prefix (in blocks) from kvidx (/v1/lookup: replicas[].cached_tokens / B) and
from Dynamo (/query_by_hash: scores[worker]["0"] / B) must be identical. Also checks that the token
forms (kvidx /v1/lookup token_ids, /v1/lookup/binary; Dynamo /query) give the same answers on the
first --tok-n queries. Prints one JSON object; exit 1 on any mismatch."""
import argparse
import http.client
import json
import struct
import sys


def read_reqs(path, limit=None):
    d = open(path, "rb").read()
    assert d[:8] == b"REQS0001"
    n = struct.unpack_from("<I", d, 8)[0]
    p, out = 12, []
    for _ in range(n if limit is None else min(n, limit)):
        n_bytes = struct.unpack_from("<I", d, p)[0]
        p += 4
        out.append(d[p:p + n_bytes])
        p += n_bytes
    return out


def send(conn, raw):
    head, body = raw.split(b"\r\n\r\n", 1)
    line, *hdrs = head.decode().split("\r\n")
    method, path, _ = line.split(" ")
    h = dict(x.split(": ", 1) for x in hdrs)
    h.pop("Host", None)
    conn.request(method, path, body, h)
    r = conn.getresponse()
    data = r.read()
    if r.status != 200:
        raise RuntimeError(f"{path}: HTTP {r.status}: {data[:300]!r}")
    return json.loads(data)


def kv_answer(js, B, ep_to_w):
    return {ep_to_w[r["replica"]]: r["cached_tokens"] // B for r in js["replicas"] if r["cached_tokens"] > 0}


def dyn_answer(js, B):
    out = {}
    for wid, ranks in js["scores"].items():
        v = ranks.get("0", 0)
        if v > 0:
            out[int(wid) - 1] = v // B
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--qdir", required=True)
    ap.add_argument("--kvidx-port", type=int, required=True)
    ap.add_argument("--dyn-port", type=int, required=True)
    ap.add_argument("--zmq-base", type=int, required=True)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--tok-n", type=int, default=100)
    ap.add_argument("--B", type=int, default=512)
    a = ap.parse_args()
    B = a.B
    ep_to_w = {f"tcp://127.0.0.1:{a.zmq_base + w}": w for w in range(a.workers)}
    kc = http.client.HTTPConnection("127.0.0.1", a.kvidx_port, timeout=60)
    dc = http.client.HTTPConnection("127.0.0.1", a.dyn_port, timeout=60)
    kh = read_reqs(f"{a.qdir}/kvidx_hash.reqs")
    dh = read_reqs(f"{a.qdir}/dyn_hash.reqs")
    mism, hit_q, sum_blocks, n_workers_hit = [], 0, 0, 0
    kv_all, dyn_all = [], []
    for i, (k, d) in enumerate(zip(kh, dh, strict=True)):
        ka = kv_answer(send(kc, k), B, ep_to_w)
        da = dyn_answer(send(dc, d), B)
        kv_all.append(ka)
        dyn_all.append(da)
        if ka != da:
            mism.append(i)
        hit_q += bool(ka)
        sum_blocks += sum(ka.values())
        n_workers_hit += len(ka)
    tok_mism = []
    kt = read_reqs(f"{a.qdir}/kvidx_tok.reqs", a.tok_n)
    kb = read_reqs(f"{a.qdir}/kvidx_bin.reqs", a.tok_n)
    dt = read_reqs(f"{a.qdir}/dyn_tok.reqs", a.tok_n)
    for i in range(len(kt)):
        a1 = kv_answer(send(kc, kt[i]), B, ep_to_w)
        a2 = kv_answer(send(kc, kb[i]), B, ep_to_w)
        a3 = dyn_answer(send(dc, dt[i]), B)
        if not (a1 == a2 == a3 == kv_all[i]):
            tok_mism.append(i)
    out = {"queries": len(kh), "mismatches": len(mism), "first_mismatches": mism[:5],
           "queries_with_a_hit": hit_q, "checksum_sum_of_matched_blocks": sum_blocks,
           "mean_workers_with_hit": n_workers_hit / len(kh),
           "token_form_queries_checked": len(kt), "token_form_mismatches": len(tok_mism)}
    if mism:
        i = mism[0]
        out["example"] = {"i": i, "kvidx": kv_all[i], "dynamo": dyn_all[i]}
    print(json.dumps(out))
    return 1 if (mism or tok_mism) else 0


if __name__ == "__main__":
    sys.exit(main())
