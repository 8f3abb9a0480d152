"""A real single-node Kafka 4.x broker (KRaft, broker+controller) without Docker.

The broker jars are resolved from Maven Central with ``mvn dependency:copy-dependencies``
(see ``pom.xml`` next to this file) into ``~/.cache/kvidx/kafka-<version>/libs``
(override the directory with env ``KVIDX_KAFKA_HOME``); later runs reuse them.

Python API::

    kafka = LocalKafka()
    bootstrap = kafka.start(data_dir)   # "127.0.0.1:<port>"
    ...
    kafka.stop()

CLI (registered into ``kvidx`` by :func:`add_cli`)::

    kvidx kafka up [--state-dir DIR]     # start detached, write DIR/kafka.json
    kvidx kafka status [--state-dir DIR]
    kvidx kafka down [--state-dir DIR]   # stop and delete the data dir

Everything binds to 127.0.0.1 only. Needs ``java`` (17+) and, on first use, ``mvn``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
POM = HERE / "pom.xml"
LOG4J_CONFIG = HERE / "log4j2.yaml"
DEFAULT_STATE_DIR = Path("var/kafka")
STATE_FILE = "kafka.json"
MARKER = ".kvidx-jars-complete"

JVM_OPTS = [
    "-Xms256m",
    "-Xmx512m",
    # Measured: these cut broker start-to-serving time noticeably for a tiny dev broker.
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-Xshare:auto",
    "-Djava.awt.headless=true",
]

Log = Callable[[str], None]


def _default_log(msg: str) -> None:
    print(f"[kafka] {msg}", file=sys.stderr, flush=True)


def kafka_version() -> str:
    """The Kafka version pinned in pom.xml."""
    m = re.search(r"<kafka\.version>([^<]+)</kafka\.version>", POM.read_text())
    if not m:
        raise RuntimeError(f"no <kafka.version> in {POM}")
    return m.group(1).strip()


def kafka_home() -> Path:
    env = os.environ.get("KVIDX_KAFKA_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kvidx" / f"kafka-{kafka_version()}"


def _pom_digest() -> str:
    return hashlib.sha256(POM.read_bytes()).hexdigest()


def ensure_jars(log: Log = _default_log) -> Path:
    """Return the libs dir with the broker's runtime jars, fetching them once with Maven."""
    home = kafka_home()
    libs = home / "libs"
    marker = home / MARKER
    digest = _pom_digest()

    def ready() -> bool:
        return marker.is_file() and marker.read_text().strip() == digest and any(libs.glob("kafka_*.jar"))

    if ready():
        return libs
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".lock", "w") as lock:  # parallel test workers: fetch once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ready():
            return libs
        _fetch_jars(home, libs, marker, digest, log)
    return libs


def _fetch_jars(home: Path, libs: Path, marker: Path, digest: str, log: Log) -> None:
    mvn = shutil.which("mvn")
    if not mvn:
        raise RuntimeError(
            "Maven ('mvn') is needed once to fetch the Kafka jars; install it or set "
            "KVIDX_KAFKA_HOME to a dir whose libs/ has them (plus a marker file)"
        )
    log(f"fetching Kafka {kafka_version()} jars into {libs} (one-time) ...")
    t0 = time.monotonic()
    tmp = home / "libs.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [
        mvn,
        "-q",
        "-B",
        "-f",
        str(POM),
        "dependency:copy-dependencies",
        "-DincludeScope=runtime",
        f"-DoutputDirectory={tmp}",
    ]
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"mvn failed ({res.returncode}):\n{res.stdout[-4000:]}")
    shutil.rmtree(libs, ignore_errors=True)
    tmp.rename(libs)
    marker.write_text(digest + "\n")
    log(f"fetched {len(list(libs.glob('*.jar')))} jars in {time.monotonic() - t0:.1f}s")


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").exists():
        return str(Path(java_home) / "bin" / "java")
    java = shutil.which("java")
    if not java:
        raise RuntimeError("'java' (17+) not found on PATH")
    return java


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (sockets held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def random_cluster_id() -> str:
    """Same format as ``kafka.tools.StorageTool random-uuid`` (Kafka Uuid: url-safe base64, no padding).

    Done in Python to save a JVM launch (~1 s). Kafka's Uuid.randomUuid() also avoids ids whose
    string form starts with '-' (they look like CLI flags), so do we.
    """
    while True:
        s = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not s.startswith("-"):
            return s


def server_properties(data_dir: Path, port: int, controller_port: int) -> str:
    props = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.bootstrap.servers": f"127.0.0.1:{controller_port}",
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "log.dirs": str(data_dir / "kraft-logs"),
        "num.partitions": "4",
        "default.replication.factor": "1",
        "min.insync.replicas": "1",
        "auto.create.topics.enable": "true",
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "4",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "4",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "share.coordinator.state.topic.num.partitions": "1",
        "group.initial.rebalance.delay.ms": "0",
        "num.network.threads": "2",
        "num.io.threads": "4",
        "log.retention.hours": "168",
        "log.segment.bytes": str(64 * 1024 * 1024),
    }
    return "".join(f"{k}={v}\n" for k, v in props.items())


