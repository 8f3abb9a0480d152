"""The compiled fold of plain batches (native/src/fold.rs, `kvidx.core.shard.NATIVE_FOLD`) against the
Python fold it stands in for (`ModelShard.apply`, the reference): random streams mixing plain batches
with every rarer event (copies, partial-block tails, router keys, clears of a replica and of a tier,
host tiers, lookahead) and what the compiled fold declines (new replicas, new groups and tiers),
redeliveries, gaps and a change journal, with routes (pending credit, eviction foresight, hybrid
models' pooled order) and lookups interleaved, folded both ways, must leave the same state after every
batch: every replica's fields, the counts, every map, the journal, the pending credit and every
eviction order."""

import inspect
import random

import msgspec
import pytest

from kvidx.core.foresight import Foresight
from kvidx.core.maskmap import IMPLEMENTATION, PyMaskMap
from kvidx.core.pending import PendingCredits
from kvidx.core.shard import NATIVE_FOLD, ModelShard, ReplicaState
from kvidx.core.snapshot import encode_delta
from schemas.events import (
    SCHEMA_VERSION,
    BlocksRemoved,
    BlocksStored,
    EventBatch,
    ReplicaCleared,
    decode_batch,
    encode_batch,
)

pytestmark = pytest.mark.skipif(IMPLEMENTATION != "native", reason="kvidx_native is not built here")


class PythonFoldShard(ModelShard):
    """Compiled maps, the Python fold."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        vars(self).pop("apply")  # the compiled fold bound in ModelShard.__init__: the class's apply is Python


class _SubclassForesight(Foresight):
    __slots__ = ()


class SubclassShard(ModelShard):
    """Compiled maps and fold on a subclass, whose foresight is a subclass's too: the fold reads their
    fields at the base classes' slots."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.foresight = _SubclassForesight()


class ReferenceShard(ModelShard):
    """The pure-Python reference: reference maps (the compiled fold declines them), the Python fold."""

    new_map = PyMaskMap


def _event(r: random.Random, chains: list[list[int]], rare: bool, hybrid: bool = True):
    c = r.choice(chains)
    k = r.randint(1, len(c))
    tier = r.choice(["GPU", "CPU", "DISK", "NVME?"]) if r.random() < 0.3 else "GPU"
    group = 1 if hybrid and r.random() < 0.15 else 0
    kind = "sliding_window" if group else "full_attention"
    extra = {}
    if rare and r.random() < 0.3:
        extra = r.choice([{"tail": True}, {"router_keys": True}])
    x = r.random()
    if x < 0.55:
        if rare and r.random() < 0.1:
            extra = {"copy": True}
        bs = r.choice([0, 0, 0, 1, 4, 16])
        return BlocksStored(tier, group, c[:k], None, 0, group_kind=kind,
                            sliding_window=32 if group else None, block_size=bs, **extra)
    if x < 0.97:
        g = group if r.random() < 0.9 else 7  # a group no replica has: nothing to remove
        return BlocksRemoved(tier, g, r.sample(c, r.randint(1, len(c))), **extra)
    return ReplicaCleared("reset", tier=r.choice(["", "CPU"]))


def _stream(r: random.Random, n_replicas: int, chains: list[list[int]], n: int,
            hybrid: bool = True) -> list[EventBatch]:
    seqs: dict[str, int] = {}
    out = []
    for _ in range(n):
        rep = f"r{r.randrange(n_replicas)}"
        rare = r.random() < 0.15
        events = [_event(r, chains, rare, hybrid) for _ in range(r.choice([1, 1, 1, 2, 3]))]
        seq = seqs.get(rep, -1) + 1
        x = r.random()
        if x < 0.05:  # a redelivery
            seq = max(0, seq - 1)
        elif x < 0.08:  # batches lost in between
            seq += r.randint(1, 3)
        seqs[rep] = seq
        out.append(EventBatch(
            SCHEMA_VERSION, "m", rep, 0, 1 + (r.random() < 0.01), seq, r.random(), r.random(),
            r.choice([16, 16, 0]), events, part=r.choice([0, 0, 0, 1]),
            recompute_tokens=r.choice([1, 0]), replica_group=r.choice([0, 0, 2]),
            lookahead_tokens=1 if rare and r.random() < 0.2 else 0,
            host_tier_blocks=40 if rare and r.random() < 0.2 else 0))
    return out


