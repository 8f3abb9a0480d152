"""The fleet simulator (kvidx/sim/fleet.py, kvidx/simulate.py): exact agreement without event delay,
the KV-aware router beating the baselines, gaps, the CLI's JSON line. The Kafka path:
tests/integration/test_simulate.py."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvidx import simulate
from kvidx.cli import main as cli_main
from kvidx.sim.fleet import run_fleet
from kvidx.sim.workloads import (
    MOONCAKE_TRACE,
    agent_requests,
    chat_requests,
    load_trace,
    model_names,
    trace_requests,
)
from tests.helpers import TRACE_BT as BT
from tests.helpers import fleet_config as cfg


def test_trace_tokens_are_deterministic_prefixes(trace_reqs):
    rows = load_trace(limit=300)
    again = trace_requests(rows, BT)
    assert all(np.array_equal(a.prompt, b.prompt) for a, b in zip(trace_reqs, again, strict=True))
    # requests 0 and 1 share hash id 0 only: exactly one block of tokens in common
    a, b = trace_reqs[0].prompt, trace_reqs[1].prompt
    assert np.array_equal(a[:BT], b[:BT]) and not np.array_equal(a[BT:2 * BT], b[BT:2 * BT])
    r = rows[0]
    last = r["input_length"] - 512 * (len(r["hash_ids"]) - 1)
    assert len(a) == (len(r["hash_ids"]) - 1) * BT + -(-last * BT // 512)


@pytest.mark.parametrize("engine_block", [16, 32])
def test_zero_delay_agrees_exactly(trace_reqs, engine_block):
    r = run_fleet(trace_reqs, cfg(engine_block=engine_block), "kv")
    s = r.overall.summary()
    assert r.counters["engine_evicted_blocks"] > 0  # the cache is small enough to evict
    assert s["reused_tokens"] > 0
    assert s["recall"] == 1.0 and s["over_credit"] == 0.0, s
    assert s["exact_requests"] == s["requests"] == len(trace_reqs)
    for a in r.per_replica.values():
        assert a.matched_tokens == a.reused_tokens and a.over_tokens == 0


def test_lookups_over_http_through_the_client_agree_as_in_process(trace_reqs):
    """lookup="http" (simulate --http): the router asks the real service through kvidx.client's binary
    form; the answers are the in-process ones, so the runs agree request for request."""
    reqs = trace_reqs[:120]
    over_http = run_fleet(reqs, cfg(lookup="http"), "kv").overall
    in_process = run_fleet(reqs, cfg(), "kv").overall
    assert over_http.summary() == in_process.summary() and over_http.summary()["reused_tokens"] > 0


def test_kv_router_beats_baselines(trace_reqs):
    reuse = {p: run_fleet(trace_reqs, cfg(delay_ms=(1.0, 20.0)), p).overall.summary()["reuse_rate"]
             for p in ("kv", "random", "round_robin", "least_loaded")}
    assert all(reuse["kv"] > reuse[p] for p in ("random", "round_robin", "least_loaded")), reuse


def test_chat_workload_multi_model_zero_delay_exact():
    reqs = chat_requests(400, models=2, rate=50.0, seed=3)
    r = run_fleet(reqs, cfg(models=model_names(2), replicas=3, token_scale=1.0, num_blocks=600), "kv")
    s = r.overall.summary()
    assert s["recall"] == 1.0 and s["over_credit"] == 0.0 and s["reuse_rate"] > 0.3
    assert set(r.per_model) == {"model-0", "model-1"} and all(a.requests for a in r.per_model.values())


def test_agent_loops_zero_delay_exact_and_kv_router_wins():
    reqs = agent_requests(200, rate=50.0, seed=4, concurrent=8)
    assert len(reqs) == 200 and any(len(r.prompt) > 3000 for r in reqs)
    c = cfg(replicas=4, token_scale=1.0, num_blocks=2000)
    kv = run_fleet(reqs, c, "kv").overall.summary()
    assert kv["recall"] == 1.0 and kv["over_credit"] == 0.0
    assert kv["reuse_rate"] > run_fleet(reqs, c, "random").overall.summary()["reuse_rate"]


def test_drops_filled_by_replay_or_clear_the_replica(trace_reqs):
    filled = run_fleet(trace_reqs, cfg(drop_rate=0.1), "kv")
    assert filled.counters["seq_gaps"] > 0 and filled.counters["gaps_unfilled"] == 0
    lost = run_fleet(trace_reqs, cfg(drop_rate=0.1, replay=False), "kv")
    assert lost.counters["gaps_unfilled"] > 0
    # a cleared replica is seen as cold: the index under-credits, never over-credits for it
    assert lost.overall.summary()["recall"] < filled.overall.summary()["recall"]


def test_cli_json_last_line(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    with open(MOONCAKE_TRACE) as f:
        trace.write_text("".join(next(f) for _ in range(150)))
    out = tmp_path / "out"
    rc = cli_main(["simulate", "--trace", str(trace), "--trace-block-tokens", "32", "--replicas", "4",
                        "--jobs", "1", "--out", str(out), "--json", "--speed", "5"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    head = json.loads(lines[-1])
    for k in simulate.KEYS:
        assert k in head
    assert head["requests"] == 150
    assert head["zero_delay"]["recall"] == 1.0 and head["zero_delay"]["over_credit"] == 0.0
    assert set(head["policies"]) == {"kv", "random", "round_robin", "least_loaded"}
    full = json.loads((out / "summary.json").read_text())
    assert full["runs"]["kv"]["windows"] and full["runs"]["kv"]["per_replica"]


def test_cli_help():
    with pytest.raises(SystemExit) as e:
        cli_main(["simulate", "--help"])
    assert e.value.code == 0


# ---- mixed engines, tiers, shared pools ------------------------------------------------------------
MIX = ("vllm", "sglang", "trtllm")


def test_mixed_engines_zero_delay_agree_per_engine(trace_reqs):
    """vLLM and SGLang replicas agree exactly; TensorRT-LLM reuses partial blocks, which the index
    credits rounded down to the index block (never more)."""
    r = run_fleet(trace_reqs, cfg(engines=MIX, replicas=6, trtllm_poll_ms=0.0), "kv")
    assert set(r.per_engine) == set(MIX) and all(a.requests for a in r.per_engine.values())
    for k in ("vllm", "sglang"):
        s = r.per_engine[k].summary()
        assert s["reused_tokens"] > 0 and s["recall"] == 1.0 and s["over_credit"] == 0.0, (k, s)
    t = r.per_engine["trtllm"]
    assert t.reused_tokens > 0 and t.over_tokens == 0
    assert t.reused_tokens - t.matched_tokens < 16 * t.requests
    assert r.counters["dead_letters"] == 0 and set(r.counters["engine_evicted_blocks_by_engine"]) == set(MIX)
    assert all(v > 0 for v in r.counters["engine_evicted_blocks_by_engine"].values())
    assert {r.replica_kinds[n] for n in r.per_replica} == set(MIX)


def test_host_tier_and_shared_pool_zero_delay(trace_reqs):
    """TensorRT-LLM's host tier and a node-shared pool: reuse split by tier; the index credits pool
    blocks to the attached replicas exactly; the only over-credit is TensorRT-LLM's own onboarding
    evicting the rest of the prompt's host prefix (the engine's walk changes what it matched)."""
    r = run_fleet(trace_reqs, cfg(engines=MIX, replicas=6, trtllm_poll_ms=0.0, host_tier_blocks=600,
                                  pool_blocks=2500, pool_group=3), "kv")
    assert set(r.per_tier) == {"GPU", "CPU", "NODE_SHARED"}
    pool = r.per_tier["NODE_SHARED"].summary()
    assert r.counters["pools"]["pools"] == 2 and r.counters["pools"]["evicted_blocks"] > 0
    assert pool["reused_tokens"] > 0 and pool["recall"] == 1.0 and pool["over_credit"] == 0.0, pool
    assert r.per_tier["CPU"].reused_tokens > 0 and r.counters["trtllm"]["onboarded"] > 0
    for k in ("vllm", "sglang"):
        s = r.per_engine[k].summary()
        assert s["recall"] == 1.0 and s["over_credit"] == 0.0, (k, s)
    t = r.per_engine["trtllm"]
    assert t.over_tokens <= r.counters["trtllm"]["self_evicted_tokens"]


def test_pool_with_delay_and_baselines(trace_reqs):
    kw = dict(engines=("vllm", "sglang"), delay_ms=(1.0, 20.0), pool_blocks=2500, pool_group=2)
    reuse = {p: run_fleet(trace_reqs, cfg(**kw), p).overall.summary()["reuse_rate"]
             for p in ("kv", "round_robin")}
    assert reuse["kv"] > reuse["round_robin"], reuse


def test_cli_mixed_fleet_json(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    with open(MOONCAKE_TRACE) as f:
        trace.write_text("".join(next(f) for _ in range(120)))
    rc = cli_main(["simulate", "--trace", str(trace), "--trace-block-tokens", "32", "--replicas", "3",
                   "--jobs", "1", "--json", "--speed", "5", "--engines", "vllm,sglang,trtllm",
                   "--host-tier-blocks", "400", "--pool-blocks", "2000", "--pool-group", "3",
                   "--policies", "kv,random", "--no-progress", "--quiet"])
    assert rc == 0
    head = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for k in simulate.KEYS:
        assert k in head
    assert set(head["per_engine"]) == set(MIX) and set(head["per_tier"]) == {"GPU", "CPU", "NODE_SHARED"}
    assert head["config"]["engines"] == list(MIX) and head["config"]["pool_blocks"] == 2000
    assert head["zero_delay"]["per_engine"]["vllm"]["recall"] == 1.0
    ec = head["engine_counters"]  # the engines' own counts behind the figures
    assert set(ec) == {"trtllm", "pools"} and "self_evicted_tokens" in ec["trtllm"]


# ---- hybrid groups and vLLM CPU offload --------------------------------------------------------------
@pytest.mark.parametrize("spec", ["swa:256", "mamba:3"])
def test_hybrid_zero_delay_agrees_per_group_kind(trace_reqs, spec):
    """Hybrid replicas (kvidx/engines/vllm/sim_hybrid.py) reuse by vLLM's hybrid rule; without delay the index
    agrees exactly, overall and per group kind; both groups evict from their shared pool. (Mamba
    checkpoints every 3 blocks: the trace's prefixes end on multiples of 4 blocks, so the state group
    shortens hits; with every 2 blocks it never would.)"""
    r = run_fleet(trace_reqs, cfg(hybrid=spec, hybrid_group_blocks=200), "kv")
    s = r.overall.summary()
    assert s["recall"] == 1.0 and s["over_credit"] == 0.0 and s["exact_requests"] == len(trace_reqs), s
    kind = "sliding_window" if spec.startswith("swa") else "mamba"
    assert set(r.per_group_kind) == {"full_attention", kind}
    for a in r.per_group_kind.values():
        assert a.matched_tokens == a.reused_tokens and a.over_tokens == 0
    fa = r.per_group_kind["full_attention"]
    assert fa.reused_tokens > s["reused_tokens"] > 0  # the second group shortens some hits
    h = r.counters["hybrid"]
    assert all(x > 0 for x in h["evicted_blocks_by_group"]) and r.counters["dead_letters"] == 0
    assert h["relay_extra_copies"] > 0  # recomputed blocks after a shortened hit are second copies
    if kind == "mamba":
        assert h["hashless_announced"] == h["relay_hashless_stored"] > 0
    else:
        assert h["relay_reannounced"] > 0


def test_hybrid_with_delay_and_drops(trace_reqs):
    r = run_fleet(trace_reqs, cfg(hybrid="swa:256", hybrid_group_blocks=200, delay_ms=(1.0, 20.0),
                                  drop_rate=0.05), "kv")
    s = r.overall.summary()
    assert r.counters["seq_gaps"] > 0 and r.counters["gaps_unfilled"] == 0
    assert s["recall"] > 0.9 and s["over_credit"] < 0.02, s


def test_vllm_cpu_offload_zero_delay_agrees_per_tier(trace_reqs):
    """GPU evictions move to the connector's CPU tier (placeholder events: block_size 0, no tokens);
    CPU hits after the GPU hit are reused and credited in the CPU tier, exactly without delay."""
    r = run_fleet(trace_reqs, cfg(num_blocks=700, cpu_offload_blocks=800), "kv")
    assert set(r.per_tier) == {"GPU", "CPU"}
    for tn in ("GPU", "CPU"):
        t = r.per_tier[tn].summary()
        assert t["reused_tokens"] > 0 and t["recall"] == 1.0 and t["over_credit"] == 0.0, (tn, t)
    c = r.counters["cpu_offload"]
    assert c["cpu_evicted_blocks"] > 0 and c["cpu_hit_blocks"] > 0
    assert c["relay_placeholder_stored"] == c["offloaded_blocks"] and c["relay_placeholder_unknown"] == 0
    plain = run_fleet(trace_reqs, cfg(num_blocks=700), "kv").overall.summary()
    assert r.overall.summary()["reuse_rate"] > plain["reuse_rate"]


def test_cli_hybrid_and_offload_json(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    with open(MOONCAKE_TRACE) as f:
        trace.write_text("".join(next(f) for _ in range(100)))
    base = ["simulate", "--trace", str(trace), "--trace-block-tokens", "32", "--replicas", "3", "--jobs", "1",
            "--json", "--policies", "kv", "--no-progress", "--quiet"]
    assert cli_main([*base, "--hybrid", "mamba:2"]) == 0
    head = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(head["per_group_kind"]) == {"full_attention", "mamba"}
    assert head["config"]["hybrid"] == "mamba:2"
    assert head["zero_delay"]["per_group_kind"]["mamba"]["recall"] == 1.0
    h = head["engine_counters"]["hybrid"]
    assert h["pool_blocks"] > 0 and h["overdrawn_blocks"] == 0 and sum(h["stored_blocks_by_group"]) > 0
    assert cli_main([*base, "--cpu-offload-blocks", "300", "--engine-blocks", "300"]) == 0
    head = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(head["per_tier"]) == {"GPU", "CPU"} and head["zero_delay"]["per_tier"]["CPU"]["recall"] == 1.0
    with pytest.raises(SystemExit):
        cli_main([*base, "--hybrid", "swa:64", "--cpu-offload-blocks", "10"])


def test_vllm_disk_level_under_the_cpu_zero_delay_agrees_per_tier(trace_reqs):
    """CPU evictions move to a disk level (placeholders with medium DISK); a request loads the blocks
    after its GPU hit from either level, credited in the tier it came from, exactly without delay."""
    r = run_fleet(trace_reqs, cfg(num_blocks=700, cpu_offload_blocks=300, disk_offload_blocks=2000), "kv")
    assert set(r.per_tier) == {"GPU", "CPU", "DISK"}
    for tn in ("GPU", "CPU", "DISK"):
        t = r.per_tier[tn].summary()
        assert t["reused_tokens"] > 0 and t["recall"] == 1.0 and t["over_credit"] == 0.0, (tn, t)
    c = r.counters["cpu_offload"]
    assert c["disk_stored_blocks"] > 0 and c["disk_hit_blocks"] > 0
    assert c["relay_placeholder_stored"] == c["offloaded_blocks"] + c["disk_stored_blocks"]
    assert r.counters["serving"]["bytes_moved"] > 0


def test_kv_hints_prefetch_followed_pays_off_and_never_slows_a_request(trace_reqs):
    """The same fleet and routing, with the index's prefetch plans followed: the loads the queue hides
    come off the requests' turns (TTFT no worse on average), and the counters say so."""
    c = cfg(num_blocks=700, cpu_offload_blocks=300, disk_offload_blocks=2000, speed=4.0)
    kv = run_fleet(trace_reqs, c, "kv")
    hinted = run_fleet(trace_reqs, c, "kv_hints")
    p = hinted.counters["hints"]["prefetch"]
    assert p["issued"] > 0 and p["followed"] == p["issued"] and 0 < p["paid_off"] <= p["followed"]
    assert p["saved_s"] > 0
    # the gate (issue #41): plans that could not pay (idle replicas, where the hint's delay would hold the
    # turn) are not issued, so none came late
    assert "hints" not in kv.counters
    assert hinted.ttft_s.mean() < kv.ttft_s.mean()
    assert hinted.counters["serving"]["gpu_share_of_reused"] > kv.counters["serving"]["gpu_share_of_reused"]
    # engines that never follow: the hints are issued, nothing changes
    ignored = run_fleet(trace_reqs, cfg(num_blocks=700, cpu_offload_blocks=300, disk_offload_blocks=2000,
                                        speed=4.0, hint_compliance=0.0), "kv_hints")
    assert ignored.counters["hints"]["prefetch"]["followed"] == 0
    assert np.allclose(ignored.ttft_s, kv.ttft_s)


