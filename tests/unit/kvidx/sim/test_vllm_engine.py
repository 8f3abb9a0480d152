"""The simulated vLLM engine: wire format, prefix caching, eviction, replay and gap hooks."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from kvidx.engines.vllm.sim import SimVllmEngine
from kvidx.engines.vllm.wire import AllBlocksCleared, BlockRemoved, BlockStored, decode_payload
from kvidx.sim.prompts import workload, workload_requests

B = 16
END = (-1).to_bytes(8, "big", signed=True)


def _sub(ctx: zmq.Context, endpoint: str | None = None) -> tuple[zmq.Socket, str]:
    """A SUB socket: connects to `endpoint`, or binds a free loopback port if None."""
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SUBSCRIBE, b"kv")
    if endpoint is None:
        s.bind("tcp://127.0.0.1:*")
        endpoint = s.getsockopt_string(zmq.LAST_ENDPOINT)
    else:
        s.connect(endpoint)
    return s, endpoint


def _settle(sub: zmq.Socket, seconds: float = 0.3) -> None:
    """Wait out the slow joiner. Poll rather than sleep: a bound SUB only attaches a connecting PUB
    (and sends it the subscription) when the application thread touches the socket."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert not sub.poll(20)


def _recv_all(sock: zmq.Socket, timeout_ms: int = 500) -> list[list[bytes]]:
    msgs = []
    while sock.poll(timeout_ms):
        msgs.append(sock.recv_multipart())
        timeout_ms = 200
    return msgs


def _replay(ctx: zmq.Context, endpoint: str, start: int) -> list[list[bytes]]:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(endpoint)
    d.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    try:
        while True:
            assert d.poll(3000), "replay timed out"
            out.append(d.recv_multipart())
            if out[-1][2] == END:
                return out
    finally:
        d.close()


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


@pytest.fixture
def engine():
    e = SimVllmEngine(num_blocks=64, block_size=B, endpoint="tcp://127.0.0.1:*",
                      replay_endpoint="tcp://127.0.0.1:*")
    yield e
    e.close()


