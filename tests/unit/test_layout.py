"""The layout's rules, checked on the import graph (every import statement, at module level or inside a
function): the core is pure (it imports nothing of the project but schemas/), engine adapters know
nothing of transports, relays import no simulator, shadow or operations module, and the production
commands never load the local-broker launcher."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

PROJECT = ("kvidx", "relays", "streams", "index_service", "schemas")


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every project import in a file, relative ones resolved."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            out.append((node.lineno, base))
            for a in node.names:  # `from pkg import module` imports the module
                sub = ROOT / f"{base}.{a.name}".replace(".", "/")
                if sub.exists() or sub.with_suffix(".py").exists():
                    out.append((node.lineno, f"{base}.{a.name}"))
    return [(n, m) for n, m in out if m.split(".")[0] in PROJECT]


def violations(folder: str, allowed, forbidden=()) -> list[str]:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for line, mod in imports(path):
            ok = any(mod == a or mod.startswith(a + ".") for a in allowed) if allowed is not None else True
            if not ok or any(mod == f or mod.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    return bad


# the import order, lowest first: a module imports its own layer's and lower layers' modules only; the
# processes (one layer) do not import each other. The routers' client depends on schemas only.
LAYERS: list[tuple[str, ...]] = [
    ("schemas",),
    ("kvidx.core",),
    ("kvidx.index",),
    ("kvidx.engines",),
    ("kvidx.config", "kvidx.kafka", "kvidx.ready", "kvidx.logfmt", "kvidx.clihelp"),  # every process uses
    ("relays", "streams", "index_service"),  # the processes, each assembling itself
    ("kvidx.ops", "kvidx.sim", "kvidx.demo", "kvidx.shadow", "kvidx.simulate"),  # tools over them
    ("kvidx.cli",),  # parsing only
]
PROCESSES = LAYERS[5]
# the one process that runs another's code: the service starts the relays Dynamo's and the conductor's
# POST /register ask for (relays/managed.py, publishing through relays/sinks.py)
EMBEDS = {("index_service", "relays")}


def _home(module: str) -> tuple[int, str] | None:
    """(layer, the layer's package the module is in), or None (kvidx's own __init__, the client)."""
    for i, layer in enumerate(LAYERS):
        for pkg in layer:
            if module == pkg or module.startswith(pkg + "."):
                return i, pkg
    return None


def order_violations() -> list[str]:
    bad = []
    for folder in PROJECT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            me = _home(".".join(path.relative_to(ROOT).with_suffix("").parts))
            if me is None:
                continue
            for line, mod in imports(path):
                it = _home(mod)
                if it is None:
                    continue
                across = it[0] == me[0] == LAYERS.index(PROCESSES) and it[1] != me[1]
                if it[0] > me[0] or (across and (me[1], it[1]) not in EMBEDS):
                    bad.append(f"{path.relative_to(ROOT)}:{line} ({me[1]}) imports {mod} ({it[1]})")
    return bad


def test_imports_run_one_way():
    assert order_violations() == []


def test_the_order_rule_catches_an_upward_import():
    probe = ROOT / "relays" / "_layout_probe.py"
    probe.write_text("def f():\n    from streams.worker import main\n")
    try:
        assert order_violations() == ["relays/_layout_probe.py:2 (relays) imports streams.worker (streams)"]
    finally:
        probe.unlink()


def test_the_routers_client_depends_on_schemas_only():
    mods = [mod for _, mod in imports(ROOT / "kvidx" / "client.py")]
    assert mods and [m for m in mods if not m.startswith(("schemas.", "kvidx.client"))] == []


def engine_names_outside_the_registry() -> list[str]:
    """Where relays/ and the CLI name an engine themselves: an import of an engine's folder, or an
    engine's name as a value (they reach engines through the registry, kvidx.engines). The service's
    embedded relays name the engines Dynamo's and the conductor's registrations run, once each."""
    from kvidx import engines

    names = set(engines.names())
    allowed = {("relays/managed.py", "REGISTERED_ENGINE"), ("relays/managed.py", "POOL_ENGINE")}
    bad = []
    for path in [*sorted((ROOT / "relays").rglob("*.py")), ROOT / "kvidx" / "cli.py"]:
        rel = path.relative_to(ROOT).as_posix()
        bad += [f"{rel}:{line} imports {mod}" for line, mod in imports(path)
                if mod.split(".")[:2] == ["kvidx", "engines"] and len(mod.split(".")) > 2
                and mod.split(".")[2] in names]
        tree = ast.parse(path.read_text())
        named = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and any((rel, getattr(t, "id", "")) in allowed for t in node.targets)}
        bad += [f"{rel}:{node.lineno} names {node.value!r}" for node in ast.walk(tree)
                if isinstance(node, ast.Constant) and node.value in names and id(node) not in named]
    return bad


def test_relays_and_the_cli_know_engines_only_through_the_registry():
    assert engine_names_outside_the_registry() == []


def test_the_registry_rule_catches_an_engine_branch(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "relays").mkdir()
    (tmp_path / "kvidx").mkdir()
    (tmp_path / "kvidx" / "cli.py").write_text("")
    (tmp_path / "relays" / "x.py").write_text(
        "from kvidx.engines.vllm.wire import check_engine_version\nif engine == 'sglang':\n    pass\n")
    assert engine_names_outside_the_registry() == ["relays/x.py:1 imports kvidx.engines.vllm.wire",
                                                   "relays/x.py:2 names 'sglang'"]


def test_the_core_imports_nothing_of_the_project_but_schemas():
    assert violations("kvidx/core", allowed=("kvidx.core", "schemas")) == []


def test_relays_import_no_simulator_shadow_or_ops_module():
    assert violations("relays", None, forbidden=("kvidx.sim", "kvidx.simulate", "kvidx.shadow", "kvidx.ops",
                                                 "kvidx.demo", "kvidx.kafka.local")) == []


def test_engine_adapters_know_no_transport():
    assert violations("kvidx/engines", None, forbidden=("relays", "streams", "index_service", "kvidx.kafka",
                                                        "kvidx.sim", "kvidx.ops")) == []


# a shard's members that only kvidx/core (the state and its fold) and kvidx/index (the reads) touch
SHARD_INTERNALS = ("by_slot", "_lookup_group", "_pools")
# the walk: everyone else asks the Index (kvidx.index.lookup, answer, credited, ...)
SHARD_WALK = ("lookup", "lookup_json", "credited", "prefix_blocks", "resume_points", "resume_point",
              "tier_runs", "pending_resumable", "tail_hits", "onboard_cut", "local_first_cut")


def shard_reaches(folder: str) -> list[str]:
    """Where code outside kvidx/core and kvidx/index reads a shard's internals: one of
    SHARD_INTERNALS on anything but `self`, a private member (`_x`) of a name ending in "shard", or
    walks it itself (SHARD_WALK on a name ending in "shard")."""
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("kvidx/core/", "kvidx/index/")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            value = node.value
            owner = value.attr if isinstance(value, ast.Attribute) else getattr(value, "id", "")
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            if (node.attr in SHARD_INTERNALS and owner != "self") or (
                    owner.endswith("shard") and (node.attr in SHARD_WALK or private)):
                bad.append(f"{rel}:{node.lineno} reads .{node.attr}")
    return bad


@pytest.mark.parametrize("folder", ["kvidx", "index_service", "relays", "streams", "bench"])
def test_only_the_core_and_the_index_reach_into_a_shard(folder):
    assert shard_reaches(folder) == []


# a shard's state, read by the product only through the Index (kvidx/config.py configures it)
SHARD_STATE = ("replicas", "groups", "foresight", "pending", "pool_readers")


@pytest.mark.parametrize("folder", ["kvidx", "index_service", "relays", "streams"])
def test_the_product_reads_a_shards_state_through_the_index(folder):
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("kvidx/core/", "kvidx/index/")) or rel == "kvidx/config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in SHARD_STATE:
                value = node.value
                owner = value.attr if isinstance(value, ast.Attribute) else getattr(value, "id", "")
                if owner.endswith("shard"):
                    bad.append(f"{rel}:{node.lineno} reads .{node.attr}")
    assert bad == []


def test_the_shard_is_its_state_and_its_fold_only():
    """No mixins: the walk is functions of the state (kvidx/core/walk.py, called through the Index),
    snapshots a codec of it (kvidx/core/snapshot.py)."""
    from kvidx.core.shard import ModelShard

    assert ModelShard.__mro__ == (ModelShard, object)
    codec = ("snapshot", "restore", "from_parts", "snapshot_delta", "snapshot_segments", "segment_bytes")
    kept = [m for m in (*SHARD_WALK, *codec) if hasattr(ModelShard, m)]
    assert kept == []


def test_the_shard_rule_catches_a_reach(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "index_service").mkdir()
    (tmp_path / "index_service" / "x.py").write_text(
        "def f(shard, r):\n    return shard._lookup_group(None)\n"
        "def g(r):\n    return r.shard.lookup([1], 16, 0.0)\n")
    assert shard_reaches("index_service") == ["index_service/x.py:2 reads ._lookup_group",
                                              "index_service/x.py:4 reads .lookup"]


def test_the_rules_catch_a_forbidden_import(tmp_path, monkeypatch):
    # a self-test: the walk sees imports inside functions too
    core = ROOT / "kvidx" / "core"
    probe = core / "_layout_probe.py"
    probe.write_text("def f():\n    from relays.sinks import KafkaSink\n")
    try:
        assert violations("kvidx/core", allowed=("kvidx.core", "schemas")) == [
            "kvidx/core/_layout_probe.py:2 imports relays.sinks"]
    finally:
        probe.unlink()


@pytest.mark.parametrize("command", ["relay", "worker", "serve"])
def test_production_commands_do_not_load_the_local_broker_launcher(command):
    argv = [command, "--model", "m"] if command == "relay" else [command]
    code = f"""
import sys
from kvidx.cli import build_parser
args = build_parser().parse_args({argv!r})
import relays.run, relays.sinks, relays.control, relays.zmq_source, streams.worker, streams.snapshots
import index_service.app, index_service.follower, kvidx.kafka.reach, kvidx.kafka.topics, kvidx.kafka.config
print("kvidx.kafka.local" in sys.modules)
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False"


def test_fast_suites_run_first():
    """tests/conftest.py orders a run unit, security, fuzz, integration: progress shows within a minute,
    whatever order the folders are named or given in."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "tests/integration/test_readiness.py", "tests/fuzz", "tests/unit/test_layout.py"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300).stdout
    suites = [line.split("/")[1] for line in out.splitlines() if "::" in line]
    assert suites and suites == sorted(suites, key=["unit", "fuzz", "integration"].index), out[-2000:]
