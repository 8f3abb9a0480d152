"""The per-model index shard (kvidx/core/shard.py): fold, lookup walk, tiers, snapshot."""

from __future__ import annotations

import random

import pytest

from kvidx.core import walk
from kvidx.core.hashing import prompt_hashes
from kvidx.core.shard import ModelShard
from kvidx.core.snapshot import decode_snapshot, encode_snapshot
from kvidx.core.walk import resumable
from schemas.answers import Tier
from schemas.events import SCHEMA_VERSION, BlocksRemoved, BlocksStored, EventBatch, ReplicaCleared

rng = random.Random(3)
T = [rng.randrange(1024) for _ in range(256)]
H = prompt_hashes(T, 16)  # 16 blocks
U = [rng.randrange(1024) for _ in range(256)]
HU = prompt_hashes(U, 16)


def batch(events, replica="r0", seq=0, epoch=1, dp_rank=0, block_size=32, ts=100.0) -> EventBatch:
    return EventBatch(SCHEMA_VERSION, "m", replica, dp_rank, epoch, seq, ts, ts, block_size, list(events))


def st(hashes, tier="GPU", group=0, depth=0, parent=None) -> BlocksStored:
    return BlocksStored(tier, group, list(hashes), parent, depth)


def rm(hashes, tier="GPU", group=0) -> BlocksRemoved:
    return BlocksRemoved(tier, group, list(hashes))


class Feeder:
    """Applies batches to a shard with consecutive seqs per replica."""

    def __init__(self, shard: ModelShard):
        self.shard = shard
        self.seqs: dict[tuple[str, int], int] = {}

    def __call__(self, *events, replica="r0", dp_rank=0):
        k = (replica, dp_rank)
        seq = self.seqs.get(k, -1) + 1
        self.seqs[k] = seq
        assert self.shard.apply(batch(events, replica, seq, dp_rank=dp_rank), 101.0)


def slot_blocks(shard: ModelShard, hashes) -> dict[str, int]:
    hits = walk.prefix_blocks(shard, hashes)
    return {f"{s.replica}/{s.dp_rank}": hits.get(s.slot, 0) for s in shard.by_slot if s is not None}


def test_redelivery_is_skipped_and_newer_epoch_applies():
    sh = ModelShard("m", 16)
    assert sh.apply(batch([st(H[:2])], seq=5), 1.0)
    assert not sh.apply(batch([st(H[:4])], seq=5), 1.0)  # redelivered
    assert not sh.apply(batch([st(H[:4])], seq=3), 1.0)  # older
    assert slot_blocks(sh, H) == {"r0/0": 2}
    assert sh.replicas[("r0", 0)].duplicates == 2
    assert sh.apply(batch([st(H[:4])], seq=0, epoch=2), 1.0)  # restarted engine: new epoch, seq 0
    assert slot_blocks(sh, H) == {"r0/0": 4}
    assert not sh.apply(batch([rm(H[:4])], seq=9, epoch=1), 1.0)  # the old epoch is over
    assert slot_blocks(sh, H) == {"r0/0": 4}
    assert sh.apply(batch([], seq=3, epoch=2), 1.0)
    assert sh.replicas[("r0", 0)].seq_gaps == 2


def test_walk_stops_at_first_missing_block():
    sh = ModelShard("m", 16)
    f = Feeder(sh)
    f(st(H[:6]))
    f(rm([H[2]]))
    assert slot_blocks(sh, H) == {"r0/0": 2}
    f(st([H[2]], depth=2, parent=H[1]))
    assert slot_blocks(sh, H) == {"r0/0": 6}
    f(rm([H[0]]))
    assert walk.prefix_blocks(sh, H) == {}  # a child without its parent is unreachable
    assert walk.prefix_blocks(sh, H[1:]) == {0: 5}


def test_two_replicas_with_different_prefixes():
    sh = ModelShard("m", 16)
    f = Feeder(sh)
    f(st(H[:3]), replica="a")
    f(st(H[:7]), replica="b")
    f(st(HU[:4]), replica="a")
    f(st(H[:5]), replica="b", dp_rank=1)
    assert slot_blocks(sh, H) == {"a/0": 3, "b/0": 7, "b/1": 5}
    assert slot_blocks(sh, HU) == {"a/0": 4, "b/0": 0, "b/1": 0}
    assert slot_blocks(sh, H[:4]) == {"a/0": 3, "b/0": 4, "b/1": 4}
    ans = walk.lookup(sh, H, 256, 102.0)
    assert [(a.replica, a.dp_rank, a.cached_tokens, a.resumable_tokens) for a in ans] == [
        ("b", 0, 112, 96), ("b", 1, 80, 64), ("a", 0, 48, 32)]
    assert walk.credited(sh, H, 256) == 96
    assert walk.credited(sh, H, 256, "a") == 32
    assert walk.credited(sh, H, 256, "b", 1) == 64
    assert walk.credited(sh, HU, 256, "b") == 0


