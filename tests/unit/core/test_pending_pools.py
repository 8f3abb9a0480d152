"""Pending credit (routed prompts count as cached until confirmed or expired) and shared pools
(a pool's blocks count for every replica attached to it), on the pure shard."""

from kvidx.core import walk
from kvidx.core.shard import ModelShard
from schemas.answers import Tier
from schemas.events import SCHEMA_VERSION, BlocksRemoved, BlocksStored, EventBatch

H = list(range(1000, 1010))  # ten canonical hashes of one chain (16-token index blocks)


def batch(replica, seq, events, bs=16):
    return EventBatch(SCHEMA_VERSION, "m", replica, 0, 1, seq, 0.0, 0.0, bs, events)


def stored(hashes, tier="GPU"):
    return BlocksStored(tier, 0, hashes, None, 0)


def answer(shard, replica, hashes=H, n=161, now=0.0):
    return next(a for a in walk.lookup(shard, hashes, n, now) if a.replica == replica)


def test_pending_credit_until_confirmed_or_expired():
    s = ModelShard("m", 16)
    s.apply(batch("a", 0, [stored(H[:2])]), 0.0)
    s.apply(batch("b", 0, [stored(H[:1])]), 0.0)
    assert answer(s, "b").resumable_tokens == 16
    s.add_pending("b", 0, H, 161, credited=16, expires=5.0)
    a = answer(s, "b", now=1.0)
    assert a.resumable_tokens == 160 and a.pending_tokens == 144 and a.cached_tokens == 16
    assert a.inflight_prefill_tokens == 145
    assert answer(s, "a", now=1.0).pending_tokens == 0  # only the routed replica
    # the engine confirms 4 blocks: they are the index's now; an eviction of one is not hidden
    s.apply(batch("b", 1, [stored(H[:4])]), 1.5)
    s.apply(batch("b", 2, [BlocksRemoved("GPU", 0, [H[2]])]), 1.6)
    assert answer(s, "b", now=2.0).resumable_tokens == 32
    s2 = ModelShard("m", 16)
    s2.apply(batch("b", 0, [stored(H[:1])]), 0.0)
    s2.add_pending("b", 0, H, 161, 16, expires=5.0)
    assert answer(s2, "b", now=4.9).resumable_tokens == 160
    assert answer(s2, "b", now=5.0).resumable_tokens == 16  # expired
    assert walk.credited(s2, H, 161, "b", now=6.0) == 16


def test_pending_credit_uses_the_engine_block_size():
    s = ModelShard("m", 16)
    s.apply(batch("a", 0, [stored(H[:2])], bs=32), 0.0)
    s.add_pending("new", 0, H[:9], 150, 0, expires=9.0)  # a replica with no event yet
    assert answer(s, "new", H[:9], 150).resumable_tokens == 128  # 32-token engine blocks


def test_pending_credit_in_a_sliding_window_model_counts_the_last_window_only():
    """A routed prefill computes its whole prompt, but a sliding-window group keeps only the window
    before its end (vLLM allocates no block the window has passed): the route credits the prompt up to
    its end, and a prompt that leaves it earlier only as far as the window group holds it."""
    s = ModelShard("m", 16)
    fa = BlocksStored("GPU", 0, H[:1], None, 0, group_kind="full_attention")
    swa = BlocksStored("GPU", 1, H[:1], None, 0, group_kind="sliding_window", sliding_window=32)
    s.apply(batch("r", 0, [fa, swa]), 0.0)
    s.add_pending("r", 0, H, 161, credited=16, expires=5.0)  # 161 tokens: resumable up to 160
    a = answer(s, "r", now=1.0)
    assert a.resumable_tokens == 160 and a.pending_tokens == 144
    assert walk.credited(s, H, 161, "r", now=1.0) == 160
    # a prompt leaving the routed one after 6 blocks: the window before 96 is not kept
    other = [*H[:6], 2000, 2001]
    assert answer(s, "r", other, 129, now=1.0).resumable_tokens == 16
    # the engine's events: the full-attention blocks and the last window; the route is confirmed
    s.apply(batch("r", 1, [BlocksStored("GPU", 0, H, None, 0, group_kind="full_attention"),
                           BlocksStored("GPU", 1, H[8:], None, 0, group_kind="sliding_window",
                                        sliding_window=32)]), 1.5)
    assert not s.pending.window_masks and answer(s, "r", now=2.0).resumable_tokens == 160
    s.apply(batch("r", 2, [BlocksRemoved("GPU", 1, [H[9]])]), 1.6)  # an eviction shows at once
    assert answer(s, "r", now=2.0).resumable_tokens == 16
    # the prompt routed there again: full attention holds it all, the window group will hold its end
    s.add_pending("r", 0, H, 161, credited=16, expires=5.0)
    assert not s.pending.masks and s.pending.window_masks
    a = answer(s, "r", now=2.5)
    assert a.resumable_tokens == 160 and a.pending_tokens == 144


