"""Partial blocks: what token-exact credit costs for engines that resume inside blocks.

SGLang's radix cache with page size 1 (its default) or small pages, and TensorRT-LLM with partial
reuse (its default), reuse prompts to the token. The index keys whole index blocks (16 tokens) plus
partial-block keys (kvidx.engines.common.PartialTails); before them, exact credit needed
`--index-block-size 1` (16x the entries). On the same prompts, with the engines' simulators
(kvidx/sim: their own event formats, eviction and partial-match rules) replayed one request at a time
through the relay and fold code, this prints per engine and index:

- recall, over-credit and exact requests against the engine's own cached tokens, with the
  partial keys (what lookups by token ids get) and without them (lookups by block hashes, and kvidx
  before partial keys);
- full-block entries, partial keys, and map bytes per entry (the compiled map where built).

    .venv/bin/python bench/bench_partial.py [--requests 600] [--json out.json]

Workloads: "chat" (kvidx.sim.prompts.chat_requests: each turn extends its conversation's history,
so the engine's cache ends inside a block at every turn) and "shared-system"
(kvidx.sim.prompts.workload_requests: five system prompts of 40-130 tokens that conversations
leave inside a block).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import _common as c

from kvidx import index
from kvidx.core.hashing import prompt_hashes
from kvidx.core.shard import ModelShard
from kvidx.engines import RelayOptions
from kvidx.engines import get as get_engine
from kvidx.engines.contract import zmq_replay
from kvidx.engines.recording import replay_requests
from kvidx.engines.sglang.relay import SglangPublisherRelay
from kvidx.engines.sglang.sim import SimSglangEngine, stepping_clock
from kvidx.engines.sglang.sim import record as record_sglang
from kvidx.engines.trtllm.sim import SimTrtllmEngine, record
from kvidx.shadow import Agreement, load_requests
from kvidx.sim.prompts import chat_requests, workload_requests


def sglang_recording(reqs, page: int, cache_tokens: int) -> tuple:
    eng = SimSglangEngine(num_pages=cache_tokens // page, page_size=page, version="0.5.23", endpoint=None,
                          clock=stepping_clock())
    frames, log = record_sglang(eng, reqs)

    def batches(ibs: int):
        return zmq_replay(frames, lambda ep: SglangPublisherRelay("m", ep, ibs, engine_version="0.5.23",
                                                                  epoch=0))

    return batches, log


def trtllm_recording(reqs, host_blocks: int, cache_tokens: int, tmp: Path) -> tuple:
    eng = SimTrtllmEngine(num_blocks=cache_tokens // 32, host_blocks=host_blocks, block_size=32,
                          version="1.2.0")
    ev, rq = tmp / f"trt{host_blocks}.events.jsonl", tmp / f"trt{host_blocks}.requests.jsonl"
    record(eng, reqs, str(ev), str(rq))
    adapter = get_engine("trtllm")
    return (lambda ibs: adapter.replay(ev, "m", ibs, RelayOptions())), load_requests(rq)


def measure(batches, requests: list[dict], ibs: int) -> dict:
    shard = ModelShard("m", ibs)
    with_keys, without = Agreement(), Agreement()
    for r in replay_requests(batches, requests, lambda t_ns, b: shard.apply(b, t_ns / 1e9)):
        toks = r["prompt_token_ids"]
        reused = int(r["cached_tokens"])
        keyed = index.credited(shard, prompt_hashes(toks, ibs, tails=True), len(toks))
        with_keys.add(r["i"], len(toks), reused, keyed)
        without.add(r["i"], len(toks), reused, index.credited(shard, prompt_hashes(toks, ibs), len(toks)))
    _blocks, entries = c.shard_entries(shard)
    mem = index.index_size([shard], union_maps=False)[1]  # the tier maps
    full = sum(st.blocks for st in index.replicas(shard))
    return {"with_keys": with_keys.summary(), "without": without.summary(), "full_entries": full,
            "partial_keys": shard.tail_keys, "entries": entries,
            "map_bytes_per_entry": round(mem / entries, 1) if entries else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--requests", type=int, default=600, help="requests per workload (default: 600)")
    ap.add_argument("--cache-tokens", type=int, default=12_000,
                    help="each engine's GPU cache in tokens (default: 12000)")
    ap.add_argument("--json", help="write the rows as JSON here")
    args = ap.parse_args()
    workloads = {"chat": chat_requests(1, args.requests),
                 "shared-system": workload_requests(5, args.requests)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for wname, reqs in workloads.items():
            engines = {
                "sglang page 1": lambda reqs=reqs: sglang_recording(reqs, 1, args.cache_tokens),
                "sglang page 4": lambda reqs=reqs: sglang_recording(reqs, 4, args.cache_tokens),
                "sglang page 16": lambda reqs=reqs: sglang_recording(reqs, 16, args.cache_tokens),
                "trtllm partial reuse": lambda reqs=reqs: trtllm_recording(reqs, 0, args.cache_tokens,
                                                                           Path(tmp)),
                "trtllm + host tier": lambda reqs=reqs: trtllm_recording(reqs, args.cache_tokens // 64,
                                                                         args.cache_tokens // 2, Path(tmp)),
            }
            for ename, make in engines.items():
                batches_of, log = make()
                for ibs in (16, 1):
                    c.log(f"{wname} / {ename} / index block {ibs}")
                    rows.append({"workload": wname, "engine": ename, "index_block": ibs,
                                 **measure(batches_of(ibs), log, ibs)})
    print()
    print("| workload | engine | index block | recall | over-credit | exact | recall without partial keys "
          "| full entries | partial keys | map bytes/entry |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        w, wo = r["with_keys"], r["without"]
        print(f"| {r['workload']} | {r['engine']} | {r['index_block']} | {w['recall']:.6f} "
              f"| {w['over_credit']:.6f} "
              f"| {w['exact_requests']}/{w['requests']} | {wo['recall']:.6f} | {r['full_entries']:,} "
              f"| {r['partial_keys']:,} | {r['map_bytes_per_entry']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