def _log_tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    lines = [ln for ln in lines if not ln.lstrip().startswith(("at ", "... "))]  # drop stack frames
    return "\n".join(lines[-n:]) or "(empty)"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _is_kafka_pid(pid: int) -> bool:
    """Guard against PID reuse: only signal a process whose cmdline looks like our broker."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return _pid_alive(pid)  # no /proc (macOS): trust the state file
    return b"kafka.Kafka" in cmdline


def _terminate_pid(pid: int, timeout: float = 20.0, wait: Callable[[float], bool] | None = None) -> None:
    """SIGTERM, wait up to ``timeout`` s, then SIGKILL. ``wait(t)`` -> True once exited (optional)."""
    if not _pid_alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if wait is not None:
            if wait(0.1):
                return
        elif not _pid_alive(pid):
            return
        else:
            time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if wait is not None:
        wait(10.0)
    else:
        end = time.monotonic() + 10
        while _pid_alive(pid) and time.monotonic() < end:
            time.sleep(0.05)


def _serving(bootstrap: str, timeout: float) -> bool:
    """True once the broker answers a metadata request listing itself."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0, "socket.timeout.ms": 2000})
    try:
        md = admin.list_topics(timeout=timeout)
    except Exception:
        return False
    return bool(md.brokers)


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class LocalKafka:
    """One KRaft broker+controller JVM on 127.0.0.1.

    ``start(data_dir)`` formats ``data_dir`` (which should be empty or absent), starts the
    broker in its own session and returns the bootstrap string once it serves.
    ``stop()`` terminates it (SIGTERM, SIGKILL after 20 s). The data dir is left in place.
    """

    def __init__(self, log: Log = _default_log, start_timeout: float = 60.0) -> None:
        self.log = log
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self.port: int | None = None
        self.controller_port: int | None = None
        self.bootstrap: str | None = None
        self.data_dir: Path | None = None
        self.log_file: Path | None = None

    def start(self, data_dir: str | os.PathLike) -> str:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"already running (pid {self.proc.pid})")
        t0 = time.monotonic()
        libs = ensure_jars(self.log)
        data = Path(data_dir).resolve()
        data.mkdir(parents=True, exist_ok=True)
        self.data_dir = data
        self.port, self.controller_port = free_ports(2)
        self.bootstrap = f"127.0.0.1:{self.port}"
        props = data / "server.properties"
        props.write_text(server_properties(data, self.port, self.controller_port))
        self.log_file = data / "kafka.out"
        java = _java()
        cp = str(libs / "*")
        sysprops = [f"-Dlog4j2.configurationFile={LOG4J_CONFIG}", f"-Dkafka.logs.dir={data}"]

        self.log(f"formatting KRaft storage in {data / 'kraft-logs'} ...")
        cluster_id = random_cluster_id()
        fmt = subprocess.run(
            [
                java,
                *JVM_OPTS,
                *sysprops,
                "-cp",
                cp,
                "kafka.tools.StorageTool",
                "format",
                "--standalone",
                "-t",
                cluster_id,
                "-c",
                str(props),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        if fmt.returncode != 0:
            raise RuntimeError(f"kafka storage format failed ({fmt.returncode}):\n{fmt.stdout[-4000:]}")

        self._spawn(t0)
        return self.bootstrap

    def restart(self, down_s: float = 0.0) -> str:
        """Stop the broker and start it again on the same ports and data (a broker restart as
        clients see it); `down_s` keeps it down that long."""
        if self.data_dir is None:
            raise RuntimeError("restart() needs a broker started with start()")
        self.stop()
        time.sleep(down_s)
        self._spawn(time.monotonic())
        return self.bootstrap

    def _spawn(self, t0: float) -> None:
        assert self.data_dir is not None and self.log_file is not None
        cp = str(ensure_jars(self.log) / "*")
        sysprops = [f"-Dlog4j2.configurationFile={LOG4J_CONFIG}", f"-Dkafka.logs.dir={self.data_dir}"]
        with open(self.log_file, "ab") as out:
            self.proc = subprocess.Popen(
                [_java(), *JVM_OPTS, *sysprops, "-cp", cp, "kafka.Kafka",
                 str(self.data_dir / "server.properties")],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                start_new_session=True,
                close_fds=True,
            )
        self.pid = self.proc.pid
        try:
            self._wait_serving(t0)
        except BaseException:
            self.stop()
            raise
        took = time.monotonic() - t0
        self.log(f"started at {self.bootstrap} (pid {self.pid}, {took:.1f}s, logs in {self.data_dir})")

    def _wait_serving(self, t0: float) -> None:
        assert self.proc is not None and self.port is not None and self.bootstrap is not None
        deadline = t0 + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"Kafka exited with code {self.proc.returncode} during start-up; "
                    f"tail of {self.log_file}:\n{_log_tail(self.log_file)}\n"
                    f"tail of server.log:\n{_log_tail(self.data_dir / 'server.log')}"
                )
            if _port_open(self.port) and _serving(self.bootstrap, timeout=2.0):
                return
            time.sleep(0.1)
        raise TimeoutError(
            f"Kafka not serving at {self.bootstrap} after {self.start_timeout:.0f}s; "
            f"tail of server.log:\n{_log_tail(self.data_dir / 'server.log')}"
        )

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None:
            return
        proc = self.proc

        def wait(t: float) -> bool:
            try:
                proc.wait(t)
                return True
            except subprocess.TimeoutExpired:
                return False

        if proc.poll() is None:
            _terminate_pid(proc.pid, timeout, wait)
        self.proc = None

    def detach(self) -> None:
        """Forget the child without stopping it (it keeps running in its own session)."""
        if self.proc is not None:
            self.proc.returncode = 0  # silence Popen's "still running" ResourceWarning
            self.proc = None

    def __enter__(self) -> LocalKafka:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- detached broker managed through a state dir (CLI) -------------------------------------


def _state_path(state_dir: str | os.PathLike) -> Path:
    return Path(state_dir) / STATE_FILE


def _read_state(state_dir: str | os.PathLike) -> dict | None:
    p = _state_path(state_dir)
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def up(state_dir: str | os.PathLike = DEFAULT_STATE_DIR, log: Log = _default_log) -> dict:
    """Start a detached broker whose data lives in ``<state_dir>/data``; idempotent.

    Returns the state dict also written to ``<state_dir>/kafka.json``:
    ``{"pid", "bootstrap", "port", "controller_port", "data_dir", "log", "version", "started_at"}``.
    """
    state_dir = Path(state_dir).resolve()
    st = _read_state(state_dir)
    if st and _pid_alive(st["pid"]) and _is_kafka_pid(st["pid"]):
        log(f"already running at {st['bootstrap']} (pid {st['pid']})")
        return st
    data = state_dir / "data"
    if data.exists():  # stale data from a crashed/killed broker: start fresh
        shutil.rmtree(data)
    state_dir.mkdir(parents=True, exist_ok=True)
    k = LocalKafka(log=log)
    bootstrap = k.start(data)
    st = {
        "pid": k.pid,
        "bootstrap": bootstrap,
        "port": k.port,
        "controller_port": k.controller_port,
        "data_dir": str(data),
        "log": str(data / "server.log"),
        "version": kafka_version(),
        "started_at": time.time(),
    }
    tmp = _state_path(state_dir).with_suffix(".tmp")
    tmp.write_text(json.dumps(st, indent=2) + "\n")
    tmp.replace(_state_path(state_dir))
    k.detach()
    return st


def down(state_dir: str | os.PathLike = DEFAULT_STATE_DIR, log: Log = _default_log) -> bool:
    """Stop the broker recorded in ``<state_dir>/kafka.json`` and delete its data dir.

    Returns True if a running broker was stopped.
    """
    state_dir = Path(state_dir).resolve()
    st = _read_state(state_dir)
    stopped = False
    if st and _pid_alive(st["pid"]):
        if _is_kafka_pid(st["pid"]):
            log(f"stopping pid {st['pid']} ...")
            _terminate_pid(st["pid"], timeout=20.0)
            stopped = True
        else:
            log(f"pid {st['pid']} is not a Kafka broker any more; not signalling it")
    elif st:
        log("not running (stale state file)")
    else:
        log(f"no broker state in {state_dir}")
    data = Path(st["data_dir"]) if st else state_dir / "data"
    shutil.rmtree(data, ignore_errors=True)
    _state_path(state_dir).unlink(missing_ok=True)
    if stopped:
        log("stopped")
    return stopped


def status(state_dir: str | os.PathLike = DEFAULT_STATE_DIR) -> dict:
    """``{"running": bool, "serving": bool, ...state}``; running=False when there is no state."""
    st = _read_state(Path(state_dir).resolve())
    if not st:
        return {"running": False, "serving": False}
    running = _pid_alive(st["pid"]) and _is_kafka_pid(st["pid"])
    serving = running and _port_open(st["port"]) and _serving(st["bootstrap"], timeout=3.0)
    return {**st, "running": running, "serving": serving}


# ---- CLI --------------------------------------------------------------------------------------


def _cmd_up(args: argparse.Namespace) -> int:
    st = up(args.state_dir)
    print(st["bootstrap"])
    print(f"export KAFKA_BOOTSTRAP_SERVERS={st['bootstrap']}")
    return 0


def _cmd_fetch(args: argparse.Namespace) -> int:
    print(ensure_jars())
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    down(args.state_dir)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    st = status(args.state_dir)
    if not st["running"]:
        print("kafka: not running")
        return 1
    state = "serving" if st["serving"] else "running, NOT serving"
    print(f"kafka: {state} at {st['bootstrap']} (pid {st['pid']}, data {st['data_dir']})")
    print(f"export KAFKA_BOOTSTRAP_SERVERS={st['bootstrap']}")
    return 0 if st["serving"] else 2


def add_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``kafka {fetch,up,down,status}``. Each leaf sets ``func(args) -> int`` (exit code)."""
    p = subparsers.add_parser(
        "kafka",
        help="run a local single-node Kafka broker (no Docker)",
        description="Run a real single-node Kafka broker (KRaft) on 127.0.0.1 with java; the jars "
        "are fetched once with Maven into ~/.cache/kvidx (override: KVIDX_KAFKA_HOME).",
    )
    sub = p.add_subparsers(dest="kafka_cmd", metavar="{fetch,up,down,status}", required=True)
    sp = sub.add_parser("fetch", help="fetch the Kafka jars with Maven (once; cached)",
                        description="Download Apache Kafka's jars from Maven Central into the cache "
                        "(~/.cache/kvidx, or $KVIDX_KAFKA_HOME) and print where they are.")
    sp.set_defaults(func=_cmd_fetch)

    def state_arg(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--state-dir",
            type=Path,
            default=DEFAULT_STATE_DIR,
            metavar="DIR",
            help=f"where kafka.json and the broker data live (default: ./{DEFAULT_STATE_DIR})",
        )

    sp = sub.add_parser(
        "up",
        help="start the broker in the background (idempotent)",
        description="Start a detached broker, wait until it serves, print the "
        "bootstrap servers and an export line for KAFKA_BOOTSTRAP_SERVERS.",
    )
    state_arg(sp)
    sp.set_defaults(func=_cmd_up)
    sp = sub.add_parser(
        "down",
        help="stop the broker and delete its data",
        description="Stop the broker (SIGTERM, SIGKILL after 20 s) and delete its data dir.",
    )
    state_arg(sp)
    sp.set_defaults(func=_cmd_down)
    sp = sub.add_parser(
        "status",
        help="show whether the broker runs and serves",
        description="Exit 0 if serving, 1 if not running, 2 if running but not serving.",
    )
    state_arg(sp)
    sp.set_defaults(func=_cmd_status)
    return p
