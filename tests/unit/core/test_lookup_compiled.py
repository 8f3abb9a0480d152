"""kvidx.index.lookup's compiled answers (kvidx.core.walk.lookup_json, unpriced, decoded into the
answer structs) against the Python walk they stand in for (kvidx.core.walk.lookup): on random
shards of the kind the compiled writer takes (one full-attention group in one tier: engine block
sizes, token-granular replicas and their partial-block keys, recompute tails, pending routes with
prefill in flight, some expired, a replica never reported; hashes as PromptHashes, lists and the
service's HashArray) the answers must be equal for every top_k; where it does not apply (a second
tier, a host queue below the GPU, a full-attention group with a window, a seq past 64 bits, a
negative top_k) the compiled writer must decline and the walk answer."""

import os
import random

import pytest

from kvidx import index
from kvidx.core import maskmap, walk
from kvidx.core.hashing import pack_tokens, prompt_hashes, tail_key
from kvidx.core.shard import ModelShard
from schemas.events import SCHEMA_VERSION, BlocksRemoved, BlocksStored, EventBatch

NATIVE = maskmap.lookup_json is not None
if not NATIVE and os.environ.get("KVIDX_REQUIRE_NATIVE") == "1" and os.environ.get("KVIDX_NATIVE") != "0":
    raise ImportError("KVIDX_REQUIRE_NATIVE=1 but kvidx_native has no lookup_json")
NOW = 1_700_000_100.25
BS = 16


def _prompts(r: random.Random) -> list[list[int]]:
    """Token prompts sharing prefixes (4 roots, 3 continuations each)."""
    roots = [[r.randrange(50_000) for _ in range(r.randint(1, 120))] for _ in range(4)]
    return [root + [r.randrange(50_000) for _ in range(r.randint(0, 100))]
            for root in roots for _ in range(3)]


def _shard(r: random.Random, tier: str = "GPU") -> tuple[ModelShard, list[list[int]]]:
    shard = ModelShard("m", BS)
    prompts = _prompts(r)
    names = ['r"0', "rép-1"] + [f"tcp://10.0.0.{i}:5557" for i in range(r.randint(1, 70))]
    seqs: dict[str, int] = {}
    for _ in range(300):
        rep = r.choice(names)
        toks = r.choice(prompts)
        hs = prompt_hashes(toks, BS)
        k = r.randint(1, max(1, len(hs)))
        if not hs:
            continue
        events: list = []
        if r.random() < 0.75:
            events.append(BlocksStored(tier, 0, hs[:k], None, 0, block_size=r.choice([0, 0, 0, 1])))
            if r.random() < 0.4:  # the partial block after them: a token-granular engine's keys
                seed = hs[k - 1]
                n = r.randint(1, BS - 1)
                part = toks[k * BS:k * BS + n]
                if len(part) == n:
                    keys = [tail_key(seed, pack_tokens(part[:i])) for i in range(1, n + 1)]
                    events.append(BlocksStored(tier, 0, keys, None, 0, tail=True))
        else:
            events.append(BlocksRemoved(tier, 0, r.sample(hs, r.randint(1, len(hs)))))
        seq = seqs.get(rep, -1) + 1
        seqs[rep] = seq
        ets = NOW - r.uniform(0, 30)
        shard.apply(EventBatch(SCHEMA_VERSION, "m", rep, 0, 1, seq, ets, ets, r.choice([16, 32, 64]), events,
                               recompute_tokens=r.choice([1, 1, 2])), ets + r.uniform(0, 0.01))
    shard.replica("never-reported", 0)  # no batch yet: no freshness
    for _ in range(r.randint(1, 4)):  # routed prompts pending (some expired), with prefill in flight
        hs = prompt_hashes(r.choice(prompts), BS)
        st = r.choice([s for s in shard.by_slot if s is not None])
        shard.add_pending(st.replica, st.dp_rank, list(hs), BS * len(hs) + r.randint(0, 15), r.randint(0, 64),
                          NOW + r.choice([-1, 60]))
    return shard, prompts + [[r.randrange(50_000) for _ in range(40)]]


def _compare(shard: ModelShard, prompts: list[list[int]], r: random.Random) -> tuple[int, int, int]:
    """(answers compared, tokens they credit, answers crediting a partial block)."""
    n_answers = credited = partial = 0
    for toks in prompts:
        # prompts ending past their blocks: keyed for partial blocks as the lookup service keys them,
        # or a router's plain list, or the service's HashArray (whole blocks only)
        form = r.choice(["tails", "tails", "list", "array"])
        hs = prompt_hashes(toks + [7] * r.randint(0, 20), BS, tails=form == "tails", array=form == "array")
        n = len(toks) + r.randint(0, 20)
        for top_k in (None, 0, 1, 3, 200):
            want = walk.lookup(shard, hs, n, NOW, top_k)
            got = index.lookup(shard, hs, n, NOW, top_k)
            assert got == want
            n_answers += len(got)
            credited += sum(a.resumable_tokens for a in got)
            partial += sum(a.cached_tokens % BS != 0 for a in got)
    return n_answers, credited, partial


