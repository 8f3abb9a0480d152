"""The deployment configuration: the documented example parses, and its settings take effect."""

import pytest

import kvidx.config  # noqa: E402
from index_service.store import ShardStore
from kvidx.config import load_config
from kvidx.core import walk
from kvidx.engines.vllm.relay import VllmPublisherRelay
from tests.helpers import ROOT

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
    (gpu_only,) = walk.lookup(shard, [1, 2], 33, 0.0)
    (with_cpu,) = walk.lookup(shard, [1, 2, 3, 4], 65, 0.0)
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


REFERENCE = ROOT / "docs" / "config.md"
EXAMPLE_FILE = ROOT / "docs" / "kvidx.example.toml"


def documented_rows() -> dict[str, tuple[str, str, str]]:
    """docs/config.md's table: key -> (type, default, meaning)."""
    rows = {}
    for line in REFERENCE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (cells[1], cells[2], cells[3])
    return rows


def test_the_reference_documents_every_key_with_its_type_and_default():
    from kvidx.config import reference_rows

    documented = documented_rows()
    for key, type_name, default in reference_rows():
        row = f"| `{key}` | {type_name} | {default} | (meaning) |"
        assert key in documented, f"docs/config.md has no row for {key!r}: {row}"
        assert documented[key][:2] == (type_name, default), (key, documented[key][:2], (type_name, default))
        assert documented[key][2], f"docs/config.md: {key!r} has no meaning"
    stale = set(documented) - {key for key, _, _ in reference_rows()}
    assert not stale, f"docs/config.md documents keys kvidx/config.py does not have: {sorted(stale)}"


def _flat_keys(table: dict, prefix: str = "") -> set[str]:
    """The example's keys as the reference writes them: a model's under `default`, chosen names as
    <pool>, <group>."""
    keys = set()
    for name, value in table.items():
        if prefix == "models.":
            key = "default"  # a model's section takes the keys of `default`
        elif prefix == "pools.":
            key = "pools.<pool>"
        elif prefix.endswith(".groups."):
            key = prefix + "<group>"
        else:
            key = prefix + name
        keys.add(key)
        if isinstance(value, dict) and not key.endswith(("load_tokens_per_s", "replica_placement",
                                                         "lmcache_instances")):
            keys |= _flat_keys(value, key + ".")
    return keys


def test_the_example_file_sets_every_key_and_loads_as_config_does():
    import tomllib

    from kvidx.config import reference_rows

    cfg = load_config(EXAMPLE_FILE)  # what every command's --config calls
    assert cfg.model("llama-3-70b").replica_groups == 4
    assert cfg.model("llama-3-70b").hints.lmcache_controller == "tcp://lmcache-controller:8300"
    assert cfg.model("gemma-2-27b").group_kinds()[0] == ("sliding_window", 4096)
    assert cfg.pools["rack-7-lmcache"].tier == "NODE_SHARED"
    keys = _flat_keys(tomllib.loads(EXAMPLE_FILE.read_text()))
    missing = [key for key, _, _ in reference_rows() if key not in keys]
    assert not missing, f"docs/kvidx.example.toml does not show: {missing}"


@pytest.mark.parametrize("command", ["serve", "worker", "relay"])
def test_help_points_to_the_reference(command, capsys):
    from kvidx.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    assert "docs/config.md" in " ".join(capsys.readouterr().out.split())


def test_simulate_defaults_to_the_hint_kinds_the_service_issues_once_hints_are_on(tmp_path):
    """Issue #41: `kvidx simulate --policies kv,kv_hints` runs the policy a deployment gets by turning a
    model's hints on as docs/routers.md says (its `hints = {...}` setting, loaded as a configuration
    file): the same kinds, whichever of the docs, HintsConfig or the parser's default moves."""
    import re

    from kvidx.cli import build_parser
    from kvidx.config import HintsConfig

    routers = (ROOT / "docs" / "routers.md").read_text()
    documented = re.search(r"Prefetch hints \(opt-in per model\)\.\*\* With `(hints = \{[^}]*\})`", routers)
    assert documented, "docs/routers.md no longer says how to turn a model's hints on"
    path = tmp_path / "kvidx.toml"
    path.write_text(f"[models.llama]\n{documented.group(1)}\n")
    service = load_config(path).model("llama").hints.kinds()
    simulated = build_parser().parse_args(["simulate"]).hints.split(",")
    assert service == ("prefetch",) and tuple(simulated) == service
    # the kinds follow the service's two switches (index_service/query.py)
    assert HintsConfig().kinds() == ()
    assert HintsConfig(sessions=True).kinds() == ("placement", "eviction")
