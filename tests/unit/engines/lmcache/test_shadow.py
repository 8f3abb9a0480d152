"""`kvidx shadow --engine lmcache` (kvidx/engines/lmcache/adapter.py) on a generated recording of a
vLLM 0.32 engine running LMCache 0.5.6 (tests/fixtures/lmcache-0.5.6 holds a frames stream but no request log,
so the recording is generated here).

How the recording is made (the serialization rules are those of tests/fixtures/vllm-variants/
engine_wire.py and kvidx/engines/lmcache/chunks.py, with their citations):
- vLLM's own GPU events: the simulated vLLM 0.32 engine (kvidx/engines/vllm/sim.py: sha256 block
  hashes, LRU block pool, one BlockRemoved per evicted block), engine block 32, a small pool so that
  GPU evictions are frequent;
- LMCache's stores re-published by vLLM's connector, in the next batch of the same publisher
  (engine_wire.lmcache_store_call: one BlockStored per 64-token chunk, medium "cpu", parent None for
  the chunk at 0 and 0 for the first chunk of a call that skips stored ones, one extra token id on
  non-last chunks, LMCache's own hashes), after each request, over its prompt, skipping the leading
  full chunks LMCache already holds; LMCache never evicts here (its capacity exceeds the workload)
  and publishes no evictions anyway;
- the request log's `cached_tokens`: vLLM's GPU prefix hit or LMCache's hit (its lookup: leading
  full chunks stored), the larger (the connector loads what LMCache holds beyond the GPU hit),
  capped below the last prompt token at the engine block (floor((n - 1) / 32) * 32).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvidx.engines import RelayOptions
from kvidx.engines.contract import Frame
from kvidx.engines.lmcache.chunks import LmcacheConfig
from kvidx.engines.recording import frame_to_line
from kvidx.engines.vllm.sim import SimVllmEngine
from kvidx.shadow import run_shadow_engine
from kvidx.sim.prompts import workload_requests
from tests.helpers import FIXTURES

sys.path.insert(0, str(FIXTURES / "vllm-variants"))
from engine_wire import lmcache_hash, lmcache_store_call, payload  # noqa: E402

B, CHUNK = 32, 64
ENDPOINT = "tcp://10.0.0.7:5557"


def make_recording(out: Path, n_requests: int = 400, seed: int = 8, save_unfull: bool = True) -> dict:
    eng = SimVllmEngine(num_blocks=40, block_size=B, endpoint="tcp://127.0.0.1:*")
    stored_chunks: set[int] = set()  # LMCache's keys (chunk hash of the prefix up to the chunk's end)
    t = time.time()
    fed = 0
    frames, reqs = [], []
    counts = {"gpu_wins": 0, "lmcache_wins": 0}
    try:
        for i, (prompt, output) in enumerate(workload_requests(seed, n_requests, systems=4, sys_len=(60, 200),
                                                               user_len=(10, 80), output_len=10,
                                                               max_prompt=700)):
            n = len(prompt)
            t += 0.01
            t_send = t
            cap = (n - 1) // B * B
            lm = 0
            while lm < n and lmcache_hash(prompt[:min(lm + CHUNK, n)]) in stored_chunks:
                lm = min(lm + CHUNK, n)  # LMCache's lookup: chunk keys are prefix hashes up to each end
            gpu = eng.serve(prompt, output)
            reused = max(gpu, min(lm, cap))
            if reused > gpu:
                counts["lmcache_wins"] += 1
            elif gpu:
                counts["gpu_wins"] += 1
            skip = 0
            while (skip + 1) * CHUNK <= n and lmcache_hash(prompt[:(skip + 1) * CHUNK]) in stored_chunks:
                skip += 1
            call = lmcache_store_call(prompt, CHUNK, skip, lmcache_hash, save_unfull=save_unfull)
            for start in range(skip * CHUNK, n if save_unfull else n // CHUNK * CHUNK, CHUNK):
                stored_chunks.add(lmcache_hash(prompt[:min(start + CHUNK, n)]))
            if call:
                eng._publish(payload(call, ts=time.time(), rank=0))
            for seq, pl in [(s, p) for s, p in eng._buffer if s >= fed]:
                t += 0.0005
                frames.append(Frame(b"kv", seq, pl, int(t * 1e9), ENDPOINT))
                fed = seq + 1
            reqs.append({"i": i, "t_send": t_send, "replica": ENDPOINT, "prompt_token_ids": prompt,
                         "prompt_tokens": n, "cached_tokens": reused, "status": 200})
    finally:
        eng.close()
    (out / "frames.jsonl").write_text("".join(frame_to_line(f) + "\n" for f in frames))
    (out / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reqs))
    return {**counts, "gpu_removed": eng.removed_blocks}


@pytest.mark.parametrize("save_unfull", [False, True])
def test_shadow_lmcache_on_a_generated_recording(tmp_path, save_unfull):
    counts = make_recording(tmp_path, save_unfull=save_unfull)
    assert counts["lmcache_wins"] > 20 and counts["gpu_wins"] > 20 and counts["gpu_removed"] > 100
    res, _ = run_shadow_engine("lmcache", tmp_path / "frames.jsonl", tmp_path / "requests.jsonl")
    ag, extra = res.agreement, res.extra
    s = ag.summary()
    assert s["requests"] == 400 and res.dead_letters == 0 and s["recall"] == 1.0, s
    assert extra["lmcache_stored"] > 100 and extra["lmcache_orphans"] == 0
    assert extra["upper_bound_requests"] >= counts["lmcache_wins"], extra
    # Over-credit, never under: (1) a short last chunk (save_unfull_chunk) is keyed by LMCache on the
    # prefix up to ITS end, so only a prompt ending at that token hits it, while the relay indexes the
    # chunk's full index blocks (engines/lmcache/chunks.py); (2) without short chunks, 12 of 400 requests
    # are still over-credited by one engine block (cause not yet pinned down; see the report).
    assert s["exact_requests"] >= (385 if not save_unfull else 340), ag.mismatches
    assert s["over_credit"] < 0.03, s
    assert all(0 < m["credited"] - m["reused"] < CHUNK for m in ag.mismatches), ag.mismatches

    # with LMCache's chunks aged out at once, the index misses the LMCache hits
    res0, _ = run_shadow_engine("lmcache", tmp_path / "frames.jsonl", tmp_path / "requests.jsonl",
                                options=RelayOptions(extra={"lmcache": LmcacheConfig(ttl_s=1e-9)}))
    assert res0.agreement.summary()["recall"] < 1.0


def test_cli_shadow_engine_lmcache(tmp_path):
    make_recording(tmp_path, n_requests=120, seed=9)
    cmd = [sys.executable, "-m", "kvidx.cli", "shadow", "--engine", "lmcache", "--json",
           "--recording", str(tmp_path / "frames.jsonl"), "--requests", str(tmp_path / "requests.jsonl")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["requests"] == 120 and summary["recall"] == 1.0
    assert summary["upper_bound_requests"] > 0 and summary["lmcache_orphans"] == 0
