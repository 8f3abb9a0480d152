"""bench/peers/turns.py: the indexers' ingest passes taken in turns (run.sh --turns), driven against
small stand-in indexers that speak the protocol (bench_kvidx.py's and dynbench's take_turns)."""

import importlib.util
import json
import sys

from tests.helpers import ROOT

_spec = importlib.util.spec_from_file_location("peers_turns", ROOT / "bench" / "peers" / "turns.py")
turns = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(turns)

# an indexer that runs its passes (noted in the shared log), then answers each "ingest" after noting it
# there; "go": its JSON
_INDEXER = """
import json, sys, time
key, log, fail_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
open(log, "a").write(f"start-{key}\\n")
print("loading", file=sys.stderr, flush=True)
time.sleep(0.05)
open(log, "a").write(f"passes-{key}\\n")
print("turn: ready", file=sys.stderr, flush=True)
n = 0
for line in sys.stdin:
    if line.strip() == "go":
        break
    n += 1
    if n == fail_at:
        sys.exit(3)
    open(log, "a").write(key + "\\n")
    print(f"turn: ingest {n / 1000:.6f}", file=sys.stderr, flush=True)
print(json.dumps({"key": key, "passes": n}))
"""


def _run(tmp_path, fail_at=(0, 0, 0)):
    script = tmp_path / "indexer.py"
    script.write_text(_INDEXER)
    log = tmp_path / "order.log"
    runs = []
    for key, f in zip(("a", "b", "c"), fail_at, strict=True):
        runs += ["--run", key, f"{sys.executable} {script} {key} {log} {f}"]
    status = turns.main(["--dir", str(tmp_path), "--round", "2", "--reps", "3", "--nice", "0", *runs])
    return status, log.read_text().split() if log.exists() else []


def test_the_passes_alternate_and_each_result_goes_to_its_file(tmp_path, capsys):
    status, order = _run(tmp_path)
    assert status == 0
    # each indexer's other passes alone, one after the other; then the ingest passes alternate, in an
    # order where a drift favours nobody
    assert order == ["start-a", "passes-a", "start-b", "passes-b", "start-c", "passes-c",
                     "a", "b", "c", "c", "b", "a", "a", "b", "c"]
    for key in "abc":
        assert json.loads((tmp_path / f"round2_{key}.json").read_text()) == {"key": key, "passes": 3}
        assert (tmp_path / f"round2_{key}.err").read_text() == "loading\n"  # turn lines kept apart
    assert "a: ingest passes in turns 0.001, 0.002, 0.003 s" in capsys.readouterr().out


def test_an_indexer_that_fails_is_reported_and_the_others_go_on(tmp_path, capsys):
    status, order = _run(tmp_path, fail_at=(0, 2, 0))  # b exits in its second pass
    assert status == 1
    assert order[6:] == ["a", "b", "c", "c", "a", "a", "c"]
    assert json.loads((tmp_path / "round2_a.json").read_text())["passes"] == 3
    err = capsys.readouterr().err
    assert "b: expected 'ingest', got None" in err and "b exited with 3" in err
