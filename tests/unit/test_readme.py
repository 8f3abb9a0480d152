"""The README and docs, checked without running anything: every inline `kvidx ...` command parsed by
the real CLI (an option or value the CLI refuses, as `--from -1d` once was, fails here), and the
module map (docs/modules.md) names every source file. Running the README's ```bash blocks as written (set-up,
the walkthrough over a real broker, ...) is tests/integration/test_readme.py."""

import contextlib
import io
import re
import shlex
import subprocess

import pytest

from tests.helpers import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


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
    """The paths the module map (docs/modules.md, linked from the README) names (first column; later
    names in a cell are relative to the first one's folder)."""
    text = (ROOT / "docs" / "modules.md").read_text()
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
    assert not missing, f"files the module map (docs/modules.md) does not name: {missing}"
