"""A simulated TensorRT-LLM KV cache manager (one window, beam width 1) that emits KV-cache events
exactly as the engine serializes them, and serves them the way trtllm-serve's pull API does.

What it reproduces (cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp, evictionPolicy.cpp,
kvCacheEventManager.cpp, blockKey.h; tensorrt_llm/_utils.py KVCacheEventSerializer):

* Radix tree of blocks keyed by their token tuple (`BlockKey`), a root with id -1 and hash 0; block
  hashes by `BlockKeyHasher::hash` (u64 arithmetic, seed = len ^ parent * 0xbf58476d1ce4e5b9, then a
  32-bit mix per token).
* `addSequence` / `loadOrAllocateBlocks`: keys over the prompt's first n - 1 tokens, partial last
  key allowed, an empty key when n % B == 1; whole blocks by exact key, then `findMatchingBlock`'s
  partial match (longest common token prefix over the children, copy_on_partial_reuse: every child
  is a candidate; the first best in child order). A partially matched block that is in use or not a
  leaf is copied into a fresh block (no event); an unused leaf is detached and taken over privately
  (no event). Matched host blocks are onboarded (`updated` 1 -> 0).
* Free blocks: per cache level, one LRU queue per priority (0..100, lowest evicted first, front
  first); `releaseBlocks` frees a sequence's blocks tail first. `getFreeBlock`: a primary victim with
  tokens and priority >= 30 is offloaded when the host pool has a free block (`updated` 0 -> 1, the
  victim keeps its place in the tree), and the host block it takes is freed with its subtree;
  otherwise the victim is freed with its subtree (`freeChildren`: one removal per tree block,
  descendants first).
* Stores: context blocks after prefill (full blocks only), each block filled during decode, and at
  release the whole sequence minus its last token with the partial last block (`storeBlocks`: only
  newly inserted blocks appear in the `stored` event; parent null under the root).
* Events: ids from 0 per manager, a `created` event first; a removal merges into the previous queued
  event when that is a removal of the same window; `flush` per step; at most `event_buffer_max_size`
  events wait (older ones are discarded). Serialized exactly as KVCacheEventSerializer (key order,
  `attention_dp_rank` only when set). Version "1.2.0rc2": a drain that meets an `updated` event
  without priority raises (the poll fails, its events are lost); later versions write
  `"priority": null` (PR #11576).
"""

from __future__ import annotations

import json
import math
import time
from collections import OrderedDict

M64 = (1 << 64) - 1
DEFAULT_PRIORITY = 35  # KvCacheRetentionConfig::kDefaultRetentionPriority
OFFLOAD_MIN_PRIORITY = 30  # evictionPolicy.cpp kDefaultSecondaryOffloadMinPriority


