"""Record vLLM's own KV-cache event stream for a release, by stepping vLLM's own scheduler.

Runs inside a throwaway venv holding the release (see ../run.sh); never imported by kvidx or CI.
For each scenario it:

1. writes a tiny model `config.json` (no weights) and builds a real `VllmConfig` with vLLM's
   `EngineArgs.create_engine_config()`, as `vllm serve` does with the same flags;
2. builds the `KVCacheConfig` the way `EngineCore._initialize_kv_caches` does (vLLM's
   `get_global_kv_cache_groups`, `get_kv_cache_configs`, `generate_scheduler_kv_cache_config`,
   `resolve_kv_cache_block_sizes`, ...). The one stand-in here is the per-layer `KVCacheSpec`
   list that a GPU worker would read from the model's attention / mamba layers: it is built from
   the model config with vLLM's own spec classes (and, for mamba layers, the model class's own
   state-shape and dtype functions);
3. creates vLLM's `Scheduler` (its `KVCacheManager`, block pool and coordinator, the KV connector's
   scheduler side, and the `ZmqEventPublisher` from `--kv-events-config`), the block hasher from
   `get_request_block_hasher`, and steps it as `EngineCore.step()` / `post_step()` do:
   `schedule()`, the model runner (stand-in), `update_from_output()`, `update_draft_token_ids()`;
4. captures every frame the publisher sends with a zmq SUB socket over loopback, and records each
   request's `cached_tokens` from the engine's own `PrefillStats` (what the OpenAI server reports
   as `usage.prompt_tokens_details.cached_tokens`), split into GPU (local) and connector
   (external, the CPU tier) tokens.

Stand-ins (the model and the GPU only): sampled tokens come from a seeded function of the request
and position; draft tokens (EAGLE / MTP) are right with a seeded probability; a KV connector's
worker side completes each transfer job without moving data (loads in the step they are issued,
stores one step later, like the real worker that defers stores to the next step).

Usage (inside the engine venv): python make_recordings.py --out DIR [--scenario NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/conformance: the kit's common parts
from kit_common import VOCAB, Capture, Workload  # noqa: E402
from kit_common import workload as common_workload  # noqa: E402


@dataclass
class Scenario(Workload):
    name: str
    model: str                       # llama | gemma2 | qwen3next
    num_gpu_blocks: int
    about: str
    block_size: int | None = 16
    offload_blocks: int = 0          # CPU tier size in GPU blocks (0: no offloading)
    connector: str = "offloading"    # with offload_blocks: "offloading" (OffloadingConnector) or
    #                                  "simple" / "simple_lazy" (SimpleCPUOffloadConnector, eager / lazy)
    self_describing: bool = False
    spec: dict[str, Any] | None = None   # speculative decoding
    accept_p: float = 0.7
    salts: bool = False              # a cache salt per conversation (two tenants and none)
    loras: bool = False              # a LoRA adapter per conversation (two adapters and the base)
    extra_args: dict[str, Any] = field(default_factory=dict)
    # reset_prefix_cache (as vLLM's POST /reset_prefix_cache, running requests preempted) once this
    # many jobs have started; 0: never. With `reset_connector`, the connector's tiers are reset too
    reset_after: int = 0
    reset_connector: bool = False
    # data-parallel ranks: one engine core each (its own scheduler, KV cache and publisher on the base
    # port + rank, vLLM's offset rule), the jobs dealt out in turn; run one rank after the other (their
    # caches and publishers are independent), so the recording holds each rank's stream whole
    dp: int = 1


SCENARIOS = {s.name: s for s in [
    Scenario("plain", "llama", 96,
             "2-layer llama, prefix caching, 96 GPU blocks of 16: eviction pressure"),
    Scenario("eagle", "llama", 96,
             "llama + EAGLE draft (2 speculative tokens): lookahead block hashing",
             spec={"method": "eagle", "num_speculative_tokens": 2}),
    Scenario("cpu_offload", "llama", 40,
             "llama + OffloadingConnector (40 GPU blocks, a CPU tier of 192), placeholder "
             "offload events (the default)",
             offload_blocks=192),
    Scenario("cpu_offload_selfdesc", "llama", 40,
             "llama + OffloadingConnector, self_describing_kv_events",
             offload_blocks=192, self_describing=True),
    Scenario("eagle_cpu_offload", "llama", 40,
             "llama + EAGLE + OffloadingConnector (self-describing): lookahead in CPU-tier stores",
             offload_blocks=192, self_describing=True,
             spec={"method": "eagle", "num_speculative_tokens": 2}),
    Scenario("gemma2_swa", "gemma2", 128,
             "gemma2: 4 layers alternating sliding window 32 and full attention"),
    Scenario("qwen3next_offload", "qwen3next", 24,
             "Qwen3-Next-like gated delta-net + attention hybrid + OffloadingConnector",
             block_size=None, offload_blocks=96),
    Scenario("qwen3next_mtp_offload", "qwen3next", 24,
             "Qwen3-Next-like hybrid + MTP + OffloadingConnector, placeholder offload events",
             block_size=None, offload_blocks=96,
             spec={"method": "mtp", "num_speculative_tokens": 1}),
    Scenario("cache_salt", "llama", 96,
             "llama, prefix caching, each job's requests under cache salt 'tenant-a', "
             "'tenant-b' or none", salts=True),
    Scenario("simple_offload", "llama", 40,
             "llama + SimpleCPUOffloadConnector (40 GPU blocks, a CPU tier of 192), eager: every "
             "computed block copied to host memory", offload_blocks=192, connector="simple"),
    Scenario("simple_offload_lazy", "llama", 40,
             "llama + SimpleCPUOffloadConnector, lazy: blocks copied only from the GPU's eviction end, "
             "which then evicts the copied ones first", offload_blocks=192, connector="simple_lazy"),
    Scenario("lora", "llama", 96,
             "llama, prefix caching, each job's requests under LoRA adapter 'sql' (id 1), 'chat' "
             "(id 2) or the base model", loras=True,
             extra_args={"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}),
    Scenario("qwen3next_mtp_offload_selfdesc", "qwen3next", 24,
             "Qwen3-Next-like hybrid + MTP + OffloadingConnector, self_describing_kv_events",
             block_size=None, offload_blocks=96, self_describing=True,
             spec={"method": "mtp", "num_speculative_tokens": 1}),
    Scenario("dp2", "llama", 48,
             "llama, prefix caching, 2 data-parallel ranks of 48 GPU blocks each (publishers on the "
             "base port and the next), the jobs dealt out in turn", dp=2),
    Scenario("reset", "llama", 96,
             "llama, prefix caching; reset_prefix_cache (running requests preempted) once 60 jobs "
             "have started", reset_after=60),
    Scenario("cpu_offload_reset", "llama", 40,
             "llama + OffloadingConnector (self-describing); a GPU-only reset_prefix_cache once 60 "
             "jobs have started: the CPU tier keeps its blocks", offload_blocks=192,
             self_describing=True, reset_after=60),
    Scenario("cpu_offload_reset_all", "llama", 40,
             "llama + OffloadingConnector (self-describing); reset_prefix_cache with "
             "reset_connector once 60 jobs have started: both tiers emptied", offload_blocks=192,
             self_describing=True, reset_after=60, reset_connector=True),
]}

# ---------------------------------------------------------------- model configs (no weights)

COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_attention_heads=2,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, bos_token_id=1,
              eos_token_id=2, pad_token_id=3, tie_word_embeddings=True, torch_dtype="bfloat16",
              rms_norm_eps=1e-6)


def model_config_json(kind: str) -> dict[str, Any]:
    if kind == "llama":
        return dict(COMMON, architectures=["LlamaForCausalLM"], model_type="llama",
                    num_hidden_layers=2, rope_theta=10000.0)
    if kind == "eagle_draft":
        return dict(COMMON, architectures=["EagleLlamaForCausalLM"], model_type="llama",
                    num_hidden_layers=1, rope_theta=10000.0)
    if kind == "gemma2":
        return dict(COMMON, architectures=["Gemma2ForCausalLM"], model_type="gemma2",
                    num_hidden_layers=4, sliding_window=32, query_pre_attn_scalar=64,
                    layer_types=["sliding_attention", "full_attention"] * 2,
                    hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=30.0,
                    attn_logit_softcapping=50.0, rope_theta=10000.0)
    if kind == "qwen3next":
        c = {k: v for k, v in COMMON.items()}
        return dict(c, architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next",
                    num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
                    mlp_only_layers=[0, 1, 2], num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=64, shared_expert_intermediate_size=64,
                    decoder_sparse_step=1, norm_topk_prob=True,
                    linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
                    linear_num_key_heads=2, linear_num_value_heads=2, partial_rotary_factor=0.5,
                    full_attention_interval=2, num_nextn_predict_layers=1, rope_theta=10000.0,
                    hidden_act="silu", attention_bias=False)
    raise SystemExit(f"unknown model kind {kind}")


def write_model(kind: str, root: Path) -> Path:
    d = root / kind
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(model_config_json(kind), indent=1))
    return d


# ---------------------------------------------------------------- the workload

def workload(s: Scenario) -> list[tuple[str, Any]]:
    return common_workload(s.seed, s.convs, s.turns, s.one_shot)


# ---------------------------------------------------------------- the engine

def layer_specs(vllm_config: Any, kind: str) -> dict[str, Any]:
    """Stand-in for the GPU worker's `get_kv_cache_spec()`: the KVCacheSpec each layer of the
    model would report, built with vLLM's own classes from the same config values."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    hf = vllm_config.model_config.hf_config
    cache = vllm_config.cache_config
    dtype = vllm_config.model_config.dtype if cache.cache_dtype == "auto" else torch.bfloat16
    block = cache.block_size
    kv_heads, head = hf.num_key_value_heads, hf.head_dim
    specs: dict[str, Any] = {}
    types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
    for i, t in enumerate(types):
        name = f"model.layers.{i}.self_attn.attn"
        if t == "sliding_attention":
            specs[name] = SlidingWindowSpec(block_size=block, num_kv_heads=kv_heads,
                                            head_size=head, dtype=dtype,
                                            sliding_window=hf.sliding_window)
        elif t == "linear_attention":
            from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM
            shapes = Qwen3NextForCausalLM.get_mamba_state_shape_from_config(vllm_config)
            dtypes = Qwen3NextForCausalLM.get_mamba_state_dtype_from_config(vllm_config)
            from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
            specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
                shapes=tuple(shapes), dtypes=dtypes, block_size=cache.mamba_block_size,
                page_size_padded=cache.mamba_page_size_padded,
                mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                mamba_cache_mode=cache.mamba_cache_mode,
                num_speculative_blocks=vllm_config.num_speculative_tokens)
        else:
            specs[name] = FullAttentionSpec(block_size=block, num_kv_heads=kv_heads,
                                            head_size=head, dtype=dtype)
    spec_cfg = vllm_config.speculative_config
    if spec_cfg is not None:
        # the drafter's own attention layer(s) (EAGLE head / MTP layer): full attention
        n = getattr(spec_cfg.draft_model_config.hf_config, "num_hidden_layers", 1) \
            if spec_cfg.method == "eagle" else 1
        for j in range(n):
            specs[f"drafter.layers.{j}.self_attn.attn"] = FullAttentionSpec(
                block_size=block, num_kv_heads=kv_heads, head_size=head, dtype=dtype)
    return specs


