"""Replica groups (kvidx.core.groups): a model's index split by replica, and put together again
(ModelShard.absorb) with exactly the answers of the one shard that folded everything."""

import random

import pytest

from kvidx.config import Config, ModelConfig, PoolConfig, load_config
from kvidx.core import walk
from kvidx.core.groups import hashed_group, key_group, parse_groups, replica_group, shard_key
from kvidx.core.shard import ModelShard
from kvidx.core.snapshot import SEGMENTS, decode_parts, encode_segments, shift_masks
from schemas.events import SCHEMA_VERSION, BlocksStored, EventBatch, ReplicaCleared
from tests.helpers import random_fleet

BS = 16


def test_shard_keys_and_group_assignment():
    assert shard_key("llama", 0) == "llama" and shard_key("llama", 3) == "llama#3"
    names = [f"node-{i}:5557" for i in range(400)]
    groups = [hashed_group(n, 4) for n in names]
    assert groups == [hashed_group(n, 4) for n in names]  # stable
    assert all(400 / 4 * 0.7 < groups.count(g) < 400 / 4 * 1.3 for g in range(4))  # spread
    assert hashed_group("x", 1) == 0 and replica_group("x", 1, {"x": 3}) == 0
    assert replica_group("node-1:5557", 4, {"node-1:5557": 2}) == 2
    # a pool's readers go where the pool goes
    pool_of = {"a": "pool-7", "b": "pool-7"}
    assert (replica_group("a", 4, None, pool_of) == replica_group("b", 4, None, pool_of)
            == hashed_group("pool-7", 4))
    assert parse_groups("0, 2") == {0, 2}
    keys = ("m/manifest", "m#2/manifest", "org/llama#3/b0/12/4", "m#12")
    assert [key_group(k) for k in keys] == [0, 2, 3, 12]
    with pytest.raises(ValueError, match="group numbers"):
        parse_groups("0,x")


def test_config_replica_groups(tmp_path):
    c = Config(models={"m": ModelConfig(replica_groups=4, replica_placement={"r1": 1})},
               pools={"p": PoolConfig(["r2", "r3"])})
    assert c.replica_group("m", "r1") == 1
    assert c.replica_group("m", "r2") == c.replica_group("m", "r3") == c.replica_group("m", "p")
    assert c.replica_group("other", "r1") == 0  # one group by default
    bad = tmp_path / "bad.toml"
    bad.write_text('[models.m]\nreplica_groups = 2\nreplica_placement = {r1 = 5}\n')
    with pytest.raises(SystemExit, match="replica_placement puts 'r1' in group 5, outside 0..1"):
        load_config(bad)
    bad.write_text('[models.m]\nreplica_groups = 0\n')
    with pytest.raises(SystemExit, match="replica_groups must be at least 1"):
        load_config(bad)


@pytest.mark.parametrize("words_in,shift,words_out", [(1, 0, 1), (1, 5, 1), (1, 60, 2), (2, 64, 3),
                                                      (2, 71, 4), (3, 3, 4)])
def test_shift_masks_matches_python_ints(words_in, shift, words_out):
    rng = random.Random(shift)
    masks = [rng.getrandbits(64 * words_in) for _ in range(50)] + [0, 1 << (64 * words_in - 1)]
    drop = rng.getrandbits(64 * words_in)
    raw = b"".join(m.to_bytes(8 * words_in, "little") for m in masks)
    out = shift_masks(raw, words_in, shift, words_out, drop)
    want = [((m & ~drop) << shift) & ((1 << (64 * words_out)) - 1) for m in masks]
    w = 8 * words_out
    got = [int.from_bytes(out[i * w:(i + 1) * w], "little") for i in range(len(masks))]
    assert got == want


def _answers(shard: ModelShard, docs):
    out = []
    for d in docs:
        res = walk.lookup(shard, d, len(d) * BS + 1, 100.0)
        out.append(sorted(res, key=lambda a: (a.replica, a.dp_rank)))
    return out


@pytest.mark.parametrize("replicas,groups", [(9, 4), (70, 3), (130, 4)])
@pytest.mark.parametrize("through_snapshots", [False, True])
def test_groups_absorbed_answer_like_one_shard(replicas, groups, through_snapshots):
    batches, docs = random_fleet(replicas, seed=replicas)
    whole = ModelShard("m", BS)
    parts = [ModelShard("m", BS) for _ in range(groups)]
    for b in batches:
        whole.apply(b, 2.0)
        parts[hashed_group(b.replica, groups)].apply(b, 2.0)
    if through_snapshots:  # what a service instance rebuilds from: each group's snapshot parts
        parts = [decode_parts([encode_segments(p, 0, SEGMENTS)]) for p in parts]
    merged = parts[0]
    for p in parts[1:]:
        merged.absorb(p)
    assert sorted(merged.replicas) == sorted(whole.replicas)
    assert _answers(merged, docs) == _answers(whole, docs)
    for gid, g in whole.groups.items():  # the same entries, per tier
        for tid, d in g.tiers.items():
            assert len(merged.groups[gid].tiers[tid]) == len(d)


def test_a_replica_in_two_groups_keeps_its_newer_state():
    old, new = ModelShard("m", BS), ModelShard("m", BS)
    old.apply(EventBatch(SCHEMA_VERSION, "m", "r", 0, 1, 4, 1.0, 1.0, BS,
                         [BlocksStored("GPU", 0, [1, 2, 3], None, 0)]), 1.0)
    old.apply(EventBatch(SCHEMA_VERSION, "m", "other", 0, 1, 0, 1.0, 1.0, BS,
                         [BlocksStored("GPU", 0, [1], None, 0)]), 1.0)
    # the replica moved to another group: its relay re-sent its state there (a later part)
    new.apply(EventBatch(SCHEMA_VERSION, "m", "r", 0, 1, 4, 2.0, 2.0, BS,
                         [ReplicaCleared("resync"), BlocksStored("GPU", 0, [1, 2], None, 0)], part=1), 2.0)
    a = decode_parts([encode_segments(old, 0, SEGMENTS)])
    a.absorb(decode_parts([encode_segments(new, 0, SEGMENTS)]))
    hits = {a.by_slot[s].replica: n for s, n in walk.prefix_blocks(a, [1, 2, 3]).items()}
    assert hits == {"r": 2, "other": 1}
    b = decode_parts([encode_segments(new, 0, SEGMENTS)])  # the other order: the same
    b.absorb(decode_parts([encode_segments(old, 0, SEGMENTS)]))
    assert {b.by_slot[s].replica: n for s, n in walk.prefix_blocks(b, [1, 2, 3]).items()} == hits