def _mix32(a: int, seed: int) -> int:
    a &= 0xFFFFFFFF
    a = (((a >> 16) ^ a) * 0x45D9F3B) & 0xFFFFFFFF
    a = (((a >> 16) ^ a) * 0x45D9F3B) & 0xFFFFFFFF
    a = (a >> 16) ^ a
    return seed ^ ((a + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & M64)


def block_key_hash(tokens: tuple[int, ...], parent_hash: int) -> int:
    """BlockKeyHasher::hash (kvCacheManager.cpp / blockKey.cpp) for plain tokens: no extra ids, LoRA,
    multimodal keys or cache salt."""
    seed = (len(tokens) ^ (parent_hash * 0xBF58476D1CE4E5B9)) & M64
    for t in tokens:
        seed = _mix32(t, seed) & M64
    return seed


class Block:
    __slots__ = ("id", "level", "key", "full", "hash", "prev", "children", "refs", "priority", "queued")

    def __init__(self, bid: int, level: int):
        self.id = bid
        self.level = level  # 0 primary (GPU), 1 secondary (host): swapped on offload / onboard
        self.key: tuple[int, ...] = ()
        self.full = False
        self.hash = 0
        self.prev: Block | None = None  # parent in the radix tree (None: not in the tree)
        self.children: dict[tuple[int, ...], Block] = {}
        self.refs = 0
        self.priority = DEFAULT_PRIORITY
        self.queued: int | None = None  # (level, priority) queue it sits in, if free


class SimTrtllmEngine:
    def __init__(self, num_blocks: int = 64, host_blocks: int = 0, block_size: int = 32,
                 window_size: int | None = None, partial_reuse: bool = True,
                 copy_on_partial_reuse: bool = True, event_buffer_max_size: int = 1 << 20,
                 version: str = "1.2.0", attention_dp_rank: int | None = None):
        self.B = block_size
        self.window = window_size or 1 << 20
        self.partial_reuse = partial_reuse
        self.copy_on_partial_reuse = copy_on_partial_reuse
        self.max_events = event_buffer_max_size
        self.version = version
        self.dp_rank = attention_dp_rank
        self.root = Block(-1, 0)
        self.blocks = [Block(i, 0) for i in range(num_blocks)] + \
            [Block(num_blocks + i, 1) for i in range(host_blocks)]
        self.queues: list[list[OrderedDict]] = [[OrderedDict() for _ in range(101)] for _ in range(2)]
        for b in self.blocks:
            self._release(b)
        self.event_id = 0
        self.pending: list[dict] = []  # mEventQueue (not yet flushed)
        self.ready: list[dict] = []  # mEvents (what a poll drains)
        self.lost_events = 0
        self.stats = {"requests": 0, "matched": 0, "partial_matches": 0, "taken_over": 0, "copied": 0,
                      "offloaded": 0, "onboarded": 0, "evicted": 0}
        self._event({"type": "created", "num_blocks_per_cache_level": [num_blocks, host_blocks]})
        self.flush()

    # ---- eviction policy (evictionPolicy.cpp LRUEvictionPolicy) --------------------------------
    def _release(self, b: Block, front: bool = False) -> None:
        q = self.queues[b.level][b.priority]
        q[b.id] = b
        if front:
            q.move_to_end(b.id, last=False)
        b.queued = b.level * 1000 + b.priority

    def _claim(self, b: Block, priority: int | None = None) -> None:
        if b.queued is not None:
            lvl, pr = divmod(b.queued, 1000)
            del self.queues[lvl][pr][b.id]
            b.queued = None
        if priority is not None:
            b.priority = priority

    def _num_free(self, level: int) -> int:
        return sum(len(q) for q in self.queues[level])

    def _front(self, level: int) -> tuple[Block, bool]:
        for pr, q in enumerate(self.queues[level]):
            if q:
                return next(iter(q.values())), level == 0 and pr >= OFFLOAD_MIN_PRIORITY
        raise RuntimeError("no free block")

    # ---- events -------------------------------------------------------------------------------
    def _event(self, data: dict) -> None:
        ev = {"event_id": self.event_id, "data": data, "window_size": self.window}
        if self.dp_rank is not None:
            ev["attention_dp_rank"] = self.dp_rank
        self.event_id += 1
        self.pending.append(ev)

    def _removed(self, b: Block) -> None:
        last = self.pending[-1] if self.pending else None
        if last is not None and last["window_size"] == self.window and last["data"]["type"] == "removed":
            last["data"]["block_hashes"].append(b.hash)
        else:
            self._event({"type": "removed", "block_hashes": [b.hash]})

    def _updated_level(self, b: Block, old: int, new: int) -> None:
        self._event({"type": "updated", "block_hash": b.hash,
                     "cache_level": {"type": "event_diff", "new_value": new, "old_value": old},
                     "priority": None})

    def flush(self) -> None:
        """KVCacheEventManager::flush + worker: the step's events become pollable (oldest dropped)."""
        self.ready.extend(self.pending)
        self.pending = []
        if len(self.ready) > self.max_events:
            drop = len(self.ready) - self.max_events
            self.lost_events += drop
            self.ready = self.ready[drop:]

    def poll(self) -> list[dict]:
        """POST /kv_cache_events: the drained events as JSON objects. Raises RuntimeError where the
        engine's serializer fails (1.2.0rc2 on an `updated` event without priority): the drained
        events are lost."""
        events, self.ready = self.ready, []
        if self.version == "1.2.0rc2" and any(e["data"]["type"] == "updated" and e["data"]["priority"] is None
                                              for e in events):
            self.lost_events += len(events)
            raise RuntimeError("'NoneType' object has no attribute 'new_value'")
        return json.loads(json.dumps(events))

    # ---- tree ---------------------------------------------------------------------------------
    def _in_tree(self, b: Block) -> bool:
        return bool(b.key) and b.prev is not None

    def _free_leaf(self, b: Block) -> None:
        if b.prev is not None:
            if b.prev.children.get(b.key) is b:
                del b.prev.children[b.key]
            b.prev = None

    def _free_children(self, b: Block) -> None:
        for child in list(b.children.values()):
            self._free_children(child)
        if self._in_tree(b):
            self._removed(b)
            self.stats["evicted"] += 1
        self._free_leaf(b)

    def _get_free_block(self, priority: int = DEFAULT_PRIORITY) -> Block:
        block, can_offload = self._front(0)
        if block.key and can_offload and self._num_free(1) > 0:
            off, _ = self._front(1)
            block.level, off.level = 1, 0  # swapMemoryPoolBlockOffset
            if self._in_tree(block):
                self._updated_level(block, 0, 1)
            self.stats["offloaded"] += 1
            # claim from the primary queue, release into the secondary queue (keeps its priority)
            lvl, pr = divmod(block.queued, 1000)
            del self.queues[lvl][pr][block.id]
            block.queued = None
            self._release(block)
            lvl, pr = divmod(off.queued, 1000)
            del self.queues[lvl][pr][off.id]
            off.queued = None
            block = off
        self._free_children(block)
        self._claim(block, priority)
        return block

    def _onboard(self, b: Block) -> None:
        if b.level == 1:
            fresh = self._get_free_block(DEFAULT_PRIORITY)
            b.level, fresh.level = 0, 1
            self._updated_level(b, 1, 0)
            self._release(fresh)
            self.stats["onboarded"] += 1

    def _find(self, root: Block, key: tuple[int, ...], partial: bool) -> tuple[bool, int, Block] | None:
        if not key or not root.children:
            return None
        b = root.children.get(key)
        if b is not None:
            return (not b.full, len(key), b)
        if partial:
            best, bb = 0, None
            for k, c in root.children.items():
                if self.copy_on_partial_reuse or (c.refs == 0 and not c.children):
                    m = 0
                    for x, y in zip(k, key, strict=False):
                        if x != y:
                            break
                        m += 1
                    if m > best:
                        best, bb = m, c
            if bb is not None:
                return (True, best, bb)
        return None

    def _chop(self, tokens: list[int], n: int, partial: bool) -> list[tuple[int, ...]]:
        B = self.B
        keys = [tuple(tokens[i:min(i + B, n)]) for i in range(0, n, B)]
        if keys and not partial and len(keys[-1]) < B:
            keys.pop()
        return keys

    def _store(self, keys: list[tuple[int, ...]], blocks: list[Block]) -> None:
        root, need = self.root, True
        stored: list[Block] = []
        for key, block in zip(keys, blocks, strict=False):
            found = self._find(root, key, False) if need else None
            if found is not None:
                root = found[2]
                continue
            need = False
            block.key, block.full = key, len(key) == self.B
            block.prev = root
            root.children.setdefault(key, block)
            block.hash = block_key_hash(key, root.hash)
            stored.append(block)
            root = block
        if stored:
            p = stored[0].prev
            self._event({"type": "stored", "parent_hash": p.hash if p is not None and p.id >= 0 else None,
                         "blocks": [{"type": "stored_block", "block_hash": b.hash,
                                     "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                                                for t in b.key],
                                     "cache_level": b.level, "priority": b.priority} for b in stored]})

    # ---- a request ----------------------------------------------------------------------------
    def generate(self, prompt: list[int], output: list[int]) -> dict:
        """Run one request to completion (admission, prefill, decode, release); returns the engine's
        own counts: cached tokens and their split by cache level at match time."""
        n, B = len(prompt), self.B
        keys = self._chop(prompt, n - 1, True)
        if n % B == 1:
            keys.append(())
        n_ctx = math.ceil(n / B)
        seq: list[Block] = []
        matched = {0: 0, 1: 0}
        root: Block | None = self.root
        for bi in range(n_ctx):
            key = keys[bi] if bi < len(keys) else None
            res = self._find(root, key, self.partial_reuse) if root is not None and key else None
            if res is not None:
                partial, m, blk = res
                matched[blk.level] += m
                if partial:
                    self.stats["partial_matches"] += 1
                    if blk.refs > 0 or blk.children:
                        new = self._get_free_block(blk.priority)
                        new.key, new.full = key, len(key) == B
                        blk = new
                        self.stats["copied"] += 1
                    else:
                        self._free_leaf(blk)  # taken over privately: no event
                        self._claim(blk)
                        self.stats["taken_over"] += 1
                    root = None
                else:
                    self._claim(blk)
                    root = blk
                self._onboard(blk)
            else:
                blk = self._get_free_block(DEFAULT_PRIORITY)
                root = None
                if key is not None:
                    blk.key, blk.full = key, len(key) == B
            blk.refs += 1
            seq.append(blk)
        # prefill done: context blocks (full blocks of n - 1 tokens)
        self._store(self._chop(prompt, n - 1, False), seq)
        tokens = list(prompt)
        for t in output:
            tokens.append(t)
            total = len(tokens)
            if (total - 1) % B == 0 and len(seq) * B < total:
                blk = self._get_free_block(DEFAULT_PRIORITY)
                blk.refs += 1
                seq.append(blk)
            if (total - 1) % B == 0:
                self._store(self._chop(tokens, total - 1, False), seq)
        # release: store prompt + output minus the last token (partial last block), free tail first
        self._store(self._chop(tokens, len(tokens) - 1, True), seq)
        for blk in reversed(seq):
            blk.refs -= 1
            if blk.refs == 0:
                self._release(blk)
        self.flush()
        self.stats["requests"] += 1
        cached = matched[0] + matched[1]
        self.stats["matched"] += cached
        return {"cached_tokens": cached,
                "cached_tokens_by_level": {"primary": matched[0], "secondary": matched[1]}}

    # ---- the index's view to compare with ----------------------------------------------------
    def reusable_tokens(self, prompt: list[int]) -> int:
        """What a request with this prompt would reuse now (the matching walk, without side effects)."""
        keys = self._chop(prompt, len(prompt) - 1, True)
        root, got = self.root, 0
        for key in keys:
            res = self._find(root, key, self.partial_reuse)
            if res is None:
                break
            partial, m, blk = res
            got += m
            if partial:
                break
            root = blk
        return got


def record(engine: SimTrtllmEngine, requests: list[tuple[list[int], list[int]]], events_path: str,
           requests_path: str, t0: float | None = None) -> dict:
    """Run requests one at a time and write a recording in the pull-API format
    (../shared/fixtures/README.md): events.jsonl (one line per poll, after each request) and
    requests.jsonl. Returns counters."""
    t = t0 if t0 is not None else time.time()
    lost = 0
    with open(events_path, "w") as ev_f, open(requests_path, "w") as rq_f:
        try:
            first = engine.poll()
        except RuntimeError:
            first = []
        ev_f.write(json.dumps({"recv_ns": int(t * 1e9), "events": first}) + "\n")
        for i, (prompt, output) in enumerate(requests):
            t += 0.01
            t_send = t
            res = engine.generate(prompt, output)
            t += 0.01
            rq_f.write(json.dumps({"i": i, "t_send": t_send, "t_done": t, "status": 200,
                                   "prompt_token_ids": prompt, "prompt_tokens": len(prompt),
                                   "cached_tokens": res["cached_tokens"],
                                   "cached_tokens_by_level": res["cached_tokens_by_level"],
                                   "output_token_ids": output, "completion_tokens": len(output)}) + "\n")
            t += 0.001
            try:
                rec = {"recv_ns": int(t * 1e9), "events": engine.poll()}
            except RuntimeError:  # trtllm-serve answers 500: recorded as a failed poll
                lost += 1
                rec = {"recv_ns": int(t * 1e9), "events": [], "error": "http_500"}
            ev_f.write(json.dumps(rec) + "\n")
    return {"failed_polls": lost, "lost_events": engine.lost_events}