def test_pool_blocks_count_for_attached_replicas_only():
    s = ModelShard("m", 16)
    s.set_pools({"pool-1": ["a", "b"]})
    s.apply(batch("a", 0, [stored(H[:2])]), 0.0)
    s.apply(batch("pool-1", 0, [stored(H[:6], tier="POOL")]), 0.0)
    s.apply(batch("c", 0, [stored(H[:1])]), 0.0)
    s.apply(batch("b", 0, [stored([7])]), 0.0)  # b holds none of this prompt itself
    a, b, c = (answer(s, r) for r in "abc")
    gpu, pool = Tier("GPU", 32), Tier("POOL", 64)
    assert a.cached_tokens == 96 and a.tiers == [gpu, pool]
    assert b.cached_tokens == 96 and b.tiers == [Tier("POOL", 96)]
    assert c.cached_tokens == 16  # not attached
    assert all(x.replica != "pool-1" for x in walk.lookup(s, H, 161, 0.0))  # a pool is not a routing target
    s.apply(batch("pool-1", 1, [BlocksRemoved("POOL", 0, [H[3]])]), 0.0)  # the pool evicts
    assert answer(s, "b").cached_tokens == 48


def test_move_between_tiers_never_loses_a_block():
    s = ModelShard("m", 16)
    s.apply(batch("a", 0, [stored(H[:4])]), 0.0)
    s.apply(batch("a", 1, [stored(H[2:4], tier="CPU"), BlocksRemoved("GPU", 0, H[2:4])]), 0.0)
    a = answer(s, "a")
    assert a.cached_tokens == 64
    assert a.tiers == [Tier("GPU", 32), Tier("CPU", 32)]
    s.apply(batch("a", 2, [BlocksRemoved("CPU", 0, H[3:4])]), 0.0)  # the last tier drops it
    assert answer(s, "a").cached_tokens == 48


def test_the_bound_prefix_walk_answers_as_prefix_blocks_as_the_shard_changes():
    """index.prefix_walk's walker skips prefix_blocks' checks on the common shard: it must still see a
    shard with no group yet, an empty prompt, a pool attached later, a sliding-window group added, and
    (a walker bound while a sliding-window group was the only one) a full-attention group that comes
    later and becomes the default."""
    from kvidx import index
    s = ModelShard("m", 16)
    walk_prompt = index.prefix_walk(s)
    prompts = [H, H[:3], [], [H[0], 7, *H[1:]], [5]]

    def same():
        for p in prompts:
            assert dict(walk_prompt(p)) == dict(walk.prefix_blocks(s, p)), p

    same()  # no group: nothing cached
    s.apply(batch("a", 0, [stored(H[:4])]), 0.0)
    s.apply(batch("b", 0, [stored(H[:2])]), 0.0)
    same()
    s.apply(batch("pool-1", 0, [stored(H)]), 0.0)
    s.set_pools({"pool-1": ["a", "b"]})  # a's and b's hits reach through the pool now
    same()
    assert dict(walk_prompt(H))[s.replicas[("a", 0)].slot] == len(H)
    s.set_pools({})
    swa = BlocksStored("GPU", 1, H[:1], None, 0, group_kind="sliding_window", sliding_window=32)
    s.apply(batch("a", 1, [swa, stored(H[:6])]), 0.0)
    same()
    s = ModelShard("m", 16)
    s.apply(batch("a", 0, [BlocksStored("GPU", 1, H[:3], None, 0, group_kind="sliding_window",
                                        sliding_window=32)]), 0.0)
    walk_prompt = index.prefix_walk(s)
    same()
    assert dict(walk_prompt(H)) == {0: 3}  # the only group
    s.apply(batch("a", 1, [stored(H[:2])]), 0.0)  # a full-attention group: the default from now on
    same()
    assert dict(walk_prompt(H)) == {0: 2}
