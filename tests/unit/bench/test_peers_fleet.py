"""bench/peers/summarize.py --fleet: the fleet table (issue 43) from run.sh --workers' result folders:
same-round ratios of kvidx to Dynamo's best backend, medians over rounds, and the bars at 2,048."""

import importlib.util
import json
import sys

from tests.helpers import ROOT

_spec = importlib.util.spec_from_file_location("peers_summarize", ROOT / "bench" / "peers" / "summarize.py")
summarize = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summarize)


def _run(ingest, p99, lps, heap, live):
    return {"ingest_blocks_per_s": ingest, "lookup_p99_us": p99, "lookups_per_s": lps,
            "index_heap_bytes": heap * live}


def _folder(tmp_path, workers, live, rounds):
    d = tmp_path / f"w{workers}"
    d.mkdir()
    (d / "events.bin.meta.json").write_text(json.dumps({"workers": workers, "live_entries_end": live}))
    for r, by_key in enumerate(rounds, 1):
        for key, run in by_key.items():
            (d / f"round{r}_{key}.json").write_text(json.dumps(run) + "\n")
    return str(d)


def test_fleet_rows_are_same_round_ratios_to_the_best_backend(tmp_path, capsys):
    live = 1000
    small = _folder(tmp_path, 64, live, [
        {"kvidx": _run(10, 10, 100, 20, live), "dyn_radix": _run(5, 40, 50, 90, live),
         "dyn_crtc1": _run(8, 20, 40, 180, live)},
    ])
    big = _folder(tmp_path, 2048, live, [  # round 1: radix ingests faster, crtc has the better p99
        {"kvidx": _run(6, 30, 90, 40, live), "dyn_radix": _run(5, 300, 10, 80, live),
         "dyn_crtc1": _run(4, 60, 30, 100, live)},
        {"kvidx": _run(4, 30, 90, 40, live), "dyn_radix": _run(5, 300, 10, 80, live),
         "dyn_crtc1": _run(4, 100, 30, 100, live)},
        {"kvidx": _run(5, 30, 90, 40, live), "dyn_radix": _run(5, 300, 10, 80, live),
         "dyn_crtc1": _run(4, 60, 30, 100, live)},
        {"kvidx": _run(9, 30, 90, 40, live)},  # an incomplete round: left out
    ])
    assert summarize.fleet([small, big]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("| ") and "---" not in line]
    assert rows[1].startswith("| 64 | 0.0M | 1.25x | 2.00x | 0.50x | 20, 90, 180 |")
    # ingest: 6/5, 4/5, 5/5 -> median 1.0; p99: 30/60, 30/100, 30/60 -> 0.5; lookups 90/30 = 3
    assert rows[2].startswith("| 2,048 | 0.0M | 1.00x | 3.00x | 0.50x | 40, 80, 100 "
                              "(issue 43's bars: all met) | 3 |")


def test_a_bar_missed_at_2048_is_named(tmp_path, capsys):
    live = 1000
    big = _folder(tmp_path, 2048, live, [
        {"kvidx": _run(4, 30, 90, 50, live), "dyn_radix": _run(5, 300, 10, 80, live),
         "dyn_crtc1": _run(4, 50, 30, 100, live)},
    ])
    summarize.fleet([big])
    out = capsys.readouterr().out
    assert "missed: ingest, p99, bytes" in out


def test_a_size_without_a_complete_round_fails(tmp_path, capsys):
    d = _folder(tmp_path, 512, 10, [{"kvidx": _run(1, 1, 1, 1, 10)}])
    assert summarize.fleet([d]) == 1
    assert "no complete round" in capsys.readouterr().out


def test_the_cli_takes_the_fleet_mode(tmp_path, capsys, monkeypatch):
    d = _folder(tmp_path, 64, 10, [{"kvidx": _run(2, 1, 1, 1, 10), "dyn_radix": _run(1, 1, 1, 1, 10)}])
    monkeypatch.setattr(sys, "argv", ["summarize.py", "--fleet", d])
    assert summarize.main() == 0
    assert "| 64 |" in capsys.readouterr().out