def use_cuda_platform() -> None:
    """vLLM's own CUDA platform (what a GPU deployment resolves), with the device queries a GPU
    would answer given as an H100's (sm90, 80 GiB): there is no GPU here, and the scheduler's side
    never touches one. Must run before vLLM resolves `current_platform`."""
    import types

    class KernelStub(types.ModuleType):
        """A CUDA kernel extension: loading it needs the GPU driver (libcuda.so.1); the model
        modules import names from it, but no kernel is ever called here."""

        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return lambda *a, **k: None

    for mod in ("vllm._C_stable_libtorch", "vllm.vllm_flash_attn"):
        sys.modules.setdefault(mod, KernelStub(mod))
    import vllm.platforms as platforms
    from vllm.platforms.cuda import NonNvmlCudaPlatform
    from vllm.platforms.interface import DeviceCapability

    class H100StandIn(NonNvmlCudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(major=9, minor=0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H100 80GB HBM3 (stand-in)"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 80 << 30

        @classmethod
        def device_count(cls) -> int:
            return 1

        @classmethod
        def is_fully_connected(cls, device_ids: list[int]) -> bool:
            return True

    platforms.current_platform = H100StandIn()

    # vLLM inspects the model class in a subprocess (to keep CUDA out of the engine process);
    # here it is inspected in this process, where the stand-ins above are in place.
    from vllm.model_executor.models import registry

    def inspect_here(self: Any) -> Any:
        return registry._ModelInfo.from_model_cls(self.load_model_cls())
    registry._LazyRegisteredModel.inspect_model_cls = inspect_here


def engine_config(s: Scenario, models: Path, port: int) -> Any:
    """A real VllmConfig, from the flags `vllm serve` would be given."""
    from vllm.config import KVEventsConfig
    from vllm.engine.arg_utils import EngineArgs

    args: dict[str, Any] = dict(
        model=str(write_model(s.model, models)), skip_tokenizer_init=True, load_format="dummy",
        enforce_eager=True, enable_prefix_caching=True, num_gpu_blocks_override=s.num_gpu_blocks,
        max_model_len=512, max_num_seqs=8, max_num_batched_tokens=2048,
        async_scheduling=False,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                        endpoint=f"tcp://*:{port}", topic="kv"),
    )
    if s.block_size is not None:
        args["block_size"] = s.block_size
    if s.spec is not None:
        spec = dict(s.spec)
        if spec["method"] == "eagle":
            spec["model"] = str(write_model("eagle_draft", models))
        args["speculative_config"] = spec
    if s.offload_blocks and s.connector == "offloading":
        args["kv_offloading_size"] = 1.0      # GiB: set to offload_blocks below
        args["kv_offloading_backend"] = "native"
    elif s.offload_blocks:
        lazy = s.connector == "simple_lazy"
        args["kv_transfer_config"] = {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
                                      "kv_connector_extra_config": {"lazy_offload": lazy}}
    args.update(s.extra_args)
    return EngineArgs(**args).create_engine_config()


def kv_cache_config(vllm_config: Any, s: Scenario) -> Any:
    """`EngineCore._initialize_kv_caches`, with the layer specs of `layer_specs` for the
    executor's and the memory the block count override asks for."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
        update_kv_cache_capacity,
    )
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    register_all_kvcache_specs(vllm_config)
    specs = [layer_specs(vllm_config, s.model)]
    # the worker's attention backends would report their layouts; the standard one
    resolve_kv_cache_layout(vllm_config, [["NHD"]], list(specs[0].values()))
    groups = get_global_kv_cache_groups(vllm_config, specs)
    page = sum(sp.page_size_bytes for sp in specs[0].values())
    memory = [page * (s.num_gpu_blocks + 8) * 4]
    configs = get_kv_cache_configs(vllm_config, specs, memory, groups)
    sched_cfg = generate_scheduler_kv_cache_config(configs)
    vllm_config.cache_config.num_gpu_blocks = sched_cfg.num_blocks
    kv_groups = sched_cfg.kv_cache_groups
    participating = [g.kv_cache_spec.block_size for g in kv_groups
                     if g.kv_cache_spec.prefix_cacheable]
    vllm_config.cache_config.block_size = min(
        participating or [g.kv_cache_spec.block_size for g in kv_groups])
    update_kv_cache_capacity(vllm_config, sched_cfg)
    vllm_config.validate_block_size()
    block, hash_block = resolve_kv_cache_block_sizes(sched_cfg, vllm_config)
    align = resolve_cache_hit_alignment_tokens(sched_cfg, vllm_config, block, hash_block)
    for c in (*configs, sched_cfg):
        c.hash_block_size = hash_block
        c.cache_hit_alignment_tokens = align
    return sched_cfg, block, hash_block


class Runner:
    """Stand-in for the model executor: seeded sampled tokens, seeded draft acceptance, and a KV
    connector worker that completes transfer jobs without moving data."""

    def __init__(self, s: Scenario, scheduler: Any):
        self.s = s
        self.sched = scheduler
        self.pending_stores: dict[int, Any] = {}
        self.k = (s.spec or {}).get("num_speculative_tokens", 0)

    def target(self, rid: str, pos: int) -> int:
        return random.Random(f"t:{self.s.seed}:{rid}:{pos}").randrange(4, VOCAB)

    def connector_output(self, out: Any) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput

        meta = out.kv_connector_metadata
        if meta is None:
            return None
        if self.s.connector != "offloading":
            return self.simple_connector_output(meta)
        done = OffloadingWorkerMetadata()
        recving: set[str] = set()
        for job_id in list(self.pending_stores):   # stores issued last step finish now
            done.mark_completed(job_id)
            del self.pending_stores[job_id]
        for job_id, job in meta.load_jobs.items():
            done.mark_completed(job_id)
            if not job.sync:
                recving.add(job.req_id)
        for job_id in meta.jobs_to_flush or ():
            if job_id in meta.store_jobs:
                done.mark_completed(job_id)
        for job_id, job in meta.store_jobs.items():
            if job_id not in done.completed_jobs:
                self.pending_stores[job_id] = job
        return KVConnectorOutput(finished_recving=recving or None,
                                 kv_connector_worker_meta=done)

    def simple_connector_output(self, meta: Any) -> Any:
        """SimpleCPUOffloadConnector's worker side (simple_kv_offload/worker.py get_finished and
        build_connector_worker_meta): a store event issued in one step completes in the next, a
        load completes in the step that issued it, no data moved."""
        from vllm.v1.outputs import KVConnectorOutput
        from vllm.v1.simple_kv_offload.metadata import INVALID_JOB_ID, SimpleCPUOffloadWorkerMetadata

        done = dict.fromkeys(self.pending_stores, 1)
        self.pending_stores = {}
        if meta.store_event != INVALID_JOB_ID:
            self.pending_stores[meta.store_event] = True
        recving = set(meta.load_event_to_reqs.get(meta.load_event, ())) \
            if meta.load_event != INVALID_JOB_ID else set()
        worker_meta = SimpleCPUOffloadWorkerMetadata(done) if done else None
        return KVConnectorOutput(finished_recving=recving or None, kv_connector_worker_meta=worker_meta)

    def execute(self, out: Any) -> Any:
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

        kvc = self.connector_output(out)
        if out.total_num_scheduled_tokens == 0:
            worker_meta = kvc.kv_connector_worker_meta if kvc is not None else None
            if kvc is None or kvc.is_empty() and not (worker_meta and (
                    getattr(worker_meta, "completed_jobs", None)
                    or getattr(worker_meta, "completed_store_events", None))):
                return EMPTY_MODEL_RUNNER_OUTPUT
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], kv_connector_output=kvc)
        req_ids, sampled = [], []
        for rid in out.num_scheduled_tokens:
            req = self.sched.requests[rid]
            req_ids.append(rid)
            if req.is_prefill_chunk:
                sampled.append([])
                continue
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            n = req.num_tokens
            acc = 0
            while acc < len(drafts) and drafts[acc] == self.target(rid, n + acc):
                acc += 1
            sampled.append(list(drafts[:acc]) + [self.target(rid, n + acc)])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled,
                                 kv_connector_output=kvc)

    def drafts(self, out: Any) -> Any:
        from vllm.v1.outputs import DraftTokenIds

        ids, toks = [], []
        for rid in out.num_scheduled_tokens:
            req = self.sched.requests.get(rid)
            if req is None or req.is_finished() or req.is_prefill_chunk:
                continue
            n = req.num_tokens
            d = []
            for i in range(self.k):
                t = self.target(rid, n + i)
                if random.Random(f"d:{self.s.seed}:{rid}:{n + i}").random() >= self.s.accept_p:
                    t = 4 + (t - 3) % (VOCAB - 4)
                d.append(t)
            ids.append(rid)
            toks.append(d)
        return DraftTokenIds(ids, toks)


def record_scenario(s: Scenario, out_dir: Path, port: int) -> dict[str, Any]:
    os.environ.pop("PYTHONHASHSEED", None)
    lines: list[str] = []
    records: list[dict[str, Any]] = []
    for rank in range(s.dp):
        meta = record_rank(s, port, rank, lines, records)
    d = out_dir / s.name
    d.mkdir(parents=True, exist_ok=True)
    (d / "frames.jsonl").write_text("".join(x + "\n" for x in lines))
    if s.dp > 1:  # the ranks' requests in the order they were sent, numbered again
        records = [{**r, "i": i} for i, r in enumerate(sorted(records, key=lambda r: r["t_send"]))]
    with open(d / "requests.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    meta["counts"] = {"requests": len(records), "batches": len(lines),
                      "prompt_tokens": prompt, "cached_tokens": cached,
                      "cached_gpu": sum(r["cached_tokens_by_tier"]["GPU"] for r in records),
                      "cached_cpu": sum(r["cached_tokens_by_tier"]["CPU"] for r in records),
                      "preempted_requests": sum(1 for r in records if r["num_preemptions"])}
    if s.dp > 1:
        meta["engine"]["data_parallel_size"] = s.dp
    (d / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{s.name}: " + json.dumps(meta["counts"]), flush=True)
    return meta


def record_rank(s: Scenario, port: int, rank: int, lines: list[str], records: list[dict[str, Any]]
                ) -> dict[str, Any]:
    """One engine core (DP rank `rank` of `s.dp`) through its share of the jobs: its frames and
    request records appended to `lines` and `records`; the scenario's metadata."""
    import vllm
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.structured_output import StructuredOutputManager

    tmp = Path(tempfile.mkdtemp(prefix="kvidx-conf-"))
    try:
        vc = engine_config(s, tmp, port)
        vc.parallel_config.data_parallel_index = rank  # the publisher's rank: its endpoint is port + rank
        sched_cfg, block, hash_block = kv_cache_config(vc, s)
        if s.offload_blocks:
            page = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names)
                       for g in sched_cfg.kv_cache_groups)
            ktc = vc.kv_transfer_config
            ktc.kv_connector_extra_config["cpu_bytes_to_use"] = page * s.offload_blocks
            if s.self_describing:
                ktc.kv_connector_extra_config["self_describing_kv_events"] = True
        scheduler_cls = vc.scheduler_config.get_scheduler_cls()
        sched = scheduler_cls(vllm_config=vc, kv_cache_config=sched_cfg,
                              structured_output_manager=StructuredOutputManager(vc),
                              include_finished_set=False, log_stats=True,
                              block_size=block, hash_block_size=hash_block)
        hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(hash_block, hash_fn, vc.num_hash_lookahead_tokens)
        cap = Capture(f"tcp://127.0.0.1:{port + rank}")
        time.sleep(0.5)   # the SUB joins before the first batch
        published = [0]
        pub = sched.kv_event_publisher
        orig = pub.publish

        def counting_publish(batch: Any) -> None:
            published[0] += 1
            orig(batch)
        pub.publish = counting_publish
        runner = Runner(s, sched)
        meta = describe(s, vc, sched, sched_cfg, block, hash_block, vllm.__version__)
        print(f"{s.name}: " + json.dumps(meta["engine"]), flush=True)
        ranked = drive(s, sched, runner, hasher, cap, published, rank)
        sched.shutdown()
        cap.drain(published[0])
        cap.sub.close(0)
        if cap.seqs != list(range(len(cap.seqs))):
            raise SystemExit(f"{s.name}: publisher sequence has gaps")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if s.dp > 1:  # which engine core took each request, and whose stream its lookup_at counts in
        for r in ranked:
            r["dp_rank"], r["publisher"] = rank, cap.endpoint
    lines += cap.lines
    records += ranked
    return meta


