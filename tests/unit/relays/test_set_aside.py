"""A relay that sets an event aside publishes the rest of its batch, writes that event alone to the
dead-letter topic (its position in the headers), counts it on /metrics per engine, reason and kind, and
says how many events were set aside, and why, on its status line (issue 42)."""

from __future__ import annotations

import logging

import msgspec
from prometheus_client import REGISTRY

from kvidx.engines.contract import Frame
from kvidx.engines.vllm.relay import VllmPublisherRelay
from relays.run import Relay
from relays.sinks import KafkaSink
from tests.helpers import ListSink

T = list(range(100, 164))


def payload(events: list) -> bytes:
    return msgspec.msgpack.encode([1.0, events, 0])


def set_aside_metric(reason: str, event: str) -> float:
    return REGISTRY.get_sample_value("kvidx_relay_set_aside_events_total",
                                     {"engine": "vllm", "reason": reason, "event": event}) or 0.0


def test_a_set_aside_event_is_a_dead_letter_of_its_own_and_the_rest_is_published(caplog):
    sink = ListSink()
    relay = Relay(VllmPublisherRelay("m", "r0", 16, epoch=0), sink, status_every_s=0.0)
    before = (set_aside_metric("undecodable_event", "stored"), set_aside_metric("unknown_hash", "removed"))
    good = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": T[:32],
            "block_size": 16}
    bad = {"type": "BlockStored", "block_hashes": [3], "parent_block_hash": None, "token_ids": "no",
           "block_size": 16}
    unknown = {"type": "BlockRemoved", "block_hashes": [99]}
    relay.handle(Frame(b"kv", 0, payload([good, bad, unknown]), 1, "tcp://e:1"))
    (batch,) = sink.batches
    assert [len(e.hashes) for e in batch.events] == [2] and batch.seq == 0  # the good store, folded
    assert [(d.reason, d.event, d.position, d.frame.seq) for d in sink.dead] == [
        ("undecodable_event", "stored", 1, 0), ("unknown_hash", "removed", 2, 0)]
    assert msgspec.msgpack.decode(sink.dead[0].frame.payload) == bad  # the event's own bytes
    assert set_aside_metric("undecodable_event", "stored") == before[0] + 1
    assert set_aside_metric("unknown_hash", "removed") == before[1] + 1
    assert relay.dead_letters == 0  # no whole message was lost
    with caplog.at_level(logging.INFO, logger="kvidx.relay"):
        relay.status_tick(now=1e12)
    assert "set_aside_events=2 set_aside=undecodable_event/stored:1,unknown_hash/removed:1" in caplog.text


def test_the_dead_letter_topic_gets_the_events_position_and_kind_with_its_tokens_redacted():
    sink = KafkaSink("127.0.0.1:9", "events", "dead")  # no broker: what it would produce is caught
    produced = []
    sink._produce = lambda topic, key, value, headers=None, **kw: produced.append(
        (topic, value, dict(headers)))
    relay = VllmPublisherRelay("m", "r0", 16, epoch=0)
    short = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": T[:20],
             "block_size": 16}
    out = relay.on_frame(Frame(b"kv", 7, payload([{"type": "AllBlocksCleared"}, short]), 1, "tcp://e:1"))
    (dl,) = out.set_aside
    sink.dead_letter(dl, "m", "r0")
    ((topic, value, headers),) = produced
    assert topic == "dead" and headers["reason"] == b"short_token_ids" and headers["seq"] == b"7"
    assert headers["position"] == b"1" and headers["event"] == b"stored"
    kept = msgspec.msgpack.decode(value)
    assert kept["token_ids"] == {"redacted_token_ids": 20} and kept["block_hashes"] == [1, 2]


def test_a_controller_message_goes_to_the_engines_relay_or_is_a_dead_letter():
    """The relay hands a connector's own feed (src "controller") to its engine's relay logic: vLLM's
    takes LMCache's admit/evict messages, an engine without such a feed dead-letters them."""
    from kvidx.engines.sglang.relay import SglangPublisherRelay

    sink = ListSink()
    vllm = VllmPublisherRelay("m", "r0", 16, epoch=0)
    Relay(vllm, sink).handle(Frame(b"controller", -1, b"\xc1", 1, "tcp://*:9001", "controller"))
    assert vllm.controller is not None and vllm.controller.counters["messages"] == 1
    assert [d.reason for d in sink.dead] == ["malformed_payload"]  # LMCache's decoder read it
    sink = ListSink()
    Relay(SglangPublisherRelay("m", "r0", 16, epoch=0), sink).handle(
        Frame(b"controller", -1, b"x", 1, "tcp://*:9001", "controller"))
    assert [d.reason for d in sink.dead] == ["unexpected_controller_message"] and not sink.batches
