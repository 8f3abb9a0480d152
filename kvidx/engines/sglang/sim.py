"""A simulated SGLang engine replica: a radix cache with leaf-only eviction, publishing SGLang's real
KV-event wire format over ZMQ PUB + a replay ROUTER, by the serialization rules of the version it
imitates (checked in the released wheels; see kvidx/engines/sglang/wire.py for the line references):

* Radix tree (mem_cache/radix_cache.py): keys page-aligned; children keyed by (namespace, first
  page), the namespace being (extra_key, cache_salt) (a LoRA adapter's id is appended to extra_key,
  managers/schedule_batch.py l. 1164-1171); a match that ends inside a node splits it.
  `match_prefix` is capped at len(prompt) - 1 tokens and rounded down to a page
  (schedule_batch.py `_compute_max_prefix_len` l. 1766-1785, radix_cache.py `page_aligned`): that is
  what the engine reuses. The prompt is inserted after prefill and prompt + output minus the last
  token when the request finishes (mem_cache/common.py `release_kv_cache`: owned_kv_len).
* Eviction (radix_cache.py `evict`): a heap of evictable leaves by last access (LRU), unlocked
  only; a parent becomes a candidate when its last child goes; one removal per node.
* Hashes: 0.5.10+ SHA-256 per page chained over the parent's 32-byte digest, tokens as u32 LE
  (mem_cache/utils.py `get_hash_str` / cpp_utils/hash_binding.cpp `hash_page`; 0.5.10
  hicache_storage.py l. 17-32), published as the first 8 bytes, signed (`hash_str_to_int64`).
  0.5.22+ with a cache salt: the event chain is seeded with sha256(b"sglang-cache-salt-v1\\0" + salt)
  (utils.py `compute_node_event_hash_values`); with a known LoRA adapter the event hashes are
  namespaced (kv_events.py `kv_event_namespace_seed` / `namespaced_block_hash`, events.py
  `_namespace_seed`) and carry `lora_name`; `cache_salt` is on every stored chain. <= 0.5.3:
  Python's `hash(tuple(page))`, not chained; a root child's parent is hash(()); a node split
  publishes remove(child) + store(prefix) + store(child) (radix_cache.py 0.5.3 `_split_node`).
* Events per version: 0.5.22+ maps tagged by "type", optional fields omitted when None, pages of a
  chain merged into one BlockStored and consecutive removals (one per node) into one BlockRemoved
  (events.py `enqueue`); 0.5.10 positional arrays with a trailing medium, one event per page;
  <= 0.5.3 positional arrays without medium. Batches `[ts, events, attn_dp_rank]`.
* Replay: 0.5.22+ `[identity, b"", topic, seq, payload]` ... `[identity, b"", b"", -1, b""]`;
  older `[identity, b"", seq, payload]` ... `[identity, b"", -1, b""]`.

Simplifications: requests run one at a time (one batch after prefill: evictions + the prompt's
store; one when the request finishes); one GPU tier (no HiCache host tier); no EAGLE bigram keys.
With `endpoint=None` no socket is opened: batches are only kept in `published` (fixtures, tests).
"""

from __future__ import annotations

import hashlib
import heapq
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from kvidx.engines.sglang.hashing import hash_str_to_int64, namespace_seed, namespaced, page_hash_hex
from kvidx.engines.sglang.wire import check_version

END_SEQ = (-1).to_bytes(8, "big", signed=True)
def lora_id_of(name: str) -> str:
    """A 32-hex-digit adapter id (SGLang's LoRARef.lora_id is a uuid hex)."""
    return hashlib.sha256(b"lora-id\x00" + name.encode()).hexdigest()[:32]


class _Node:
    __slots__ = ("key", "parent", "children", "access", "lock", "chain", "ns", "id")
    _ids = 0

    def __init__(self, key: list[int], parent: _Node | None, ns: tuple, access: int):
        self.key = key
        self.parent = parent
        self.children: dict[tuple, _Node] = {}
        self.access = access
        self.lock = 0
        self.chain: list[str] | None = None  # per-page hex digests of the event chain (sha256)
        self.ns = ns
        _Node._ids += 1
        self.id = _Node._ids