def _state(shard: ModelShard) -> dict:
    maps = {(gid, tid): sorted(d.items()) for gid, g in shard.groups.items() for tid, d in g.tiers.items()}
    anys = {gid: sorted(g.any.items()) for gid, g in shard.groups.items()}
    # the journal's keys touched (a tier cleared lists its keys in its map's order: the maps' own)
    journal = None if shard.journal is None else (
        {k: sorted({h for hs in v for h in hs}) for k, v in shard.journal.touched.items()},
        set(shard.journal.cleared))
    return {
        "replicas": {k: msgspec.to_builtins(st) for k, st in shard.replicas.items()},
        # the types too: to_builtins and == take 1, 1.0 and True for one another
        "types": {k: [type(getattr(st, f)).__name__ for f in st.__struct_fields__]
                  for k, st in shard.replicas.items()},
        "slots": [st.slot if st else None for st in shard.by_slot],
        "blocks_applied": shard.blocks_applied, "tail_keys": shard.tail_keys, "lookahead": shard.lookahead,
        "host_orders": sorted(shard.host_orders), "maps": maps, "any": anys, "journal": journal,
        "groups": {gid: (g.kind, g.window) for gid, g in shard.groups.items()},
        "pending": _pending(shard), "foresight": _foresight(shard),
    }


def _pending(shard: ModelShard) -> tuple:
    p = shard.pending
    return (dict(p.masks), dict(p._blocks.refs), dict(p.window_masks), dict(p._window.refs), dict(p.inflight),
            list(p._queue))


def _foresight(shard: ModelShard) -> tuple:
    f = shard.foresight
    orders = {k: (r.order.head(len(r.order)), dict(r.unconfirmed), r.peak, r.full, r.untrusted,
                  dict(r.copies), r.extra, r.transient, dict(r.markers), r.evicting)
              for k, r in f.slots.items()}
    return f.active, f.pooled, f.version, len(f.grown), orders, list(f._expiries)


@pytest.mark.parametrize("seed", range(10))
def test_compiled_fold_leaves_the_state_the_python_fold_leaves(seed):
    r = random.Random(seed)
    n_replicas = r.choice([2, 5, 64, 70])
    chains = [[r.getrandbits(64) for _ in range(r.randint(1, 24))] for _ in range(10)]
    # the last folds each batch as the service gets it, decoded (its hashes packed: a HashArray)
    shards = [ModelShard("m", 16), PythonFoldShard("m", 16), ReferenceShard("m", 16), ModelShard("m", 16)]
    if seed % 2:
        for s in shards:
            s.track_changes()
    folded0 = NATIVE_FOLD.folded
    for i, b in enumerate(_stream(r, n_replicas, chains, 600)):
        now = 3.0 + i
        assert len({s.apply(x, now) for s, x in zip(shards, _forms(b), strict=True)}) == 1
        native, *others = (_state(s) for s in shards)
        for other in others:
            assert native == other, f"batch {i}: {b}"
    assert NATIVE_FOLD.folded - folded0 > 450  # most batches took the compiled fold


def _forms(b: EventBatch) -> list[EventBatch]:
    """The batch for each shard but the last, decoded for the last."""
    return [b, b, b, decode_batch(encode_batch(b))]


def _batch(seq: int, hashes: list[int]) -> EventBatch:
    ev = BlocksStored("GPU", 0, hashes, None, 0)
    return EventBatch(SCHEMA_VERSION, "m", "a", 0, 1, seq, 1.0, 1.0, 16, [ev])


