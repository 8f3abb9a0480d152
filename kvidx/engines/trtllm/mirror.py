"""The relay's mirror of one TensorRT-LLM KV cache (one attention-DP rank of one replica).

TensorRT-LLM keeps its reusable blocks in a radix tree (cpp/tensorrt_llm/batch_manager/
kvCacheManager.cpp, WindowBlockManager; checked on main as of 2026 and the 1.x series). Its rules,
and what the mirror does with them:

- **Stores** (`storeBlocks`): a chain of blocks newly inserted under a parent that is in the tree
  (`parent_hash` null: the root). Each stored block lists its tokens, so the mirror re-hashes them
  canonically from its parent's canonical hash. The parent of a stored chain is always live in the
  tree, so a parent the mirror does not know means lost events: the chain is counted as orphaned.
- **Partial blocks**: a sequence's last block is stored even when it holds fewer than
  tokens_per_block tokens (`releaseBlocks`/`storeBlocksForReuse`: `chopVectorIntoBlocks(...,
  allowPartial=true)` over length - 1 tokens). Its full index blocks (floor(t / index block size))
  are indexed like any other.
- **Partial reuse** (`loadOrAllocateBlocks` + `KVCacheBlock::findMatchingBlock` +
  `BlockKey::partialMatch`, enable_partial_reuse / copy_on_partial_reuse on by default): the engine
  matches whole blocks, then the longest token prefix of any child of the last matched block, and
  never the last prompt token (keys cover length - 1 tokens). Canonical hashes are prefix chains, so
  an index walk at the index block size finds the same tokens; the mirror marks its stored events
  with `block_size = 1` ("token-granular resume"), and the shard then credits the hit at any token
  below the last prompt token (kvidx/core/walk.py). The tokens past the last full index block are
  credited by partial-block keys (kvidx.engines.common.PartialTails: every index block and partial
  tail is an end of its parent's trie), so the credit is token-exact at any index block size but where
  a prompt leaves a full index block that nothing else shares (the block boundary before: the safe side).
- **Private take-over of a partially matched leaf**: a partially matched child that is an unused
  leaf is detached from the tree and reused by the new request *without any event* (the
  `freeLeafBlock` branch of `loadOrAllocateBlocks`): its old hash is stale. Events show it only
  indirectly: the request later stores its own block under the same parent. So when a stored block
  is placed under a parent, the mirror computes, as the engine does, the sibling with the longest
  common token prefix (ties: all of them); if that sibling is a leaf in the mirror's view, it is
  retracted (counted in `stats["taken_over"]`). Where the engine copied instead (the sibling was in
  use by a running request, or was stored after the request arrived) this under-credits, which is
  the safe side; between the take-over and the store (the request's run) the stale block still
  counts. The mirror keeps each live block's tokens (4 bytes per token, relay memory only; never
  published) to compute those prefixes.
- **Eviction frees the whole subtree** (`getFreeBlock` -> `freeChildren`: one `removed` per tree
  block, descendants first, merged into one event): a removed block takes its mirror subtree with it
  even if some descendants were not listed.
- **Host tier** (`getFreeBlock`/`onboardBlock`): `updated` cache_level 0 -> 1 (offload, priority >=
  secondary_offload_min_priority, default 30, evictionPolicy.cpp) and 1 -> 0 (onboard on reuse) are
  moves: the canonical events store the block in the new tier *before* removing it from the old one,
  so the shard never sees it missing. Stored blocks may arrive at level 1 directly.
- **Window sizes**: only the largest attention window is indexed (as TensorRT-LLM's own ZMQ
  publisher does); other windows' events are counted and skipped by the relay.
- Unknown removals / updates are counted, never fatal. Hashes are unsigned 64-bit.
- Events are placed one by one (kvidx/engines/common.py, docs/engines.md): a store that cannot be
  placed (a parent never seen, a cache level that is neither GPU nor host, bad sizes) is set aside and
  not indexed; a removal or update of a block not held is set aside; an update to an unknown cache
  level drops the block (and its subtree); an undecodable event follows common.place_unreadable.

The mirror is pure: fed decoded events, returns schema events.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from kvidx.core.hashing import chain, namespace_seed, pack_tokens
from kvidx.engines.common import (
    UNKNOWN_HASH,
    UNKNOWN_MEDIUM,
    UNKNOWN_PARENT,
    MirrorError,
    PartialTails,
    SetAside,
)
from kvidx.engines.trtllm.wire import PRIMARY, SECONDARY, Created, Removed, Stored, Updated, check_hash
from schemas.events import BlocksRemoved, BlocksStored, Event, ReplicaCleared

TOKEN_GRANULAR = 1  # BlocksStored.block_size marking an engine that resumes inside any block


def tier_of(level: int | None) -> str:
    return "GPU" if (level or PRIMARY) == PRIMARY else "CPU"


class Node:
    __slots__ = ("parent", "children", "tier", "sub", "depth", "tokens", "seed", "plain")

    def __init__(self, parent: int | None, tier: str, sub: tuple[int, ...], depth: int, tokens: bytes,
                 seed: int, plain: bool = True):
        self.parent = parent  # engine hash of the parent block (None: the root)
        self.children: dict[int, None] = {}  # engine hashes, insertion-ordered
        self.tier = tier
        self.sub = sub  # canonical hashes of the block's full index blocks
        self.depth = depth  # index depth of sub[0]
        self.tokens = tokens  # packed token ids (relay memory only)
        self.seed = seed  # the canonical hash the block's chain starts from (its parent's end)
        self.plain = plain  # no extra ids: a router's prompt hashes can reach its partial keys


class TrtllmMirror:
    def __init__(self, index_block_size: int, block_size: int | None = None, partial_reuse: bool = True):
        self.index_block_size = index_block_size
        self.block_size = block_size or 0  # tokens_per_block (learned from full blocks if not given)
        self.partial_reuse = partial_reuse
        self.nodes: dict[int, Node] = {}
        self.roots: dict[int, None] = {}  # children of the tree root
        self.refs: dict[tuple[int, str], int] = {}  # (canonical hash, tier) -> live blocks covering it
        self.capacity: list[int] = []
        # with partial reuse the engine resumes at any token: partial-block keys of its tree
        self.tails = PartialTails(index_block_size, 1) if partial_reuse else None
        self.stats = {"stored": 0, "removed": 0, "cascaded": 0, "moved": 0, "restored_live": 0,
                      "remove_unknown": 0, "update_unknown": 0, "orphan_blocks": 0, "partial_blocks": 0,
                      "taken_over": 0, "priority_updates": 0, "extra_id_blocks": 0}
        self.set_aside: list[SetAside] = []  # the last call's events that could not be placed

    # ---- events -------------------------------------------------------------------------------
    def apply(self, events: Iterable[Created | Stored | Removed | Updated]) -> list[Event]:
        """Events that cannot be placed are listed in `self.set_aside` (by position in `events`); a
        MirrorError or ValueError is raised before the event changed anything and goes up."""
        out: list[Event] = []
        self.set_aside = []
        for i, data in enumerate(events):
            if isinstance(data, Stored):
                self._stored(data, out, i)
            elif isinstance(data, Removed):
                self._removed(data.block_hashes, out, i)
            elif isinstance(data, Updated):
                self._updated(data, out, i)
            elif isinstance(data, Created):
                self.capacity = list(data.num_blocks_per_cache_level)
        return out

    def drop_everywhere(self, engine_hashes: list[int], out: list[Event]) -> None:
        """Drop blocks (and their subtrees) whatever their tier: what an event the mirror cannot place
        could have removed or moved."""
        for eh in engine_hashes:
            if eh in self.nodes:
                self.stats["removed"] += 1
                self._drop(eh, out)

    def _stored(self, ev: Stored, out: list[Event], at: int = 0) -> None:
        ibs = self.index_block_size
        levels = {blk.cache_level for blk in ev.blocks} - {PRIMARY, SECONDARY, None}
        if levels:
            raise MirrorError(UNKNOWN_MEDIUM, f"stored at cache level {sorted(levels)[:3]}")
        parent = ev.parent_hash
        if parent is None:
            seed, depth = namespace_seed(ev.lora_name), 0
        else:
            pnode = self.nodes.get(check_hash(parent))
            if pnode is None:
                self.stats["orphan_blocks"] += len(ev.blocks)
                self.set_aside.append(SetAside(at, "stored", UNKNOWN_PARENT,
                                               f"{len(ev.blocks)} blocks under a parent never seen"))
                return
            seed, depth = pnode.sub[-1] if pnode.sub else pnode.seed, pnode.depth + len(pnode.sub)
        new: list[tuple[str, int, int, list[int], int]] = []  # (tier, depth, parent canon, hashes, engine)
        for blk in ev.blocks:
            eh = check_hash(blk.block_hash)
            n = len(blk.tokens)
            ids = [t.token_id for t in blk.tokens]
            packed = pack_tokens(ids)
            last = blk is ev.blocks[-1]
            if not last or n > self.block_size:
                # blocks before the last of a chain are full: that is the engine's tokens_per_block
                # (a lone last block can only raise a provisional guess; configure block_size)
                self.block_size = max(self.block_size, n)
            partial = n < self.block_size
            if n == self.block_size and n % ibs:
                raise MirrorError("block_size_mismatch",
                                  f"engine block size {n} is not a multiple of the index block size "
                                  f"{ibs}: set --index-block-size (or the model's index_block_size) "
                                  "to a divisor of it")
            extras = None
            if any(t.token_extra_id for t in blk.tokens) or blk.mm_keys:
                # prompt-tuning / multimodal ids: the block is not the plain tokens a router hashes
                self.stats["extra_id_blocks"] += 1
                extras = [["trtllm_extra", [t.token_extra_id for t in blk.tokens], blk.mm_keys or []]]
            sub = tuple(chain(packed, ibs, seed, extras))
            tier = "GPU" if blk.cache_level == PRIMARY else "CPU"
            siblings = self.nodes[parent].children if parent is not None else self.roots
            node = self.nodes.get(eh)
            if node is not None:  # re-stored while live (e.g. a private take-over re-keyed to the same key)
                self.stats["restored_live"] += 1
                if node.parent != parent:
                    self._unlink(eh, node)
                    node.parent = parent
                    siblings[eh] = None
            else:
                if self.partial_reuse and siblings:
                    self._retract_taken_over(siblings, packed, out)
                node = Node(parent, tier, sub, depth, packed, seed, extras is None)
                self.nodes[eh] = node
                self._ends(node, tier, True)
                siblings[eh] = None
                self.stats["stored"] += 1
                if partial:
                    self.stats["partial_blocks"] += 1
                fresh = self._ref(sub, tier)
                if fresh or (tier != "GPU" and self._host_queue()):
                    new.append((tier, depth, seed, fresh, eh))
            if partial:
                break  # a partial block is always the last of a stored chain
            parent = eh
            seed = sub[-1] if sub else seed
            depth += len(sub)
        self._emit_stored(new, out)
        if self.tails is not None:
            out.extend(self.tails.events())

    def _ends(self, node: Node, tier: str, add: bool) -> None:
        """The block's index blocks and its partial tail, as ends of the partial-key tries (add or
        drop them in `tier`)."""
        tails = self.tails
        if tails is None or not node.plain:
            return
        step = 4 * self.index_block_size
        seed, packed = node.seed, node.tokens
        op = tails.add if add else tails.drop
        for i in range(len(node.sub)):
            op(tier, seed, packed[i * step:(i + 1) * step], True)
            seed = node.sub[i]
        rest = packed[len(node.sub) * step:]
        if rest:
            op(tier, seed, rest, False)

    def _ref(self, sub: tuple[int, ...], tier: str) -> list[tuple[int, int]]:
        """Count a block's index blocks in `tier`; returns [(position, hash)] of those newly cached."""
        refs = self.refs
        fresh = []
        for i, c in enumerate(sub):
            k = (c, tier)
            r = refs.get(k, 0)
            refs[k] = r + 1
            if not r:
                fresh.append((i, c))
        return fresh

    def _unref(self, sub: tuple[int, ...], tier: str) -> list[int]:
        refs = self.refs
        gone = []
        for c in sub:
            k = (c, tier)
            r = refs.get(k, 0) - 1
            if r > 0:
                refs[k] = r
            else:
                refs.pop(k, None)
                gone.append(c)
        return gone

    def _host_queue(self) -> bool:
        """The engine has a host tier: every engine block that enters or leaves it is published, with
        its engine hash, even when none of its index blocks is new or gone (kvidx.core.foresight
        HostLoads keeps the host's queue)."""
        return len(self.capacity) > 1 and self.capacity[1] > 0

    def _emit_stored(self, new: list, out: list[Event]) -> None:
        unit = TOKEN_GRANULAR if self.partial_reuse else 0
        for tier, depth, seed, fresh, eh in new:
            if not fresh:  # an engine block with no index block of its own to store (_host_queue)
                out.append(BlocksStored(tier, 0, [], None, depth, [eh], "full_attention", None, unit))
                continue
            # contiguous runs of newly cached index blocks of this engine block
            start = 0
            for i in range(1, len(fresh) + 1):
                if i == len(fresh) or fresh[i][0] != fresh[i - 1][0] + 1:
                    p0 = fresh[start][0]
                    node = self.nodes[eh]
                    parent = node.sub[p0 - 1] if p0 else (None if depth == 0 else seed)
                    out.append(BlocksStored(tier, 0, [h for _, h in fresh[start:i]], parent, depth + p0,
                                            [eh] if start == 0 else [], "full_attention", None, unit))
                    start = i

    def _retract_taken_over(self, siblings: dict[int, None], packed: bytes, out: list[Event]) -> None:
        """The engine's partial match at this parent (BlockKey::partialMatch: the longest common token
        prefix, over every child with copy_on_partial_reuse): if the best candidate is a leaf, the
        engine took it over privately, without a `removed` event."""
        best, cands = 0, []
        for sh in siblings:
            s = self.nodes[sh]
            m = len(os.path.commonprefix([s.tokens, packed])) // 4
            if m > best:
                best, cands = m, [sh]
            elif m == best and m:
                cands.append(sh)
        for sh in cands:
            s = self.nodes[sh]
            if not s.children and s.tokens != packed:
                self.stats["taken_over"] += 1
                self._drop(sh, out)

    def _removed(self, hashes: list[int], out: list[Event], at: int = 0) -> None:
        for h in hashes:
            check_hash(h)
        unknown = 0
        for eh in hashes:
            if eh not in self.nodes:
                self.stats["remove_unknown"] += 1
                unknown += 1
                if self._host_queue():  # it may hold a host slot all the same (a wrong take-over guess)
                    out.append(BlocksRemoved("CPU", 0, [], [eh]))
                continue
            self.stats["removed"] += 1
            self._drop(eh, out)
        if unknown:
            self.set_aside.append(SetAside(at, "removed", UNKNOWN_HASH, f"{unknown} of {len(hashes)} blocks "
                                                                        "not held"))

    def _drop(self, eh: int, out: list[Event]) -> None:
        """Retract a block and its whole mirror subtree (TensorRT-LLM frees subtrees)."""
        node = self.nodes.get(eh)
        if node is None:
            return
        self._unlink(eh, node)
        gone: dict[str, tuple[list[int], list[int]]] = {}
        stack = [eh]
        order = []
        while stack:
            h = stack.pop()
            order.append(h)
            stack.extend(self.nodes[h].children)
        for h in reversed(order):  # descendants first, as the engine lists them
            n = self.nodes.pop(h)
            if h != eh:
                self.stats["cascaded"] += 1
            g = gone.setdefault(n.tier, ([], []))
            g[0].extend(self._unref(n.sub, n.tier))
            g[1].append(h)
            self._ends(n, n.tier, False)
        for tier, (hashes, engine) in gone.items():
            if hashes or (tier != "GPU" and self._host_queue()):
                out.append(BlocksRemoved(tier, 0, hashes, engine))
        if self.tails is not None:
            out.extend(self.tails.events())

    def _unlink(self, eh: int, node: Node) -> None:
        if node.parent is None:
            self.roots.pop(eh, None)
        else:
            p = self.nodes.get(node.parent)
            if p is not None:
                p.children.pop(eh, None)

    def _updated(self, ev: Updated, out: list[Event], at: int = 0) -> None:
        if ev.priority is not None and ev.priority.new_value != ev.priority.old_value:
            self.stats["priority_updates"] += 1
        lvl = ev.cache_level
        if lvl is None or lvl.new_value is None:
            return
        eh = check_hash(ev.block_hash)
        if lvl.new_value not in (PRIMARY, SECONDARY):  # a tier this mirror does not know
            self.drop_everywhere([eh], out)
            self.set_aside.append(SetAside(at, "updated", UNKNOWN_MEDIUM, f"moved to cache level "
                                           f"{lvl.new_value}", "dropped_everywhere"))
            return
        node = self.nodes.get(eh)
        if node is None:
            self.stats["update_unknown"] += 1
            self.set_aside.append(SetAside(at, "updated", UNKNOWN_HASH, "a block not held moved"))
            if self._host_queue() and lvl.old_value is not None and lvl.old_value != lvl.new_value:
                # a block the mirror lost (a wrong take-over guess) still moves through the host queue
                out.append(BlocksStored(tier_of(lvl.new_value), 0, [], None, 0, [eh]))
                out.append(BlocksRemoved(tier_of(lvl.old_value), 0, [], [eh]))
            return
        new_tier = tier_of(lvl.new_value)
        if new_tier == node.tier:
            return
        self.stats["moved"] += 1
        old = node.tier
        node.tier = new_tier
        fresh = self._ref(node.sub, new_tier)
        host = self._host_queue()
        self._emit_stored([(new_tier, node.depth, node.seed, fresh, eh)] if fresh or host else [], out)
        gone = self._unref(node.sub, old)  # after the store: a move never shows as a loss
        if gone or host:
            out.append(BlocksRemoved(old, 0, gone, [eh]))
        if self.tails is not None:
            self._ends(node, new_tier, True)
            self._ends(node, old, False)
            out.extend(self.tails.events())  # a batch is folded whole: no lookup sees it halfway

    def clear(self) -> None:
        self.nodes.clear()
        self.roots.clear()
        self.refs.clear()
        if self.tails is not None:
            self.tails.clear()

    def cleared(self, reason: str) -> list[Event]:
        self.clear()
        return [ReplicaCleared(reason)]

    def live_blocks(self) -> int:
        return len(self.nodes)
