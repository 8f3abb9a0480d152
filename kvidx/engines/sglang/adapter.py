"""SGLang (sglang/srt/disaggregation/kv_events.py): vLLM's ZMQ PUB + replay design with its own event
encodings per release, signed page hashes, radix-node removals and EAGLE bigram pages."""

from __future__ import annotations

from kvidx.engines import EngineAdapter, RelayOptions
from kvidx.engines.sglang.wire import DEFAULT_VERSION, SUPPORTED_VERSIONS


def relay_args(group) -> None:
    group.add_argument("--sglang-router-keys", action="store_true",
                       help="also index the engine's own page hashes, so that SGLang's router asking "
                            "kvidx serve --sglang-indexer finds this replica (name it by the router's worker "
                            "URL with --replica); one index entry more per page")


def relay_extra(args) -> dict:
    return {"router_keys": bool(getattr(args, "sglang_router_keys", False))}


def make_relay(model: str, replica: str, index_block_size: int, dp_rank: int | None, opts: RelayOptions):
    from kvidx.engines.sglang.relay import SglangPublisherRelay

    return SglangPublisherRelay(model, replica, index_block_size, dp_rank,
                                engine_version=opts.engine_version or DEFAULT_VERSION,
                                router_keys=bool(opts.extra.get("router_keys")))


def replay(recording, model: str, index_block_size: int, opts: RelayOptions):
    from kvidx.engines.contract import zmq_replay
    from kvidx.engines.recording import read_frames
    from kvidx.engines.sglang.relay import SglangPublisherRelay

    version = opts.engine_version or DEFAULT_VERSION
    SglangPublisherRelay(model, "check", index_block_size, engine_version=version)  # a clear error first
    return zmq_replay(read_frames(recording), lambda ep: SglangPublisherRelay(
        model, ep, index_block_size, engine_version=version, epoch=0))


ADAPTER = EngineAdapter(
    name="sglang", summary="SGLang 0.4.9-0.5.23 KV events over ZMQ (positional or tagged maps)",
    versions=SUPPORTED_VERSIONS, default_version=DEFAULT_VERSION, recording="frames", live="zmq",
    make_relay=make_relay, replay=replay, relay_args=relay_args, relay_extra=relay_extra,
    conformance=tuple(f"sglang-{v}" for v in SUPPORTED_VERSIONS), sim="sglang")