class SimSglangEngine:
    def __init__(self, num_pages: int, page_size: int = 16, version: str = "0.5.23",
                 endpoint: str | None = "tcp://127.0.0.1:*", replay_endpoint: str | None = None,
                 topic: bytes = b"kv", dp_rank: int = 0, buffer_steps: int = 10000,
                 clock: Callable[[], float] | None = None):
        self.encoding, self.hash_kind = check_version(version)
        self.version = version
        self.P = page_size
        self.capacity = num_pages * page_size
        self.dp_rank = dp_rank
        self.topic = topic
        self.clock = clock or time.time
        self.coalesce = self.encoding == "map"
        self.root = _Node([], None, (None, None), 0)
        self.root.lock = 1
        self.root.chain = []
        self.tick = 0
        self.tree_tokens = 0
        self.lora_names: dict[str, str] = {}  # extra_key -> adapter name
        self._queue: list = []
        self._enc = msgspec.msgpack.Encoder()
        self._seq = 0
        self._lock = threading.RLock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.published: list[tuple[int, float, bytes]] = []  # (seq, ts, payload)
        self.requests = self.prompt_tokens = self.cached_tokens = 0
        self.endpoint = self.replay_endpoint = None
        self._pub = self._ctx = self._thread = None
        self._stop = threading.Event()
        if endpoint is not None:
            import zmq
            self._ctx = zmq.Context()
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 500)
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if replay_endpoint is not None:
                router = self._ctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                router.bind(replay_endpoint)
                self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
                self._thread = threading.Thread(target=self._replay_loop, args=(router,), daemon=True)
                self._thread.start()

    # ---- hashing (per node, lazily, as SGLang's recorder) ------------------------------------------
    def _pages(self, node: _Node) -> list[list[int]]:
        P = self.P
        return [node.key[i:i + P] for i in range(0, len(node.key), P)]

    def _event_hashes(self, node: _Node) -> list[int]:
        if self.hash_kind == "py_tuple_hash":
            return [hash(tuple(p)) for p in self._pages(node)]
        if node.chain is None:
            par = node.parent
            if par is not self.root:
                self._event_hashes(par)
                prior = par.chain[-1] if par.chain else None
            elif self.encoding == "map" and node.ns[1] is not None:  # 0.5.22+: the salt seeds the chain
                prior = hashlib.sha256(b"sglang-cache-salt-v1\0" + node.ns[1].encode()).hexdigest()
            else:
                prior = None
            out = []
            for p in self._pages(node):
                prior = page_hash_hex(p, prior)
                out.append(prior)
            node.chain = out
        seed = self._seed(node)
        return [namespaced(hash_str_to_int64(h), seed) for h in node.chain]

    def _seed(self, node: _Node) -> bytes | None:
        if self.version != "0.5.23":  # 0.5.22's default format publishes the hashes unchanged
            return None
        extra = node.ns[0]
        return namespace_seed(extra if extra in self.lora_names else None, None)

    def _parent_hash(self, node: _Node) -> int | None:
        par = node.parent
        if self.hash_kind == "py_tuple_hash":
            return hash(tuple(par.key[-self.P:])) if par.key else hash(())
        if par is self.root:
            return None
        return self._event_hashes(par)[-1]

    # ---- events ---------------------------------------------------------------------------------
    def _enqueue(self, ev: dict) -> None:
        if self.coalesce and self._queue:
            tail = self._queue[-1]
            if tail["type"] == ev["type"] == "BlockRemoved" and tail.get("medium") == ev.get("medium"):
                tail["block_hashes"].extend(ev["block_hashes"])
                return
            same = ("medium", "lora_id", "block_size", "cache_salt", "session_id", "lora_name")
            if (tail["type"] == ev["type"] == "BlockStored"
                    and ev["parent_block_hash"] == tail["block_hashes"][-1]
                    and all(tail.get(k) == ev.get(k) for k in same)):
                tail["block_hashes"].extend(ev["block_hashes"])
                tail["token_ids"].extend(ev["token_ids"])
                return
        self._queue.append(ev)

    def _record_store(self, node: _Node) -> None:
        hashes = self._event_hashes(node)
        parent = self._parent_hash(node)
        lora = self.lora_names.get(node.ns[0]) if self.version == "0.5.23" else None
        for h, page in zip(hashes, self._pages(node), strict=True):
            ev: dict[str, Any] = {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
                                  "token_ids": list(page), "block_size": len(page), "lora_id": None}
            if self.version != "0.4.9.post6" and self.version != "0.5.3":
                ev["medium"] = "GPU"
            if self.encoding == "map":
                if node.ns[1] is not None:
                    ev["cache_salt"] = node.ns[1]
                if lora is not None:
                    ev["lora_name"] = lora
            self._enqueue(ev)
            parent = h

    def _record_remove(self, node: _Node) -> None:
        hashes = self._event_hashes(node)
        medium = {"medium": "GPU"} if self.version not in ("0.4.9.post6", "0.5.3") else {}
        if self.encoding == "map":  # one removal per node (events.py record_remove)
            self._enqueue({"type": "BlockRemoved", "block_hashes": hashes, **medium})
        else:  # one per page (radix_cache.py <= 0.5.10 _record_remove_event)
            for h in hashes:
                self._enqueue({"type": "BlockRemoved", "block_hashes": [h], **medium})

    def _wire(self, ev: dict) -> Any:
        if self.encoding == "map":
            return ev  # dict order = declaration order; omitted defaults were never added
        if ev["type"] == "BlockStored":
            arr = ["BlockStored", ev["block_hashes"], ev["parent_block_hash"], ev["token_ids"],
                   ev["block_size"], ev["lora_id"]]
        elif ev["type"] == "BlockRemoved":
            arr = ["BlockRemoved", ev["block_hashes"]]
        else:
            return ["AllBlocksCleared"]
        if "medium" in ev:
            arr.append(ev["medium"])
        return arr

    def flush(self) -> int | None:
        """Publish the queued events as one batch (a scheduler step); returns its seq."""
        if not self._queue:
            return None
        events, self._queue = self._queue, []
        ts = self.clock()
        payload = self._enc.encode([ts, [self._wire(e) for e in events], self.dp_rank])
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
            self.published.append((seq, ts, payload))
            if self._pub is not None:
                self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    @property
    def next_seq(self) -> int:
        return self._seq

    # ---- radix tree -----------------------------------------------------------------------------
    def _touch(self) -> int:
        self.tick += 1
        return self.tick

    def _split(self, child: _Node, at: int) -> _Node:
        legacy = self.hash_kind == "py_tuple_hash"
        if legacy:
            self._record_remove(child)
        par = child.parent
        new = _Node(child.key[:at], par, child.ns, child.access)
        new.lock = child.lock
        del par.children[(child.ns, tuple(child.key[:self.P]))]
        par.children[(new.ns, tuple(new.key[:self.P]))] = new
        child.key = child.key[at:]
        child.parent = new
        new.children[(child.ns, tuple(child.key[:self.P]))] = child
        if child.chain is not None:
            k = at // self.P
            new.chain, child.chain = child.chain[:k], child.chain[k:]
        if legacy:
            self._record_store(new)
            self._record_store(child)
        return new

    def _match(self, key: list[int], ns: tuple) -> tuple[_Node, int]:
        P, node, i = self.P, self.root, 0
        t = self._touch()
        while i < len(key):
            child = node.children.get((ns, tuple(key[i:i + P])))
            if child is None:
                break
            child.access = t
            m = 0
            while m < len(child.key) and i + m + P <= len(key) and child.key[m:m + P] == key[i + m:i + m + P]:
                m += P
            if m < len(child.key):
                child = self._split(child, m)
                node, i = child, i + m
                break
            node, i = child, i + m
        return node, i

    def _insert(self, key: list[int], ns: tuple) -> None:
        node, i = self._match(key, ns)
        if i < len(key):
            new = _Node(key[i:], node, ns, self._touch())
            node.children[(ns, tuple(new.key[:self.P]))] = new
            self.tree_tokens += len(new.key)
            self._record_store(new)

    def _lock_path(self, node: _Node, d: int) -> None:
        while node is not self.root:
            node.lock += d
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        heap = [(n.access, n.id, n) for n in self._nodes() if not n.children and n.lock == 0]
        heapq.heapify(heap)
        done = 0
        while done < num_tokens and heap:
            _, _, x = heapq.heappop(heap)
            done += len(x.key)
            par = x.parent
            del par.children[(x.ns, tuple(x.key[:self.P]))]
            self.tree_tokens -= len(x.key)
            if not par.children and par.lock == 0:
                heapq.heappush(heap, (par.access, par.id, par))
            self._record_remove(x)
        return done

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    # ---- requests -------------------------------------------------------------------------------
    def serve(self, prompt: list[int], output: list[int] | None = None, cache_salt: str | None = None,
              lora_name: str | None = None) -> int:
        """Run one request; publish its steps' batches; return the tokens reused (SGLang's match)."""
        output = list(output or [])
        n, P = len(prompt), self.P
        if n == 0:
            raise ValueError("empty prompt")
        extra = None
        if lora_name is not None:
            extra = lora_id_of(lora_name)
            self.lora_names[extra] = lora_name
        ns = (extra, cache_salt)
        with self._lock:
            limit = (n - 1) // P * P
            node, m = self._match(list(prompt[:limit]), ns)
            self._lock_path(node, 1)
            kv_len = n + max(len(output) - 1, 0)
            need = kv_len - m
            free = self.capacity - self.tree_tokens
            if need > free:
                self.evict(need - free)
                if need > self.capacity - self.tree_tokens:
                    self._lock_path(node, -1)
                    raise RuntimeError(f"request needs {need} tokens, cache holds {self.capacity}")
            self._insert(list(prompt[:n // P * P]), ns)  # after prefill
            self.flush()
            full = (list(prompt) + output)[:kv_len]
            self._insert(full[:kv_len // P * P], ns)  # when the request finishes
            self.flush()
            self._lock_path(node, -1)
            self.requests += 1
            self.prompt_tokens += n
            self.cached_tokens += m
            return m

    def reset(self) -> None:
        with self._lock:
            self.root.children.clear()
            self.tree_tokens = 0
            self._queue.append({"type": "AllBlocksCleared"})
            self.flush()

    def _match_key(self, prompt: list[int], cap: bool = True) -> list:
        """The radix key a prompt is matched with: its tokens below the last one, whole pages."""
        n = len(prompt) - 1 if cap else len(prompt)
        return list(prompt[:n // self.P * self.P])

    def cached_tokens_of(self, prompt: list[int], cache_salt: str | None = None,
                         lora_name: str | None = None, cap: bool = True) -> int:
        """What the engine would reuse for `prompt` now (no side effect on the published state); with
        `cap=False` the whole cached prefix, the last prompt token included."""
        ns = (lora_id_of(lora_name) if lora_name else None, cache_salt)
        P, node, i, key = self.P, self.root, 0, self._match_key(prompt, cap)
        while i < len(key):
            child = node.children.get((ns, tuple(key[i:i + P])))
            if child is None:
                break
            m = 0
            while m < len(child.key) and i + m + P <= len(key) and child.key[m:m + P] == key[i + m:i + m + P]:
                m += P
            i += m
            if m < len(child.key):
                break
            node = child
        return i

    # ---- ZMQ ------------------------------------------------------------------------------------
    def _replay_loop(self, router) -> None:
        import zmq
        try:
            while not self._stop.is_set():
                if not router.poll(100):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3:
                    continue
                ident, _, start = frames
                start_seq = int.from_bytes(start, "big")
                with self._lock:
                    items = [(s, p) for s, p in self._buffer if s >= start_seq]
                for s, p in items:
                    if self.encoding == "map":  # 0.5.22+: the topic frame too
                        router.send_multipart([ident, b"", self.topic, s.to_bytes(8, "big"), p])
                    else:
                        router.send_multipart([ident, b"", s.to_bytes(8, "big"), p])
                if self.encoding == "map":
                    router.send_multipart([ident, b"", b"", END_SEQ, b""])
                else:
                    router.send_multipart([ident, b"", END_SEQ, b""])
        except zmq.ZMQError:
            if not self._stop.is_set():
                raise
        finally:
            router.close(0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._pub is not None:
            self._pub.close()
            self._ctx.term()
            self._pub = None

    def __enter__(self) -> SimSglangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def record(engine: SimSglangEngine, requests: list[tuple[list[int], list[int]]], endpoint: str = "tcp://sim:5557"
           ) -> tuple[list, list[dict]]:
    """Serve requests one at a time on an engine built with a stepping `clock` and no endpoint: (its
    frames as a recording would hold them, the request log with each request's reuse)."""
    from kvidx.engines.contract import Frame

    log = []
    for i, (prompt, output) in enumerate(requests):
        ts = engine.clock()
        log.append({"i": i, "t_send": ts + 5e-7, "prompt_token_ids": prompt,
                    "cached_tokens": engine.serve(prompt, output)})
    frames = [Frame(engine.topic, s, p, int(ts * 1e9), endpoint, "pub") for s, ts, p in engine.published]
    return frames, log


def stepping_clock(start: float = 1000.0, step: float = 0.001) -> Callable[[], float]:
    """A clock for recordings: each reading `step` seconds after the last."""
    t = [start]

    def clock() -> float:
        t[0] += step
        return t[0]

    return clock
