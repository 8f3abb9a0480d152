"""Mooncake conversation trace -> one common KV-event stream (binary), fed identically to every indexer.

Workload (mirrors Dynamo's mooncake_bench trace handling where it is deterministic):
  * trace lines in file order; --dup D copies of the trace with disjoint hash_id spaces, interleaved
    request by request (Dynamo benches/common/mod.rs duplicate_traces: copy d offsets ids by (max+1)*d)
  * each request routed to one of N workers uniformly at random with a fixed seed (Dynamo's
    partition_trace does the same with StdRng(42); here numpy default_rng(seed)); or, with
    --route kv, to the worker caching the longest prefix of it when that is longer than one block
    (ties spread by the random pick; otherwise the random pick)
  * each hash_id is one KV block of 512 tokens; its tokens are the hash_id repeated 512 times as
    uint32 (Dynamo's tokens_from_request / local_block_hash_from_id convention)
  * each worker: an LRU prefix cache of C blocks; a request hits its longest cached prefix, stores
    the rest (one Stored event, parent = last hit block), and the least recently used blocks beyond
    C are evicted (one Removed event, emitted BEFORE the Stored event of the same request). Blocks
    of a request are touched tail-first (as vLLM frees them), so a parent is always at least as
    recent as its children: caches stay prefix-closed and every Stored chain has a live parent.
  * before each request is routed, a lookup query for its full block sequence.

Per block the file carries: seq = kvidx's canonical chained hash (xxh3-64 of the packed uint32
tokens, seeded by the parent's seq; kvidx.core.hashing.prompt_hashes), local = Dynamo's
LocalBlockHash (xxh3-64 of the tokens, seed 1337), and for queries the hash_id (token synthesis).

File format (little-endian): b"KVEVTS01", u32 n_workers, u32 block_tokens, u64 n_records, then
records: u8 type; Q(0): u32 n, u64 seq[n], u64 local[n], u64 ids[n]
                  S(1): u32 worker, u8 has_parent, u64 parent_seq, u32 n, u64 seq[n], u64 local[n]
                  R(2): u32 worker, u32 n, u64 seq[n]
"""
import argparse
import json
import os
import struct
import sys
import time
from collections import OrderedDict

import numpy as np
import xxhash

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TRACE = os.path.join(REPO, "kvidx", "sim", "data", "mooncake_conversation_trace.jsonl")

