"""The signals a fleet's own controllers act on (issue 41 item 4), on /metrics of a real HTTP server:
the working set by tier, the prompt tokens cached below GPU memory only, and each replica's cache
pressure (blocks its removal events took out), each with the figure worked out by hand."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from index_service.app import create_app
from index_service.store import ShardStore
from kvidx.core.hashing import prompt_hashes
from kvidx.core.maskmap import PyMaskMap
from kvidx.core.shard import ModelShard
from schemas.events import SCHEMA_VERSION, BlocksRemoved, BlocksStored, EventBatch
from tests.helpers import ServerThread

MODEL = "signals-model"
BS = 16
PROMPT = list(range(1000, 1000 + 8 * BS))  # 8 index blocks
HASHES = prompt_hashes(PROMPT, BS)


def _batch(replica: str, seq: int, events: list) -> EventBatch:
    now = time.time()
    return EventBatch(SCHEMA_VERSION, MODEL, replica, 0, 1, seq, now, now, BS, events)


def _sample(text: str, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    m = re.search(rf"^{name}{{{re.escape(want)}}} (\S+)$", text, re.M)
    return float(m[1]) if m else None


@pytest.fixture()
def store() -> ShardStore:
    """Replica a: the prompt's 8 blocks in host memory (CPU) and its first 2 in GPU memory too;
    replica b: the first 3 in GPU memory, of which it then evicts the third."""
    s = ShardStore(index_block_size=BS)
    s.apply(_batch("a", 0, [BlocksStored("CPU", 0, HASHES, None, 0),
                            BlocksStored("GPU", 0, HASHES[:2], None, 0)]))
    s.apply(_batch("b", 0, [BlocksStored("GPU", 0, HASHES[:3], None, 0)]))
    s.apply(_batch("b", 1, [BlocksRemoved("GPU", 0, HASHES[2:3])]))
    return s


def test_working_set_by_tier_and_cache_pressure_per_replica(store):
    with ServerThread(create_app(store)) as url:
        text = httpx.get(f"{url}/metrics").text
        models = httpx.get(f"{url}/v1/models").json()["models"]
    # distinct blocks held in each tier by any replica: GPU {0, 1} (a's two, b's two left), CPU all 8
    assert _sample(text, "kvidx_working_set_blocks", model=MODEL, tier="GPU") == 2
    assert _sample(text, "kvidx_working_set_blocks", model=MODEL, tier="CPU") == 8
    assert _sample(text, "kvidx_working_set_blocks", model=MODEL, tier="any") == 8
    assert _sample(text, "kvidx_working_set_tokens", model=MODEL, tier="CPU") == 8 * BS
    (m,) = [m for m in models if m["model"] == MODEL]
    assert m["groups"]["0"]["tiers"] == {"GPU": 2, "CPU": 8}
    # b's one eviction; a removed nothing
    assert _sample(text, "kvidx_replica_blocks_removed_total", model=MODEL, replica="b", dp_rank="0") == 1
    assert _sample(text, "kvidx_replica_blocks_removed_total", model=MODEL, replica="a", dp_rank="0") == 0


def test_prompt_tokens_cached_below_gpu_only_are_counted_per_lookup(store):
    with ServerThread(create_app(store)) as url:
        for body in ({"model": MODEL, "token_ids": PROMPT}, {"model": MODEL, "token_ids": PROMPT[:2 * BS]}):
            assert httpx.post(f"{url}/v1/lookup", json=body).status_code == 200
        text = httpx.get(f"{url}/metrics").text
        models = httpx.get(f"{url}/v1/models").json()["models"]
    # the whole prompt: a holds 8 blocks (2 on GPU, then CPU), b 2 on GPU: 128 cached, 32 on GPU ->
    # 96 below GPU only. The 2-block prompt: on GPU at both replicas -> 0.
    assert _sample(text, "kvidx_lookup_below_gpu_tokens_total", model=MODEL) == 6 * BS
    assert _sample(text, "kvidx_lookup_prompt_tokens_total", model=MODEL) == 10 * BS
    # the same counts per model in /v1/models, beside the working set
    (m,) = [m for m in models if m["model"] == MODEL]
    assert m["since_start"]["lookup_below_gpu_tokens"] == 6 * BS
    assert m["since_start"]["lookup_prompt_tokens"] == 10 * BS


@pytest.mark.parametrize("compiled", [True, False])
def test_removed_counts_the_entries_a_removal_took_out_in_both_folds(compiled):
    shard = ModelShard("m", BS) if compiled else type("Ref", (ModelShard,), {"new_map": PyMaskMap})("m", BS)
    shard.apply(_batch("a", 0, [BlocksStored("GPU", 0, [1, 2, 3], None, 0)]), 1.0)
    shard.apply(_batch("a", 1, [BlocksStored("GPU", 0, [4], None, 0)]), 1.0)
    # two held, one never stored: two taken out
    shard.apply(_batch("a", 2, [BlocksRemoved("GPU", 0, [2, 3, 99])]), 1.0)
    st = shard.replicas[("a", 0)]
    assert (st.removed, st.blocks) == (2, 2)
