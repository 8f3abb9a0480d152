"""The mutation check: does the unit suite catch small, plausible bugs in the core and the compiled code?

Each mutation of scripts/mutations.toml (a file, an exact text that occurs once in it, its replacement,
the builds it must be caught in, the tests that must catch it) is applied alone to a scratch copy of
the repository (the work tree's files as they are, or `--rev`: `git archive` of a commit; the work
tree itself is never touched) and that mutation's tests are run there, in each of its builds:

- `python`: KVIDX_NATIVE=0, the pure-Python core;
- `native`: the compiled core (KVIDX_REQUIRE_NATIVE=1). For a mutation of native/ (Rust), the mutated
  crate is built with cargo into a cache directory (~/.cache/kvidx-mutations: the first build compiles
  the dependencies, later ones only the crate, without LTO) and put in front of the venv's kvidx_native;
  a mutation of Python code runs against the venv's kvidx_native.

A mutation is killed when its tests fail; it survives when they pass. Before the mutations, the
unmutated copy runs every listed test in each build: a failure there is an error, not a kill. Exit
status: 0 when every mutation is killed in every build it lists, 1 when one survives, 2 on an error
(a stale mutation whose text is not found exactly once, a failed build, a baseline that does not
pass, a run that times out). docs/testing.md says how to add a mutation.

    .venv/bin/python scripts/mutations.py                # all of them
    .venv/bin/python scripts/mutations.py -k walk -k price   # those whose name contains a word
    .venv/bin/python scripts/mutations.py --list
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIST = ROOT / "scripts" / "mutations.toml"
BUILDS = ("python", "native")
CACHE = Path(os.environ.get("KVIDX_MUTATIONS_CACHE", Path.home() / ".cache" / "kvidx-mutations"))
RUN_TIMEOUT_S = 1200


class Fail(Exception):
    """An error of the check itself (not a surviving mutation): exit 2 with its one-line message."""


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    old: str
    new: str
    builds: tuple[str, ...]
    tests: tuple[str, ...]
    why: str

    @property
    def rust(self) -> bool:
        return self.file.startswith("native/")


def load(path: Path) -> list[Mutation]:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise Fail(f"{path}: {e}") from None
    out = []
    for i, m in enumerate(data.get("mutation", [])):
        missing = {"name", "file", "old", "new", "builds", "tests"} - m.keys()
        if missing:
            raise Fail(f"{path}: mutation {i + 1} has no {', '.join(sorted(missing))}")
        bad = set(m["builds"]) - set(BUILDS)
        if bad or not m["builds"]:
            raise Fail(f"{path}: mutation {m['name']!r}: builds must be some of {BUILDS}, not {m['builds']}")
        out.append(Mutation(m["name"], m["file"], m["old"], m["new"], tuple(m["builds"]), tuple(m["tests"]),
                            m.get("why", "")))
    names = [m.name for m in out]
    if len(set(names)) != len(names):
        raise Fail(f"{path}: mutation names repeat")
    return out


def scratch_copy(rev: str | None, dest: Path) -> None:
    """The files of commit `rev` (git archive), or with None the work tree's files as they are (tracked
    and untracked, not ignored: no venv, no build output)."""
    if rev is not None:
        tar = subprocess.run(["git", "archive", "--format=tar", rev], cwd=ROOT, capture_output=True)
        if tar.returncode:
            raise Fail(f"git archive {rev}: {tar.stderr.decode().strip()}")
        with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as t:
            t.extractall(dest, filter="data")
        return
    ls = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                        capture_output=True)
    if ls.returncode:
        raise Fail(f"git ls-files: {ls.stderr.decode().strip()}")
    for name in ls.stdout.decode().split("\0"):
        src = ROOT / name
        if name and src.is_file():  # (a tracked file deleted in the work tree is left out)
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def apply(copy: Path, m: Mutation) -> str:
    """Mutate the scratch copy's file; returns its original text (to restore)."""
    f = copy / m.file
    if not f.is_file():
        raise Fail(f"mutation {m.name!r}: {m.file} does not exist")
    text = f.read_text()
    n = text.count(m.old)
    if n != 1:
        raise Fail(f"mutation {m.name!r}: its text occurs {n} times in {m.file} (must be once): update "
                   f"scripts/mutations.toml")
    f.write_text(text.replace(m.old, m.new))
    return text


