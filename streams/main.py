"""`kvidx worker`, assembled: the faust worker (streams/worker.py) under a supervisor that starts it again
when it dies, with every operator's mistake (a port in use, a data dir another worker holds) one line.
The command line is parsed by kvidx/cli.py."""

from __future__ import annotations

import logging
import os
import signal
import sys

from kvidx.runtime import port_in_use, shard_settings, stop_on_sigterm


def _die_with_parent() -> None:
    """In the supervised child: get SIGTERM when the supervisor dies, even by SIGKILL (Linux), so a
    killed supervisor never leaves an orphan worker behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


EX_CONFIG = 78  # sysexits.h: a configuration error; the supervisor stops instead of restarting


EX_TEMPFAIL = 75  # sysexits.h: try again later (the data dir's lock is held): the supervisor waits


SUPERVISOR_PID = "KVIDX_SUPERVISOR_PID"


def _supervise(what: str) -> int:
    """Run this same command as a child process and start it again when it dies (a faust worker
    exits when the broker goes away for too long); SIGTERM/SIGINT stop both within seconds. A child
    that exits with EX_CONFIG (data dir in use, port taken ...) has said why: restarting cannot help.
    A crash loses nothing: events are acknowledged only once a snapshot holds them."""
    import subprocess
    import threading
    import time

    log = logging.getLogger("kvidx.supervisor")
    env = dict(os.environ, KVIDX_SUPERVISED="1", **{SUPERVISOR_PID: str(os.getpid())})
    stopping = threading.Event()
    child: subprocess.Popen | None = None

    def stop(signum, _frame):
        stopping.set()
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    backoff = 1.0
    while not stopping.is_set():
        started = time.monotonic()
        child = subprocess.Popen([sys.executable, "-m", "kvidx.cli", *sys.argv[1:]], env=env,
                                 preexec_fn=_die_with_parent)
        while True:
            try:
                code = child.wait(0.2)
                break
            except subprocess.TimeoutExpired:
                if stopping.is_set() and _stop_child(child, log):
                    code = child.returncode
                    break
        if stopping.is_set():
            return 0
        if code == EX_CONFIG:
            log.error("event=supervisor_stop what=%s reason=configuration_error (see the line above)", what)
            return 2
        if time.monotonic() - started > 60:
            backoff = 1.0
        if code == EX_TEMPFAIL:  # e.g. the data dir still locked by a worker that is stopping
            log.warning("event=waiting what=%s reason=%r retry_in_s=%.1f", what,
                        "the data dir is locked (see the line above)", backoff)
            backoff = min(backoff, 5.0)
        else:
            log.warning("event=child_exited what=%s code=%s restart_in_s=%.1f", what, code, backoff)
        if stopping.wait(backoff):  # a SIGTERM during the back-off ends it at once
            return 0
        backoff = min(backoff * 2, 30.0)
    return 0


def _stop_child(child, log, grace_s: float = 5.0) -> bool:
    """After SIGTERM was passed on: wait up to grace_s, then SIGKILL (nothing acknowledged is lost by
    a kill: the events after the last snapshot are redelivered)."""
    import subprocess

    try:
        child.wait(grace_s)
    except subprocess.TimeoutExpired:
        log.warning("event=child_kill reason=did_not_stop_in_s=%g", grace_s)
        child.kill()
        child.wait()
    return True


def _config_error(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(EX_CONFIG)


def worker(args) -> int:
    from kvidx.kafka.reach import resolve_bootstrap

    b = resolve_bootstrap(args.bootstrap)  # a missing address is a configuration error: before anything
    for port, opt in ((args.web_port, "--web-port"), (args.metrics_port, "--metrics-port")):
        if port and port_in_use("127.0.0.1" if opt == "--web-port" else args.metrics_host, port):
            _config_error(f"port {port} is in use (another worker?): pass {opt} N (--web-port 0 turns "
                          "faust's web server off)")
    if not args.no_supervise and not os.environ.get("KVIDX_SUPERVISED"):
        return _supervise("worker")
    import faust

    from kvidx.kafka.reach import wait_for_broker
    from kvidx.kafka.topics import ensure_topics
    from schemas.events import topic_names
    from streams.worker import create_app

    log = logging.getLogger("kvidx.streams")
    stop = stop_on_sigterm()
    if os.environ.get(SUPERVISOR_PID):
        _stop_without_supervisor(int(os.environ[SUPERVISOR_PID]), log)
    log.info("event=worker_start kafka=%s data_dir=%s", b, args.data_dir)
    if not wait_for_broker(b, log, stop):
        return 0
    t = topic_names(args.topic_prefix)
    repl = ensure_topics(b, t)
    try:
        app, worker = create_app(
            b, args.data_dir, app_id=args.topic_prefix + "kvidx-worker", events_topic=t["events"],
            snapshot_topic=t["snapshots"], dead_letter_topic=t["dead_letters"],
            snapshot_interval=args.snapshot_interval, settings=shard_settings(args),
            metrics_port=args.metrics_port, metrics_host=args.metrics_host, web_port=args.web_port,
            session_timeout=args.session_timeout, replication_factor=repl.factor if repl else 1)
    except Exception as e:  # noqa: BLE001 - rocksdict raises plain Exceptions
        text = str(e).lower()
        if "lock" in text:
            holder = _lock_holder(str(e))
            msg = (f"--data-dir {args.data_dir} is in use by another worker{holder} (its RocksDB LOCK is "
                   "held): give each worker its own --data-dir")
            if os.environ.get("KVIDX_SUPERVISED"):  # the supervisor waits for the lock to free
                print(f"error: {msg}; waiting for it to be released", file=sys.stderr, flush=True)
                sys.exit(EX_TEMPFAIL)
            _config_error(msg)
        if "address already in use" in text:
            _config_error(f"--metrics-port {args.metrics_port} is in use: pass another port")
        raise
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # faust installs its own handlers
    log.info("event=worker_waiting_for topic=%s group=%s", t["events"], args.topic_prefix + "kvidx-worker")
    faust.Worker(app, loglevel=args.log_level.lower()).execute_from_commandline()
    return 0


def _lock_holder(error: str) -> str:
    """" (pid N)" of the process holding the RocksDB LOCK named in `error` (Linux /proc/locks), or ""."""
    import re

    m = re.search(r"(/\S+/LOCK)\b", error)
    if not m:
        return ""
    try:
        inode = os.stat(m.group(1)).st_ino
        with open("/proc/locks") as f:
            for line in f:  # "1: POSIX  ADVISORY  WRITE 4242 08:01:1234567 0 EOF"
                fields = line.split()
                if len(fields) > 5 and fields[5].rsplit(":", 1)[-1] == str(inode):
                    return f" (pid {fields[4]})"
    except (OSError, ValueError):
        pass
    return ""


def _stop_without_supervisor(supervisor: int, log: logging.Logger, grace_s: float = 10.0) -> None:
    """In the supervised worker: once its supervisor is gone (killed with -9: Linux's parent-death
    signal has already asked faust to stop), make sure the worker is gone within `grace_s`, even
    if faust's shutdown waits on something; its partitions then go to the other workers once the
    group's session times out, and its events after the last snapshot are redelivered to them."""
    import threading
    import time

    def watch() -> None:
        while os.getppid() == supervisor:
            time.sleep(0.5)
        log.warning("event=supervisor_gone action=stop grace_s=%g", grace_s)
        os.kill(os.getpid(), signal.SIGTERM)  # where there is no parent-death signal
        time.sleep(grace_s)
        log.error("event=stop_timeout action=kill grace_s=%g", grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="supervisor-watch").start()
