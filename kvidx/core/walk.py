"""The lookup walk over a shard, as functions of its state (kvidx.core.shard.ModelShard; the Index,
kvidx/index/, is how everyone else calls them): the prompt's block hashes walked once for
all replicas, AND-ing slot masks per KV-cache group and tier, then each replica's resumable hit by
its engine's hybrid rule (full attention: a contiguous run; sliding window: the window before the
resume point; state: a checkpoint exactly there). Pure: no I/O; callers pass `now`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvidx.core.hashing import PromptHashes
from kvidx.core.maskmap import UNPRICED_JSON, walk_masks
from kvidx.core.maskmap import lookup_json as native_lookup_json
from kvidx.core.masks import or_masks, run_end, slots_of
from schemas.answers import Freshness, Group, ReplicaAnswer, Tier
from schemas.events import TIER_IDS, TIERS

if TYPE_CHECKING:
    from kvidx.core.shard import GroupIndex, ModelShard, ReplicaState

FULL_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
STATE_KINDS = frozenset({"mamba"})


def window_blocks(window: int, engine_block_size: int, per: int) -> int:
    """Index blocks a sliding window of `window` tokens needs before a resume point: the
    ceil((w-1)/B) engine blocks right before it, `per` index blocks each."""
    return -(-(window - 1) // engine_block_size) * per


# ---- lookup -----------------------------------------------------------------------------
def prefix_blocks(shard: ModelShard, hashes: list[int], group: int | None = None, pending: bool = False,
                  doomed: dict[int, dict[int, int]] | None = None) -> dict[int, int]:
    """slot -> number of leading blocks it holds (in any tier, or in a pool it reads) in `group`
    (default: the first full-attention group); with `pending`, pending credit counts too; with
    `doomed` (Foresight.doomed), copies in-flight prefills will evict do not. Slots that hold
    nothing are left out. `prefix_walker` takes its common path without this frame: a check added
    here belongs there too."""
    g = shard._lookup_group(group)
    if g is None or not hashes:
        return {}
    pool_mask = shard._pools()[0] if shard.pool_readers else 0
    pend = shard.pending.masks if pending else None
    cut = doomed.get(g.gid) if doomed else None
    if pool_mask or pend or cut:
        return walk_masks(_overlay_get(shard, g.any.get, pool_mask, pend, cut), hashes)
    return g.any.walk(hashes)  # one call: the map walks the prompt itself


def prefix_walker(shard: ModelShard) -> Callable[[list[int]], dict[int, int]]:
    """`prefix_blocks(shard, hashes)` bound once for a loop of many prompts. The common shard (its
    default group known, no shared pools) walks its union map straight away: per prompt, a few field
    reads in place of prefix_blocks' frame and checks (~130 ns of a ~950 ns lookup at 64 replicas,
    bench/peers); any other goes through prefix_blocks, which also learns the default group."""
    def walk_prompt(hashes: list[int]) -> dict[int, int]:
        cached = shard._lookup_cache
        if cached is not None and cached[0] is not None and hashes and not shard.pool_readers:
            return cached[0].any.walk(hashes)
        return prefix_blocks(shard, hashes)
    return walk_prompt


def onboard_cut(shard: ModelShard, hashes: list[int], hits: dict[int, int]) -> dict[int, int]:
    """`hits` with each replica whose host loads free its host's oldest block (host_orders,
    kvidx.core.foresight.HostLoads) cut where its own loads would free the rest of its hit: a
    prompt's deepest host blocks are often the oldest (freed tail first, offloaded first)."""
    if not shard.host_orders:
        return hits
    cands = [(slot, host, hits[slot]) for slot, host in shard.host_orders.items()
             if hits.get(slot) and host.keys]
    if not cands:
        return hits
    g = shard._lookup_group(None)
    gpu = g.tiers.get(TIER_IDS["GPU"]) if g is not None else None
    top = max(nb for _, _, nb in cands)
    on_gpu = gpu.masks(hashes[:top]) if gpu is not None else [0] * top  # once for every replica
    out = None
    for slot, host, nb in cands:
        bit = 1 << slot
        loads = [i for i in range(nb) if not on_gpu[i] & bit]  # held only below the GPU
        cut = host.reach(hashes, loads) if loads else None
        if cut is not None:
            if out is None:
                out = dict(hits)
            out[slot] = cut
    return out if out is not None else hits