@pytest.mark.skipif(not NATIVE, reason="kvidx_native is not built here")
@pytest.mark.parametrize("seed", range(8))
def test_compiled_lookups_are_the_walks(seed, monkeypatch):
    r = random.Random(seed)
    shard, prompts = _shard(r, tier=r.choice(["GPU", "CPU"]))
    if seed % 2:  # the replicas' fields by attribute lookup (no ReplicaFields): the same answers
        shard.replica_fields = None
    compiled = []
    real = walk.lookup_json
    monkeypatch.setattr(walk, "lookup_json", lambda *a, **k: compiled.append(real(*a, **k)) or compiled[-1])
    n_answers, credited, partial = _compare(shard, prompts, r)
    assert n_answers and credited > 0 and partial > 0  # not a comparison of empty answers: partial
    assert compiled and all(c is not None for c in compiled)  # blocks credited; all compiled


def _one_replica(events: list, seq: int = 0, **batch) -> ModelShard:
    shard = ModelShard("m", BS)
    shard.apply(EventBatch(SCHEMA_VERSION, "m", "r0", 0, 1, seq, NOW, NOW, BS, events, **batch), NOW)
    return shard


HS = prompt_hashes(list(range(8 * BS)), BS)  # 8 blocks


def _declined(shard: ModelShard) -> None:
    """The compiled writer declines; index.lookup gives the walk's answers (and the walk credits)."""
    assert walk.lookup_json(shard, HS, len(HS) * BS, NOW, 0.0, {}, priced=False) is None
    for top_k in (None, 1):
        want = walk.lookup(shard, HS, len(HS) * BS, NOW, top_k)
        assert index.lookup(shard, HS, len(HS) * BS, NOW, top_k) == want
        assert want[0].cached_tokens > 0


@pytest.mark.skipif(not NATIVE, reason="kvidx_native is not built here")
def test_shards_the_compiled_writer_does_not_take_fall_back_to_the_walk():
    r = random.Random(11)
    shard, prompts = _shard(r)
    hs = prompt_hashes(prompts[0], BS)
    shard.apply(EventBatch(SCHEMA_VERSION, "m", "tcp://10.0.0.0:5557", 0, 2, 0, NOW, NOW, 16,
                           [BlocksStored("CPU", 0, list(hs), None, 0)]), NOW)  # a second tier
    assert walk.lookup_json(shard, hs, 16 * len(hs), NOW, 0.0, {}, priced=False) is None
    n_answers, credited, _ = _compare(shard, prompts, r)  # (the walk's answers on both sides)
    assert n_answers and credited > 0


@pytest.mark.skipif(not NATIVE, reason="kvidx_native is not built here")
def test_a_host_queue_below_the_gpu_cuts_the_hit_as_the_walk_does():
    # TensorRT-LLM with a host tier of 4 blocks holding the prompt's 8, offloaded deepest first (one
    # engine block each): loading them frees the host's oldest, so the walk credits 2 of the 8 blocks
    # (onboard_cut); the compiled writer knows no host queue and credited all 8
    shard = _one_replica([BlocksStored("CPU", 0, [HS[i]], HS[i - 1] if i else None, i, [100 + i])
                          for i in range(7, -1, -1)], host_tier_blocks=4)
    _declined(shard)
    assert walk.lookup(shard, HS, len(HS) * BS, NOW)[0].evicting_tokens > 0


@pytest.mark.skipif(not NATIVE, reason="kvidx_native is not built here")
def test_a_full_attention_group_with_a_window_keeps_its_window():
    shard = _one_replica([BlocksStored("GPU", 0, list(HS), None, 0, sliding_window=4096)])
    _declined(shard)
    assert walk.lookup(shard, HS, len(HS) * BS, NOW)[0].groups[0].window == 4096


@pytest.mark.skipif(not NATIVE, reason="kvidx_native is not built here")
def test_values_past_the_writers_ints_are_answered_by_the_walk():
    # a batch's seq is an unbounded int in the schema: past 2**63 the compiled writer cannot read it
    # (this raised OverflowError out of every lookup of the model, the HTTP service's included)
    shard = _one_replica([BlocksStored("GPU", 0, list(HS), None, 0)], seq=2**63 + 5)
    _declined(shard)
    shard = _one_replica([BlocksStored("GPU", 0, list(HS), None, 0)])
    assert index.lookup(shard, HS, len(HS) * BS, NOW, -1) == walk.lookup(shard, HS, len(HS) * BS, NOW, -1)


@pytest.mark.skipif(not NATIVE, reason="kvidx_native is not built here")
def test_a_native_build_without_unpriced_answers_still_answers(monkeypatch):
    # a build older than `priced` (kvidx.core.maskmap.UNPRICED_JSON False): the walk answers the
    # in-process lookups, and the service's priced answers are still compiled
    shard = _one_replica([BlocksStored("GPU", 0, list(HS), None, 0)])
    monkeypatch.setattr(walk, "UNPRICED_JSON", False)
    _declined(shard)
    assert walk.lookup_json(shard, HS, len(HS) * BS, NOW, 1e-4, {}) is not None
