"""Plotting is the `plots` extra: without matplotlib, the commands that draw write their JSON and
say in one line that the plots are left out."""

from __future__ import annotations

import sys

from kvidx.ops import audit


def test_audit_plots_without_matplotlib_are_none_and_said(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert audit.plots({"over_time": [], "from": 0.0}, tmp_path) == []
    assert "pip install -e '.[plots]'" in audit.NO_PLOTS and "\n" not in audit.NO_PLOTS


def test_simulate_says_so_in_one_line(monkeypatch, tmp_path):
    from kvidx import simulate

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    said: list[str] = []
    simulate._write_out(tmp_path, {}, {}, said.append)
    assert (tmp_path / "summary.json").exists()
    assert said == ["no PNG plots: matplotlib is not installed (pip install -e '.[plots]'); "
                    "summary.json written"]