def local_first_cut(shard: ModelShard, hashes: list[int], hits: dict[int, int]) -> dict[int, int]:
    """`hits` with each replica whose engine resumes from its GPU prefix and then loads one
    contiguous run from its lower tiers (EventBatch.external_after_local: vLLM's scheduler takes
    its local hit, then the KV connector's from there) cut before the first block, after a block
    the GPU lacks, that no lower tier holds: a GPU-only block there is not reused. Not with pools
    (their readers' loads are credited as before)."""
    g = shard._lookup_group(None)
    gpu_id = TIER_IDS["GPU"]
    if g is None or len(g.tiers) < 2 or gpu_id not in g.tiers or shard.pool_readers:
        return hits
    slots = [st.slot for st in shard.by_slot
             if st is not None and st.external_after_local and hits.get(st.slot)]
    if not slots:
        return hits
    top = max(hits[s] for s in slots)
    local = g.tiers[gpu_id].walk(hashes[:top])  # slot -> its GPU prefix
    cands = [(s, local.get(s, 0)) for s in slots if local.get(s, 0) < hits[s]]
    if not cands:
        return hits
    start = min(a for _, a in cands)
    # per block from `start`: the slots a lower tier holds it for
    lower = or_masks([m for tid, m in g.tiers.items() if tid != gpu_id], hashes[start:top])
    out = dict(hits)
    for s, a in cands:
        out[s] = start + run_end(lower, 1 << s, a - start, hits[s] - start)
    return out


def _loadable(shard: ModelShard, hashes: list[int], hits: dict[int, int]
              ) -> tuple[dict[int, int], dict[int, int]]:
    """(the hits the engines' own loads leave (local_first_cut, onboard_cut), the partial blocks
    after them: a cut hit has none)."""
    tails = tail_hits(shard, hashes, hits)
    loadable = onboard_cut(shard, hashes, local_first_cut(shard, hashes, hits))
    if loadable is not hits and tails:
        tails = {s: t for s, t in tails.items() if loadable.get(s, 0) == hits.get(s, 0)}
    return loadable, tails


def _doomed(shard: ModelShard, now: float) -> dict[int, dict[int, int]] | None:
    """Foresight's doomed copies now (None: no replica under pressure)."""
    if not shard.foresight.slots:
        return None
    return shard.foresight.doomed(now)[0] or None


def _overlay_get(shard: ModelShard, get, pool_mask: int, pend: dict[int, int] | None,
                 cut: dict[int, int] | None = None):
    """A mask getter where a pool's bit also lights its readers', pending credit adds in, and
    doomed copies (`cut`) drop out."""
    readers = shard._pools()[1] if pool_mask else {}
    cache: dict[int, int] = {}

    def expand(m: int) -> int:
        p = m & pool_mask
        if p:
            e = cache.get(p)
            if e is None:
                e = 0
                for b in slots_of(p):
                    e |= readers.get(1 << b, 0)
                cache[p] = e
            m |= e
        return m

    if cut:
        raw, cget = get, cut.get

        def get(h, default=0):
            return raw(h, 0) & ~cget(h, 0)

    if pend:
        pget = pend.get
        return lambda h, default=0: expand(get(h, 0)) | pget(h, 0)
    return lambda h, default=0: expand(get(h, 0))


