"""bench/peers/turns.py: the indexers' ingest passes taken in turns (run.sh --turns), driven against
small stand-in indexers that speak the protocol (bench_kvidx.py's and dynbench's take_turns)."""

import importlib.util
import json
import sys

from tests.helpers import ROOT

_spec = importlib.util.spec_from_file_location("peers_turns", ROOT / "bench" / "peers" / "turns.py")
turns = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(turns)

# A stand-in indexer: its other passes (begin/end noted in the shared log, 0.1 s), then a pass for
# each "warmup" / "ingest" (the same); "go": its JSON. fail_at: the pass that exits 3 (-1: before
# "ready"). Overlapping work would interleave two indexers' begin/end lines in the log.
_INDEXER = """
import json, sys, time
key, log, fail_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
def work(what):
    open(log, "a").write(f"begin-{what}-{key}\\n")
    time.sleep(0.1)
    open(log, "a").write(f"end-{what}-{key}\\n")
print("loading", file=sys.stderr, flush=True)
if fail_at == -1:
    sys.exit(3)
work("passes")
print("turn: ready", file=sys.stderr, flush=True)
n = 0
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "go":
        break
    n += cmd == "ingest"
    if cmd == "ingest" and n == fail_at:
        sys.exit(3)
    work(cmd)
    print(f"turn: {cmd} {n / 1000:.6f}", file=sys.stderr, flush=True)
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
    lines = log.read_text().split() if log.exists() else []
    for begin, end in zip(lines[::2], lines[1::2], strict=True):  # no two indexers' work overlapped
        assert begin.replace("begin-", "end-") == end, lines
    return status, [x.removeprefix("begin-") for x in lines[::2]]


def test_the_passes_alternate_after_a_warmup_and_each_result_goes_to_its_file(tmp_path, capsys):
    status, order = _run(tmp_path)
    assert status == 0
    # each indexer's other passes, one after the other; one untimed pass each; then the ingest
    # passes alternate
    assert order == ["passes-a", "passes-b", "passes-c", "warmup-a", "warmup-b", "warmup-c",
                     "ingest-a", "ingest-b", "ingest-c", "ingest-c", "ingest-b", "ingest-a",
                     "ingest-a", "ingest-b", "ingest-c"]
    for key in "abc":
        assert json.loads((tmp_path / f"round2_{key}.json").read_text()) == {"key": key, "passes": 3}
        assert (tmp_path / f"round2_{key}.err").read_text() == "loading\n"  # turn lines kept apart
    out = capsys.readouterr().out
    assert "a: ingest passes in turns 0.001, 0.002, 0.003 s (after a warm-up pass of 0.000 s)" in out


def test_an_indexer_that_fails_is_reported_and_the_others_go_on(tmp_path, capsys):
    status, order = _run(tmp_path, fail_at=(-1, 2, 0))  # a exits before ready, b in its second pass
    assert status == 1
    assert order == ["passes-b", "passes-c", "warmup-b", "warmup-c",
                     "ingest-b", "ingest-c", "ingest-c", "ingest-c"]
    assert json.loads((tmp_path / "round2_c.json").read_text())["passes"] == 3
    err = capsys.readouterr().err
    assert "a: expected 'ready', got None" in err and "a exited with 3" in err
    assert "b: expected 'ingest', got None" in err and "b exited with 3" in err
    assert "loading" in err  # the tail of a failed indexer's stderr
