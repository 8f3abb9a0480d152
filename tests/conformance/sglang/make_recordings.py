"""Record SGLang's own KV-cache event stream for a release, with SGLang's own radix cache.

Runs inside a throwaway venv holding the release (see ../run.sh); never imported by kvidx or CI.
SGLang's code: `RadixCache` (match_prefix, insert, evict, lock refs: the tree, its node splits and
LRU eviction), its `KVCacheEventRecorder` (page hashes, parent links, LoRA namespaces, store and
removal coalescing) and the `ZmqEventPublisher` with `KVEventBatch`, captured over loopback.

Stand-ins (the scheduler's bookkeeping around the cache, the model, the GPU): a token-slot pool
of `pool_pages` pages; requests admitted up to 4 at a time, first come first served; a request's
prefix lookup as `Req.init_next_round_input` makes it (its prompt but the last token, page-aligned
by the tree), the pool short of room evicting from the tree first (`evict`), the prompt inserted
after its prefill and the duplicate slots freed, the lock moved to the new node
(`RadixCache.checkpoint`), one token per decode step, the finished request's prompt and output but
the last token inserted, its lock released and its other slots freed (`cache_finished_req`);
sampled tokens from a seeded function of (request, position). `cached_tokens` is the length of the
prefix the tree matched, what SGLang reports as `usage.prompt_tokens_details.cached_tokens`.

Usage (inside the engine venv): python make_recordings.py --out DIR [--scenario NAME ...]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from array import array
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/conformance: the kit's common parts
from kit_common import VOCAB, Capture, Workload, workload  # noqa: E402


@dataclass
class Scenario(Workload):
    name: str
    page_size: int
    pool_pages: int  # the token pool, in pages
    about: str
    loras: bool = False  # a LoRA adapter per job (two adapters and the base model)
    # attention-DP ranks: a tree, pool and publisher each (SGLang's port + attn_dp_rank endpoint), the
    # jobs dealt out in turn, run one rank after the other (their caches and publishers are independent)
    dp: int = 1
    eagle: bool = False  # speculative decoding with EAGLE: the tree keys token pairs (bigrams)


SCENARIOS = {s.name: s for s in [
    Scenario("page1", 1, 1536, "page size 1 (SGLang's default): the tree matches to the token"),
    Scenario("page16", 16, 96, "page size 16"),
    Scenario("page64", 64, 24, "page size 64"),
    Scenario("page16_lora", 16, 96, "page size 16, LoRA adapters 'sql' / 'chat' / the base model",
             loras=True),
    Scenario("page1_lora", 1, 1536, "page size 1, LoRA adapters 'sql' / 'chat' / the base model",
             loras=True),
    Scenario("page16_eagle", 16, 96, "page size 16, EAGLE speculative decoding: the radix tree keys "
             "token pairs (SGLang's bigram keys), its events pages of pairs", eagle=True),
    Scenario("page16_dp2", 16, 72, "page size 16, 2 attention-DP ranks of 72 pages each (publishers on "
             "the base port and the next), the jobs dealt out in turn", dp=2),
]}

LORAS = {"sql": "lora-id-1", "chat": "lora-id-2"}  # adapter name -> SGLang's lora_id (the extra_key)


class Pool:
    """Token slots in pages (the allocator's role): a request's slots are page-aligned runs."""

    def __init__(self, pages: int, page_size: int):
        import torch
        self.torch = torch
        self.page = page_size
        self.free_pages = list(range(pages))
        self.device = "cpu"

    def available(self) -> int:
        return len(self.free_pages) * self.page

    def alloc_pages(self, n: int) -> list[int]:
        assert n <= len(self.free_pages)
        got, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return got

    def free_segment(self, indices: Any, start_pos: int = 0) -> None:
        """SGLang's allocator call: free the pages these slots start (page-aligned runs)."""
        for i in indices.tolist() if hasattr(indices, "tolist") else indices:
            if i % self.page == 0:
                self.free_pages.append(i // self.page)


class Job:
    def __init__(self, rid: str, prompt: list[int], lora: str | None, t_send: float):
        self.rid, self.prompt, self.lora, self.t_send = rid, prompt, lora, t_send
        self.slots: list[int] = []  # token slot per position computed (or cached)
        self.protected = 0  # positions whose slots the tree owns
        self.node = None  # the tree node it locks
        self.out: list[int] = []
        self.cached = 0
        self.lookup_at: list[int] | None = None
        self.prefilled = False


def key(tokens: list[int], lora: str | None, bigram: bool = False) -> Any:
    """The tree's key of `tokens` (with EAGLE, as SGLang's scheduler makes it: a view of token pairs)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    return RadixKey(array("q", tokens), LORAS.get(lora) if lora else None, is_bigram=bigram)


def record_scenario(s: Scenario, out_dir: Path, port: int) -> dict[str, Any]:
    import sglang

    lines: list[str] = []
    records: list[dict[str, Any]] = []
    published = 0
    for rank in range(s.dp):
        rank_lines, rank_records = record_rank(s, port, rank)
        if s.dp > 1:  # which rank took each request, and whose stream its lookup_at counts in
            for r in rank_records:
                r["dp_rank"], r["publisher"] = rank, f"tcp://127.0.0.1:{port + rank}"
        lines += rank_lines
        records += rank_records
        published += len(rank_lines)
    if s.dp > 1:  # the ranks' requests in the order they were sent, numbered again
        records = [{**r, "i": i} for i, r in enumerate(sorted(records, key=lambda r: r["t_send"]))]
    P = s.page_size
    d = out_dir / s.name
    d.mkdir(parents=True, exist_ok=True)
    (d / "frames.jsonl").write_text("".join(line + "\n" for line in lines))
    (d / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    meta = {"made_by": "tests/conformance/sglang/make_recordings.py (SGLang's own RadixCache, event "
                       "recorder and ZmqEventPublisher; the scheduler's bookkeeping a stand-in)",
            "release": sglang.__version__, "scenario": s.name, "about": s.about, "page_size": P,
            "pool_tokens": s.pool_pages * P, "loras": LORAS if s.loras else None,
            "workload": {"seed": s.seed, "convs": s.convs, "turns": s.turns, "one_shot": s.one_shot,
                         "concurrency": s.concurrency, "max_tokens": s.max_tokens, "max_prompt": 500},
            "counts": {"requests": len(records), "batches": published,
                       "prompt_tokens": sum(r["prompt_tokens"] for r in records),
                       "cached_tokens": sum(r["cached_tokens"] for r in records)}}
    if s.dp > 1:
        meta["attn_dp_size"] = s.dp
    (d / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{s.name}: " + json.dumps(meta["counts"]), flush=True)
    return meta


def record_rank(s: Scenario, port: int, rank: int) -> tuple[list[str], list[dict[str, Any]]]:
    """One scheduler's tree (attention-DP rank `rank` of `s.dp`) through its share of the jobs: the
    frames its publisher sent and its request records."""
    import torch
    from sglang.srt.disaggregation.kv_events import KVEventBatch, ZmqEventPublisher
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.events import KvEventLoraNames
    from sglang.srt.mem_cache.radix_cache import RadixCache

    pool = Pool(s.pool_pages, s.page_size)
    names = KvEventLoraNames()
    for name, lora_id in LORAS.items():  # as admission registers each request's namespace (its
        # extra_key ends with the adapter's lora_id) and the adapter's load its id
        names.register(lora_id=lora_id, lora_name=name)
        names.register(SimpleNamespace(extra_key=lora_id, lora_id=lora_id), name)
    tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=pool,
                                      page_size=s.page_size, is_eagle=s.eagle, enable_kv_cache_events=True,
                                      kv_event_lora_names=names))  # as create_simulated, with is_eagle
    pub = ZmqEventPublisher(attn_dp_rank=rank, endpoint=f"tcp://*:{port}", topic="kv")  # port + rank
    cap = Capture(f"tcp://127.0.0.1:{port + rank}")
    time.sleep(0.5)  # the SUB joins before the first batch
    published = 0
    tree.kv_events.take()  # the AllBlocksCleared of the tree's own reset, before anyone listens
    P = s.page_size

    def target(rid: str, pos: int) -> int:
        return random.Random(f"t:{s.seed}:{rid}:{pos}").randrange(4, VOCAB)

    def room(tokens: int) -> bool:
        """Pages for `tokens` more tokens, evicting from the tree as the scheduler does."""
        need = -(-tokens // P) * P
        if pool.available() < need:
            tree.evict(EvictParams(num_tokens=need - pool.available()))
        return pool.available() >= need

    def grow(job: Job, n: int) -> None:
        """Slots for positions len(job.slots) .. n-1: the last page's free slots, then new pages."""
        while len(job.slots) < n:
            if len(job.slots) % P == 0:
                (page,) = pool.alloc_pages(1)
                job.slots.append(page * P)
            else:
                job.slots.append(job.slots[-1] + 1)

    def insert(job: Job, tokens: list[int]) -> None:
        """RadixCache.checkpoint / cache_finished_req: the page-aligned tokens into the tree, the
        duplicate slots freed, the lock moved to the new node, the tree's slots taken."""
        k = key(tokens, job.lora, s.eagle).page_aligned(P)
        n = len(k)
        values = torch.tensor(job.slots[:n], dtype=torch.int64)
        res = tree.insert(InsertParams(key=k, value=values, inserted_len=job.protected))
        pool.free_segment(values[job.protected:res.prefix_len])
        m = tree.match_prefix(MatchPrefixParams(key=k))
        tree_slots = tree.path_device_indices(m.last_device_node).tolist()
        assert len(tree_slots) == n, (len(tree_slots), n)
        job.slots[job.protected:n] = tree_slots[job.protected:n]
        job.protected = n
        tree.dec_lock_ref(job.node)
        job.node = m.last_device_node
        tree.inc_lock_ref(job.node)

    jobs = workload(s.seed, s.convs, s.turns, s.one_shot)[rank::s.dp]
    waiting: list[tuple[Job, dict]] = []
    running: list[tuple[Job, dict]] = []
    records: list[dict[str, Any]] = []
    n_req, next_job = 0, 0

    def submit(state: dict) -> None:
        nonlocal n_req
        kind, x = state["job"]
        if kind == "oneshot":
            if state["turn"] > 0:
                return
            prompt = x[2] + x[3]
        else:
            if state["turn"] >= len(x[3]):
                return
            prompt = (state.get("prompt") or list(x[2])) + state.get("out", []) + x[3][state["turn"]]
            if len(prompt) + s.max_tokens > 500:
                return
        state["prompt"] = prompt
        waiting.append((Job(f"r{n_req}", prompt, state["lora"], time.time()), state))
        n_req += 1

    while True:
        while len(waiting) + len(running) < s.concurrency and next_job < len(jobs):
            lora = ("sql", "chat", None)[next_job % 3] if s.loras else None
            submit({"job": jobs[next_job], "turn": 0, "lora": lora})
            next_job += 1
        if not waiting and not running:
            break
        # schedule: first come first served, while the pool has room
        admitted = []
        while waiting:
            job, state = waiting[0]
            job.lookup_at = [published, len(tree.kv_events._queue)]
            m = tree.match_prefix(MatchPrefixParams(key=key(job.prompt[:len(job.prompt) - 1], job.lora,
                                                            s.eagle)))
            job.node = m.last_device_node
            tree.inc_lock_ref(job.node)
            prefix = tree.path_device_indices(job.node).tolist()
            if not room(len(job.prompt) - len(prefix) + 1):
                tree.dec_lock_ref(job.node)
                break
            waiting.pop(0)
            job.slots, job.protected, job.cached = prefix, len(prefix), len(prefix)
            grow(job, len(job.prompt))
            admitted.append((job, state))
        # the step: prefills, then a decode token for every running request
        for job, _ in running + admitted:
            if job.prefilled:
                if not room(1):
                    raise SystemExit(f"{s.name}: the pool is too small for the running requests")
                grow(job, len(job.prompt) + len(job.out))  # the last sampled token's KV
            job.out.append(target(job.rid, len(job.prompt) + len(job.out)))
        for job, _ in admitted:
            insert(job, job.prompt)  # the prompt's KV is in the tree from here on
            job.prefilled = True
        running += admitted
        done = [(j, st) for j, st in running if len(j.out) >= s.max_tokens]
        running = [(j, st) for j, st in running if len(j.out) < s.max_tokens]
        for job, _ in done:
            insert(job, job.prompt + job.out[:-1])
            tree.dec_lock_ref(job.node)
            pool.free_segment(job.slots[job.protected:])
        events = tree.kv_events.take()
        if events:
            pub.publish(KVEventBatch(ts=time.time(), events=events))
            published += 1
            cap.drain(published)
        t_done = time.time()
        for job, state in done:
            kind, x = state["job"]
            rec = {"i": len(records), "request_id": job.rid, "kind": kind,
                   "conv": x[0] if kind == "conv" else -1 - x[0], "turn": state["turn"], "sys_id": x[1],
                   "t_send": job.t_send, "t_done": t_done, "status": 200, "prompt_token_ids": job.prompt,
                   "prompt_tokens": len(job.prompt), "cached_tokens": job.cached,
                   "cached_tokens_by_tier": {"GPU": job.cached}, "lookup_at": job.lookup_at,
                   "output_token_ids": job.out, "completion_tokens": len(job.out)}
            if s.loras:
                rec["lora"] = job.lora
            records.append(rec)
            state["out"] = job.out
            state["turn"] += 1
            submit(state)
    pub.shutdown()
    cap.sub.close(0)
    if cap.seqs != list(range(len(cap.seqs))):
        raise SystemExit(f"{s.name}: publisher sequence has gaps")
    return cap.lines, records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for <scenario>/ recordings")
    ap.add_argument("--scenario", nargs="*", default=None, choices=sorted(SCENARIOS),
                    help="scenarios to record (default: all)")
    ap.add_argument("--port", type=int, default=5592, help="loopback port for the publisher")
    a = ap.parse_args()
    for name in a.scenario or list(SCENARIOS):
        record_scenario(SCENARIOS[name], Path(a.out), a.port)


if __name__ == "__main__":
    sys.exit(main())