def tail_hits(shard: ModelShard, hashes: list[int], hits: dict[int, int]) -> dict[int, int]:
    """slot -> tokens of the prompt's partial block, after the slot's `hits` full blocks, that the
    slot's engine holds (its partial-block keys, BlocksStored.tail: engines that resume inside
    blocks). The longest keyed prefix: the relays key every prefix a prompt can leave the engine's
    cache at, except along the one path to a single full block (kvidx.engines.common.PartialTails),
    so where a key is missing the answer is short, never long. Only prompts hashed with their
    tokens (PromptHashes) have partial keys; slots grouped by depth, one batched probe each."""
    if not shard.tail_keys or not isinstance(hashes, PromptHashes):
        return {}
    g = shard._lookup_group(None)
    if g is None or g.kind not in FULL_KINDS or len(shard.groups) > 1:
        return {}
    by_depth: dict[int, int] = {}
    for st in shard.by_slot:
        if st is not None and st.tails:
            d = hits.get(st.slot, 0)
            by_depth[d] = by_depth.get(d, 0) | (1 << st.slot)
    out: dict[int, int] = {}
    for d, want in by_depth.items():
        masks = g.any.masks(hashes.tail_keys(d))
        for k in range(len(masks), 0, -1):
            got = masks[k - 1] & want
            if got:
                for slot in slots_of(got):
                    out[slot] = k
                want &= ~got
                if not want:
                    break
    return out


def _tail_tier(shard: ModelShard, hashes: PromptHashes, slot: int, depth: int, n: int) -> str:
    """The fastest tier holding a slot's partial block of `n` tokens at `depth`."""
    key = hashes.tail_keys(depth)[n - 1]
    order = sorted(shard._lookup_group(None).tiers.items())
    return next((TIERS[t] for t, d in order if d.get(key, 0) >> slot & 1), TIERS[-1])


def tier_runs(shard: ModelShard, hashes: list[int], slot: int, n_blocks: int, group: int | None = None
              ) -> list[tuple[str, int]]:
    """The hit prefix of one slot split into runs by the fastest tier holding each block:
    [(tier, tokens), ...] in prompt order."""
    g = shard._lookup_group(group)
    if g is None or n_blocks == 0:
        return []
    if len(g.tiers) == 1 and not shard.pool_readers:
        (tid,) = g.tiers
        return [(TIERS[tid], n_blocks * shard.block_size)]
    bit = 1 << slot
    if shard.pool_readers:  # the pools this slot reads hold blocks for it, in their own tier
        for pool_bit, readers in shard._pools()[1].items():
            if readers & (1 << slot):
                bit |= pool_bit
    order = sorted(g.tiers.items())
    runs: list[tuple[str, int]] = []
    for h in hashes[:n_blocks]:
        tier = next((TIERS[t] for t, d in order if d.get(h, 0) & bit), TIERS[-1])
        if runs and runs[-1][0] == tier:
            runs[-1] = (tier, runs[-1][1] + shard.block_size)
        else:
            runs.append((tier, shard.block_size))
    return runs