def build_native(copy: Path, overlay: Path) -> None:
    """Build the copy's native/ crate and install it as a `kvidx_native` package in `overlay` (put in
    front of the venv's by PYTHONPATH)."""
    env = dict(os.environ, PYO3_PYTHON=sys.executable, CARGO_TARGET_DIR=str(CACHE / "target"),
               CARGO_PROFILE_RELEASE_LTO="off", CARGO_PROFILE_RELEASE_CODEGEN_UNITS="16")
    if not shutil.which("cargo", path=env.get("PATH")) and (Path.home() / ".cargo" / "bin").is_dir():
        env["PATH"] = f"{Path.home() / '.cargo' / 'bin'}:{env.get('PATH', '')}"
    p = subprocess.run(["cargo", "build", "--release", "--offline", "--quiet"], cwd=copy / "native", env=env,
                       capture_output=True, text=True)
    if p.returncode:
        raise Fail(f"cargo build of the mutated native/ failed: {p.stderr.strip()[-2000:]}")
    pkg = overlay / "kvidx_native"
    if pkg.exists():
        shutil.rmtree(pkg)
    pkg.mkdir(parents=True)
    import kvidx_native  # the venv's: its package's __init__ (maturin's) is the overlay's

    shutil.copy2(Path(kvidx_native.__file__), pkg / "__init__.py")
    so = CACHE / "target" / "release" / "libkvidx_native.so"
    shutil.copy2(so, pkg / f"kvidx_native{sysconfig.get_config_var('EXT_SUFFIX')}")


def run_tests(copy: Path, tests: tuple[str, ...], build: str, overlay: Path | None) -> tuple[bool, str]:
    """(passed, the tail of pytest's output) for `tests` in the copy, in one build."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVIDX_")}
    env["PYTHONPATH"] = os.pathsep.join([*([str(overlay)] if overlay else []), str(copy)])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if build == "python":
        env["KVIDX_NATIVE"] = "0"
    else:
        env["KVIDX_REQUIRE_NATIVE"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    try:
        p = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise Fail(f"pytest {' '.join(tests)} ({build}) ran over {RUN_TIMEOUT_S} s") from None
    tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-3:])
    if p.returncode not in (0, 1):  # 2-5: interrupted, usage, nothing collected: not a verdict
        raise Fail(f"pytest {' '.join(tests)} ({build}) exited {p.returncode}: {tail}")
    return p.returncode == 0, tail


def check_imports(copy: Path) -> None:
    """The scratch copy, not the work tree, must be what the tests import."""
    code = "import kvidx, sys; print(kvidx.__file__)"
    env = dict(os.environ, PYTHONPATH=str(copy))
    got = subprocess.run([sys.executable, "-c", code], cwd=copy, env=env, capture_output=True, text=True)
    if not got.stdout.strip().startswith(str(copy)):
        raise Fail(f"the scratch copy's kvidx is not the one imported ({got.stdout.strip() or got.stderr})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Apply each mutation of scripts/mutations.toml alone to a "
                                 "scratch copy, run its tests in its builds, report the survivors.")
    ap.add_argument("-k", action="append", default=[], metavar="WORD",
                    help="only the mutations whose name contains WORD (repeatable)")
    ap.add_argument("--rev", default=None,
                    help="the commit to mutate (default: the work tree as it is, uncommitted files included)")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--file", type=Path, default=LIST,
                    help="the mutation list (default scripts/mutations.toml)")
    args = ap.parse_args(argv)
    try:
        muts = load(args.file)
        if args.k:
            muts = [m for m in muts if any(w in m.name for w in args.k)]
        if args.list:
            for m in muts:
                print(f"{m.name}: {m.file} [{', '.join(m.builds)}] {m.why}")
            return 0
        if not muts:
            raise Fail("no mutation selected")
        return _run(muts, args.rev)
    except Fail as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(muts: list[Mutation], rev: str | None) -> int:
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvidx-mutations-") as tmp:
        copy, overlay = Path(tmp) / "repo", Path(tmp) / "overlay"
        copy.mkdir()
        scratch_copy(rev, copy)
        check_imports(copy)
        for build in BUILDS:  # the baseline: every listed test passes unmutated
            tests = tuple(dict.fromkeys(t for m in muts if build in m.builds for t in m.tests))
            if tests:
                ok, tail = run_tests(copy, tests, build, None)
                if not ok:
                    raise Fail(f"the unmutated tests fail in the {build} build: {tail}")
        print(f"baseline: passes ({time.monotonic() - t0:.0f} s)", flush=True)
        survivors = []
        for m in muts:
            t = time.monotonic()
            original = apply(copy, m)
            try:
                if m.rust:
                    build_native(copy, overlay)
                verdicts = []
                for build in m.builds:
                    passed, _ = run_tests(copy, m.tests, build, overlay if m.rust else None)
                    verdicts.append(f"{build}: {'SURVIVED' if passed else 'killed'}")
                    if passed:
                        survivors.append(f"{m.name} ({build})")
            finally:
                (copy / m.file).write_text(original)
            print(f"{m.name}: {', '.join(verdicts)} ({time.monotonic() - t:.0f} s)", flush=True)
    named = ": " + ", ".join(survivors) if survivors else ""
    print(f"{len(muts)} mutations, {len(survivors)} survivors (mutation x build){named} "
          f"({time.monotonic() - t0:.0f} s)")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
