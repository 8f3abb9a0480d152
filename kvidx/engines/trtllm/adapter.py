"""TensorRT-LLM (tensorrt_llm/_torch/pyexecutor/kv_cache_events, trtllm-serve POST /kv_cache_events):
events pulled over HTTP; subtree eviction, `updated` tier moves, partial-block reuse."""

from __future__ import annotations

from kvidx.engines import Batches, EngineAdapter, RelayOptions
from kvidx.engines.trtllm.wire import SUPPORTED_VERSIONS

REPLICA = "trtllm"  # what a recording of one engine's polls is credited to


def replay(recording, model: str, index_block_size: int, opts: RelayOptions) -> Batches:
    from kvidx.engines.trtllm.relay import TrtllmPollRelay, read_polls

    relay = TrtllmPollRelay(model, REPLICA, index_block_size, opts.engine_block_size, epoch=0)

    def step(recv_ns: int, events: list, error: str | None) -> list:
        return (relay.poll_failed(error, recv_ns) if error else relay.on_poll(events, recv_ns)).batches

    def gen():
        for recv_ns, events, error in sorted(read_polls(recording), key=lambda p: p[0]):
            yield recv_ns, lambda a=(recv_ns, events, error): step(*a)

    return Batches(gen(), dead=lambda: relay.counters["dead"], default_replica=lambda: REPLICA,
                   relays={REPLICA: relay})


def make_poll_relay(model: str, replica: str, index_block_size: int, opts: RelayOptions,
                    epoch: int | None = None):
    from kvidx.engines.trtllm.relay import TrtllmPollRelay

    return TrtllmPollRelay(model, replica, index_block_size, opts.engine_block_size, epoch=epoch)


def http_source(url: str):
    from kvidx.engines.trtllm.relay import TrtllmHttpSource

    return TrtllmHttpSource(url)


def read_polls(path):
    from kvidx.engines.trtllm.relay import read_polls as read

    return read(path)


def poll_recorder(path):
    from kvidx.engines.trtllm.relay import PollRecorder

    return PollRecorder(path)


ADAPTER = EngineAdapter(
    name="trtllm", summary="TensorRT-LLM 0.20-1.3 KV events pulled from trtllm-serve (HTTP)",
    versions=SUPPORTED_VERSIONS, default_version=None, recording="polls", live="http", make_relay=None,
    replay=replay, conformance=("trtllm-1.2",), sim="trtllm", shadow_defaults={"replica": REPLICA},
    make_poll_relay=make_poll_relay, http_source=http_source, read_polls=read_polls,
    poll_recorder=poll_recorder)
