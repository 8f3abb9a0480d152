"""Load tests of the lookup API on loopback: every test collected under this folder is marked `load`
(deselected by pyproject's default `-m 'not slow and not load'`; `pytest -m load` runs them)."""

import pytest


def pytest_itemcollected(item):
    # called through this folder's hooks only (node.ihook): every item under tests/load/
    item.add_marker(pytest.mark.load)