@pytest.mark.parametrize("seed", range(8))
def test_with_routes_and_lookups_interleaved_the_compiled_fold_leaves_the_python_folds_state(seed):
    """The production fold (issue #40 item 1): a service following routes keeps pending credit and
    eviction foresight; routes and lookups (which expire credit and foresight) come between batches.
    Half the seeds keep one group (the compiled fold takes those batches, calling the routes' hooks);
    the others are hybrid (pooled foresight: the Python fold's)."""
    from kvidx.core import walk
    r = random.Random(100 + seed)
    hybrid = bool(seed % 2)
    n_replicas = r.choice([2, 5, 64, 70])
    chains = [[r.getrandbits(64) for _ in range(r.randint(1, 24))] for _ in range(10)]
    shards = [ModelShard("m", 16), PythonFoldShard("m", 16), ReferenceShard("m", 16), SubclassShard("m", 16),
              ModelShard("m", 16)]  # the last fed decoded batches
    if seed % 4 == 0:
        for s in shards:
            s.track_changes()
    folded0 = NATIVE_FOLD.folded
    for i, b in enumerate(_stream(r, n_replicas, chains, 500, hybrid)):
        now = 3.0 + i * 0.25
        if r.random() < 0.3:  # a route: pending credit and the prefill's place in the eviction order
            c = r.choice(chains)
            rep, k = f"r{r.randrange(n_replicas)}", r.randint(1, len(c))
            expires, credited = now + r.uniform(0.1, 4.0), r.randrange(0, 16 * k)
            for s in shards:
                s.add_pending(rep, 0, c[:k], 16 * k + 3, credited, expires)
        assert len({s.apply(x, now) for s, x in zip(shards, [b, *_forms(b)], strict=True)}) == 1
        if r.random() < 0.2:  # a lookup: expires credit and foresight as of now
            c = r.choice(chains)
            answers = [msgspec.to_builtins(walk.lookup(s, c, 16 * len(c) + 1, now)) for s in shards]
            assert all(a == answers[0] for a in answers), f"batch {i}"
        native, *others = (_state(s) for s in shards)
        for other in others:
            assert native == other, f"batch {i}: {b}"
    assert NATIVE_FOLD.folded - folded0 > 350  # most batches took the compiled fold, hybrid ones too


def test_with_pending_credit_the_compiled_fold_confirms_as_the_python_fold():
    shards = [ModelShard("m", 16), PythonFoldShard("m", 16)]
    first = _batch(0, [1, 2])
    for s in shards:
        s.apply(first, 1.0)
        s.add_pending("a", 0, [1, 2, 3, 4], 64, 32, 100.0)  # blocks 3, 4 pending on replica a
    declined0, folded0 = NATIVE_FOLD.declined, NATIVE_FOLD.folded
    b = _batch(1, [3])
    assert [s.apply(b, 2.0) for s in shards] == [True, True]
    assert (NATIVE_FOLD.declined, NATIVE_FOLD.folded) == (declined0, folded0 + 1)  # compiled, with hooks
    assert _state(shards[0]) == _state(shards[1])
    assert dict(shards[0].pending.masks) == {4: 1}  # the store confirmed block 3 in both


def test_a_field_of_another_type_is_declined_not_misread():
    s = ModelShard("m", 16)
    s.apply(_batch(0, [1]), 1.0)
    st = s.replicas[("a", 0)]
    big = _batch(2**70, [2])
    declined0 = NATIVE_FOLD.declined
    assert s.apply(big, 2.0) is True  # a seq past i64: the Python fold's
    assert NATIVE_FOLD.declined == declined0 + 1
    assert st.seq == 2**70 and s.groups[0].any.get(2) == 1
    assert isinstance(st, ReplicaState)


def test_an_event_that_fails_leaves_what_the_python_fold_leaves():
    """A hash that is not a u64 in the second event: the first is folded and counted, the second's
    earlier hashes are in the map, the error propagates, and the journal still writes a delta."""
    shards = [ModelShard("m", 16), PythonFoldShard("m", 16)]
    bad = EventBatch(SCHEMA_VERSION, "m", "a", 0, 1, 1, 1.0, 1.0, 16,
                     [BlocksStored("GPU", 0, [10, 11, 12], None, 0, block_size=4),
                      BlocksStored("GPU", 0, [13, -5], None, 0)])
    for s in shards:
        s.track_changes()
        s.apply(_batch(0, [1]), 1.0)
        with pytest.raises(OverflowError):
            s.apply(bad, 2.0)
    assert _state(shards[0]) == _state(shards[1])
    # the first event counted; the second's hash 13 set but not counted, as in the Python fold
    assert shards[0].replicas[("a", 0)].blocks == 4 and shards[0].blocks_applied == 4
    assert shards[0].groups[0].any.get(13) == 1
    assert encode_delta(shards[0]) == encode_delta(shards[1])