def lookup(shard: ModelShard, hashes: list[int], n_tokens: int, now: float, top_k: int | None = None
           ) -> list[ReplicaAnswer]:
    """Per replica and DP rank: tokens cached along the prefix (by tier), the tokens the engine
    can resume from, and how fresh the view is. Sorted by resumable tokens, best first; with
    `top_k`, only the best k are described (the others cost nothing beyond the prefix walk).

    Hybrid models add why the resumable hit can be shorter than the cached full-attention prefix:
    `full_attention_hit_tokens` (what the full-attention groups alone would resume), per group
    its kind, its own hit within the full-attention hit, and its memory (`blocks`: the replica's
    live entries in the group; `prompt_blocks`: this prompt's index blocks it holds, hybrid models
    only); `upper_bound` when the credit relies on a group kind whose evictions go unreported."""
    if len(shard.pending):
        shard.pending.expire(now)
    doomed = _doomed(shard, now)
    hits = prefix_blocks(shard, hashes, doomed=doomed)
    loadable, tails = _loadable(shard, hashes, hits)
    resume = resume_points(shard, hashes, n_tokens, loadable, tails=tails, doomed=doomed)
    evicting = _evicting(shard, hashes, n_tokens, resume) if doomed or loadable is not hits else None
    with_pending = (pending_resumable(shard, hashes, n_tokens, hits, None, doomed)
                    if shard._pending_applies() else None)
    inflight = shard.pending.inflight
    held = _prompt_held(shard, hashes) if len(shard.groups) > 1 else None
    gids = sorted(shard.groups)
    unreported = [gid for gid in gids if shard.groups[gid].kind in shard.unreported_eviction_kinds]
    # per group: (gid, kind, window, whether its hit is its own or the full-attention one)
    group_info = [(gid, g.kind, g.window, g.kind in STATE_KINDS or (g.kind in WINDOW_KINDS and g.window))
                  for gid, g in ((gid, shard.groups[gid]) for gid in gids)]
    fa = shard._lookup_group(None)
    single_tier = (TIERS[next(iter(fa.tiers))] if fa is not None and len(fa.tiers) == 1
                   and not shard.pool_readers else None)
    bs = shard.block_size
    ranked = []  # (resumable, pending, replica state), best first
    for st in shard.by_slot:
        if st is None or st.replica in shard.pool_readers:
            continue
        slot = st.slot
        res = resume.get(slot, _NO_HIT)[1]
        # a routed prompt not yet confirmed by the engine's events: resumable up to its end
        pending = max(0, with_pending.get(slot, 0) - res) if with_pending else 0
        ranked.append((res + pending, pending, st))
    ranked.sort(key=_by_first_desc)
    answers = []
    for res, pending, st in ranked if top_k is None else ranked[:top_k]:
        slot = st.slot
        nb = hits.get(slot, 0)
        tail = tails.get(slot, 0) if tails else 0
        fa_hit, _, ghits = resume.get(slot, _NO_HIT)
        groups = [Group(gid, kind, (ghits.get(gid, 0) if ghits else 0) if own else fa_hit,
                        st.group_blocks.get(gid, 0), window or None,
                        None if held is None else held[gid].get(slot, 0))
                  for gid, kind, window, own in group_info]
        if not nb and not tail:
            tiers = []
        elif single_tier is not None:
            tiers = [Tier(single_tier, nb * bs + tail)]
        else:
            runs = tier_runs(shard, hashes, slot, nb)
            if tail:
                t = _tail_tier(shard, hashes, slot, nb, tail)
                runs = (runs[:-1] + [(t, runs[-1][1] + tail)] if runs and runs[-1][0] == t
                        else runs + [(t, tail)])
            tiers = [Tier(t, k) for t, k in runs]
        seen = st.batches > 0
        answers.append(ReplicaAnswer(
            st.replica, st.dp_rank, min(nb * bs + tail, n_tokens), tiers, res, fa_hit, groups, pending,
            inflight.get(slot, 0) if inflight else 0,
            bool(res and (unreported or shard._upper_bound_tiers(tiers))), unreported if res else [],
            Freshness(int((now - st.engine_ts) * 1e6) / 1e3 if seen else None,
                      int((st.applied_ts - st.engine_ts) * 1e6) / 1e3 if seen else None,
                      st.epoch, st.seq, st.seq_gaps),
            evicting_tokens=evicting.get(slot, 0) if evicting else 0))
    if evicting:
        shard.foresight.discounted_lookups += 1
    return answers


def _evicting(shard: ModelShard, hashes: list[int], n_tokens: int, resume: dict) -> dict[int, int]:
    """slot -> resumable tokens the lookup did not credit because in-flight prefills will evict
    blocks they need first, or the request's own host loads will (onboard_cut): the same walk
    without either, minus the one with them."""
    raw_hits = prefix_blocks(shard, hashes)
    raw = resume_points(shard, hashes, n_tokens, raw_hits, tails=tail_hits(shard, hashes, raw_hits))
    out = {}
    for slot, (_, res, _) in raw.items():
        d = res - resume.get(slot, _NO_HIT)[1]
        if d > 0:
            out[slot] = d
    return out


