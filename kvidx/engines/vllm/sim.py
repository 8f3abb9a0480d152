"""A simulated vLLM 0.32 engine replica that publishes real vLLM-format KV-cache events over ZMQ.

What it reproduces (vllm/v1/core/block_pool.py, vllm/distributed/kv_events.py, 0.32.0):

* Block pool: physical blocks, a free queue in eviction order (LRU: freed blocks go to the tail,
  new blocks are taken from the head), a map hash -> physical copies. No de-duplication: a block
  recomputed while an identical one is cached (the last prompt block is never served from cache)
  is a second copy, stored again and later removed once per copy, as vLLM does.
* Block hashes as vLLM's ``sha256`` algorithm: ``h_i = sha256(pickle.dumps((parent, tuple(tokens),
  None), protocol=5))`` over the full 32-byte parent digest, the first parent being
  ``NONE_HASH = sha256(pickle.dumps(hash_seed, protocol=5))``. On the wire:
  ``int.from_bytes(digest, "big") & (2**64 - 1)``.
* A request hits the longest run of cached full blocks, capped at ``(n - 1) // B`` blocks (the last
  prompt token is never served from cache). It stores the full blocks of prompt + output minus the
  last output token (whose KV is never computed), frees its blocks tail first, and they stay cached
  until evicted one by one (one BlockRemoved per evicted block).
* Wire: 3 frames ``[topic, seq (8-byte BE, from 0), msgpack [ts, [events], dp_rank]]``; events are
  maps tagged by "type" with the keys vLLM 0.32 writes; a ROUTER replay endpoint answers
  ``[identity, b"", start_seq]`` with ``[identity, b"", topic, seq, payload]`` per buffered message
  and the end marker ``[identity, b"", b"", seq=-1, b""]``.

Simplifications: a request runs synchronously in one "step" (all its events go out as one batch:
evictions first, then one BlockStored for the request's new chain); ``num_blocks`` are all usable
(no null block); one KV-cache group (full attention); no LoRA, salt or multimodal extra keys.
"""

from __future__ import annotations

import hashlib
import pickle
import threading
import time
from collections import OrderedDict, deque
from typing import Any

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_U64 = (1 << 64) - 1


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()


def none_hash(hash_seed: str = "vllm-none-hash") -> bytes:
    """vLLM's NONE_HASH for the sha256 algorithms: the parent digest of a chain's first block."""
    return _sha256(hash_seed)


