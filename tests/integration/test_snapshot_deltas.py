"""Snapshots cost what changed (real broker, real RocksDB): a worker folding a recording writes deltas,
and a new base (in pieces, over several snapshots) only once the deltas outweigh the current one;
replaced parts are deleted from the compacted topic; a second worker on a new machine takes the
model over from the topic mid-stream and goes on from its manifest; at every step the topic alone
rebuilds exactly the in-process fold."""

import msgspec
import pytest

import kvidx.kafka.snapshots as snapshots
import streams.snapshots as writer
from kvidx.engines.recording import read_frames
from kvidx.engines.vllm.relay import VllmPublisherRelay
from kvidx.kafka.snapshots import Manifest, read_snapshot_logs
from schemas.events import encode_batch
from streams.worker import SNAP_BYTES, ShardWorker
from tests.helpers import LLAMA
from tests.integration.helpers import answers, expected_shard, prompts
from tests.unit.core.test_snapshot_parts import content

pytestmark = pytest.mark.kafka


def batches():
    relay = VllmPublisherRelay("tiny", "tcp://127.0.0.1:5557", 16, epoch=0)
    for f in sorted(read_frames(LLAMA / "frames.jsonl"), key=lambda f: f.recv_ns):
        yield from relay.on_frame(f).batches


def test_deltas_bases_and_a_takeover_rebuild_exactly(kafka_bootstrap, topics, tmp_path, monkeypatch):
    monkeypatch.setattr(writer, "PIECE_BYTES", 2000)  # bases in several pieces, over several snapshots
    all_batches = list(batches())
    assert len(all_batches) > 120, "the recording is long enough for several bases"
    worker = ShardWorker(kafka_bootstrap, tmp_path / "w1", topics["snapshots"], topics["dead_letters"])
    written = {k: SNAP_BYTES.labels("tiny", k)._value.get() for k in ("delta", "base")}
    gens = set()
    for i, b in enumerate(all_batches):
        if i == len(all_batches) // 2:  # a new machine takes the model over from the topic alone
            worker.close()
            worker = ShardWorker(kafka_bootstrap, tmp_path / "w2", topics["snapshots"],
                                 topics["dead_letters"])
        worker.fold(encode_batch(b), 0, i)
        if i % 7 == 6:
            worker.snapshot_dirty()
            shard = worker.shards["tiny"]
            rebuilt, m = read_snapshot_logs(kafka_bootstrap, topics["snapshots"])["tiny"]
            assert content(rebuilt) == content(shard) and m.snapshot_id == shard.snapshot_id
            gens.add(m.base_gen)
    worker.snapshot_dirty()
    worker.close()
    assert len(gens) >= 3, f"several bases were completed (generations {sorted(gens)})"
    delta = SNAP_BYTES.labels("tiny", "delta")._value.get() - written["delta"]
    base = SNAP_BYTES.labels("tiny", "base")._value.get() - written["base"]
    assert 0 < base <= delta, "bases are written at most as much as the deltas"
    # what is left in the topic after compaction is what the manifest names (plus the manifest)
    rebuilt, m = read_snapshot_logs(kafka_bootstrap, topics["snapshots"])["tiny"]
    assert isinstance(m, Manifest) and m.format == 3
    ps = prompts(LLAMA / "requests.jsonl")
    assert answers(rebuilt, ps) == answers(expected_shard(LLAMA / "frames.jsonl", "tiny"), ps)
    live = _live_keys(kafka_bootstrap, topics["snapshots"])
    named = {k for ref in m.parts() for k in snapshots.chunk_keys(ref)} | {"tiny/manifest"}
    assert named <= live
    assert len(live - named) <= 2 * max(4, len(m.base)), "replaced parts are deleted"
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(m), type=Manifest) == m


def _live_keys(bootstrap: str, topic: str) -> set[str]:
    live: set[str] = set()
    for key, value, _ in snapshots._read_to_end(bootstrap, topic, None, 60):
        if value is None:
            live.discard(key)
        else:
            live.add(key)
    return live
