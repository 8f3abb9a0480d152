"""vLLM (vllm/distributed/kv_events.py): KV events on a ZMQ PUB socket with a ROUTER replay endpoint;
0.32-0.34 tagged maps (0.33: lookahead block hashing; 0.34: offload-tier state checkpoints) and the
older positional arrays; data parallelism on port + rank."""

from __future__ import annotations

from kvidx.engines import EngineAdapter, RelayOptions
from kvidx.engines.vllm.wire import ENGINE_VERSIONS

DEFAULT_VERSION = "0.34.0"  # the newest release the adapter was checked against (reads 0.32-0.33 streams too)


def relay_args(group) -> None:
    """vLLM's `kvidx relay` options, LMCache's with them (it rides on vLLM's publisher)."""
    group.add_argument("--cpu-chunk-blocks", type=int, default=1,
                       help="vLLM offloading connector: engine blocks per offloaded chunk (CPU events)")
    group.add_argument("--kv-cache-report-mode", choices=("incremental", "full"), default="incremental",
                       help="'full' where requests may ask vLLM to re-announce every prefix hit (sampling "
                            "extra_args kv_cache_report_mode=full): a single-group model's chain re-stored "
                            "from the root is then not a second copy")
    group.add_argument("--lmcache-ttl", type=float, default=300.0, metavar="S",
                       help="LMCache chunks re-published through vLLM (no evictions published) age out after "
                            "S seconds (0: never)")
    group.add_argument("--lmcache-capacity-blocks", type=int, default=None,
                       help="cap on LMCache's live index blocks (its max size / chunk size)")
    group.add_argument("--lmcache-controller-endpoint", metavar="ENDPOINT",
                       help="bind a PULL socket for LMCache's admit/evict messages (e.g. tcp://*:9001): with "
                            "them, LMCache's evictions are known and its blocks are no upper bound")


def relay_extra(args) -> dict:
    """vLLM's relay options from the command line (LMCache's too: it rides on vLLM's publisher)."""
    from kvidx.engines.lmcache.chunks import LmcacheConfig

    # with the controller's admit/evict messages, LMCache's evictions are known: no TTL, no bound
    lmcache = (LmcacheConfig(ttl_s=None, evictions_reported=True)
               if getattr(args, "lmcache_controller_endpoint", None) else
               LmcacheConfig(ttl_s=args.lmcache_ttl or None, capacity_blocks=args.lmcache_capacity_blocks))
    return {"cpu_chunk_blocks": args.cpu_chunk_blocks, "lmcache": lmcache,
            "full_reports": getattr(args, "kv_cache_report_mode", "incremental") == "full"}


def controller_endpoint(args) -> str | None:
    """Where the relay binds the connector's own feed (LMCache's controller), if anywhere."""
    return getattr(args, "lmcache_controller_endpoint", None)


def unchecked_read_as(version: str) -> str | None:
    from kvidx.engines.vllm.wire import is_checked, read_as

    return None if is_checked(version) else read_as(version)


def make_relay(model: str, replica: str, index_block_size: int, dp_rank: int | None, opts: RelayOptions):
    from kvidx.engines.vllm.relay import VllmPublisherRelay

    return VllmPublisherRelay(model, replica, index_block_size, dp_rank, group_kinds=opts.group_kinds or None,
                              engine_version=opts.engine_version or DEFAULT_VERSION,
                              allow_unchecked_version=opts.allow_unchecked_version, **opts.extra)


def replay(recording, model: str, index_block_size: int, opts: RelayOptions):
    from kvidx.engines.contract import zmq_replay
    from kvidx.engines.recording import read_frames
    from kvidx.engines.vllm.relay import VllmPublisherRelay

    return zmq_replay(read_frames(recording), lambda ep: VllmPublisherRelay(
        model, ep, index_block_size, epoch=0, group_kinds=opts.group_kinds or None,
        engine_version=opts.engine_version or DEFAULT_VERSION,
        allow_unchecked_version=opts.allow_unchecked_version, **opts.extra))


ADAPTER = EngineAdapter(
    name="vllm", summary="vLLM 0.32-0.34 (tagged maps; 0.33+ lookahead hashing) and older (positional) KV "
                         "events over ZMQ",
    versions=tuple(f"{v}.x" for v in ENGINE_VERSIONS), default_version=DEFAULT_VERSION,
    recording="frames", live="zmq", make_relay=make_relay, replay=replay, relay_args=relay_args,
    relay_extra=relay_extra, relay_args_for=("vllm", "lmcache"), controller_endpoint=controller_endpoint,
    unchecked_read_as=unchecked_read_as,
    conformance=("vllm-0.32", "vllm-0.33", "vllm-0.34", "vllm-variants"), sim="vllm")
