"""The test tree mirrors the source tree:

- tests/unit/<package>/...: no broker, no Java (uvicorn on loopback and ZMQ inproc/loopback are fine):
  core/, engines/<engine>/, relays/, index_service/, kafka/ (client settings), ops/ (kvidx/ops),
  kvidx/ (the cli, config, demo, shadow, simulate modules and kvidx/sim/); test_layout.py and
  test_readme.py check the project as a whole.
- tests/integration/: everything that needs a real Kafka broker or its toolchain (java, the Kafka
  jars); its conftest.py marks every test there `kafka` and holds the broker fixtures.
- tests/fuzz/: mutation and schema fuzzing (fast by default; the long runs are marked `slow`).
- tests/load/: the bounded load test (marked `load`).
- tests/security/: the adversarial suite (the auth matrix over every route and RPC, credentials and
  rotation, hijacks, oversize and deep inputs); no broker (`kvidx serve` itself, with credentials, is
  run by tests/integration/test_serve_auth.py).

Helpers shared by several test modules live in tests/helpers.py (and tests/commands.py,
tests/integration/helpers.py, tests/fuzz/mutations.py), imported by absolute name; test modules
never import each other. The unit run: `pytest -m "not kafka and not slow and not load"`.
"""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the source packages and `tests` itself, whatever the cwd

INTEGRATION = ROOT / "tests" / "integration"


@pytest.fixture(scope="module")
def trace_reqs():
    """The first 300 requests of the Mooncake trace as token lists (tests.helpers.TRACE_BT tokens per
    hash id), for the fleet simulator's tests."""
    from kvidx.sim.workloads import load_trace, trace_requests
    from tests.helpers import TRACE_BT

    return trace_requests(load_trace(limit=300), TRACE_BT)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Markers follow folders: the folder says which run a test belongs to, so a test marked `kafka`
    outside tests/integration/ is an error (move it there; its conftest.py marks it). Then the order."""
    stray = [item.nodeid for item in items
             if item.get_closest_marker("kafka") and not Path(str(item.path)).is_relative_to(INTEGRATION)]
    if stray:
        raise pytest.UsageError("tests that need a broker belong in tests/integration/ (which marks them "
                                "`kafka`): " + ", ".join(stray))
    # then the suites in SUITE_ORDER: the fast ones first, so that a run shows progress (and the common
    # failures) within a minute instead of after the broker tests; stable within a suite
    items.sort(key=lambda item: suite_rank(Path(str(item.path))))


SUITE_ORDER = ("unit", "security", "fuzz", "integration", "load")


def suite_rank(path: Path) -> int:
    tests = ROOT / "tests"
    parts = path.relative_to(tests).parts if path.is_relative_to(tests) else ()
    return SUITE_ORDER.index(parts[0]) if parts and parts[0] in SUITE_ORDER else len(SUITE_ORDER)

