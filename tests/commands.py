"""Running `kvidx` commands as an operator does (a subprocess of the repo's Python, no broker address
from the environment): one-shot commands that must fail fast, long-running ones read line by line, and
`kvidx demo`. Shared by the unit and the integration tests of operator errors and of the demo."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

from tests.helpers import ROOT

DEAD = "127.0.0.1:1"  # nothing listens on port 1: connection refused at once
LIMIT_S = 10.0


def env(**extra):
    e = dict(os.environ, PYTHONPATH=str(ROOT), **extra)
    e.pop("KAFKA_BOOTSTRAP_SERVERS", None)
    return e


def run(args, cwd=ROOT, **extra):
    """A one-shot command: exits non-zero within LIMIT_S; returns its output."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "kvidx.cli", *args], cwd=cwd, env=env(**extra),
                       capture_output=True, text=True, timeout=LIMIT_S + 20)
    took = time.monotonic() - t0
    out = p.stdout + p.stderr
    assert p.returncode != 0, f"{args} exited 0:\n{out}"
    assert took < LIMIT_S, f"{args} took {took:.1f}s:\n{out}"
    assert "Traceback" not in out, out
    return out


class Running:
    """A long-running command: its output, line by line, as it comes."""

    def __init__(self, args, **extra):
        self.proc = subprocess.Popen([sys.executable, "-m", "kvidx.cli", *args], cwd=ROOT, env=env(**extra),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_line(self, *needles, timeout=LIMIT_S) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                if all(n in line for n in needles):
                    return line
            time.sleep(0.05)
        raise AssertionError(f"no line with {needles} in {timeout}s:\n{''.join(self.lines)}")

    def stop(self, sig=signal.SIGTERM, timeout=10.0) -> float:
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"did not stop in {timeout}s:\n{''.join(self.lines)}") from None
        self.reader.join(5)
        return time.monotonic() - t0

    def output(self) -> str:
        return "".join(self.lines)



def run_demo(*args: str) -> subprocess.CompletedProcess:
    """`kvidx demo --requests 40 ARGS...`, its output captured."""
    return subprocess.run([sys.executable, "-m", "kvidx.cli", "demo", "--requests", "40", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)


def demo_agreement(stdout: str) -> dict:
    """The demo's `[demo] agreement: {...}` line, decoded."""
    line = next(x for x in stdout.splitlines() if x.startswith("[demo] agreement"))
    return json.loads(line.split(": ", 1)[1])