def test_resumable():
    assert resumable(64, 64, 32) == 32
    assert resumable(96, 97, 32) == 96
    assert resumable(96, 96, 32) == 64
    assert resumable(0, 100, 32) == 0
    assert resumable(48, 100, 32) == 32
    assert resumable(48, 100, 16) == 48
    assert resumable(10, 1, 16) == 0
    assert resumable(10, 10, 0) == 0
    for n in range(1, 200, 7):
        for cached in range(0, 220, 16):
            r = resumable(cached, n, 32)
            assert r % 32 == 0 and r <= n - 1 and r <= cached


def test_lookup_resumes_at_engine_block_size_and_never_last_token():
    sh = ModelShard("m", 16)
    sh.apply(batch([st(H[:4])], block_size=32), 1.0)
    a = walk.lookup(sh, H[:4], 64, 2.0)[0]
    assert a.cached_tokens == 64 and a.resumable_tokens == 32
    a = walk.lookup(sh, H[:3], 50, 100.5)[0]
    assert a.cached_tokens == 48 and a.resumable_tokens == 32
    assert a.freshness.seq == 0 and a.freshness.last_event_age_ms == pytest.approx(500.0)


def test_block_in_two_tiers_retracted_only_on_last_tier():
    sh = ModelShard("m", 16)
    f = Feeder(sh)
    f(st(H[:4], "GPU"))
    f(st(H[:4], "CPU"))
    f(rm(H[:4], "GPU"))
    assert slot_blocks(sh, H) == {"r0/0": 4}
    assert walk.tier_runs(sh, H, 0, 4) == [("CPU", 64)]
    f(rm([H[1]], "CPU"))
    assert slot_blocks(sh, H) == {"r0/0": 1}
    f(st([H[1]], "GPU", depth=1, parent=H[0]))
    assert slot_blocks(sh, H) == {"r0/0": 4}
    assert walk.tier_runs(sh, H, 0, 4) == [("CPU", 16), ("GPU", 16), ("CPU", 32)]


def test_tier_runs_split_prefix_by_fastest_tier():
    sh = ModelShard("m", 16)
    f = Feeder(sh)
    f(st(H[:2], "GPU"))
    f(st(H[:5], "CPU"))
    assert walk.tier_runs(sh, H, 0, 5) == [("GPU", 32), ("CPU", 48)]
    ans = walk.lookup(sh, H[:5], 200, 1.0)[0]
    assert ans.tiers == [Tier("GPU", 32), Tier("CPU", 48)]
    assert ans.cached_tokens == 80
    # one tier only: one run
    sh2 = ModelShard("m", 16)
    Feeder(sh2)(st(H[:3], "CPU"))
    assert walk.tier_runs(sh2, H, 0, 3) == [("CPU", 48)]


def test_remove_in_one_tier_with_other_replica_in_other_tier():
    sh = ModelShard("m", 16)
    f = Feeder(sh)
    f(st(H[:3], "GPU"), replica="a")
    f(st(H[:3], "CPU"), replica="b")
    f(rm(H[:3], "GPU"), replica="a")
    assert slot_blocks(sh, H) == {"a/0": 0, "b/0": 3}
    f(rm(H[:3], "CPU"), replica="b")
    assert walk.prefix_blocks(sh, H) == {}


def test_replica_cleared_clears_one_replica_only():
    sh = ModelShard("m", 16)
    f = Feeder(sh)
    f(st(H[:4], "GPU"), replica="a")
    f(st(H[:2], "CPU"), replica="a")
    f(st(H[:3]), replica="b")
    f(ReplicaCleared("engine_cache_reset"), replica="a")
    assert slot_blocks(sh, H) == {"a/0": 0, "b/0": 3}
    assert sh.replicas[("a", 0)].blocks == 0
    f(st(H[:1]), replica="a")
    assert slot_blocks(sh, H) == {"a/0": 1, "b/0": 3}


def test_groups_default_lookup_uses_full_attention():
    sh = ModelShard("m", 16)
    f = Feeder(sh)
    f(BlocksStored("GPU", 0, H[:2], None, 0, [], "sliding_window", 32),
      BlocksStored("GPU", 1, H[:5], None, 0, [], "full_attention"))
    assert walk.prefix_blocks(sh, H) == {0: 5}
    assert walk.prefix_blocks(sh, H, group=0) == {0: 2}
    f(rm(H[:5], group=0))  # nothing in group 0's GPU map beyond 2; group 1 untouched
    assert walk.prefix_blocks(sh, H) == {0: 5}


def _lookups(sh: ModelShard, prompts) -> list:
    out = []
    for hashes in prompts:
        ans = walk.lookup(sh, hashes, 16 * len(hashes) + 1, 500.0)
        out.append(sorted((a.replica, a.dp_rank, a.cached_tokens, a.resumable_tokens,
                           str(a.tiers), a.freshness.epoch, a.freshness.seq) for a in ans))
    return out