def lookup_json(shard: ModelShard, hashes: list[int], n_tokens: int, now: float, per_token: float,
                load_cost: dict[str, float], rank: bool = False, top_k: int | None = None,
                priced: bool = True) -> tuple[bytes, int, int, int] | None:
    """`lookup`, priced (kvidx.core.price.Pricer's rates; not with `priced` False), ranked by price
    if `rank`, cut to `top_k`, as the JSON of a LookupAnswer with (its bytes, the first replica's
    resumable tokens, how many replicas, its tokens below GPU memory: kvidx.index.lookups.below_gpu),
    written by the compiled core with no object per replica: for the common shard (one
    full-attention group in one tier, no window, no pools, nothing whose evictions go unreported, no
    host queue below the GPU). None where that does not apply, where a value does not fit the
    writer (an int past 64 bits, a name that is not UTF-8) or nothing was compiled: the caller makes
    the typed answer."""
    if (native_lookup_json is None or len(shard.groups) != 1 or shard.pool_readers
            or (not priced and not UNPRICED_JSON)):
        return None
    ((gid, g),) = shard.groups.items()
    if (g.kind not in FULL_KINDS or g.kind in shard.unreported_eviction_kinds or len(g.tiers) != 1
            or g.window):
        return None
    (tier,) = (TIERS[t] for t in g.tiers)
    if (tier in shard.unreported_eviction_tiers or _doomed(shard, now)
            or (shard.host_orders and tier != "GPU")):  # host loads may cut the hit (onboard_cut)
        return None
    if len(shard.pending):
        shard.pending.expire(now)
    hits = prefix_blocks(shard, hashes)
    with_pending = prefix_blocks(shard, hashes, pending=True) if shard._pending_applies() else None
    pending_bs = (max((r.block_size for r in shard.by_slot if r is not None), default=0)
                  or shard.block_size) if with_pending else 0  # engine_block_size's fallback
    try:
        body, best, count, cached = native_lookup_json(
            shard.model, n_tokens, shard.block_size, shard.by_slot, hits, with_pending,
            shard.pending.inflight or None, gid, g.kind, tier, now, pending_bs, per_token,
            load_cost.get(tier, 0.0), rank, top_k, tail_hits(shard, hashes, hits) or None,
            shard.replica_fields, **({} if priced else {"priced": False}))
    except (OverflowError, UnicodeEncodeError):  # e.g. a batch's seq past 2**63 (the schema's ints are
        return None  # unbounded): the typed answer
    return body, best, count, 0 if tier == "GPU" else cached  # one tier: all of it or none on GPU


def credited(shard: ModelShard, hashes: list[int], n_tokens: int, replica: str | None = None,
             dp_rank: int | None = None, now: float | None = None) -> int:
    """Resumable tokens on one replica and DP rank (None: the best of any): what the shadow
    audit credits."""
    slots = [st.slot for (rep, rank), st in shard.replicas.items()
             if (replica is None or rep == replica) and (dp_rank is None or rank == dp_rank)]
    if not slots:
        return 0
    doomed = _doomed(shard, now) if now is not None else None
    hits = prefix_blocks(shard, hashes, doomed=doomed)
    loadable, tails = _loadable(shard, hashes, hits)
    resume = resume_points(shard, hashes, n_tokens, loadable, set(slots), tails, doomed)
    best = max((resume.get(s, _NO_HIT)[1] for s in slots), default=0)
    if now is not None and len(shard.pending):
        shard.pending.expire(now)
    if shard._pending_applies():  # pending credit: the prompt's resumable part up to its pending end
        best = max([best, *pending_resumable(shard, hashes, n_tokens, hits, set(slots), doomed).values()])
    return best


