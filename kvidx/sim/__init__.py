"""Simulated engines that publish real engine-format KV-cache events (for the demo and tests)."""

from kvidx.sim.vllm_engine import (
    SimVllmEngine,
    chain_digests,
    external_hash,
    none_hash,
    workload,
    workload_requests,
)

__all__ = ["SimVllmEngine", "chain_digests", "external_hash", "none_hash", "workload", "workload_requests"]
