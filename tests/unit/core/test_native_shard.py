"""The compiled mask map against the pure-Python reference, a whole shard at a time: random event
streams (stores and removals across tiers, clears, redeliveries, a sliding-window group, pools,
pending credit, > 64 replicas) folded into a shard on each implementation must answer every lookup
identically, and each one's snapshot must restore into the other."""

import random

import msgspec
import pytest

from kvidx.core import walk
from kvidx.core.maskmap import IMPLEMENTATION, PyMaskMap
from kvidx.core.shard import ModelShard
from kvidx.core.snapshot import decode_snapshot, encode_snapshot
from schemas.events import SCHEMA_VERSION, BlocksRemoved, BlocksStored, EventBatch, ReplicaCleared

pytestmark = pytest.mark.skipif(IMPLEMENTATION != "native", reason="kvidx_native is not built here")

TIERS = ["GPU", "CPU", "DISK"]


class ReferenceShard(ModelShard):
    new_map = PyMaskMap


def _stream(r: random.Random, n_replicas: int, chains: list[list[int]], n: int) -> list[EventBatch]:
    seqs: dict[str, int] = {}
    out = []
    for _ in range(n):
        rep = f"r{r.randrange(n_replicas)}"
        c = r.choice(chains)
        k = r.randint(1, len(c))
        tier = r.choice(TIERS) if r.random() < 0.4 else "GPU"
        group = 1 if r.random() < 0.2 else 0
        kind = "sliding_window" if group else "full_attention"
        x = r.random()
        if x < 0.6:
            ev = BlocksStored(tier, group, c[:k], None, 0, group_kind=kind,
                              sliding_window=32 if group else None)
        elif x < 0.95:
            ev = BlocksRemoved(tier, group, r.sample(c, r.randint(1, len(c))))
        else:
            ev = ReplicaCleared("reset")
        seq = seqs.get(rep, -1) + 1
        if r.random() < 0.05:  # a redelivery: skipped by both
            seq = max(0, seq - 1)
        seqs[rep] = seq
        out.append(EventBatch(SCHEMA_VERSION, "m", rep, 0, 1, seq, 1.0, 1.0, 16, [ev]))
    return out


def _answers(shard: ModelShard, prompts: list[list[int]]) -> list:
    return [msgspec.to_builtins(walk.lookup(shard, p, 16 * len(p) + 1, 5.0)) for p in prompts]


@pytest.mark.parametrize("seed", range(12))
def test_native_and_reference_shards_answer_identically(seed):
    r = random.Random(seed)
    n_replicas = r.choice([3, 8, 64, 70])
    roots = [[r.getrandbits(64) for _ in range(r.randint(1, 12))] for _ in range(6)]
    chains = [root + [r.getrandbits(64) for _ in range(r.randint(0, 8))] for root in roots for _ in range(3)]
    native, ref = ModelShard("m", 16), ReferenceShard("m", 16)
    # a shared pool read by half the replicas (topology is configuration: not in snapshots)
    pools = {"r0": [f"r{i}" for i in range(1, n_replicas, 2)]} if seed % 3 == 0 else {}
    native.set_pools(pools)
    ref.set_pools(pools)

    def restored(cls: type[ModelShard], data: bytes) -> ModelShard:
        shard = decode_snapshot(data, cls)
        shard.set_pools(pools)
        return shard

    for b in _stream(r, n_replicas, chains, 400):
        assert native.apply(b, 2.0) == ref.apply(b, 2.0)
    prompts = chains + [c[:-1] for c in chains] + [[r.getrandbits(64)]]
    # each one's snapshot restores into the other (pending credit is not in snapshots: before it)
    assert _answers(restored(ReferenceShard, encode_snapshot(native)), prompts) == _answers(ref, prompts)
    assert _answers(restored(ModelShard, encode_snapshot(ref)), prompts) == _answers(native, prompts)
    for s in (native, ref):
        for i in range(2):  # pending credit: a routed prompt not yet confirmed
            s.add_pending(f"r{i + 1}", 0, chains[i], 16 * len(chains[i]), 0, 10.0)
    assert _answers(native, prompts) == _answers(ref, prompts)
    assert [walk.prefix_blocks(native, p) for p in prompts] == [walk.prefix_blocks(ref, p) for p in prompts]
    assert native.stats() == ref.stats()
    assert sorted(native.groups[0].any.items()) == sorted(ref.groups[0].any.items())