def test_sequence_numbers_at_the_edge_of_64_bits_fold_alike():
    shards = [ModelShard("m", 16), PythonFoldShard("m", 16)]
    top = 2**63 - 1
    last = _batch(top, [3])
    last.part = 1  # a mirror-replay part after the last sequence number
    batches = [_batch(0, [1]), _batch(top, [2]), last]
    for b in batches:
        assert len({s.apply(b, 2.0) for s in shards}) == 1
        assert _state(shards[0]) == _state(shards[1])
    assert shards[0].replicas[("a", 0)].seq_gaps == top - 1


def test_eviction_foresight_is_kept_by_the_compiled_fold_too():
    shards = [ModelShard("m", 16), PythonFoldShard("m", 16)]
    for s in shards:
        s.apply(_batch(0, [1, 2]), 1.0)
        s.foresight.active = True  # as a route sets it (add_pending), pending credit aside
    declined0, folded0 = NATIVE_FOLD.declined, NATIVE_FOLD.folded
    for s in shards:
        s.apply(_batch(1, [3]), 2.0)
    assert (NATIVE_FOLD.declined, NATIVE_FOLD.folded) == (declined0, folded0 + 1)  # the second is Python's
    assert _state(shards[0]) == _state(shards[1])
    assert shards[0].foresight.slots[(0, 0)].order.head(3) == [3]  # the order starts with the route's side


def test_a_hybrid_model_under_foresight_is_folded_compiled_with_the_pooled_hooks():
    shards = [ModelShard("m", 16), PythonFoldShard("m", 16)]
    two = EventBatch(SCHEMA_VERSION, "m", "a", 0, 1, 0, 1.0, 1.0, 16, [
        BlocksStored("GPU", 0, [1], None, 0),
        BlocksStored("GPU", 1, [1], None, 0, group_kind="sliding_window", sliding_window=32)])
    for s in shards:
        s.apply(two, 1.0)
        s.foresight.active = True
    declined0, folded0 = NATIVE_FOLD.declined, NATIVE_FOLD.folded
    for s in shards:
        s.apply(_batch(1, [3]), 2.0)
    assert (NATIVE_FOLD.declined, NATIVE_FOLD.folded) == (declined0, folded0 + 1)  # hooks, not the reference
    assert _state(shards[0]) == _state(shards[1]) and shards[0].foresight.pooled


def test_declines_are_counted_by_reason_and_rare_events_are_folded_compiled():
    """A new replica's first batch and a store into a new tier go to the Python fold (counted by
    reason); copies, clears, partial-block and router keys, a host tier's start and a lookahead change
    are folded by the compiled fold, leaving the Python fold's state."""
    shards = [ModelShard("m", 16), PythonFoldShard("m", 16)]
    before = dict(NATIVE_FOLD.declines)
    traits = {"host_tier_blocks": 8, "lookahead_tokens": 1}
    batches = [
        _batch(0, [1, 2, 3]),  # a new replica
        EventBatch(SCHEMA_VERSION, "m", "a", 0, 1, 1, 1.0, 1.0, 16, [BlocksStored("CPU", 0, [4], None, 0)]),
        EventBatch(SCHEMA_VERSION, "m", "a", 0, 1, 2, 1.0, 1.0, 16, [
            BlocksStored("GPU", 0, [1, 2], None, 0, copy=True),
            BlocksStored("GPU", 0, [9], None, 0, tail=True),
            BlocksStored("CPU", 0, [8], None, 0, router_keys=True),
            BlocksRemoved("GPU", 0, [3]),
            ReplicaCleared("reset", tier="CPU"),
            BlocksStored("GPU", 0, [5], None, 0, engine_hashes=[55])], **traits),
        EventBatch(SCHEMA_VERSION, "m", "a", 0, 1, 3, 1.0, 1.0, 16, [
            BlocksStored("CPU", 0, [6], None, 0, engine_hashes=[66]), BlocksRemoved("GPU", 0, [9], tail=True),
            ReplicaCleared("restart"), BlocksStored("GPU", 0, [7], None, 0)], **traits),
    ]
    for i, b in enumerate(batches):
        folded0 = NATIVE_FOLD.folded
        assert [s.apply(b, 2.0 + i) for s in shards] == [True, True]
        assert NATIVE_FOLD.folded - folded0 == (i >= 2), f"batch {i}"
        assert _state(shards[0]) == _state(shards[1]), f"batch {i}"
    after = NATIVE_FOLD.declines
    grew = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert grew == {"new_replica": 1, "new_group_or_tier": 1}
    assert shards[0].replicas[("a", 0)].blocks == 1 and shards[0].lookahead == 1
    assert 0 in shards[0].host_orders


