"""One conformance suite for every registered engine adapter (kvidx.engines): its registration is
whole, its version gate refuses a release it was not checked against in one line, a malformed engine
message is a dead letter and never an exception, and every recording of its conformance fixtures
replays into batches that fold, dead-letter nothing, come out the same twice, and survive a mirror
replay (what a resync sends) without changing a single request's credit.

The checks are functions over an adapter and a fixtures folder, so an adapter registered anywhere
(tests/unit/engines/fork/: one defined in a test folder) passes the same suite without a change here.
Engine-specific behaviour is each engine's own tests."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from kvidx import engines, index
from kvidx.core.hashing import prompt_hashes
from kvidx.core.shard import ModelShard
from kvidx.engines import EngineAdapter, RelayOptions
from kvidx.engines.contract import Frame
from tests.helpers import ROOT

FIXTURES = ROOT / "tests" / "fixtures"
RECORDING_FILE = {"frames": "frames.jsonl", "polls": "events.jsonl"}
MALFORMED = b"\xc1 not msgpack, not json {"


def recordings(adapter: EngineAdapter, root: Path = FIXTURES) -> list[Path]:
    """The recordings under the adapter's conformance folders (a folder, or its scenarios' folders)."""
    name = RECORDING_FILE[adapter.recording]
    return [p for folder in adapter.conformance for p in sorted((root / folder).rglob(name))]


def check_registration(adapter: EngineAdapter, root: Path = FIXTURES) -> None:
    assert engines.get(adapter.name) is adapter
    assert adapter.recording in RECORDING_FILE and adapter.live in ("zmq", "http")
    assert adapter.versions and adapter.conformance and callable(adapter.replay)
    if adapter.live == "zmq":
        assert adapter.make_relay is not None
    else:
        assert None not in (adapter.make_poll_relay, adapter.http_source, adapter.read_polls)
    for folder in adapter.conformance:  # every checked format has its fixtures
        assert (root / folder).is_dir() and any((root / folder).rglob("*.json*")), folder


def check_version_gate(adapter: EngineAdapter) -> None:
    if adapter.make_relay is None:
        pytest.skip(f"{adapter.name} asks the engine for its release when it starts (relays/poller.py)")
    adapter.check_version(adapter.default_version)  # its default is a checked release
    with pytest.raises(ValueError) as e:
        adapter.check_version("0.0.1")
    assert "\n" not in str(e.value) and "0.0.1" in str(e.value)


def check_dead_letters(adapter: EngineAdapter) -> None:
    if adapter.live == "zmq":
        relay = adapter.make_relay("m", "r0", 16, None, RelayOptions())
        out = relay.on_frame(Frame(b"", 0, MALFORMED, 1, "tcp://conformance:1"))
    else:
        relay = adapter.make_poll_relay("m", "r0", 16, RelayOptions(engine_block_size=16), epoch=0)
        out = relay.on_poll_body(MALFORMED, 1)
    assert len(out.dead) == 1 and not out.batches, out
    assert out.dead[0].reason and out.dead[0].frame.payload == MALFORMED


def _replay(adapter: EngineAdapter, recording: Path) -> tuple[ModelShard, list[bytes], object, int]:
    batches = adapter.replay(recording, "m", 16, RelayOptions())
    shard, encoded, last = ModelShard("m", 16), [], 0
    for t_ns, step in batches:
        for b in step():
            shard.apply(b, t_ns / 1e9)
            encoded.append(msgspec.msgpack.encode(b))
        last = t_ns
    return shard, encoded, batches, last


def _credits(shard: ModelShard, requests: Path) -> list[int]:
    out = []
    for line in requests.read_text().splitlines():
        r = json.loads(line) if line.strip() else {}
        toks = r.get("prompt_token_ids")
        if toks:
            hashes = prompt_hashes(toks, 16, r.get("lora"), r.get("cache_salt"), lookahead=shard.lookahead,
                                   tails=True)
            out.append(index.credited(shard, hashes, len(toks)))
    return out


def check_recording(adapter: EngineAdapter, recording: Path) -> None:
    shard, encoded, batches, last = _replay(adapter, recording)
    assert encoded, "the recording makes batches"
    assert batches.dead_letters() == 0, "a conformance recording is every message read"
    assert _replay(adapter, recording)[1] == encoded, "a replay is deterministic"
    requests = recording.parent / "requests.jsonl"
    relays = [r for r in batches.relays.values() if hasattr(r, "resync")]
    if not requests.exists() or not relays:
        return
    before = _credits(shard, requests)
    for relay in relays:  # what a resync sends: a clear, then the mirror's blocks
        for b in relay.resync(1 << 30):
            shard.apply(b, last / 1e9 + 1.0)
    assert _credits(shard, requests) == before, "a mirror replay changes no request's credit"
    assert sum(before) > 0, "the recording's requests reuse something"


ADAPTERS = [engines.get(n) for n in engines.names()]
CASES = [(a, rec) for a in ADAPTERS for rec in recordings(a)]


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda a: a.name)
def test_registration(adapter):
    check_registration(adapter)


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda a: a.name)
def test_version_gate(adapter):
    check_version_gate(adapter)


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda a: a.name)
def test_a_malformed_message_is_a_dead_letter(adapter):
    check_dead_letters(adapter)


@pytest.mark.parametrize("adapter, recording", CASES,
                         ids=[f"{a.name}:{rec.parent.relative_to(FIXTURES)}" for a, rec in CASES])
def test_recording_replays_folds_and_survives_a_mirror_replay(adapter, recording):
    check_recording(adapter, recording)


def test_every_adapter_has_a_recording_or_its_own_fixture_test():
    """An adapter whose fixtures are not recordings (SGLang's older releases: generated payload vectors
    in conformance.json) has them checked by its own tests; every adapter has recordings somewhere."""
    assert all(recordings(a) for a in ADAPTERS)
