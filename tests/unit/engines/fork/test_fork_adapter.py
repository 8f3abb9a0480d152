"""A sixth engine adapter, defined here and nowhere else: a vendor build of vLLM ("vllm-fork", releases
1.0.x) that publishes vLLM's KV events. Registered by this test alone, it passes the conformance suite
(tests/unit/engines/test_conformance.py) over a recording made in the test, and `kvidx relay` and
`kvidx shadow` offer it, without a change to the registry, the relays or the CLI."""

from __future__ import annotations

import json
from itertools import count

import pytest

from kvidx import engines
from kvidx.engines import EngineAdapter, RelayOptions
from kvidx.engines.contract import Frame, zmq_replay
from kvidx.engines.recording import Recorder, read_frames
from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.engines.vllm.sim import SimVllmEngine
from kvidx.sim.prompts import workload_requests
from tests.unit.engines import test_conformance as suite

VERSIONS = ("1.0",)
BASE = "0.34.0"  # the vLLM release the fork's events follow


def _relay(model: str, replica: str, index_block_size: int, dp_rank: int | None, opts: RelayOptions,
           epoch: int | None = None) -> VllmPublisherRelay:
    version = opts.engine_version or "1.0.0"
    if version.rsplit(".", 1)[0] not in VERSIONS:
        raise ValueError(f"vllm-fork {version!r} was not checked (checked: {', '.join(VERSIONS)}.x)")
    return VllmPublisherRelay(model, replica, index_block_size, dp_rank, epoch=epoch, engine_version=BASE)


def _replay(recording, model: str, index_block_size: int, opts: RelayOptions):
    _relay(model, "check", index_block_size, None, opts)
    return zmq_replay(read_frames(recording), lambda ep: _relay(model, ep, index_block_size, None, opts, 0))


FORK = EngineAdapter(
    name="vllm-fork", summary="a vendor build of vLLM (test)", versions=tuple(f"{v}.x" for v in VERSIONS),
    default_version="1.0.0", recording="frames", live="zmq", make_relay=_relay, replay=_replay,
    conformance=("vllm-fork-1.0",))


@pytest.fixture
def fork(tmp_path):
    """The adapter registered, and its conformance recording: a simulated replica's stream and its
    requests, under tmp_path/vllm-fork-1.0/."""
    folder = tmp_path / "vllm-fork-1.0"
    folder.mkdir()
    engine = SimVllmEngine(num_blocks=64, block_size=16, endpoint="inproc://vllm-fork-conformance")
    ns = count(1_000_000)
    recorder = Recorder(folder / "frames.jsonl")
    sent = 0
    try:
        with open(folder / "requests.jsonl", "w") as log:
            for prompt, output in workload_requests(seed=5, n_requests=60, max_prompt=300):
                for seq, payload in engine._buffer:
                    if seq >= sent:
                        recorder.write(Frame(engine.topic, seq, payload, next(ns), "tcp://fork:5557", "pub"))
                        sent = seq + 1
                cached = engine.serve(prompt, output)
                log.write(json.dumps({"prompt_token_ids": prompt, "t_ns": next(ns), "cached_tokens": cached})
                          + "\n")
    finally:
        recorder.close()
        engine.close()
    engines.register(FORK)
    try:
        yield tmp_path
    finally:
        engines._REGISTRY.pop(FORK.name)


def test_a_sixth_adapter_passes_the_conformance_suite(fork):
    suite.check_registration(FORK, fork)
    suite.check_version_gate(FORK)
    suite.check_dead_letters(FORK)
    (recording,) = suite.recordings(FORK, fork)
    suite.check_recording(FORK, recording)


def test_the_cli_offers_it(fork):
    from kvidx.cli import build_parser

    args = build_parser().parse_args(["relay", "--engine", "vllm-fork", "--model", "m", "--play", "x"])
    assert args.engine == "vllm-fork"
    with pytest.raises(SystemExit):  # not registered: not a choice
        engines._REGISTRY.pop(FORK.name)
        try:
            build_parser().parse_args(["relay", "--engine", "vllm-fork", "--model", "m"])
        finally:
            engines.register(FORK)