def pending_resumable(shard: ModelShard, hashes: list[int], n_tokens: int, hits: dict[int, int],
                      slots: set[int] | None = None, doomed: dict[int, dict[int, int]] | None = None
                      ) -> dict[int, int]:
    """slot -> resumable tokens counting routed prompts the engine's events have not confirmed
    yet (pending credit), for the slots whose hit (`hits`) they lengthen, or whose window groups
    they fill."""
    wp = prefix_blocks(shard, hashes, pending=True, doomed=doomed)
    win = 0  # slots a routed prompt's last window is pending on, in this prompt
    for h in hashes if shard.pending.window_masks else ():
        win |= shard.pending.window_masks.get(h, 0)
    wp = {s: n for s, n in wp.items()
          if (n > hits.get(s, 0) or win >> s & 1) and (slots is None or s in slots)}
    if len(shard.groups) > 1:  # window groups: what they hold and the routed prompts' last windows
        return {s: r[1] for s, r in resume_points(shard, hashes, n_tokens, wp, set(wp), None, doomed,
                                                       pending=True).items()}
    out = {}
    for s, nb in wp.items():
        st = shard.by_slot[s]
        n_eff = n_tokens - (st.recompute - 1)
        out[s] = resumable(min(nb * shard.block_size, n_eff), n_eff, shard.engine_block_size(st))
    return out