def describe(s: Scenario, vc: Any, sched: Any, cfg: Any, block: int, hash_block: int,
             version: str) -> dict[str, Any]:
    ktc = vc.kv_transfer_config
    return {
        "made_by": "tests/conformance/vllm/make_recordings.py (vLLM's own Scheduler stepped "
                   "as EngineCore.step() does; no GPU, no weights)",
        "release": version, "scenario": s.name, "about": s.about,
        "model_config": model_config_json(s.model),
        "engine": {
            "scheduler": type(sched).__name__,
            "kv_cache_manager": type(sched.kv_cache_manager).__name__,
            "coordinator": type(sched.kv_cache_manager.coordinator).__name__,
            "connector": type(sched.connector).__name__ if sched.connector else None,
            "publisher": type(sched.kv_event_publisher).__name__,
            "block_size": block, "hash_block_size": hash_block,
            "num_gpu_blocks": cfg.num_blocks,
            "groups": [{"kind": type(g.kv_cache_spec).__name__,
                        "block_size": g.kv_cache_spec.block_size,
                        "layers": len(g.layer_names)} for g in cfg.kv_cache_groups],
            "prefix_caching_hash_algo": vc.cache_config.prefix_caching_hash_algo,
            "mamba_cache_mode": vc.cache_config.mamba_cache_mode,
            "mamba_block_size": vc.cache_config.mamba_block_size,
            "num_hash_lookahead_tokens": vc.num_hash_lookahead_tokens,
            "speculative": s.spec,
            "kv_connector": ktc.kv_connector if ktc else None,
            "kv_connector_extra_config": dict(ktc.kv_connector_extra_config) if ktc else None,
            "offload_blocks": s.offload_blocks,
        },
        "workload": {"seed": s.seed, "systems": 5, "sys_len": [40, 130], "user_len": [8, 60],
                     "convs": s.convs, "turns": s.turns, "one_shot": s.one_shot,
                     "concurrency": s.concurrency, "max_tokens": s.max_tokens,
                     "max_prompt": 500, "accept_p": s.accept_p if s.spec else None},
    }