ROOT_SEED = 0x6B76_6964_7831  # kvidx.core.hashing.ROOT_SEED
DYN_SEED = 1337               # dynamo_kv_router::protocols::XXH3_SEED
_xxh = xxhash.xxh3_64_intdigest


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--trace", default=TRACE, help="Mooncake-format JSONL (default: the repo's copy)")
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--capacity", type=int, default=8192)
    p.add_argument("--dup", type=int, default=4)
    p.add_argument("--block-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--route", choices=["random", "kv"], default="random",
                   help="random: uniform seeded (Dynamo partition_trace); kv: the worker whose cache holds "
                        "the longest prefix of the request (KV-aware routing), ties -> the seeded random "
                        "pick")
    a = p.parse_args()
    sys.path.insert(0, os.path.abspath(os.environ.get("KVIDX_ROOT") or REPO))
    import kvidx.core.hashing as kh
    assert kh.ROOT_SEED == ROOT_SEED
    B = a.block_tokens
    with open(a.trace) as f:
        reqs = [json.loads(line)["hash_ids"] for line in f]
    max_id = max(max(h) for h in reqs if h)
    base = max_id + 1
    seq_of = {}      # (parent seq, id) -> seq
    local_of = {}    # id -> local

    def toks(i):
        return np.full(B, i, dtype="<u4").tobytes()

    rng = np.random.default_rng(a.seed)
    n_req = len(reqs) * a.dup
    route = rng.integers(0, a.workers, n_req).tolist()
    caches = [OrderedDict() for _ in range(a.workers)]
    out = open(a.out, "wb")
    out.write(b"KVEVTS01" + struct.pack("<IIQ", a.workers, B, 0))
    n_rec = n_q = n_s = n_r = q_blocks = s_blocks = r_blocks = 0
    hit_blocks = 0
    qlens = []
    t0 = time.time()
    k = 0
    for ids0 in reqs:
        for d in range(a.dup):
            ids = [i + base * d for i in ids0]
            w = route[k]
            k += 1
            if a.route == "kv":
                # KV-aware: the worker caching the longest prefix, if that is more than the first block
                # (block 0 is a prompt prefix shared by nearly every request); ties -> spread by the
                # random pick; no hit beyond block 0 -> the random pick (load spreading)
                best, cands = 0, []
                for cw, cc in enumerate(caches):
                    hl = 0
                    h2 = ROOT_SEED
                    for i in ids:
                        s2 = seq_of.get((h2, i))
                        if s2 is None or s2 not in cc:
                            break
                        hl += 1
                        h2 = s2
                    if hl > best:
                        best, cands = hl, [cw]
                    elif hl == best and hl:
                        cands.append(cw)
                if best > 1:
                    w = cands[w % len(cands)]
            if not ids:
                continue
            seqs, locs = [], []
            h = ROOT_SEED
            for i in ids:
                key = (h, i)
                s = seq_of.get(key)
                if s is None:
                    b = toks(i)
                    s = seq_of[key] = _xxh(b, seed=h)
                    if i not in local_of:
                        local_of[i] = _xxh(b, seed=DYN_SEED)
                seqs.append(s)
                locs.append(local_of[i])
                h = s
            n = len(ids)
            # query
            out.write(struct.pack("<BI", 0, n))
            out.write(np.asarray(seqs, dtype="<u8").tobytes())
            out.write(np.asarray(locs, dtype="<u8").tobytes())
            out.write(np.asarray(ids, dtype="<u8").tobytes())
            n_rec += 1
            n_q += 1
            q_blocks += n
            qlens.append(n)
            # serve on worker w
            c = caches[w]
            hit = 0
            for s in seqs:
                if s not in c:
                    break
                hit += 1
            hit_blocks += hit
            stored = seqs[hit:]
            for s in reversed(seqs):   # tail first: parents end up more recent than children
                c[s] = None
                c.move_to_end(s)
            evicted = []
            while len(c) > a.capacity:
                evicted.append(c.popitem(last=False)[0])
            assert not (set(evicted) & set(seqs)), "request longer than capacity"
            if evicted:
                out.write(struct.pack("<BII", 2, w, len(evicted)))
                out.write(np.asarray(evicted, dtype="<u8").tobytes())
                n_rec += 1
                n_r += 1
                r_blocks += len(evicted)
            if stored:
                parent = seqs[hit - 1] if hit else 0
                out.write(struct.pack("<BIBQI", 1, w, 1 if hit else 0, parent, len(stored)))
                out.write(np.asarray(stored, dtype="<u8").tobytes())
                out.write(np.asarray(locs[hit:], dtype="<u8").tobytes())
                n_rec += 1
                n_s += 1
                s_blocks += len(stored)
    out.seek(0)
    out.write(b"KVEVTS01" + struct.pack("<IIQ", a.workers, B, n_rec))
    out.close()
    live = sum(len(c) for c in caches)
    ql = np.asarray(qlens)
    meta = dict(trace=a.trace, route=a.route, workers=a.workers, capacity=a.capacity, dup=a.dup, seed=a.seed,
                block_tokens=B, requests=n_req, records=n_rec, queries=n_q, query_blocks=q_blocks,
                query_blocks_p50=float(np.percentile(ql, 50)), query_blocks_mean=float(ql.mean()),
                query_blocks_p99=float(np.percentile(ql, 99)), query_blocks_max=int(ql.max()),
                stored_events=n_s, stored_blocks=s_blocks, removed_events=n_r, removed_blocks=r_blocks,
                block_events=s_blocks + r_blocks, cache_hit_blocks=hit_blocks,
                live_entries_end=live, distinct_seq=len(seq_of), distinct_ids=len(local_of),
                gen_s=round(time.time() - t0, 1))
    json.dump(meta, open(a.out + ".meta.json", "w"), indent=1)
    print(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