def _content(sh: ModelShard) -> tuple:
    """A shard's state, independent of the order its maps iterate in."""
    return ([(st.replica, st.dp_rank, st.epoch, st.seq, st.blocks, st.group_blocks) for st in sh.by_slot],
            {gid: (g.kind, g.window, sorted(g.any.items()),
                   {t: sorted(d.items()) for t, d in g.tiers.items()}) for gid, g in sh.groups.items()})


@pytest.mark.parametrize("n_replicas", [3, 64, 70, 130])
def test_snapshot_restore_round_trip(n_replicas):
    r = random.Random(n_replicas)
    prompts = [prompt_hashes([r.randrange(1024) for _ in range(128)], 16) for _ in range(6)]
    sh = ModelShard("m", 16)
    f = Feeder(sh)
    for i in range(n_replicas):
        p = prompts[i % len(prompts)]
        n = r.randint(1, 8)
        f(st(p[:n], "GPU"), replica=f"r{i}")
        if i % 3 == 0:
            f(st(p[:r.randint(1, 8)], "CPU"), replica=f"r{i}")
        if i % 5 == 0:
            f(rm([p[r.randrange(n)]], "GPU"), replica=f"r{i}")
        if i % 7 == 0:
            f(ReplicaCleared("x"), replica=f"r{i}")
            f(st(p[:2], "GPU"), replica=f"r{i}")
    before = _lookups(sh, prompts)
    assert any(a[2] for lk in before for a in lk)
    data = encode_snapshot(sh)
    sh2 = decode_snapshot(data)
    assert _lookups(sh2, prompts) == before
    assert sh2.stats() == sh.stats()
    assert _content(decode_snapshot(encode_snapshot(sh2))) == _content(sh)  # and again: idempotent
    # the restored shard folds on: a redelivery is skipped, the next seq applies
    last = n_replicas - 1
    seq = f.seqs[(f"r{last}", 0)]
    assert not sh2.apply(batch([rm(prompts[0])], f"r{last}", seq), 1.0)
    assert sh2.apply(batch([ReplicaCleared("x")], f"r{last}", seq + 1), 1.0)
    assert all(a[2] == 0 for lk in _lookups(sh2, prompts) for a in lk if a[0] == f"r{last}")


def test_snapshot_restore_high_slot_removal_and_multiword_tiers():
    sh = ModelShard("m", 16)
    f = Feeder(sh)
    for i in range(100):
        f(st(H[:2]), replica=f"r{i}")
    f(st(H[:6], "GPU"), replica="r99")
    f(st(H[:8], "CPU"), replica="r99")
    sh2 = decode_snapshot(encode_snapshot(sh))
    for s in (sh, sh2):
        g = Feeder(s)
        g.seqs = dict(f.seqs)
        g(rm(H[:6], "GPU"), replica="r99")
        assert walk.prefix_blocks(s, H)[99] == 8
        assert walk.tier_runs(s, H, 99, 8) == [("CPU", 128)]
        g(rm(H[:8], "CPU"), replica="r99")
        hits = walk.prefix_blocks(s, H)
        assert 99 not in hits and hits[98] == 2 and len(hits) == 99


def test_one_tier_clear_and_router_keys_through_a_snapshot():
    """SGLang's CLEAR_ALL_AT_TIER (ReplicaCleared.tier) empties one tier of one replica only; the
    router-key count keeps its snapshot name (`dynamo_keys`, as written before the rename)."""
    import msgspec as _msgspec

    from schemas.events import BlocksStored as Stored
    from schemas.events import EventBatch as Batch
    from schemas.events import ReplicaCleared as Cleared

    shard = ModelShard("m", 16)
    keys = [11, 12, 13]
    def stored(tier, hashes):
        return Stored(tier, 0, hashes, None, 0, router_keys=True)

    both = [stored("GPU", keys[:2]), stored("CPU", keys[1:])]
    shard.apply(Batch(1, "m", "w1", 0, 1, 0, 0.0, 0.0, 0, both), 0.0)
    shard.apply(Batch(1, "m", "w2", 0, 1, 0, 0.0, 0.0, 0, [stored("GPU", keys)]), 0.0)
    shard.apply(Batch(1, "m", "w1", 0, 2, 0, 0.0, 0.0, 0, [Cleared("test", tier="GPU")]), 0.0)
    g = shard.groups[0]
    w1, w2 = (shard.replicas[(r, 0)] for r in ("w1", "w2"))
    assert g.any.walk(keys) == {w2.slot: 3}  # w1 lost 11 (GPU only); 12 and 13 stay in its CPU tier
    assert g.any.masks(keys[1:]) == [(1 << w1.slot) | (1 << w2.slot)] * 2
    assert (w1.router_keys, w1.blocks, w2.router_keys) == (2, 0, 3)  # (key, tier) entries: 4 stored, 2 went
    raw = _msgspec.msgpack.decode(encode_snapshot(shard))
    assert all("dynamo_keys" in r and "router_keys" not in r for r in raw["replicas"])
    again = decode_snapshot(encode_snapshot(shard))
    assert again.replicas[("w1", 0)].router_keys == 2 and again.groups[0].any.walk(keys) == {w2.slot: 3}