def drive(s: Scenario, sched: Any, runner: Runner, hasher: Any, cap: Capture,
          published: list[int], rank: int = 0) -> list[dict[str, Any]]:
    """Up to `concurrency` jobs at a time; a conversation's next turn is sent when its previous
    turn finishes, carrying that turn's output tokens. DP rank `rank` takes every `s.dp`-th job."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request, RequestStatus

    jobs = workload(s)[rank::s.dp]
    slots: dict[str, dict[str, Any]] = {}
    records: list[dict[str, Any]] = []
    n_req = 0
    next_job = 0

    # Where each request's prefix lookup fell in the event stream: [the seq of the batch its step
    # publishes, how many of that batch's events the block pool had queued at the lookup]. A request
    # scheduled in the same step as another one sees the blocks that step stored or evicted before
    # its own lookup, events no index can hold at send time; `kvidx shadow` folds exactly the events
    # before the lookup to tell the index's reading from that timing. The wrapper only observes.
    looked: dict[str, list[int]] = {}
    pool = sched.kv_cache_manager.block_pool
    local_hit = sched._get_local_prefix_cache_hit

    def traced_local_hit(request: Any, *args: Any, **kwargs: Any) -> Any:
        looked[request.request_id] = [published[0], len(pool.kv_event_queue)]
        return local_hit(request, *args, **kwargs)
    sched._get_local_prefix_cache_hit = traced_local_hit

    def submit(job: dict[str, Any]) -> None:
        nonlocal n_req
        rid = f"r{n_req}"
        n_req += 1
        sp = SamplingParams(max_tokens=s.max_tokens, ignore_eos=True, temperature=0.0)
        req = Request(request_id=rid, prompt_token_ids=list(job["prompt"]), sampling_params=sp,
                      pooling_params=None, arrival_time=time.time(), block_hasher=hasher,
                      cache_salt=job["salt"], lora_request=job["lora"])
        job["t_send"] = time.time()
        job["req"] = req
        job.pop("lookup_at", None)  # a conversation's job dict carries its previous turn's
        job.pop("preempted", None)
        sched.add_request(req)
        slots[rid] = job

    def start_turn(job: dict[str, Any]) -> bool:
        kind, x = job["job"]
        if kind == "oneshot":
            if job["turn"] > 0:
                return False
            job["prompt"] = x[2] + x[3]
        else:
            if job["turn"] >= len(x[3]):
                return False
            p = (job.get("prompt") or list(x[2])) + job.get("out", []) + x[3][job["turn"]]
            if len(p) + s.max_tokens > 500:
                return False
            job["prompt"] = p
        submit(job)
        return True

    # the reset: once `reset_after` jobs have started, no new turn starts (they wait in `deferred`)
    # until vLLM's reset_prefix_cache succeeds between two steps, as the engine core runs a utility
    # call: when no running request holds blocks and the connector's transfers are done
    resetting = bool(s.reset_after)
    deferred: list[dict[str, Any]] = []
    idle_steps = 0
    while True:
        held_back = resetting and next_job >= s.reset_after  # turns wait for the reset
        if held_back:
            if sched.reset_prefix_cache(reset_connector=s.reset_connector):
                held_back = resetting = False
                for job in deferred:
                    start_turn(job)
                deferred.clear()
            elif not sched.has_requests():
                idle_steps += 1  # only the connector's transfers are left: steps until they finish
                if idle_steps > 10_000:
                    raise SystemExit(f"{s.name}: reset_prefix_cache never succeeded")
        while len(slots) < s.concurrency and next_job < len(jobs) and not held_back:
            salt = ("tenant-a", "tenant-b", None)[next_job % 3] if s.salts else None
            lora = (LoRARequest("sql", 1, "/nonexistent/sql"), LoRARequest("chat", 2, "/nonexistent/chat"),
                    None)[next_job % 3] if s.loras else None  # the scheduler never loads the weights
            job = {"job": jobs[next_job], "turn": 0, "salt": salt, "lora": lora}
            next_job += 1
            start_turn(job)
        if not sched.has_requests() and not held_back:
            break
        out = sched.schedule()
        for rid, job in slots.items():  # the lookup that placed the request (not one it was skipped after)
            req = job["req"]
            if req.num_preemptions != job.get("preempted", 0):  # placed again by a later lookup
                job["preempted"] = req.num_preemptions
                job.pop("lookup_at", None)
            if "lookup_at" not in job and rid in looked and req.status != RequestStatus.WAITING:
                job["lookup_at"] = looked[rid]
        mro = runner.execute(out)
        outputs = sched.update_from_output(out, mro)
        if runner.k and out.total_num_scheduled_tokens > 0:
            sched.update_draft_token_ids(runner.drafts(out))
        cap.drain(published[0])
        t_done = time.time()
        for eco in outputs.values():
            for o in eco.outputs:
                job = slots.get(o.request_id)
                if job is None:
                    continue
                job.setdefault("gen", []).extend(o.new_token_ids)
                if o.prefill_stats is not None:
                    job["stats"] = o.prefill_stats
                if o.finish_reason is None:
                    continue
                del slots[o.request_id]
                st = job.get("stats")
                kind, x = job["job"]
                records.append({
                    "i": len(records), "request_id": o.request_id, "kind": kind,
                    "conv": x[0] if kind == "conv" else -1 - x[0], "turn": job["turn"],
                    "sys_id": x[1], "t_send": job["t_send"], "t_done": t_done, "status": 200,
                    "prompt_token_ids": job["prompt"], "prompt_tokens": len(job["prompt"]),
                    "cached_tokens": st.num_cached_tokens if st else 0,
                    "cached_tokens_by_tier": {
                        "GPU": st.num_local_cached_tokens if st else 0,
                        "CPU": st.num_external_cached_tokens if st else 0},
                    "num_preemptions": job["req"].num_preemptions,
                    "lookup_at": job.get("lookup_at"),
                    "output_token_ids": job["gen"], "completion_tokens": len(job["gen"]),
                })
                if s.salts:
                    records[-1]["cache_salt"] = job["salt"]
                if s.loras:
                    records[-1]["lora"] = job["lora"].lora_name if job["lora"] else None
                job["out"] = job.pop("gen")
                job["turn"] += 1
                if resetting and next_job >= s.reset_after:
                    deferred.append(job)  # its next turn after the reset
                else:
                    start_turn(job)   # the conversation's next turn, if it has one
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for <scenario>/ recordings")
    ap.add_argument("--scenario", nargs="*", default=None, choices=sorted(SCENARIOS),
                    help="scenarios to record (default: all)")
    ap.add_argument("--port", type=int, default=5591, help="loopback port for the publisher")
    ap.add_argument("--platform", choices=["cpu", "cuda"], default="cpu",
                    help="cpu: vLLM's own CpuPlatform (VLLM_TARGET_DEVICE=cpu); cuda: its CUDA "
                         "platform with an H100 stand-in for the device queries")
    a = ap.parse_args()
    if os.environ.get("PYTHONHASHSEED") != "0":
        # the same frames on every run: vLLM iterates sets of request ids and hashes, whose order
        # follows the interpreter's string-hash seed (NONE_HASH does not: the seed is taken out of
        # the environment again before init_none_hash, which would read it)
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})
    if a.platform == "cuda":
        use_cuda_platform()
    else:
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
        # CpuPlatform asks for triton-cpu, which only its model runner (not run here) uses. The
        # model modules are imported first, while vLLM still sees no Triton (their kernels'
        # decorators then stay placeholders).
        import importlib

        import vllm.triton_utils
        for m in ("llama", "llama_eagle", "gemma2", "qwen3_next", "qwen3_next_mtp"):
            importlib.import_module(f"vllm.model_executor.models.{m}")
        vllm.triton_utils.HAS_TRITON = True
    for name in a.scenario or list(SCENARIOS):
        record_scenario(SCENARIOS[name], Path(a.out), a.port)


if __name__ == "__main__":
    sys.exit(main())
