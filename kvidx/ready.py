"""`kvidx wait-ready URL --pid PID --log FILE`: wait until a kvidx process started in the background
answers 200 on URL (the service's `/healthz`, a worker's `/metrics`), or say why it never will.

A background process that dies at start-up (a port another process holds, a locked data dir) writes why
to its log and nothing else shows it: the commands after it would go on against whatever answers. This
command exits 0 once URL answers 200 while PID runs; it exits 1 with one line naming the process and
its log's last line as soon as PID is gone, or after --timeout seconds (with the last answer too).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

__all__ = ["add_cli", "wait_ready"]


def _running(pid: int) -> bool:
    """PID exists and is not a zombie (a child its shell has not reaped yet is gone all the same)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return False
    except OSError:  # no procfs: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in ("Z", "X")


def _last_line(log: Path | None) -> str:
    if log is None:
        return ""
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError as e:
        return f"(cannot read {log}: {e.strerror})"
    return lines[-1].strip() if lines else f"({log} is empty)"


def _answer(url: str, timeout_s: float) -> tuple[int | None, str]:
    """The status code and the start of the body, or (None, why there was no answer)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 - an operator's URL
            return r.status, r.read(200).decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read(200).decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        return None, str(getattr(e, "reason", e))


def wait_ready(url: str, pid: int | None, log: Path | None, timeout_s: float,
               interval_s: float = 0.5) -> str | None:
    """None once URL answers 200 (while PID, if given, runs); else the one-line reason why not."""
    who = f"pid {pid}" if pid is not None else url
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while True:
        if pid is not None and not _running(pid):
            return f"{who} exited before {url} answered{_where(log)}"
        status, body = _answer(url, timeout_s=min(5.0, max(0.5, deadline - time.monotonic())))
        if status == 200:
            if pid is None or _running(pid):  # not another process answering on its port
                return None
            return f"{who} exited before {url} answered{_where(log)}"
        last = f"{status} {body.strip()[:120]}" if status is not None else body
        if time.monotonic() >= deadline:
            return f"{url} not ready after {timeout_s:g} s (last answer: {last}){_where(log)}"
        time.sleep(interval_s)


def _where(log: Path | None) -> str:
    return f"; {log}'s last line: {_last_line(log)}" if log is not None else ""


def cmd_wait_ready(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        print("error: --timeout must be > 0 seconds", file=sys.stderr)
        return 2
    reason = wait_ready(args.url, args.pid, Path(args.log) if args.log else None, args.timeout)
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 1
    return 0


def add_cli(subparsers) -> None:
    """Register `wait-ready`."""
    p = subparsers.add_parser(
        "wait-ready", help="wait until a background kvidx process answers on its health URL, or say why not",
        description="Polls URL until it answers 200 (kvidx serve: /healthz, ready once the service has "
                    "applied the snapshots and every event in the topics when it started; kvidx worker "
                    "with --metrics-port: /metrics). Exits 1 with the log's last line as soon as --pid "
                    "is gone, or after --timeout.")
    p.add_argument("url", help="e.g. http://127.0.0.1:8080/healthz")
    p.add_argument("--pid", type=int, help="the process to watch (a shell's $!): its exit is a failure")
    p.add_argument("--log", help="the process's log file: its last line is shown on failure")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S", help="seconds to wait (default 120)")
    p.set_defaults(func=cmd_wait_ready)
