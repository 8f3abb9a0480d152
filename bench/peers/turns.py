"""One round of the peer harness with the indexers' ingest passes taken in turns (run.sh --turns).

The host is shared and its speed moves by up to 2x within a minute (bench/RESULTS.md), while one
indexer's whole run takes one to two minutes at 2,048 workers: run one after the other, two
indexers' ingest passes could land in different phases, and the round's ratio was the phases'. Here
the indexers start one after the other as before, each running every pass alone (its figures other
than ingest are those); each then stays loaded, its index freed, until all are; then each runs one
untimed pass (A B C: the first pass after the others is the slowest, for every indexer), then their
ingest passes alternate, each alone on the host and on a fresh index, REPS times each in the order
A B C, C B A, A B C ... (the passes compared are seconds apart, the order turned each time; under a
steady drift of the host's speed the medians of 3 still sit one pass apart, the first indexer's the
latest), and each reports the median of its passes (for an even REPS, the lower middle one).

The protocol (bench_kvidx.py's and dynbench's take_turns): with INGEST_TURNS=1 an indexer writes
"turn: ready" on stderr once its other passes are done, then reads stdin: "ingest" -> one timed pass,
answered "turn: ingest SECONDS" after its index is freed; "warmup" -> the same, answered "turn:
warmup SECONDS" and not counted; "go" -> it writes its JSON object and ends.
Its stdout goes to DIR/roundR_KEY.json, the rest of its stderr to DIR/roundR_KEY.err.

Usage: turns.py --dir DIR --round R --reps N [--nice N] --run KEY 'COMMAND' [--run KEY 'COMMAND' ...]
"""

from __future__ import annotations

import argparse
import os
import queue
import shlex
import subprocess
import sys
import threading


class Indexer:
    """One indexer's process, its turn answers read from its stderr by a thread."""

    def __init__(self, key: str, command: str, out_dir: str, rnd: int, nice: int) -> None:
        self.key = key
        self.answers: queue.Queue[str | None] = queue.Queue()
        self.out = open(os.path.join(out_dir, f"round{rnd}_{key}.json"), "w")
        self.err_path = os.path.join(out_dir, f"round{rnd}_{key}.err")
        self.err = open(self.err_path, "w")
        self.proc = subprocess.Popen(
            ["nice", "-n", str(nice), *shlex.split(command)], stdin=subprocess.PIPE, stdout=self.out,
            stderr=subprocess.PIPE, text=True, errors="replace", env={**os.environ, "INGEST_TURNS": "1"})
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            for line in self.proc.stderr:
                if line.startswith("turn: "):
                    self.answers.put(line[6:].strip())
                else:
                    self.err.write(line)
                    self.err.flush()
        finally:
            self.answers.put(None)  # its stderr closed (it ended), or this thread failed: no answer

    def answer(self, want: str) -> str:
        got = self.answers.get()
        if got is None or not got.startswith(want):
            raise RuntimeError(f"{self.key}: expected '{want}', got {got!r} (see its .err file)")
        return got

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def finish(self) -> int:
        """Its exit status, once its output is all written (stdin closed: it ends)."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass  # it ended already: its exit status says how
        status = self.proc.wait()
        self.reader.join()
        self.out.close()
        self.err.close()
        return status


def _turn(ix: Indexer, what: str) -> float:
    ix.send(what)
    return float(ix.answer(what).split()[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="results folder (roundR_KEY.json / .err)")
    p.add_argument("--round", type=int, required=True)
    p.add_argument("--reps", type=int, default=3, help="ingest passes per indexer (default 3)")
    p.add_argument("--nice", type=int, default=10)
    p.add_argument("--run", nargs=2, action="append", metavar=("KEY", "COMMAND"), required=True)
    a = p.parse_args(argv)
    status = 0
    indexers, live = [], []
    for k, c in a.run:  # one at a time: each runs its other passes alone
        ix = Indexer(k, c, a.dir, a.round, a.nice)
        indexers.append(ix)
        try:
            ix.answer("ready")
            live.append(ix)
        except RuntimeError as e:
            print(f"turns.py: {e}", file=sys.stderr)
            status = 1
    seconds: dict[str, list[float]] = {ix.key: [] for ix in live}
    warm: dict[str, float] = {}
    # one untimed pass each, then the timed ones in the order turned each time
    for what, reverse in [("warmup", False)] + [("ingest", rep % 2 == 1) for rep in range(a.reps)]:
        for ix in list(live[::-1] if reverse else live):
            try:
                t = _turn(ix, what)
            except (RuntimeError, OSError) as e:  # it failed: the others go on
                print(f"turns.py: {e}", file=sys.stderr)
                live.remove(ix)
                status = 1
                continue
            if what == "warmup":
                warm[ix.key] = t
            else:
                seconds[ix.key].append(t)
    for ix in indexers:  # each writes its results and ends
        if ix in live:
            try:
                ix.send("go")
            except OSError:
                pass
        if ix.finish() != 0:
            print(f"turns.py: {ix.key} exited with {ix.proc.returncode} (round {a.round}); its stderr ends:",
                  file=sys.stderr)
            with open(ix.err_path) as f:
                print("".join(f.readlines()[-5:]), end="", file=sys.stderr)
            status = 1
    for k, s in seconds.items():
        print(f"    {k}: ingest passes in turns {', '.join(f'{x:.3f}' for x in s)} s"
              + (f" (after a warm-up pass of {warm[k]:.3f} s)" if k in warm else ""))
    return status


if __name__ == "__main__":
    sys.exit(main())
