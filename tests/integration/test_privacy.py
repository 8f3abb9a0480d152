"""No prompt token ids reach Kafka, RocksDB or the logs: the real recording (plus malformed frames
cut from it) goes through relay -> Kafka -> worker fold -> RocksDB + snapshot topic, and every byte
written is searched for runs of the prompts' token ids in the encodings they could take."""

import logging
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
from confluent_kafka import Consumer, TopicPartition

from kvidx.engines.contract import Frame
from kvidx.engines.recording import read_frames
from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.shadow import load_requests
from relays.run import Relay
from relays.sinks import KafkaSink
from streams.worker import ShardWorker
from tests.helpers import LLAMA

pytestmark = pytest.mark.kafka
RUN = 6  # consecutive token ids that would give a prompt away


def needles(prompts: list[list[int]]) -> set[bytes]:
    out = set()
    for p in prompts[::10]:
        for i in range(0, len(p) - RUN, 17):
            run = p[i:i + RUN]
            out.add(np.asarray(run, dtype="<u4").tobytes())  # packed little-endian
            out.add(np.asarray(run, dtype=">u4").tobytes())
            out.add(msgspec.msgpack.encode(run)[1:])  # msgpack array items
            out.add(", ".join(map(str, run)).encode())  # text: logs, JSON
            out.add(",".join(map(str, run)).encode())
    return out


def read_all(bootstrap: str, topic: str) -> list[bytes]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"privacy-{time.time_ns()}",
                  "enable.auto.commit": False})
    md = c.list_topics(topic, timeout=10).topics[topic]
    blobs = []
    for p in md.partitions:
        lo, hi = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
        if hi <= lo:
            continue
        c.assign([TopicPartition(topic, p, lo)])
        got = 0
        while got < hi - lo:
            for m in c.consume(500, 1.0):
                if not m.error():
                    got += 1
                    blobs.append((m.key() or b"") + (m.value() or b"") +
                                 b"".join(v for _, v in (m.headers() or [])))
    c.close()
    return blobs


def test_no_token_ids_in_kafka_rocksdb_or_logs(kafka_bootstrap, topics, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    frames = sorted(read_frames(LLAMA / "frames.jsonl"), key=lambda f: f.recv_ns)
    big = max(frames, key=lambda f: len(f.payload))
    sink = KafkaSink(kafka_bootstrap, topics["events"], topics["dead_letters"])
    relay = Relay(VllmPublisherRelay("tiny", "r0", 16), sink)
    relay.start_fresh(replay_from_start=False)
    for f in frames:
        relay.handle(f)
    # malformed frames made of real payloads: truncated, and valid msgpack of the wrong shape
    last = frames[-1].seq
    relay.handle(Frame(b"kv", last + 1, big.payload[: len(big.payload) // 2], time.time_ns(), "e"))
    wrong = msgspec.msgpack.decode(big.payload)
    wrong[0] = "not a timestamp"
    relay.handle(Frame(b"kv", last + 2, msgspec.msgpack.encode(wrong), time.time_ns(), "e"))
    sink.flush()
    assert relay.core.next_seq == last + 3

    worker = ShardWorker(kafka_bootstrap, tmp_path / "worker", topics["snapshots"], topics["dead_letters"])
    c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "privacy-fold",
                  "auto.offset.reset": "earliest"})
    c.subscribe([topics["events"]])
    folded, deadline = 0, time.monotonic() + 30
    while folded < len(frames) + 1 and time.monotonic() < deadline:
        for m in c.consume(500, 0.5):
            if not m.error():
                worker.fold(m.value(), m.partition(), m.offset())
                folded += 1
    c.close()
    assert folded == len(frames) + 1
    worker.snapshot_dirty()
    worker.close()

    written = []
    for t in (topics["events"], topics["snapshots"], topics["dead_letters"]):
        written += read_all(kafka_bootstrap, t)
    assert len(read_all(kafka_bootstrap, topics["dead_letters"])) == 2
    written += [p.read_bytes() for p in Path(tmp_path / "worker").rglob("*") if p.is_file()]
    written.append(caplog.text.encode())
    everything = b"\n".join(written)
    prompts = [r["prompt_token_ids"] for r in load_requests(LLAMA / "requests.jsonl")]
    found = [n for n in needles(prompts) if n in everything]
    assert not found, f"{len(found)} token-id runs written, e.g. {found[:3]}"

    # and the check can see them: the raw recording does contain such runs
    raw = b"\n".join(f.payload for f in frames)
    assert any(n in raw for n in needles(prompts))
