"""Which engine a stream is: a relay never folds another engine's stream as its own (it may decode, and
be misread); every frame of it is a dead letter `wrong_engine` naming the engine it is."""

from kvidx.engines.recording import read_frames
from kvidx.engines.sglang.relay import make_relay
from kvidx.engines.sniff import sniff_engine
from kvidx.engines.vllm.relay import VllmPublisherRelay
from relays.inputs import file_kind
from tests.helpers import FIXTURES, LLAMA


def test_vllm_recordings_are_vllm_and_never_sglang():
    for rec in sorted((FIXTURES / "vllm-0.32").glob("*/frames.jsonl")):
        seen = {sniff_engine(f.payload) for f in read_frames(rec)}
        assert "vllm" in seen and "sglang" not in seen, rec


def test_an_sglang_relay_dead_letters_a_whole_vllm_stream():
    relay = make_relay("m", "r", 16)
    frames = list(read_frames(LLAMA / "frames.jsonl"))
    dead = batches = 0
    for f in frames:
        out = relay.on_frame(f, check_gap=False)
        dead += sum(dl.reason == "wrong_engine" for dl in out.dead)
        batches += len(out.batches)
    assert dead == len(frames) and batches == 0  # beyond the sniffed first frames too
    assert "use --engine vllm" in relay.wrong_engine_reason


def test_a_vllm_relay_takes_its_own_stream():
    relay = VllmPublisherRelay("m", "r", 16)
    for f in read_frames(LLAMA / "frames.jsonl"):
        out = relay.on_frame(f, check_gap=False)
        assert not [d for d in out.dead if d.reason == "wrong_engine"]
    assert relay.wrong_engine_reason is None


def test_file_kinds():
    assert file_kind(LLAMA / "frames.jsonl") == "frames"
    assert file_kind(LLAMA / "requests.jsonl") == "requests"
    assert file_kind(FIXTURES / "trtllm-1.2" / "gpu" / "events.jsonl") == "polls"
