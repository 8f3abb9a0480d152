"""The README's commands, copied from the README and run as written: the first two commands (the setup
+ demo one run, the test one checked to be what CI runs) and every other ```bash block of the README
and docs/ (the walkthrough over a real broker, the shadow audit ...). They need java and the Kafka
jars (scripts/setup.sh checks for them; the blocks start brokers of their own). Inline `kvidx ...`
commands and the module map: tests/unit/test_readme.py."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


def bash_blocks_of(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)


def bash_blocks(path: Path) -> list[str]:
    return bash_blocks_of(path.read_text())


def commands(block: str) -> list[str]:
    """The block's commands, comments and blank lines left out."""
    return [ln.split("  #")[0].strip() for ln in block.splitlines()
            if ln.strip() and not ln.lstrip().startswith("#")]


def test_the_first_two_commands_are_setup_plus_demo_and_what_ci_runs():
    first = bash_blocks(ROOT / "README.md")[0]
    setup_demo, tests = commands(first)
    assert setup_demo == "bash scripts/setup.sh && .venv/bin/kvidx demo"
    assert tests.startswith("bash scripts/setup.sh && ")
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci, f"CI must run README's test command {tests!r}:\n{ci}"
    p = subprocess.run(["bash", "-c", setup_demo], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"})
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert '"recall": 1.0' in out and "Traceback" not in out, out[-3000:]
    assert "warning" not in out.lower(), out[-3000:]  # a successful run is quiet
    # setup says what each step is as it goes, and README's copy of the demo's output is what it printed
    assert "[setup] 1/4 " in out and "[setup] 3/4 " in out, out[:3000]
    for line in readme_demo_lines():
        assert line in out.splitlines(), f"README shows {line!r}; the demo printed:\n{out[-3000:]}"


def readme_demo_lines() -> list[str]:
    """The demo's output as README shows it (its ```text block after "What the demo shows"), the
    wrapped lines joined back."""
    text = (ROOT / "README.md").read_text().split("## What the demo shows", 1)[1]
    block = re.search(r"^```text\n(.*?)^```", text, re.S | re.M)
    assert block, "README's demo section has no ```text block"
    lines: list[str] = []
    for ln in block.group(1).splitlines():
        if ln.startswith("[demo]"):
            lines.append(ln)
        else:
            lines[-1] += " " + ln.strip()
    return lines


def other_blocks():
    for doc in DOCS:
        for i, block in enumerate(bash_blocks(doc)):
            if doc.name == "README.md" and i == 0:
                continue  # the two commands above
            yield pytest.param(block, id=f"{doc.relative_to(ROOT)}#{i}")


def run_block(block: str, tmp_path: Path) -> tuple[int, str]:
    """The block run with `bash -euo pipefail` in a checkout of its own (the repo's venv, fixtures and
    scripts) with a broker state of its own: the block's `kvidx kafka up` starts a private broker and
    nothing touches the developer's. Its exit code and output."""
    for name in (".venv", "tests", "scripts", "bench", "ops", "kvidx", "docs"):
        if (ROOT / name).exists():
            (tmp_path / name).symlink_to(ROOT / name)
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
    env.update(KVIDX_STATE_DIR=str(tmp_path / "state"), PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"the block did not finish in 300 s:\n{out[-3000:]}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # background jobs the block left
        subprocess.run([sys.executable, "-m", "kvidx.cli", "kafka", "down"], cwd=tmp_path, env=env,
                       capture_output=True, timeout=60)
    return proc.returncode, out


@pytest.mark.kafka
@pytest.mark.parametrize("block", list(other_blocks()))
def test_every_other_bash_block_runs_as_written(block, tmp_path):
    code, out = run_block(block, tmp_path)
    assert code == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


def walkthrough() -> str:
    """README's "Running it for real" block."""
    section = (ROOT / "README.md").read_text().split("## Running it for real", 1)[1]
    return bash_blocks_of(section)[0]


@pytest.mark.kafka
def test_the_walkthrough_stops_when_the_worker_cannot_start(tmp_path):
    """Another process holds the worker's web port (faust's, 6066): the worker exits at start-up, and
    the block stops at the worker's readiness check with the worker's own message, before the relay,
    the service or any lookup runs."""
    block = walkthrough()
    port = 6066
    assert "kvidx worker" in block and "--web-port" not in block  # the worker binds the default port
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", port))
    except OSError:
        holder.close()
        holder = None  # something else holds it already: the same situation
    try:
        if holder is not None:
            holder.listen()
        code, out = run_block(block, tmp_path)
    finally:
        if holder is not None:
            holder.close()
    assert code != 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    lines = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert lines, out[-3000:]
    # wait-ready's one line: which process, and its log's last line, the worker's message
    assert "exited before http://127.0.0.1:9464/metrics answered" in lines[-1], out[-3000:]
    assert f"var/worker.log's last line: error: port {port} is in use" in lines[-1], out[-3000:]
    # nothing after it ran: the relay's summary, the service's answers
    assert '"delivered"' not in out and '"models"' not in out, out[-3000:]