def test_engine_binds_sub_connects_and_batches_decode(ctx, engine):
    sub, _ = _sub(ctx, engine.endpoint)
    _settle(sub)
    prompt = list(range(100, 150))  # 50 tokens: 3 full blocks
    assert engine.serve(prompt, [7, 8, 9]) == 0
    msgs = _recv_all(sub)
    sub.close()
    assert len(msgs) == 1
    topic, seq, payload = msgs[0]
    assert topic == b"kv" and int.from_bytes(seq, "big") == 0
    batch = decode_payload(payload)
    assert batch.data_parallel_rank == 0
    (ev,) = batch.events
    assert isinstance(ev, BlockStored)
    # prompt + output minus the last token = 52 tokens -> 3 full blocks
    assert ev.parent_block_hash is None and ev.block_size == B
    assert ev.token_ids == prompt[:48]
    assert ev.block_hashes == engine.engine_hashes(prompt)[:3]
    assert ev.extra_keys == [None] * 3 and ev.group_idx == 0 and ev.medium == "GPU"
    assert ev.kv_cache_spec_kind == "full_attention"
    # exactly the keys vLLM 0.32 writes, in its order
    raw = msgspec.msgpack.decode(payload)
    assert list(raw[1][0]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                               "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                               "kv_cache_spec_kind"]


def test_sub_binds_engine_connects(ctx):
    sub, ep = _sub(ctx)
    e = SimVllmEngine(num_blocks=32, block_size=B, endpoint=ep, bind=False, dp_rank=3)
    try:
        _settle(sub)
        e.serve(list(range(40)))
        e.reset()
        msgs = _recv_all(sub)
    finally:
        e.close()
        sub.close()
    assert [int.from_bytes(m[1], "big") for m in msgs] == [0, 1]
    batches = [decode_payload(m[2]) for m in msgs]
    assert all(b.data_parallel_rank == 3 for b in batches)
    assert isinstance(batches[1].events[0], AllBlocksCleared)
    assert msgspec.msgpack.decode(msgs[1][2])[1] == [{"type": "AllBlocksCleared"}]


@pytest.mark.parametrize("n", [16, 17, 40, 48, 63, 64, 65])
def test_repeated_prompt_cached_tokens(n):
    with SimVllmEngine(num_blocks=64, block_size=B, endpoint="tcp://127.0.0.1:*") as e:
        prompt = [(i * 7) % 1024 for i in range(n)]
        assert e.serve(prompt) == 0
        assert e.serve(prompt) == (n - 1) // B * B
        assert e.serve(prompt + [1, 2, 3]) == n // B * B  # every full prompt block is cached


def test_chain_continues_from_hit_and_output_blocks_hit_next_turn(ctx, engine):
    sub, _ = _sub(ctx, engine.endpoint)
    _settle(sub)
    turn0 = list(range(200, 240))          # 40 tokens
    out0 = list(range(500, 530))            # 30 output tokens: KV for 69 tokens -> 4 blocks
    engine.serve(turn0, out0)
    turn1 = turn0 + out0 + list(range(600, 620))  # 90 tokens
    assert engine.serve(turn1) == 64  # the 4 blocks of turn 0's prompt + output
    msgs = _recv_all(sub)
    sub.close()
    ev1 = decode_payload(msgs[1][2]).events[0]
    h = engine.engine_hashes(turn1)
    assert ev1.parent_block_hash == h[3]
    assert ev1.block_hashes == h[4:5]
    assert ev1.token_ids == turn1[64:80]


def test_eviction_emits_one_block_removed_per_block(ctx):
    sub, ep = _sub(ctx)
    e = SimVllmEngine(num_blocks=4, block_size=B, endpoint=ep, bind=False)
    try:
        _settle(sub)
        a = list(range(0, 48))       # 3 blocks
        b = list(range(1000, 1048))  # needs 3 blocks: 1 free, 2 evicted
        e.serve(a)
        e.serve(b)
        msgs = _recv_all(sub)
    finally:
        e.close()
        sub.close()
    events = decode_payload(msgs[1][2]).events
    removed = [ev for ev in events if isinstance(ev, BlockRemoved)]
    assert [len(ev.block_hashes) for ev in removed] == [1, 1]
    ha = e.engine_hashes(a)
    # a's blocks were freed tail first, so the tail goes first
    assert [ev.block_hashes[0] for ev in removed] == [ha[2], ha[1]]
    assert isinstance(events[-1], BlockStored)
    assert e.removed_blocks == 2 and e.stored_blocks == 6
    assert e.cached_hashes() == {ha[0], *e.engine_hashes(b)}


def test_lru_keeps_recently_used_prefix():
    with SimVllmEngine(num_blocks=6, block_size=B, endpoint="tcp://127.0.0.1:*") as e:
        sys_prompt = list(range(32))
        for i in range(20):
            assert e.serve(sys_prompt + [900 + i] * 20) == (32 if i else 0)
        assert e.removed_blocks > 0


def test_too_long_request_raises():
    with SimVllmEngine(num_blocks=2, block_size=B, endpoint="tcp://127.0.0.1:*") as e:
        with pytest.raises(RuntimeError):
            e.serve(list(range(60)))


def test_replay_returns_buffered_messages_and_end_marker(ctx, engine):
    for i in range(5):
        engine.serve([i] * 20 + list(range(20)))
    assert engine.next_seq == 5
    msgs = _replay(ctx, engine.replay_endpoint, 2)
    assert msgs[-1] == [b"", b"", END, b""]
    body = msgs[:-1]
    assert [m[0] for m in body] == [b""] * 3
    assert [m[1] for m in body] == [b"kv"] * 3
    assert [int.from_bytes(m[2], "big") for m in body] == [2, 3, 4]
    for m in body:
        assert isinstance(decode_payload(m[3]).events[0], BlockStored)
    assert len(_replay(ctx, engine.replay_endpoint, 0)) == 6
    assert _replay(ctx, engine.replay_endpoint, 99) == [[b"", b"", END, b""]]


def test_replay_buffer_is_bounded(ctx):
    with SimVllmEngine(num_blocks=64, block_size=B, endpoint="tcp://127.0.0.1:*",
                       replay_endpoint="tcp://127.0.0.1:*", buffer_steps=3) as e:
        for i in range(6):
            e.serve([i] * 17)
        msgs = _replay(ctx, e.replay_endpoint, 0)
        assert [int.from_bytes(m[2], "big") for m in msgs[:-1]] == [3, 4, 5]


def test_drop_next_makes_a_gap_that_replay_fills(ctx, engine):
    sub, _ = _sub(ctx, engine.endpoint)
    _settle(sub)
    prompts = [[i] * 16 + list(range(16)) for i in range(6)]
    engine.serve(prompts[0])
    engine.drop_next(2)
    for p in prompts[1:]:
        engine.serve(p)
    live = _recv_all(sub)
    sub.close()
    seqs = [int.from_bytes(m[1], "big") for m in live]
    assert seqs == [0, 3, 4, 5]
    assert engine.dropped == 2
    # a subscriber seeing 0 -> 3 asks for 1 onwards and dedups
    got = {s: m[2] for s, m in zip(seqs, live, strict=True)}
    for m in _replay(ctx, engine.replay_endpoint, 1)[:-1]:
        got.setdefault(int.from_bytes(m[2], "big"), m[3])
    assert sorted(got) == [0, 1, 2, 3, 4, 5]
    firsts = [decode_payload(got[s]).events[0].token_ids[0] for s in range(6)]
    assert firsts == [0, 1, 2, 3, 4, 5]


def test_send_garbage_takes_a_seq(ctx, engine):
    sub, _ = _sub(ctx, engine.endpoint)
    _settle(sub)
    engine.serve(list(range(20)))
    assert engine.send_garbage(b"\xc1not msgpack") == 1
    engine.serve(list(range(50, 70)))
    msgs = _recv_all(sub)
    sub.close()
    assert [int.from_bytes(m[1], "big") for m in msgs] == [0, 1, 2]
    with pytest.raises(msgspec.DecodeError):
        decode_payload(msgs[1][2])
    decode_payload(msgs[2][2])


def test_deferred_reset_goes_with_next_batch():
    with SimVllmEngine(num_blocks=16, block_size=B, endpoint="tcp://127.0.0.1:*",
                       replay_endpoint="tcp://127.0.0.1:*") as e:
        p = list(range(40))
        e.serve(p)
        e.reset(defer=True)
        assert e.next_seq == 1 and e.num_cached_blocks == 0
        assert e.serve(p) == 0
        c = zmq.Context()
        try:
            msgs = _replay(c, e.replay_endpoint, 1)
        finally:
            c.term()
        events = decode_payload(msgs[0][3]).events
        assert isinstance(events[0], AllBlocksCleared) and isinstance(events[1], BlockStored)


def test_workload_is_deterministic_and_shares_prefixes():
    assert workload(7, 50) == workload(7, 50)
    assert workload(7, 50) != workload(8, 50)
    reqs = workload_requests(7, 60)
    assert len(reqs) == 60
    assert all(0 <= t < 1024 for p, o in reqs for t in p + o)
    # some turn extends an earlier prompt + output
    assert any(reqs[j][0][:len(p) + len(o)] == p + o for i, (p, o) in enumerate(reqs)
               for j in range(i + 1, len(reqs)))
    with SimVllmEngine(num_blocks=256, block_size=B, endpoint="tcp://127.0.0.1:*") as e:
        for p, o in reqs:
            e.serve(p, o)
        assert e.cached_tokens > 0.3 * e.prompt_tokens
