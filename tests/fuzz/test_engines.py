"""Fuzzing the other engines' adapters like vLLM's (tests/fuzz/test_decoders.py): SGLang frames, TensorRT-LLM
poll bodies and LMCache controller messages, mutated from real ones (made by the engines' simulators
in their wire formats): nothing raises, bad input becomes dead letters, the relay goes on."""

import random
import sys
import time
from functools import cache

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from kvidx.core.shard import ModelShard
from kvidx.engines.contract import Frame
from kvidx.engines.lmcache.controller import LmcacheControllerRelay
from kvidx.engines.sglang.relay import SglangPublisherRelay
from kvidx.engines.sglang.sim import SimSglangEngine
from kvidx.engines.trtllm.relay import TrtllmPollRelay
from kvidx.engines.trtllm.sim import SimTrtllmEngine
from kvidx.engines.vllm.relay import VllmPublisherRelay
from schemas.events import decode_batch, encode_batch
from tests.fuzz.mutations import FAST, byte_level, mutated, node_paths, replace_node
from tests.helpers import FIXTURES

sys.path.insert(0, str(FIXTURES / "vllm-variants"))
import engine_wire as ew  # noqa: E402

VERSIONS = ("0.5.3", "0.5.10", "0.5.23")


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(1024) for _ in range(48)]
    return [system + [rng.randrange(1024) for _ in range(rng.randrange(8, 80))] for _ in range(n)]


@cache
def sglang_payloads(version: str) -> tuple[bytes, ...]:
    eng = SimSglangEngine(num_pages=24, page_size=16, version=version, endpoint=None)
    for p in _prompts(30, 1):
        eng.serve(p, [7, 8, 9])
    return tuple(payload for _, payload in eng._buffer)


@cache
def trtllm_polls() -> tuple[bytes, ...]:
    eng = SimTrtllmEngine(num_blocks=24, host_blocks=8, block_size=32)
    polls = []
    for p in _prompts(30, 2):
        eng.generate(p, [7, 8, 9])
        polls.append(msgspec.json.encode(eng.poll()))
    return tuple(polls)


@cache
def controller_messages() -> tuple[bytes, ...]:
    return tuple(ew.controller(m) for m in (
        ew.KVAdmitMsg("inst", 0, 123456789, "LocalDiskBackend", 1),
        ew.KVEvictMsg("inst", 0, 123456789, "LocalCPUBackend", 2)))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats() | st.text(max_size=12)
    | st.sampled_from(["stored", "removed", "updated", "created", "event_diff", "stored_block"]),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4),
    max_leaves=20)


@st.composite
def json_structural(draw, raw: bytes) -> bytes:
    """A poll body with one JSON value anywhere replaced (wrong types, missing parts, huge ints)."""
    tree = msgspec.json.decode(raw)
    paths = list(node_paths(tree))
    path = paths[draw(st.integers(0, len(paths) - 1))]
    return msgspec.json.encode(replace_node(tree, path, draw(json_values)))


def json_mutated(seeds: tuple[bytes, ...]) -> st.SearchStrategy[bytes]:
    seed = st.integers(0, len(seeds) - 1).map(seeds.__getitem__)
    return st.one_of(seed.flatmap(byte_level), seed.flatmap(json_structural), st.binary(max_size=64))


def _fold_all(outs) -> None:
    shard = ModelShard("fuzz", 16)
    for out in outs:
        for d in out.dead:
            assert d.reason and len(d.detail) <= 300
        for b in out.batches:
            shard.apply(decode_batch(encode_batch(b)), time.time())


sglang_case = st.sampled_from(VERSIONS).flatmap(
    lambda v: st.tuples(st.just(v), st.lists(mutated(list(sglang_payloads(v))), min_size=1, max_size=3)))


@FAST
@given(sglang_case)
def test_sglang_relay_turns_bad_frames_into_dead_letters(case):
    version, bad = case
    good = sglang_payloads(version)
    relay = SglangPublisherRelay("fuzz", "r", 16, engine_version=version, epoch=0)
    outs = [relay.on_frame(Frame(b"kv", i, p, time.time_ns(), "e")) for i, p in enumerate(good[:10])]
    seq = 10
    for data in bad:
        outs.append(relay.on_frame(Frame(b"kv", seq, data, time.time_ns(), "e")))
        seq += 1
    last = relay.on_frame(Frame(b"kv", seq, good[10], time.time_ns(), "e"), check_gap=False)
    assert last.batches or last.dead  # it is still relaying
    _fold_all([*outs, last])


@FAST
@given(st.lists(json_mutated(trtllm_polls()), min_size=1, max_size=3))
def test_trtllm_relay_turns_bad_polls_into_dead_letters(bad):
    relay = TrtllmPollRelay("fuzz", "r", 16, block_size=32, epoch=0)
    polls = trtllm_polls()
    outs = [relay.on_poll_body(p, time.time_ns()) for p in polls[:10]]
    outs += [relay.on_poll_body(b, time.time_ns()) for b in bad]
    outs.append(relay.on_poll_body(polls[10], time.time_ns()))
    _fold_all(outs)


@FAST
@given(st.lists(mutated(list(controller_messages())), min_size=1, max_size=4))
def test_lmcache_controller_turns_bad_messages_into_dead_letters(bad):
    core = VllmPublisherRelay("fuzz", "r", 16, engine_version="0.32.0")
    ctl = LmcacheControllerRelay(core)
    _fold_all([ctl.on_message(b) for b in bad])