def chain_digests(tokens: list[int], block_size: int, root: bytes) -> list[bytes]:
    """Full 32-byte digests of each full block of `tokens`, chained from `root` (as vLLM sha256)."""
    out: list[bytes] = []
    parent = root
    for i in range(len(tokens) // block_size):
        parent = _sha256((parent, tuple(tokens[i * block_size:(i + 1) * block_size]), None))
        out.append(parent)
    return out


def external_hash(digest: bytes) -> int:
    """A digest as vLLM publishes it by default: its last 8 bytes as an unsigned 64-bit int."""
    return int.from_bytes(digest, "big") & _U64


class _Block:
    __slots__ = ("block_id", "digest", "ref")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.digest: bytes | None = None
        self.ref = 0


class SimVllmEngine:
    """One simulated vLLM replica (one DP rank) with prefix caching and a KV-event publisher.

    ``endpoint`` may use port ``*`` when binding (e.g. ``tcp://127.0.0.1:*``); the bound address is
    then in ``self.endpoint`` (same for ``replay_endpoint``, which is always bound).
    With ``bind=False`` the PUB connects (as vLLM does for a non-wildcard tcp endpoint) to a SUB that
    binds; such a SUB attaches the engine (and sends it its subscription) only when its owner polls
    or receives on it, so poll the SUB for a moment before the first request (slow joiner).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        endpoint: str = "tcp://127.0.0.1:5557",
        replay_endpoint: str | None = None,
        topic: bytes = b"kv",
        dp_rank: int = 0,
        bind: bool = True,
        hash_seed: str = "vllm-none-hash",
        buffer_steps: int = 10000,
        hwm: int = 100_000,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.topic = topic
        self.dp_rank = dp_rank
        self.hash_seed = hash_seed
        self._root = none_hash(hash_seed)

        # block pool
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, dict[int, None]] = {}

        # stats
        self.requests = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.stored_blocks = 0
        self.removed_blocks = 0
        self.batches = 0
        self.dropped = 0

        # publisher
        self._lock = threading.RLock()
        self._enc = msgspec.msgpack.Encoder()
        self._seq = 0
        self._drop = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._pending: list[dict[str, Any]] = []  # events queued for the next batch (deferred reset)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 500)
        if bind:
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._pub.connect(endpoint)
            self.endpoint = endpoint
        self.replay_endpoint: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        if replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(replay_endpoint)
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._replay_loop, args=(router,),
                                            name=f"sim-vllm-replay-{dp_rank}", daemon=True)
            self._thread.start()

    # ---- hashes ---------------------------------------------------------------------------------
    def engine_hashes(self, tokens: list[int]) -> list[int]:
        """The wire (64-bit) hashes this engine gives the full blocks of `tokens`."""
        return [external_hash(d) for d in chain_digests(tokens, self.block_size, self._root)]

    def cached_hashes(self) -> set[int]:
        """Wire hashes of the blocks currently cached (in use or evictable)."""
        with self._lock:
            return {external_hash(d) for d in self._cached}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def stats(self) -> dict[str, int]:
        return {"requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "stored_blocks": self.stored_blocks,
                "removed_blocks": self.removed_blocks, "cached_blocks_now": self.num_cached_blocks,
                "batches": self.batches, "dropped": self.dropped, "next_seq": self._seq}

    @property
    def num_cached_blocks(self) -> int:
        """Physical blocks currently holding a cached hash (copies counted)."""
        with self._lock:
            return sum(len(v) for v in self._cached.values())

    # ---- requests -------------------------------------------------------------------------------
    def serve(self, prompt_token_ids: list[int], output_token_ids: list[int] | None = None) -> int:
        """Run one request to completion; publish its events as one batch; return cached tokens."""
        prompt = list(prompt_token_ids)
        output = list(output_token_ids or [])
        n = len(prompt)
        if n == 0:
            raise ValueError("empty prompt")
        B = self.block_size
        # KV exists for the prompt and every output token but the last (never fed back).
        kv_len = n + max(len(output) - 1, 0)
        tokens = (prompt + output)[:kv_len]
        with self._lock:
            digests = chain_digests(tokens, B, self._root)
            hits: list[_Block] = []
            for d in digests[:(n - 1) // B]:
                copies = self._cached.get(d)
                if not copies:
                    break
                hits.append(self._blocks[next(iter(copies))])
            total = -(-kv_len // B)
            need = total - len(hits)
            free_after_touch = len(self._free) - sum(1 for b in hits if b.ref == 0)
            if need > free_after_touch:
                raise RuntimeError(f"request needs {total} blocks, only {free_after_touch + len(hits)} "
                                   f"available (num_blocks={self.num_blocks})")
            events: list[dict[str, Any]] = self._pending
            self._pending = []
            # touch the hits: they leave the free queue
            for b in hits:
                if b.ref == 0:
                    del self._free[b.block_id]
                b.ref += 1
            # allocate new blocks from the head of the free queue, evicting cached ones
            blocks = list(hits)
            for _ in range(need):
                bid, _ = self._free.popitem(last=False)
                b = self._blocks[bid]
                if b.digest is not None:
                    self._evict(b, events)
                b.ref = 1
                blocks.append(b)
            # cache the new full blocks: one BlockStored for the chain
            num_cached, num_full = len(hits), kv_len // B
            if num_full > num_cached:
                new = []
                for i in range(num_cached, num_full):
                    b = blocks[i]
                    b.digest = digests[i]
                    self._cached.setdefault(b.digest, {})[b.block_id] = None
                    new.append(external_hash(b.digest))
                parent = external_hash(digests[num_cached - 1]) if num_cached else None
                events.append(self._block_stored(new, parent, tokens[num_cached * B:num_full * B]))
                self.stored_blocks += len(new)
            # finish: free tail first, so the tail is evicted before the head
            for b in reversed(blocks):
                b.ref -= 1
                if b.ref == 0:
                    self._free[b.block_id] = None
            cached = len(hits) * B
            self.requests += 1
            self.prompt_tokens += n
            self.cached_tokens += cached
            if events:
                self._publish_events(events)
            return cached

    def advise(self, digests: list[bytes], drop: bool = False) -> int:
        """Eviction advice followed: those of these cached blocks no request holds move to the head of
        the free queue (evicted next). `drop`: the same (lower tiers, where an engine has them, too).
        Returns how many blocks moved."""
        moved = 0
        with self._lock:
            for d in digests:
                for bid in self._cached.get(d, ()):
                    if bid in self._free:
                        self._free.move_to_end(bid, last=False)
                        moved += 1
        return moved

    def reset(self, defer: bool = False) -> None:
        """Empty the prefix cache and publish AllBlocksCleared.

        With ``defer=True`` the event goes out with the next request's batch, as a real vLLM engine
        does (it publishes a reset only with its next step).
        """
        with self._lock:
            for b in self._blocks:
                b.digest = None
            self._cached.clear()
            ev = {"type": "AllBlocksCleared"}
            if defer:
                self._pending.append(ev)
            else:
                self._publish_events(self._pending + [ev])
                self._pending = []

    def _evict(self, b: _Block, events: list[dict[str, Any]]) -> None:
        assert b.digest is not None
        copies = self._cached.get(b.digest)
        if copies is not None and b.block_id in copies:
            del copies[b.block_id]
            if not copies:
                del self._cached[b.digest]
            events.append({"type": "BlockRemoved", "block_hashes": [external_hash(b.digest)],
                           "medium": "GPU", "group_idx": 0})
            self.removed_blocks += 1
        b.digest = None

    def _block_stored(self, hashes: list[int], parent: int | None, token_ids: list[int]) -> dict[str, Any]:
        # keys and order as vLLM 0.32 writes them (fields at their default are omitted)
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                "token_ids": token_ids, "block_size": self.block_size, "lora_id": None,
                "medium": "GPU", "lora_name": None, "extra_keys": [None] * len(hashes),
                "group_idx": 0, "kv_cache_spec_kind": "full_attention"}

    # ---- publishing -----------------------------------------------------------------------------
    def _publish_events(self, events: list[dict[str, Any]]) -> None:
        self._publish(self._enc.encode([time.time(), events, self.dp_rank]))
        self.batches += 1

    def _publish(self, payload: bytes) -> int:
        with self._lock:
            if self._closed:
                raise RuntimeError("engine closed")
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
            if self._drop > 0:
                self._drop -= 1
                self.dropped += 1
            else:
                self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
            return seq

    def drop_next(self, n: int = 1) -> None:
        """Test hook: do not send the next `n` messages on PUB (they keep their seq and stay
        replayable), so a subscriber sees a seq gap."""
        with self._lock:
            self._drop += n

    def send_garbage(self, payload: bytes) -> int:
        """Test hook: publish a malformed payload with the next seq; returns that seq."""
        return self._publish(payload)

    @property
    def next_seq(self) -> int:
        return self._seq

    def _replay_loop(self, router: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not router.poll(100):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3:
                    continue  # vLLM logs and ignores malformed requests
                ident, _, start = frames
                start_seq = int.from_bytes(start, "big")
                with self._lock:
                    items = [(s, p) for s, p in self._buffer if s >= start_seq]
                for s, p in items:
                    router.send_multipart([ident, b"", self.topic, s.to_bytes(8, "big"), p])
                router.send_multipart([ident, b"", b"", END_SEQ, b""])
        except zmq.ZMQError:
            if not self._stop.is_set():
                raise
        finally:
            router.close(0)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pub.close()
        self._ctx.term()

    def __enter__(self) -> SimVllmEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
