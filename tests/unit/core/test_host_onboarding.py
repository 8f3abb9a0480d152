"""A host tier whose loads free its oldest blocks (EventBatch.host_tier_blocks, TensorRT-LLM's
onboardBlock -> getFreeBlock): a hit whose own host loads free the rest of it is credited only up to
where the engine will still find it (kvidx.core.walk.onboard_cut)."""

from kvidx.core import walk
from kvidx.core.foresight import HostLoads
from kvidx.core.shard import ModelShard
from schemas.events import SCHEMA_VERSION, BlocksRemoved, BlocksStored, EventBatch

CHAIN = [1, 2, 3, 4, 5]


def batch(seq, events, host_tier_blocks):
    return EventBatch(SCHEMA_VERSION, "m", "t", 0, 1, seq, 0.0, 0.0, 16, events,
                      host_tier_blocks=host_tier_blocks)


def offloaded(host_tier_blocks: int) -> ModelShard:
    """Replica t cached CHAIN on its GPU, then offloaded its three deepest blocks to the host, deepest
    first (the engine frees a sequence tail first): the host holds 5, 4, 3, oldest first."""
    s = ModelShard("m", 16)
    events = [BlocksStored("GPU", 0, CHAIN, None, 0)]
    for h in (5, 4, 3):  # engine block hash 100 + h: each offload is one engine block
        events += [BlocksStored("CPU", 0, [h], h - 1, h - 1, [100 + h]),
                   BlocksRemoved("GPU", 0, [h], [100 + h])]
    s.apply(batch(0, events, host_tier_blocks), 0.0)
    return s


def resumable(s: ModelShard, prompt: list[int]) -> int:
    (a,) = walk.lookup(s, prompt, len(prompt) * 16 + 1, 1.0)
    return a.resumable_tokens


def test_own_loads_free_the_deepest_host_blocks_first():
    prompt = [*CHAIN, 6]
    # host of 4 blocks, 3 cached: loading 3 takes the free slot; loading 4 frees 5 (the oldest): the
    # walk ends before 5
    s = offloaded(4)
    assert resumable(s, prompt) == 64 and walk.credited(s, prompt, 97, "t") == 64
    (a,) = walk.lookup(s, prompt, 97, 1.0)
    assert a.cached_tokens == 80  # held now: the cut is what the engine can resume, not what it holds
    assert a.evicting_tokens == 16  # and the answer says what the cut took
    # host of 3, all cached: loading 3 frees 5 at once (the oldest); the walk ends there too
    assert resumable(offloaded(3), prompt) == 64
    # a prompt that needs no host block, or an engine whose loads free nothing: the whole hit
    assert resumable(s, [1, 2, 7]) == 32
    assert resumable(offloaded(0), prompt) == 80


def test_a_roomy_host_frees_only_empty_slots():
    assert resumable(offloaded(8), [*CHAIN, 6]) == 80  # five empty host slots take the three loads


def test_the_host_queue_keeps_empty_slots_where_the_engine_does():
    """HostLoads follows TensorRT-LLM's host queue by engine block: a load leaves its slot empty at
    the tail, so the next load takes the oldest block even while slots are empty; an evicted block's
    slot stays empty where it was; a removal of the front that no offload explains is an offload of a
    block outside the radix tree (its slot goes to the tail); an offload whose front block is then
    loaded took the slot behind it (the engine had claimed the block for that load)."""
    h = HostLoads(3)
    for k in (1, 2, 3):
        h.stored([100 + k], [k])  # offloads fill the host: 1, 2, 3 oldest first
    h.raised([102])
    h.removed([102])  # 2 loaded: its slot is empty, at the tail
    assert h.reach([1, 3], [0, 1]) == 1  # loading 1 takes the front, which is 3 (1 is claimed)
    h.removed([103])  # 3 evicted (a subtree freed): its slot empty where it was
    assert h.reach([1], [0]) is None  # loading 1 takes 3's empty slot
    h.removed([101])  # the front removed with no offload shown: its slot to the tail
    h.stored([107], [7])  # the next offload takes the front: 3's empty slot
    h.stored([108], [8])  # and then 2's
    assert set(h.unit_of) == {7, 8} and len(h.order) == 3
    h.stored([109], [9])  # 1's empty slot taken: 7 is the front now
    assert h.reach([9, 7], [0, 1]) == 1  # loading 9 frees the front, 7
    # an offload takes the front (7), but the next event loads 7: the engine had claimed it and took
    # the slot behind it (8, whose removal follows); 7's load leaves an empty slot at the tail
    h.stored([110], [10])
    h.removed([108])
    h.raised([107])
    h.removed([107])
    assert set(h.unit_of) == {9, 10} and len(h.order) == 3 and len(h.empty) == 1
