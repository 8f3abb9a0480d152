"""The README's commands, copied from the README and run as written: the first two commands (the setup
+ demo one run, the test one checked to be what CI runs), every other ```bash block (the walkthrough
over a real broker, the shadow audit ...), and every inline `kvidx ...` command parsed by the real CLI
(an option or value the CLI refuses, as `--from -1d` once was, fails here)."""

import contextlib
import io
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


def bash_blocks(path: Path) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", path.read_text(), re.S | re.M)


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


def other_blocks():
    for doc in DOCS:
        for i, block in enumerate(bash_blocks(doc)):
            if doc.name == "README.md" and i == 0:
                continue  # the two commands above
            yield pytest.param(block, id=f"{doc.relative_to(ROOT)}#{i}")


@pytest.mark.kafka
@pytest.mark.parametrize("block", list(other_blocks()))
def test_every_other_bash_block_runs_as_written(block, tmp_path):
    # a checkout of its own (the repo's venv, fixtures and scripts), a broker state of its own: the
    # block's `kvidx kafka up` starts a private broker and nothing touches the developer's
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
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


def inline_commands():
    for doc in DOCS:
        for span in re.findall(r"`(kvidx [^`]+)`", doc.read_text()):
            yield pytest.param(span, id=f"{doc.name}:{span[:50]}")


@pytest.mark.parametrize("span", list(inline_commands()))
def test_inline_commands_parse(span):
    from kvidx.cli import _relative_times, build_parser

    if "|" in span or "<" in span:  # a list of choices or a placeholder, not a command
        pytest.skip("not a command")
    text = re.sub(r"\[[^\]]*\]", "", span).replace("...", "X")  # optional parts, elisions
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(_relative_times(shlex.split(text)[1:]))
    except SystemExit as e:
        msg = err.getvalue().strip().splitlines()[-1:] or [""]
        # a mention of some options need not list the required ones; anything else is a broken example
        assert e.code == 0 or "the following arguments are required" in msg[0], f"{span!r}: {msg[0]}"


def map_entries() -> list[str]:
    """The paths the README's module map names (first column; later names in a cell are relative to
    the first one's folder)."""
    text = (ROOT / "README.md").read_text()
    out = []
    for row in re.findall(r"^\| (`[^|]*`) \|", text, re.M):
        names = re.findall(r"`([^`]+)`", row)
        base = names[0].rsplit("/", 1)[0] + "/" if "/" in names[0].rstrip("/") else ""
        out += [names[0]] + [n if "/" in n else base + n for n in names[1:]]
    return out


def test_the_module_map_names_every_source_file():
    entries = map_entries()

    def covered(path: str) -> bool:
        for e in entries:
            pattern = re.escape(e).replace(re.escape("<name>"), "[^/]+")
            if re.fullmatch(pattern, path) or (e.endswith("/") and re.match(pattern, path)):
                return True
        return False

    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
                           cwd=ROOT, capture_output=True, text=True).stdout.split()
    packages = ("kvidx", "relays", "streams", "index_service", "schemas")
    sources = [f for f in files if f.split("/")[0] in packages and not f.endswith("__init__.py")]
    missing = [f for f in sources if not covered(f)]
    assert not missing, f"files the README's module map does not name: {missing}"
