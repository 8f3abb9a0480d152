"""The relay's mirror of one Mooncake Store pool (one master's stream): RFC #1527 events in, canonical
index events out. The pool is shared: its relay publishes as the pool's name ([pools.NAME] in
kvidx/config.py) and the shard credits its blocks to the replicas attached to it (ModelShard.set_pools);
`backend_id` is the cache owner, never a routing target.

Rules (sources in kvidx/engines/mooncake/wire.py; Mooncake tag v0.3.12 unless noted):
- One object is one engine block (docs/source/design/conductor/indexer-api-design.md, "each key is
  treated as one pooled block"), named by its u64 seq hash (from the key: wire.key_hash).
- Canonical keys need tokens, and the master sends none (kv_event_publisher.cpp l. 324-336:
  token_ids, parent_hash nil; base_block_idx 0 because "master keys are standalone pool blocks").
  So a stored event is placed in one of two ways:
  * with token_ids (RFC #1527 publishers that send them): hashed like every engine's blocks
    (kvidx.core.hashing), chained from `parent_hash` through the memo or from the root when it is nil
    and base_block_idx is 0 or nil; `lora_name` seeds the chain and `additional_salt` is an extra key
    of its first index block (vLLM's LoRA and cache-salt rule, prompt_hashes(lora, cache_salt)).
    A parent never seen, or base_block_idx > 0 without a parent, cannot be placed (`orphan_blocks`);
  * without tokens (every master event): the seq hash is looked up in an engine-hash memo (u64 ->
    canonical index blocks, depth), as vLLM's tokenless CPU placeholders are (vllm/mirror.py). The
    memo learns from the stream's own token-carrying stores and from the attached engines' streams
    (the relay's key feed: relay.py), since the object keys are the hashes those engines publish.
    A key not (yet) in the memo is parked, not guessed and not a dead letter (a dead letter would drop
    the batch's other events); it is placed at the first master batch after its key is learned
    (`placed_late`), or dropped when the parking lot is full (`park_dropped`). Keys that name no u64
    (e.g. SGLang HiCache's) are counted (`unparsed_key`).
- Tiers from `medium`: the master's "cpu" is the pool's host memory, shared across nodes: "POOL" (a
  replica's own "CPU" tier would price it as local); "disk" -> "DISK" (kvidx has no pool-disk tier).
  The cost of that choice: schemas.events.TIERS ranks DISK before POOL, so a block in both reads as
  DISK and is priced at DISK's load rate (a replica's own disk), faster than the pool's memory; a
  deployment whose pool disk is slower maps it to POOL (`tiers={"disk": "POOL"}`): presence, hence
  credit, is the same either way. `rfc1527-v1` reads media as an engine's own (gpu/cpu/disk ->
  GPU/CPU/DISK). A block in two tiers is credited while either holds it (the shard's rule: retract
  only when the last tier drops it).
- Removals: the v0.3.12 master publishes `removed` only once an object has no replica left
  (master_service.cpp PublishKvRemovedAfterEvict l. 9123-9137, which ignores its `medium` argument;
  Remove l. 4518 erases the object), and its `medium` is then MediumForMetadata of the empty object
  ("cpu", l. 9079-9089) even when the last copy was on disk. So under 0.3.12 a removal drops the object
  from every tier; a memory eviction that leaves a disk copy is not published (the block stays
  credited in POOL: the tier is optimistic, the presence is right). Under rfc1527-v1 a removal drops
  the named medium only. `cleared` (newer publishers; never sent by 0.3.12) drops the objects of its
  backend_id (all when it names none).
- Several backend_ids in one stream are segments of one pool: every attached replica reads every
  segment (Mooncake's pool is one address space), so they are one pool replica; an object is tracked
  per (seq hash, object key, backend) so that one segment's removal does not retract another's copy.
  Two objects naming one hash (TP ranks' parts: `tp_rank:N` keys) keep the block while either lives.
- Namespaces: one relay indexes one tenant (`tenant_id`, default "default") and one model: Mooncake
  scopes object keys by tenant (tenant_id.h MakeScopedKey), so another tenant's objects are not
  readable by this pool's replicas; they are counted (`other_tenant`), as are events naming another
  model (`other_model`; the master sends model_name nil: registration supplies it). Run one relay per
  tenant, each publishing as its own pool. group_id is Mooncake's object group, not a KV-cache group:
  everything is group 0 (full attention).
- Events are placed one by one (kvidx/engines/common.py, docs/engines.md): a store that cannot be
  placed (a parent never seen, a medium outside the version's tiers, bad sizes) is set aside and
  not indexed; a removal of an object not held (nor parked) is set aside; a removal on an unknown
  medium drops its objects from every tier; an undecodable event follows common.place_unreadable.
  Parked objects (placed once their key is learned) and unparsed keys (another engine's objects)
  are counted, not set aside.
The mirror is pure: no I/O, no clocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvidx.core.hashing import chain, namespace_seed, pack_tokens
from kvidx.engines.common import (
    UNKNOWN_HASH,
    UNKNOWN_MEDIUM,
    UNKNOWN_PARENT,
    MirrorError,
    SetAside,
    Unreadable,
    engine_cache_reset,
    hold,
    normalize_tier,
    place_unreadable,
    release,
    stored_runs,
)
from kvidx.engines.mooncake.wire import Cleared, Removed, Stored
from schemas.events import TIERS, BlocksRemoved, BlocksStored, Event

GROUP = 0


class MooncakeMirror:
    def __init__(self, index_block_size: int, removal: str = "object", tiers: dict[str, str] | None = None,
                 tenant_id: str = "default", models: Iterable[str] = (), engine_block_size: int | None = None,
                 memo_limit: int = 1 << 21, park_limit: int = 1 << 16):
        """`removal`: "object" (a removal drops every tier) or "medium"; `tiers`: lower-case medium ->
        index tier ("" for none); `models`: the model names this relay indexes (empty: any);
        `engine_block_size`: tokens per block for token-carrying events that do not say."""
        self.index_block_size = index_block_size
        self.removal = removal
        self.tiers = {k.lower(): v for k, v in (tiers or {"": "POOL", "cpu": "POOL", "disk": "DISK"}).items()}
        bad = [t for t in self.tiers.values() if t not in TIERS]
        if bad:
            raise ValueError(f"unknown index tier(s) {bad} (tiers: {', '.join(TIERS)})")
        self.tenant_id = tenant_id or "default"
        self.models = frozenset(models)
        self.engine_block_size = engine_block_size
        self.memo_limit = memo_limit
        self.park_limit = park_limit
        # seq hash -> (canonical hashes of its index blocks, depth of the first), LRU order
        self.memo: dict[int, tuple[tuple[int, ...], int]] = {}
        # (seq hash, tier, group, backend, object key) -> [1, canonical hashes]: the shape
        # SequencedRelay.resync reads (key[0] hash, key[1] tier, key[2] group; entry[1] hashes)
        self.live: dict[tuple[int, str, int, str, str], list] = {}
        self.objects: dict[tuple[int, str, str], set[str]] = {}  # (hash, backend, key) -> its tiers
        self.refs: dict[tuple[int, str, int], int] = {}  # (canonical hash, tier, group) -> live objects
        # (hash, tier, backend, object key) of stored objects whose hash is not in the memo yet, oldest first
        self.parked: OrderedDict[tuple[int, str, str, str], None] = OrderedDict()
        self._parked_by_hash: dict[int, list[tuple[int, str, str, str]]] = {}
        self._learned: set[int] = set()  # parked hashes learned since the last batch
        self.set_aside: list[SetAside] = []  # the last batch's events that could not be placed
        self.group_kinds: dict[int, tuple[str, int | None]] = {GROUP: ("full_attention", None)}
        self.block_size = engine_block_size or 0
        self.stats = {"stored": 0, "refreshed": 0, "removed": 0, "remove_unknown": 0, "unparsed_key": 0,
                      "parked": 0, "placed_late": 0, "park_dropped": 0, "orphan_blocks": 0,
                      "other_tenant": 0, "other_model": 0, "cleared": 0, "keys_learned": 0}

    # ---- the memo ---------------------------------------------------------------------------------
    def learn(self, h: int, sub: tuple[int, ...], depth: int) -> None:
        """Remember what a seq hash names (from this stream's tokens or an attached engine's relay)."""
        memo = self.memo
        if memo.pop(h, None) is None:
            self.stats["keys_learned"] += 1
            if len(memo) >= self.memo_limit:  # forget the least recently learned eighth
                for old in list(memo)[: max(1, self.memo_limit // 8)]:
                    del memo[old]
        memo[h] = (sub, depth)
        if h in self._parked_by_hash:
            self._learned.add(h)

    # ---- events -----------------------------------------------------------------------------------
    def apply(self, events: Iterable[Stored | Removed | Cleared | Unreadable], now: float | None = None
              ) -> list[Event]:
        """`now` (the batch's time) is accepted for the relay's interface and not used. Events that
        cannot be placed are listed in `self.set_aside` (by position)."""
        out: list[Event] = []
        self.set_aside = []
        for i, ev in enumerate(events):
            if isinstance(ev, Unreadable):
                self.set_aside.append(place_unreadable(self, ev, i, out))
                continue
            if not self._ours(ev):
                continue
            try:
                if isinstance(ev, Stored):
                    self._stored(ev, out, i)
                elif isinstance(ev, Removed):
                    self._removed(ev, out, i)
                else:
                    self._cleared(ev, out, i)
            except MirrorError as e:  # raised before the event changed the pool's state
                self.set_aside.append(SetAside(i, "stored", e.reason, str(e)))
        if self._learned:
            self._unpark(out)
        return out

    def _ours(self, ev: Stored | Removed | Cleared) -> bool:
        if ev.tenant_id != self.tenant_id:
            self.stats["other_tenant"] += 1
            return False
        if ev.model_name is not None and self.models and ev.model_name not in self.models:
            self.stats["other_model"] += 1
            return False
        return True

    def tier(self, medium: str | None) -> str:
        m = (medium or "").lower()
        t = self.tiers.get(m)
        return t if t is not None else normalize_tier(medium)

    def _known_medium(self, medium: str | None) -> bool:
        return (medium or "").lower() in self.tiers

    def _stored(self, ev: Stored, out: list[Event], at: int = 0) -> None:
        if not ev.hashes:
            self.stats["unparsed_key"] += 1
            return
        if not self._known_medium(ev.medium):
            raise MirrorError(UNKNOWN_MEDIUM, f"stored on medium {str(ev.medium)[:40]!r}")
        tier = self.tier(ev.medium)
        okey = ev.object_key or ""
        if ev.token_ids:
            self._stored_tokens(ev, tier, okey, out, at)
            return
        for h in ev.hashes:
            known = self.memo.get(h)
            if known is None:
                self._park((h, tier, ev.backend_id, okey))
            else:
                self._place(h, tier, ev.backend_id, okey, known, out)

    def _stored_tokens(self, ev: Stored, tier: str, okey: str, out: list[Event], at: int = 0) -> None:
        ibs, ebs = self.index_block_size, ev.block_size or self.engine_block_size
        if not ebs:
            raise MirrorError("no_block_size", "a stored event with token_ids but no block_size (configure "
                                               "the engine block size)")
        if ebs % ibs:
            raise MirrorError("block_size_mismatch",
                              f"engine block size {ebs} is not a multiple of the index block size {ibs}: "
                              "set --index-block-size (or the model's index_block_size) to a divisor of it")
        nb = len(ev.hashes)
        if len(ev.token_ids) != nb * ebs:
            raise MirrorError("short_token_ids", f"{len(ev.token_ids)} token ids for {nb} blocks of {ebs}")
        if ev.parent_hash is None:
            if ev.base_block_idx:  # a chain's middle whose parent is not named: cannot be placed
                self.stats["orphan_blocks"] += nb
                self.set_aside.append(SetAside(at, "stored", UNKNOWN_PARENT,
                                               "base_block_idx without a parent"))
                return
            parent, depth0 = namespace_seed(ev.lora_name), 0
            extras: list[object] | None = [[ev.additional_salt]] if ev.additional_salt else None
        else:
            known = self.memo.get(ev.parent_hash)
            if known is None:
                self.stats["orphan_blocks"] += nb
                self.set_aside.append(SetAside(at, "stored", UNKNOWN_PARENT, f"{nb} blocks under a parent "
                                                                             "never seen"))
                return
            parent, depth0, extras = known[0][-1], known[1] + len(known[0]), None
        self.block_size = max(self.block_size, ebs)
        k = ebs // ibs
        canon = chain(pack_tokens(ev.token_ids), ibs, parent, extras)
        new_pos: list[int] = []
        engine_new: list[int] = []
        for j, h in enumerate(ev.hashes):
            sub = tuple(canon[j * k:(j + 1) * k])
            self.learn(h, sub, depth0 + j * k)
            if self._track(h, tier, ev.backend_id, okey, sub, j * k, new_pos):
                engine_new.append(h)
        for hashes, run_parent, depth, engine in stored_runs(canon, new_pos, parent, depth0, engine_new):
            out.append(BlocksStored(tier, GROUP, hashes, run_parent, depth, engine))

    def _track(self, h: int, tier: str, backend: str, okey: str, sub: tuple[int, ...], first: int,
               new_pos: list[int]) -> bool:
        """Make an object live in a tier (False if it was already: a re-put refreshes it); the
        positions (from `first`) of the index blocks that became cached there go to `new_pos`."""
        key = (h, tier, GROUP, backend, okey)
        if key in self.live:
            self.stats["refreshed"] += 1
            return False
        self.live[key] = [1, sub]
        self.objects.setdefault((h, backend, okey), set()).add(tier)
        self.stats["stored"] += 1
        hold(self.refs, sub, tier, GROUP, first, new_pos)
        return True

    def _place(self, h: int, tier: str, backend: str, okey: str, known: tuple[tuple[int, ...], int],
               out: list[Event]) -> None:
        sub, depth = known
        self.block_size = max(self.block_size, len(sub) * self.index_block_size)
        fresh: list[int] = []
        if self._track(h, tier, backend, okey, sub, 0, fresh) and fresh:
            # a pool object is placed alone: the master names no parent (None)
            for hashes, run_parent, d, engine in stored_runs(list(sub), fresh, None, depth, [h]):
                out.append(BlocksStored(tier, GROUP, hashes, run_parent, d, engine))

    def _park(self, key: tuple[int, str, str, str]) -> None:
        if key in self.parked:
            return
        if len(self.parked) >= self.park_limit:
            old, _ = self.parked.popitem(last=False)
            self._unlist(old)
            self.stats["park_dropped"] += 1
        self.parked[key] = None
        self._parked_by_hash.setdefault(key[0], []).append(key)
        self.stats["parked"] += 1

    def _unlist(self, key: tuple[int, str, str, str]) -> None:
        keys = self._parked_by_hash.get(key[0])
        if keys is not None:
            keys.remove(key)
            if not keys:
                del self._parked_by_hash[key[0]]

    def _unpark(self, out: list[Event]) -> None:
        learned, self._learned = self._learned, set()
        for h in learned:
            known = self.memo.get(h)
            if known is None:  # forgotten again meanwhile (a full memo): stays parked
                continue
            for key in self._parked_by_hash.pop(h, ()):
                del self.parked[key]
                _h, tier, backend, okey = key
                self._place(h, tier, backend, okey, known, out)
                self.stats["placed_late"] += 1

    def _removed(self, ev: Removed, out: list[Event], at: int = 0) -> None:
        if not ev.hashes:
            self.stats["unparsed_key"] += 1
            return
        if self.removal == "medium" and not self._known_medium(ev.medium):
            self.drop_everywhere(ev.hashes, out)  # the object could be in any tier
            self.set_aside.append(SetAside(at, "removed", UNKNOWN_MEDIUM, f"removed on medium "
                                           f"{str(ev.medium)[:40]!r}", "dropped_everywhere"))
            return
        okey = ev.object_key or ""
        gone: dict[str, tuple[list[int], list[int]]] = {}
        unknown = 0
        for h in ev.hashes:
            tiers = self.objects.get((h, ev.backend_id, okey), set())
            if self.removal == "medium":
                tiers = tiers & {self.tier(ev.medium)}
            was_parked = self._drop_parked(h, ev.backend_id, okey,
                                           None if self.removal == "object" else self.tier(ev.medium))
            if not tiers:
                if not was_parked:
                    self.stats["remove_unknown"] += 1
                    unknown += 1
                continue
            for tier in sorted(tiers):
                self._untrack(h, tier, ev.backend_id, okey, gone)
        out.extend(BlocksRemoved(t, GROUP, hashes, engine) for t, (hashes, engine) in gone.items() if hashes)
        if unknown:
            self.set_aside.append(SetAside(at, "removed", UNKNOWN_HASH, f"{unknown} of {len(ev.hashes)} "
                                                                        "objects not held"))

    def drop_everywhere(self, hashes: list[int], out: list[Event]) -> None:
        """Drop objects of these seq hashes from every tier, backend and key (and the parking lot): what
        a removal the mirror cannot place could have referred to."""
        hs = set(hashes)
        gone: dict[str, tuple[list[int], list[int]]] = {}
        for h, tier, _g, backend, okey in [k for k in self.live if k[0] in hs]:
            self._untrack(h, tier, backend, okey, gone)
        for key in [k for k in self.parked if k[0] in hs]:
            del self.parked[key]
            self._unlist(key)
        out.extend(BlocksRemoved(t, GROUP, hs_, engine) for t, (hs_, engine) in gone.items() if hs_)

    def _drop_parked(self, h: int, backend: str, okey: str, tier: str | None) -> bool:
        hit = [k for k in self._parked_by_hash.get(h, ()) if k[2] == backend and k[3] == okey
               and (tier is None or k[1] == tier)]
        for k in hit:
            del self.parked[k]
            self._unlist(k)
        return bool(hit)

    def _untrack(self, h: int, tier: str, backend: str, okey: str,
                 gone: dict[str, tuple[list[int], list[int]]]) -> None:
        entry = self.live.pop((h, tier, GROUP, backend, okey))
        tiers = self.objects[(h, backend, okey)]
        tiers.discard(tier)
        if not tiers:
            del self.objects[(h, backend, okey)]
        self.stats["removed"] += 1
        hashes, engine = gone.setdefault(tier, ([], []))
        engine.append(h)
        release(self.refs, entry[1], tier, GROUP, hashes)

    def _cleared(self, ev: Cleared, out: list[Event], at: int = 0) -> None:
        if ev.backend_id and not any(k[3] == ev.backend_id for k in self.live) and \
                not any(k[2] == ev.backend_id for k in self.parked):
            self.set_aside.append(SetAside(at, "cleared", UNKNOWN_HASH, "a backend with nothing held"))
            return
        if not ev.backend_id or (all(k[3] == ev.backend_id for k in self.live)
                                 and all(k[2] == ev.backend_id for k in self.parked)):
            engine_cache_reset(self, out)
            return
        self.stats["cleared"] += 1
        gone: dict[str, tuple[list[int], list[int]]] = {}
        for h, tier, _g, backend, okey in [k for k in self.live if k[3] == ev.backend_id]:
            self._untrack(h, tier, backend, okey, gone)
        for key in [k for k in self.parked if k[2] == ev.backend_id]:
            del self.parked[key]
            self._unlist(key)
        out.extend(BlocksRemoved(t, GROUP, hashes, engine) for t, (hashes, engine) in gone.items() if hashes)

    def clear(self) -> None:
        """Forget what the pool holds (a restart, an unfilled gap, a cleared stream); the memo stays:
        seq hashes are content hashes, still valid for later stores."""
        self.live.clear()
        self.objects.clear()
        self.refs.clear()
        self.parked.clear()
        self._parked_by_hash.clear()
        self._learned.clear()

    def live_blocks(self) -> int:
        return len(self.live)

    def replay_keys(self) -> list[Event]:
        """No keys besides blocks (SequencedRelay.resync)."""
        return []

    def cached_index_blocks(self, tier: str = "POOL") -> set[int]:
        """Canonical hashes of the index blocks cached in `tier` (for tests and audits)."""
        return {c for (c, t, _g) in self.refs if t == tier}