def test_kv_hints_prefetch_plans_that_cannot_pay_are_not_issued(trace_reqs):
    """The gate (issue #41): at the trace's own pace some requests go to idle replicas, where a plan's
    load would start the hint's delay after the request's turn. Those are declined (before the gate they
    were issued and regretted: 6 of 14 here), so no plan comes late and the requests are no slower."""
    c = cfg(num_blocks=700, cpu_offload_blocks=300, disk_offload_blocks=2000, speed=1.0)
    kv = run_fleet(trace_reqs, c, "kv")
    hinted = run_fleet(trace_reqs, c, "kv_hints")
    p = hinted.counters["hints"]["prefetch"]
    assert p["declined"] > 0 and p["issued"] > 0 and p["paid_off"] == p["issued"]
    assert p["regretted"] == 0 and p["lost_s"] == 0.0 and p["payoff_ratio"] == 1.0
    assert hinted.ttft_s.mean() <= kv.ttft_s.mean()


def test_cli_kv_hints_json_and_bad_hint_flags(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    with open(MOONCAKE_TRACE) as f:
        trace.write_text("".join(next(f) for _ in range(100)))
    base = ["simulate", "--trace", str(trace), "--trace-block-tokens", "32", "--replicas", "3", "--jobs", "1",
            "--json", "--no-progress", "--quiet", "--no-zero-delay", "--engine-blocks", "300",
            "--cpu-offload-blocks", "100", "--disk-offload-blocks", "500"]
    assert cli_main([*base, "--policies", "kv,kv_hints", "--load-tps", "DISK=20000"]) == 0
    head = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(head["policies"]) == {"kv", "kv_hints"}
    # the prompt tokens, from the trace by the rule of kvidx/sim/workloads.py's docstring: 32 tokens
    # per 512-token id, the last id's tail scaled (at least 1 token)
    rows = [json.loads(x) for x in trace.read_text().splitlines()]
    prompt = sum((len(r["hash_ids"]) - 1) * 32
                 + min(32, max(1, math.ceil(max(r["input_length"] - 512 * (len(r["hash_ids"]) - 1), 1) / 16)))
                 for r in rows)
    for p in head["policies"].values():
        assert {"p50", "p99", "mean"} <= set(p["ttft_est_s"]) and 0 <= p["gpu_share_of_reused"] <= 1
        assert p["ttft_est_s"]["p50"] <= p["ttft_est_s"]["p99"]
        assert p["prefill_tokens"] + p["prefill_tokens_saved"] == prompt
        saved = p["prefill_tokens_saved"]
        assert saved > 0 and p["reuse_rate"] == round(saved / prompt, 6)
        assert p["bytes_moved"] == p["loaded_tokens"] * head["config"]["kv_bytes_per_token"]
    # the default kinds are the service's once hints are on (test_config.py holds them equal): prefetch
    hinted = head["policies"]["kv_hints"]["hints"]
    assert set(hinted) == {"prefetch"} and head["config"]["hints"] == "prefetch"
    assert set(hinted["prefetch"]) >= {"issued", "followed", "paid_off", "regretted", "saved_s", "lost_s",
                                       "wasted_tokens", "wasted_s"}
    assert head["config"]["load_tps"]["DISK"] == 20000.0
    for bad in (["--hints", "placement,moving"], ["--hint-compliance", "2"], ["--load-tps", "DISK"],
                ["--load-tps", "CPU=-1"]):
        with pytest.raises(SystemExit) as e:
            cli_main([*base, "--policies", "kv_hints", *bad])
        assert str(e.value).startswith("error: ")
    with pytest.raises(SystemExit, match="--disk-offload-blocks"):
        cli_main([*base[:-4], "--disk-offload-blocks", "500"])
    # a count or rate out of range: one line naming the flag, before any work
    for flag, value, floor in (("--hybrid-group-blocks", "-5", ">= 0"), ("--index-block-size", "0", ">= 1"),
                               ("--speed", "0", "> 0"), ("--replicas", "0", ">= 1")):
        with pytest.raises(SystemExit, match=f"^error: {flag} must be {floor}, not "):
            cli_main([*base, flag, value])
    with pytest.raises(SystemExit, match="--drop-rate"):
        cli_main([*base, "--drop-rate", "1"])


def test_kv_hints_placement_and_eviction_advice_are_issued_followed_and_counted():
    """Agent loops: the session tracker sees every decision. Under load (small GPU caches, 100 req/s),
    recurring sessions on busy replicas are copied ahead of time; at a calm pace with room on GPU,
    sessions that end are advised away once silent for 5 s (the engines move their free blocks to the
    head of the free queue). Both reach the index as ordinary events: it still agrees exactly. Whether
    they pay is the benchmark's question (bench/bench_hints.py)."""
    busy = run_fleet(agent_requests(600, rate=100.0, seed=3, concurrent=24),
                     cfg(token_scale=1.0, num_blocks=1100, cpu_offload_blocks=400, delay_ms=(0.0, 0.0),
                         drop_rate=0.0, hints=("placement", "eviction")), "kv_hints")
    calm = run_fleet(agent_requests(600, rate=30.0, seed=3, concurrent=24),
                     cfg(token_scale=1.0, num_blocks=3000, cpu_offload_blocks=400, delay_ms=(0.0, 0.0),
                         drop_rate=0.0, hints=("placement", "eviction")), "kv_hints")
    for r in (busy, calm):
        assert set(r.counters["hints"]) == {"placement", "eviction"}
        s = r.overall.summary()
        assert s["recall"] == 1.0 and s["over_credit"] == 0.0, s  # copies and advice show in the events
    p = busy.counters["hints"]["placement"]
    assert p["issued"] > 0 and p["followed"] == p["issued"] and 0 < p["paid_off"] <= p["followed"]
    # the copies not reused are regretted and wasted; won is not measured for placement
    assert p["regretted"] == p["followed"] - p["paid_off"] and p["saved_s"] is None
    assert (p["wasted_tokens"] > 0) == (p["regretted"] > 0) and p["lost_s"] >= 0.0
    assert busy.counters["serving"]["bytes_moved"] > calm.counters["serving"]["bytes_moved"]
    e = calm.counters["hints"]["eviction"]
    assert e["issued"] > 0 and 0 < e["followed"] <= e["issued"]
    assert e["paid_off"] == e["followed"] - e["regretted"] and e["paid_off"] > 0
    assert e["saved_s"] is None and (e["lost_s"] > 0) <= (e["regretted"] > 0)


def test_cli_human_table_shows_tiers_bytes_and_hints(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    with open(MOONCAKE_TRACE) as f:
        trace.write_text("".join(next(f) for _ in range(100)))
    assert cli_main(["simulate", "--trace", str(trace), "--trace-block-tokens", "32", "--replicas", "3",
                     "--jobs", "1", "--no-progress", "--quiet", "--no-zero-delay", "--engine-blocks", "300",
                     "--cpu-offload-blocks", "100", "--policies", "kv,kv_hints", "--hints", "prefetch"]) == 0
    out = capsys.readouterr().out
    assert "GPU share" in out and "GB moved" in out and "prefetch hints:" in out
    lines = out.splitlines()
    at = next(i for i, x in enumerate(lines) if "prefetch hints:" in x)
    assert lines[at].endswith(" regretted") and "paid off" in lines[at]
    seconds = lines[at + 1]
    assert "seconds won " in seconds and ", lost " in seconds and "s of load channel" in seconds
