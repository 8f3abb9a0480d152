"""The deployment configuration: the documented example parses, and its settings take effect."""

import pytest

import kvidx.config  # noqa: E402
from index_service.store import ShardStore
from kvidx.config import load_config
from kvidx.engines.vllm.relay import VllmPublisherRelay

EXAMPLE = open(kvidx.config.__file__).read().split("```toml")[1].split("```")[0]


def test_documented_example_parses_and_applies(tmp_path):
    path = tmp_path / "kvidx.toml"
    path.write_text(EXAMPLE)
    cfg = load_config(path)
    assert cfg.model("llama-3-70b").price.recompute_tokens_per_s == 2500.0
    assert cfg.model("other").price.load_tokens_per_s["POOL"] == 25000.0
    want = {0: ("sliding_window", 4096), 1: ("full_attention", None)}
    assert cfg.model("gemma-2-27b").group_kinds() == want
    store = ShardStore(config=cfg)
    shard = store.shard("any-model")
    assert shard.pool_readers == {"rack-7-lmcache": frozenset({"rack7-node1:5557", "rack7-node2:5557"})}
    relay = VllmPublisherRelay("gemma-2-27b", "r", 16, group_kinds=cfg.model("gemma-2-27b").group_kinds())
    assert relay.mirror.hybrid


def test_bad_configuration_names_the_problem(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"pending_ttl_s": "soon"}')
    with pytest.raises(SystemExit, match="pending_ttl_s"):
        load_config(path)
    path.write_text('{"pools": {"p": {"tier": "POOL"}}}')
    with pytest.raises(SystemExit, match="replicas"):
        load_config(path)


def test_unreported_tiers_flag_upper_bounds(tmp_path):
    from kvidx.config import Config, ModelConfig
    from schemas.events import SCHEMA_VERSION, BlocksStored, EventBatch

    store = ShardStore(config=Config(models={"m": ModelConfig(unreported_eviction_tiers=["CPU"])}))
    shard = store.shard("m")
    for seq, (tier, hashes) in enumerate([("GPU", [1, 2]), ("CPU", [3, 4])]):
        shard.apply(EventBatch(SCHEMA_VERSION, "m", "r", 0, 1, seq, 0.0, 0.0, 16,
                               [BlocksStored(tier, 0, hashes, None, 0)]), 0.0)
    (gpu_only,) = shard.lookup([1, 2], 33, 0.0)
    (with_cpu,) = shard.lookup([1, 2, 3, 4], 65, 0.0)
    assert gpu_only.upper_bound is False and with_cpu.upper_bound is True


@pytest.mark.parametrize("hints, says", [
    ('placement_tokens_per_s = 0', "placement_tokens_per_s"),
    ('prefetch = true\nlmcache_controller = "controller:8300"', "ZMQ address"),
    ('lmcache_controller = "tcp://controller:8300"', "turn on hints.prefetch"),
])
def test_bad_hints_settings_are_refused_at_load(tmp_path, hints, says):
    path = tmp_path / "kvidx.toml"
    path.write_text(f"[models.llama.hints]\n{hints}\n")
    with pytest.raises(SystemExit, match=says):
        load_config(path)