# the fields the compiled fold reads and writes at their slots' offsets (fold.rs `SH_NAMES`, `F_NAMES`,
# `P_NAMES`): a subclass's class attribute or property of the same name would be what Python reads
# while the fold reads the slot, and the two folds would part
_SLOT_FIELDS = {
    ModelShard: ("replicas", "groups", "pending", "foresight", "host_orders", "journal", "pool_readers",
                 "blocks_applied", "tail_keys", "by_slot"),
    Foresight: ("active", "slots", "grown", "pooled", "version"),
    PendingCredits: ("masks", "window_masks", "_blocks"),
}


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


def test_the_fields_the_compiled_fold_reads_at_their_offsets_are_slots_no_subclass_shadows():
    assert {PythonFoldShard, ReferenceShard, SubclassShard} <= set(_subclasses(ModelShard))
    for cls, names in _SLOT_FIELDS.items():
        for name in names:
            for sub in _subclasses(cls):  # (a mixin's property too: what Python finds first)
                assert inspect.getattr_static(sub, name) is vars(cls)[name], (sub, name)


# replica keys the compiled fold's replica cache (native/src/fold.rs ReplicaCache) holds by their UTF-8
# and a 64-bit rank, and keys it leaves to the dict: a lone surrogate, a rank past 64 bits, a bool, a
# name past the cache's 28 bytes
_ODD_KEYS = [("r0", 0), ("r0", 1), ("ü-1", 0), ("\udcff", 0), ("r1", 2**70), ("r1", True), ("r1", -1),
             ("x" * 28, 0), ("x" * 29, 0)]


def _odd_stream(r: random.Random, keys: list[tuple], chains: list[list[int]], n: int,
                seqs: dict) -> list[EventBatch]:
    out = []
    for _ in range(n):
        rep, rank = r.choice(keys)
        seqs[rep, rank] = seq = seqs.get((rep, rank), -1) + 1
        out.append(EventBatch(SCHEMA_VERSION, "m", rep, rank, 1, seq, 1.0, 1.0, 16,
                              [_event(r, chains, False, hybrid=False)]))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_the_replica_cache_follows_a_merge_and_keys_the_dict_alone_decides(seed):
    """A batch finds its replica's state through the bound fold's cache: after a merge (absorb) replaced
    states of replicas both shards had, and for keys the cache leaves to the dict, the compiled fold
    still folds into the state the dict holds, as the Python fold does."""
    r = random.Random(seed)
    chains = [[r.getrandbits(64) for _ in range(r.randint(1, 12))] for _ in range(8)]
    native, python = ModelShard("m", 16), PythonFoldShard("m", 16)
    seqs: dict = {}

    def fold(batches):
        for i, b in enumerate(batches):
            assert native.apply(b, 5.0) == python.apply(b, 5.0)
            assert _state(native) == _state(python), f"batch {i}: {b}"

    fold(_odd_stream(r, _ODD_KEYS, chains, 150, seqs))
    # another group's shard with newer states of some of the same replicas: absorb replaces them
    others = [ModelShard("m", 16), ModelShard("m", 16)]
    for b in _odd_stream(r, _ODD_KEYS[::2], chains, 60, dict(seqs)):
        for o in others:
            o.apply(b, 5.0)
    before = dict(native.replicas)
    native.absorb(others[0])
    python.absorb(others[1])
    assert any(native.replicas[k] is not st for k, st in before.items())  # some states were replaced
    for k in seqs:  # the merged-in states' seqs are the newer ones
        seqs[k] = max(seqs[k], native.replicas[k].seq)
    folded = NATIVE_FOLD.folded
    fold(_odd_stream(r, _ODD_KEYS, chains, 150, seqs))
    assert NATIVE_FOLD.folded - folded > 100  # the compiled fold took them