def resume_point(shard: ModelShard, hashes: list[int], n_tokens: int, st: ReplicaState, cached: int) -> int:
    """The tokens the engine can resume from on one replica (see `resume_points`)."""
    hits = {st.slot: min(cached, len(hashes) * shard.block_size) // shard.block_size}
    return resume_points(shard, hashes, n_tokens, hits, {st.slot}).get(st.slot, _NO_HIT)[1]


def resume_points(shard: ModelShard, hashes: list[int], n_tokens: int, hits: dict[int, int],
                  slots: set[int] | None = None, tails: dict[int, int] | None = None,
                  doomed: dict[int, dict[int, int]] | None = None, pending: bool = False
                  ) -> dict[int, tuple[int, int, dict[int, int] | None]]:
    """slot -> (full-attention hit, resumable tokens, {group: its own hit} or None), vLLM's rule
    (vllm/v1/core/kv_cache_coordinator.py, HybridKVCacheCoordinator.find_longest_cache_hit):

    - full attention: the contiguous hit, below the last prompt token, rounded down to the
      engine's block size (the LCM of its groups' block sizes: the largest one announced);
    - sliding window w: at p, the ceil((w-1)/B) engine blocks right before p (or all from 0);
    - state space ("mamba"): a state checkpoint at exactly p;
    - resumable: the largest p, within the full-attention hit, valid for every group.

    Positions are scanned right to left once for all replicas, with slot bitmasks (no loop per
    replica over the prompt). Finer units (--prefix-match-unit): vLLM resumes inside a block only
    with fine-grained hits, which it enables for full-attention + mamba ("align") models whose
    hash unit is finer than the mamba block, and never with sliding-window groups
    (partial_hash_hits_enabled); then p steps by the unit and the full-attention hit may end at a
    partial block inside the first block it does not hold whole. Otherwise partial blocks are
    indexed but credit stays at engine block boundaries. `tails` (tail_hits): tokens of the
    partial block after a slot's full blocks that its engine holds; they count in its hit.
    `doomed` (Foresight.doomed): copies in-flight prefills will evict do not count in any group.
    `pending`: routed prompts' last windows count in window groups (`hits` then counts them too)."""
    ibs = shard.block_size
    n_prompt = n_tokens
    cons = [(gid, g) for gid, g in sorted(shard.groups.items())
            if (g.kind in WINDOW_KINDS and g.window) or g.kind in STATE_KINDS]
    fa = shard._lookup_group(None)
    fine_ok = bool(cons) and not any(g.kind in WINDOW_KINDS for _, g in cons)
    out: dict[int, tuple[int, int, dict[int, int] | None]] = {}
    classes: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (engine block, step) -> [(slot, top)]
    fine_any = fine_ok and fa is not None
    for st in shard.by_slot:
        if st is None or (slots is not None and st.slot not in slots):
            continue
        slot = st.slot
        tail = tails.get(slot, 0) if tails else 0
        if slot not in hits and not tail and not (fine_any and st.unit > 1):
            continue  # no block of the prompt: no hit (callers read a missing slot as _NO_HIT)
        ebs = st.block_size or ibs
        n_tokens = n_prompt - (st.recompute - 1)  # the engine's own limit: below the last token(s)
        cached = min(hits.get(slot, 0) * ibs + tail, n_tokens)
        step = ebs
        if st.unit == 1 and not cons:
            # token-granular partial reuse (TensorRT-LLM, kvidx/engines/trtllm/mirror.py): the engine
            # resumes at any token below the last one, so the hit (with its partial block) counts whole
            top = resumable(cached, n_tokens, 1)
        elif fine_ok and st.unit > 1 and st.unit < ebs and ebs % st.unit == 0 and fa is not None:
            step = st.unit
            top = _fine_fa_hit(shard, hashes, n_tokens, slot, fa, cached, ebs, step)
        else:
            top = resumable(cached, n_tokens, ebs)
        if not cons or not top:
            out[slot] = (top, top, None) if not cons else (0, 0, None)
            continue
        classes.setdefault((ebs, step), []).append((slot, top))
    pend = shard.pending.window_masks if pending else None
    for (ebs, step), members in classes.items():
        _scan(shard, hashes, ebs, step, members, cons, out, doomed, pend)
    return out


def _fine_fa_hit(shard: ModelShard, hashes: list[int], n_tokens: int, slot: int, fa: GroupIndex, cached: int,
                 ebs: int, unit: int) -> int:
    """vLLM's fine-grained full-attention hit: whole blocks, then the highest partial entry
    inside the next block (FullAttentionManager.find_longest_cache_hit, phase 2)."""
    limit = n_tokens - 1 if n_tokens > 1 else 0
    full = min(cached // ebs * ebs, limit // ebs * ebs)
    bit = 1 << slot
    d = fa.any
    ibs = shard.block_size
    p = min(full + ebs - unit, limit // unit * unit)
    while p > full:
        e = p // ibs
        if e <= len(hashes) and d.get(hashes[e - 1], 0) & bit:
            return p
        p -= unit
    return full


def _scan(shard: ModelShard, hashes: list[int], ebs: int, step: int, members: list[tuple[int, int]],
          cons: list[tuple[int, GroupIndex]], out: dict,
          doomed: dict[int, dict[int, int]] | None = None, pend: dict[int, int] | None = None) -> None:
    ibs = shard.block_size
    k = max(1, ebs // ibs)
    members.sort(key=lambda m: -m[1])
    tops = {slot: top for slot, top in members}
    top_max = members[0][1]
    n_idx = min(len(hashes), top_max // ibs)
    checks = []  # (gid, fn(e) -> mask of slots valid at index position e)
    reach = []  # per check: the slots valid anywhere (others are settled at once: no hit)
    for gid, g in cons:
        if g.kind in STATE_KINDS:
            # checkpoints at the step boundaries only: masks[i] is the state after (i+1)*step tokens
            sub = step // ibs
            masks = _cut(g.any.masks(hashes[sub - 1:n_idx:sub]), hashes[sub - 1:n_idx:sub], doomed, gid)
            checks.append((gid, lambda e, masks=masks, sub=sub: masks[e // sub - 1]))
        else:
            need = window_blocks(g.window, ebs, k)
            masks = _cut(g.any.masks(hashes[:n_idx]), hashes[:n_idx], doomed, gid)
            if pend:
                masks = [m | pend.get(h, 0) for m, h in zip(masks, hashes[:n_idx], strict=True)]
            checks.append((gid, _window_and(masks, max(1, need))))
        r = 0
        for m in masks:
            r |= m
        reach.append(r)
    reach_all = -1
    for r in reach:
        reach_all &= r
    ghit: dict[int, dict[int, int]] = {slot: {} for slot in tops}
    res: dict[int, int] = {}
    pend_all = 0
    pend = [0] * len(checks)
    j = 0
    p = top_max
    while p > 0:
        while j < len(members) and members[j][1] >= p:
            b = 1 << members[j][0]
            pend_all |= b & reach_all
            for i in range(len(pend)):
                pend[i] |= b & reach[i]
            j += 1
        if j == len(members) and not pend_all and not any(pend):
            break
        e = p // ibs
        both = pend_all
        for i, (gid, fn) in enumerate(checks):
            m = fn(e)
            both &= m
            got = m & pend[i]
            if got:
                pend[i] &= ~got
                for slot in slots_of(got):
                    ghit[slot][gid] = p
        if both:
            pend_all &= ~both
            for slot in slots_of(both):
                res[slot] = p
        p -= step
    for slot, top in tops.items():
        out[slot] = (top, res.get(slot, 0), ghit[slot])


def _prompt_held(shard: ModelShard, hashes: list[int]) -> dict[int, dict[int, int]]:
    """group -> slot -> how many of the prompt's index blocks the slot holds in the group
    (anywhere along the prompt, not only the prefix): the per-group memory a router sees."""
    out: dict[int, dict[int, int]] = {}
    n_slots = len(shard.by_slot)
    for gid, g in shard.groups.items():
        out[gid] = _bit_counts(g.any.masks(hashes), n_slots)
    return out


_NO_HIT: tuple[int, int, None] = (0, 0, None)


def _cut(masks, hashes, doomed: dict[int, dict[int, int]] | None, gid: int):
    """`masks` (of `hashes` in group `gid`) without the copies in-flight prefills will evict."""
    cut = doomed.get(gid) if doomed else None
    if not cut:
        return masks
    return [m & ~cut.get(h, 0) if m else m for m, h in zip(masks, hashes, strict=True)]


def _window_and(masks: list[int], width: int):
    """fn(e) -> AND of masks[max(0, e - width):e], O(1) per call after O(n) set-up (van Herk /
    Gil-Werman: prefix ANDs and suffix ANDs within runs of `width`)."""
    n = len(masks)
    pre = [0] * n
    suf = [0] * n
    for i in range(n):
        pre[i] = masks[i] if i % width == 0 else pre[i - 1] & masks[i]
    for i in range(n - 1, -1, -1):
        suf[i] = masks[i] if (i % width == width - 1 or i == n - 1) else suf[i + 1] & masks[i]

    def window(e: int) -> int:
        if e <= 0 or e > n:
            return 0
        a = e - width
        if a <= 0:
            if e <= width:  # the whole window is [0, e): all in the first run
                return pre[e - 1]
            a = 0
        if a % width == 0:
            return pre[e - 1]
        return suf[a] & pre[e - 1]

    return window


def _bit_counts(masks: list[int], n_slots: int) -> dict[int, int]:
    """slot -> how many of `masks` have its bit set (numpy over 64-bit words)."""
    out: dict[int, int] = {}
    if not masks or not any(masks):
        return out
    words = max(1, (n_slots + 63) // 64)
    for w in range(words):
        if words == 1:
            arr = np.array(masks, dtype=np.uint64)
        else:
            arr = np.array([(m >> (64 * w)) & 0xFFFF_FFFF_FFFF_FFFF for m in masks], dtype=np.uint64)
        counts = np.unpackbits(arr.view(np.uint8).reshape(-1, 8), axis=1, bitorder="little").sum(axis=0)
        for b in np.flatnonzero(counts).tolist():
            out[64 * w + b] = int(counts[b])
    return out


def _by_first_desc(item: tuple) -> int:
    return -item[0]


def resumable(cached: int, n_tokens: int, engine_block_size: int) -> int:
    """Engines never serve the last prompt token from cache and resume at a block boundary:
    at most floor((n-1)/B)*B of n prompt tokens."""
    if n_tokens <= 1 or engine_block_size <= 0:
        return 0
    return (min(cached, n_tokens - 1) // engine_block_size) * engine_block_size
