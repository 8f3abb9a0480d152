"""A real single-node Kafka 4.x broker (KRaft, broker+controller) without Docker.

The broker jars are resolved from Maven Central with ``mvn dependency:copy-dependencies``
(see ``pom.xml`` next to this file) into ``~/.cache/kvidx/kafka-<version>/libs``
(override the directory with env ``KVIDX_KAFKA_HOME``); later runs reuse them.

Python API::

    kafka = LocalKafka()
    bootstrap = kafka.start(data_dir)   # "127.0.0.1:<port>"; formats data_dir unless it holds a broker's data
    ...
    kafka.stop()                        # the data dir is left in place

CLI (registered into ``kvidx`` by :func:`add_cli`)::

    kvidx kafka up [--state-dir DIR] [--brokers N]   # start detached (or restart on its data), write
                                                     # DIR/kafka.json; N > 1: a cluster (cluster.py)
    kvidx kafka status [--state-dir DIR]
    kvidx kafka down [--state-dir DIR]   # stop; topics and messages are kept for the next `up`
    kvidx kafka reset [--state-dir DIR] [--yes]   # stop and delete all topics and messages

The state dir is one per user, whatever the working directory: ``$KVIDX_STATE_DIR/kafka`` if set,
else ``${XDG_STATE_HOME:-~/.local/state}/kvidx/kafka``. A broker that died (kill -9, OOM, reboot)
comes back from ``up`` with its data, on its previous ports when they are free. Kafka 4.1 (KRaft,
formatted with ``--standalone``) starts fine with a controller port other than the one it was
formatted with, so a taken controller port just gets replaced; a taken broker port too, with one line
saying so (clients then need the new address).

Everything binds to 127.0.0.1 only. Needs ``java`` (17+) and, on first use, ``mvn``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import functools
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
from collections.abc import Callable, Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
POM = HERE / "pom.xml"
LOG4J_CONFIG = HERE / "log4j2.yaml"
STATE_FILE = "kafka.json"
LOCK_FILE = ".lock"
DATA_SUBDIR = "data"
MARKER = ".kvidx-jars-complete"
JAVA_HINT = (
    "install a JDK 17+ (e.g. `apt-get install openjdk-17-jre-headless` or `brew install openjdk@17`) "
    "or set JAVA_HOME to one"
)

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


class KafkaError(RuntimeError):
    """A launcher failure. The first line of the message says what went wrong on its own (the CLI
    prints only that); ``log_file`` is the broker log to read for more, if there is one."""

    def __init__(self, msg: str, log_file: Path | None = None) -> None:
        super().__init__(msg)
        self.log_file = log_file


class KafkaTimeout(KafkaError, TimeoutError):
    """The broker did not serve in time (still a TimeoutError, as before)."""


class NoBrokerState(KafkaError):
    """The state dir holds no broker (no kafka.json, no data): probably the wrong dir."""


def _default_log(msg: str) -> None:
    print(f"[kafka] {msg}", file=sys.stderr, flush=True)


def kafka_version() -> str:
    """The Kafka version pinned in pom.xml."""
    m = re.search(r"<kafka\.version>([^<]+)</kafka\.version>", POM.read_text())
    if not m:
        raise KafkaError(f"no <kafka.version> in {POM}")
    return m.group(1).strip()


def kafka_home() -> Path:
    env = os.environ.get("KVIDX_KAFKA_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kvidx" / f"kafka-{kafka_version()}"


def default_state_dir() -> Path:
    """``$KVIDX_STATE_DIR/kafka``, else ``${XDG_STATE_HOME:-~/.local/state}/kvidx/kafka``.

    One per user and independent of the working directory, so status/down/reset from anywhere find
    the broker that `up` started.
    """
    env = os.environ.get("KVIDX_STATE_DIR")
    if env:
        return Path(env).expanduser().resolve() / "kafka"
    xdg = os.environ.get("XDG_STATE_HOME", "")
    # The XDG spec says to ignore a relative value (it would make the dir cwd-dependent again).
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "state"
    return base / "kvidx" / "kafka"


def _state_dir(state_dir: str | os.PathLike | None) -> Path:
    return Path(state_dir).expanduser().resolve() if state_dir else default_state_dir()


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
        raise KafkaError(
            f"Maven ('mvn') not found on PATH; it is needed once to fetch the Kafka jars into {libs}: "
            "install it (e.g. `apt-get install maven`) or set KVIDX_KAFKA_HOME to a jar cache that "
            "`kvidx kafka fetch` filled elsewhere"
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
        errors = [ln for ln in res.stdout.splitlines() if ln.startswith("[ERROR]")]
        first = errors[0] if errors else (res.stdout.strip().splitlines() or ["(no output)"])[-1]
        raise KafkaError(f"mvn failed (exit {res.returncode}): {_shorten(first)}\n{res.stdout[-4000:]}")
    shutil.rmtree(libs, ignore_errors=True)
    tmp.rename(libs)
    marker.write_text(digest + "\n")
    log(f"fetched {len(list(libs.glob('*.jar')))} jars in {time.monotonic() - t0:.1f}s")


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        java = Path(java_home) / "bin" / "java"
        if java.is_file() and os.access(java, os.X_OK):
            return str(java)
    java = shutil.which("java")
    if java:
        return java
    where = f"not in JAVA_HOME={java_home}/bin nor on PATH" if java_home else "not on PATH, JAVA_HOME unset"
    raise KafkaError(f"java (17+) not found ({where}): {JAVA_HINT}")


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


def port_free(port: int) -> bool:
    """Could the broker listen on 127.0.0.1:``port`` now?

    With SO_REUSEADDR like the JVM, so the old broker's TIME_WAIT connections do not count as taken.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen(1)
        except OSError:
            return False
    return True


def port_owner(port: int) -> str:
    """Best effort 'pid N (name)' of whoever listens on ``port`` (Linux /proc; own processes only)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{f[9]}]")
    if inodes:
        for fd_dir in Path("/proc").glob("[0-9]*/fd"):
            with contextlib.suppress(OSError):
                for fd in fd_dir.iterdir():
                    with contextlib.suppress(OSError):
                        if os.readlink(fd) in inodes:
                            pid = fd_dir.parent.name
                            comm = (fd_dir.parent / "comm").read_text().strip()
                            return f"pid {pid} ({comm})"
    return "another process"


def _pick_ports(port: int | None, controller_port: int | None) -> tuple[int, int]:
    """The given ports, with None replaced by free ones distinct from the given ones."""
    free = [p for p in free_ports(4) if p not in (port, controller_port)]
    return port or free[0], controller_port or free[1]


def random_cluster_id() -> str:
    """Same format as ``kafka.tools.StorageTool random-uuid`` (Kafka Uuid: url-safe base64, no padding).

    Done in Python to save a JVM launch (~1 s). Kafka's Uuid.randomUuid() also avoids ids whose
    string form starts with '-' (they look like CLI flags), so do we.
    """
    while True:
        s = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not s.startswith("-"):
            return s


def server_properties(data_dir: Path, port: int, controller_port: int, node_id: int = 1,
                      voters: str | None = None, cluster_size: int = 1) -> str:
    """One KRaft broker+controller. Alone (`voters` None): a standalone quorum, every internal topic
    with one replica. One node of a cluster of `cluster_size` (kvidx.kafka.cluster): the static
    `voters` quorum and a production cluster's replication defaults (3 replicas, 2 in sync)."""
    replicas = min(3, cluster_size)
    min_isr = str(2 if replicas >= 3 else 1)
    quorum = ({"controller.quorum.voters": voters} if voters
              else {"controller.quorum.bootstrap.servers": f"127.0.0.1:{controller_port}"})
    props = {
        "process.roles": "broker,controller",
        "node.id": str(node_id),
        **quorum,
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "log.dirs": str(data_dir / "kraft-logs"),
        "num.partitions": "4",
        "default.replication.factor": str(replicas),
        "min.insync.replicas": min_isr,
        "auto.create.topics.enable": "true",
        "offsets.topic.replication.factor": str(replicas),
        "offsets.topic.num.partitions": "4",
        "transaction.state.log.replication.factor": str(replicas),
        "transaction.state.log.min.isr": min_isr,
        "transaction.state.log.num.partitions": "4",
        "share.coordinator.state.topic.replication.factor": str(replicas),
        "share.coordinator.state.topic.min.isr": min_isr,
        "share.coordinator.state.topic.num.partitions": "1",
        "group.initial.rebalance.delay.ms": "0",
        "group.min.session.timeout.ms": "500",  # tests fail workers over in seconds
        "num.network.threads": "2",
        "num.io.threads": "4",
        "log.retention.hours": "168",
        "log.segment.bytes": str(64 * 1024 * 1024),
    }
    return "".join(f"{k}={v}\n" for k, v in props.items())


def _listener_ports(props_file: Path) -> tuple[int | None, int | None]:
    """(broker port, controller port) from a server.properties written by server_properties()."""
    try:
        text = props_file.read_text()
    except OSError:
        return None, None
    m = re.search(r"^listeners=(.*)$", text, re.M)
    found = dict(re.findall(r"(PLAINTEXT|CONTROLLER)://[^:,]*:(\d+)", m.group(1))) if m else {}
    port, ctl = found.get("PLAINTEXT"), found.get("CONTROLLER")
    return (int(port) if port else None), (int(ctl) if ctl else None)


def is_formatted(data_dir: Path) -> bool:
    """True if ``data_dir`` already holds a formatted KRaft log dir (a broker's topics)."""
    return (Path(data_dir) / "kraft-logs" / "meta.properties").is_file()


def _log_tail(path: Path, n: int = 40, offset: int = 0) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    lines = [ln for ln in lines if not ln.lstrip().startswith(("at ", "... "))]  # drop stack frames
    return "\n".join(lines[-n:]) or "(empty)"


_ERRORISH = re.compile(r"\b(ERROR|FATAL)\b|Exception\b|Error\b")
_EXCEPTION = re.compile(r"^(Caused by: )?[a-zA-Z_][\w.$]*(Exception|Error)\b:?\s*(.*)$")


def _shorten(line: str, n: int = 300) -> str:
    line = " ".join(line.split())
    return line if len(line) <= n else line[: n - 3] + "..."


def _cause(logs: dict[Path, int]) -> str:
    """The most telling error line the broker wrote since the given offsets ('' if none).

    That is the root cause of the first exception (Java wraps causes, and the generic "Fatal error
    during startup" ERROR line says nothing), or the outer one if it only repeats it with more detail
    ("failed to bind to 127.0.0.1:N: Address already in use" beats "BindException: Address ...").
    """
    chain: list[tuple[str, str]] = []  # (line, message) of the first exception and its causes
    first = ""
    for path, offset in logs.items():
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            continue
        for ln in lines:
            s = ln.strip()
            m = _EXCEPTION.match(s)
            if m and chain and not m.group(1):
                break  # a new top-level exception: the first chain is complete
            if m:
                chain.append((s.removeprefix("Caused by: "), m.group(3)))
            elif not first and _ERRORISH.search(s) and not s.startswith(("at ", "...")):
                first = s
        if chain:
            break
    if not chain:
        return _shorten(first)
    line, msg = chain[-1]
    if len(chain) > 1 and msg and msg in chain[-2][1]:
        line = chain[-2][0]
    return _shorten(line)


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


def _is_broker_pid(pid: int, props_file: Path | None = None) -> bool:
    """Guard against PID reuse: only a live process whose cmdline is a Kafka broker (on ``props_file``,
    if given) counts, so a stale state file never makes us signal some other process or broker."""
    if not _pid_alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True  # no /proc (macOS): trust the state file
    return b"kafka.Kafka" in cmdline and (props_file is None or str(props_file).encode() in cmdline)


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


def _brokers_listed(bootstrap: str, timeout: float) -> int:
    """How many brokers the cluster's metadata lists (0: no answer)."""
    from confluent_kafka.admin import AdminClient

    try:
        md = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0}).list_topics(timeout=timeout)
    except Exception:  # noqa: BLE001 - KafkaException: no answer in time
        return 0
    return len(md.brokers)


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class LocalKafka:
    """One KRaft broker+controller JVM on 127.0.0.1.

    ``start(data_dir)`` formats ``data_dir`` if it holds no broker data yet (else starts on its
    topics), starts the broker in its own session and returns the bootstrap string once it serves.
    ``stop()`` terminates it (SIGTERM, SIGKILL after 20 s). The data dir is left in place.
    """

    def __init__(self, log: Log = _default_log, start_timeout: float = 60.0, node_id: int = 1,
                 voters: str | None = None, cluster_size: int = 1, cluster_id: str | None = None) -> None:
        """`node_id`, `voters`, `cluster_size`, `cluster_id`: one node of a local cluster
        (kvidx.kafka.cluster.LocalKafkaCluster); the defaults make a standalone broker."""
        self.log = log
        self.start_timeout = start_timeout
        self.node_id = node_id
        self.voters = voters
        self.cluster_size = cluster_size
        self.cluster_id = cluster_id
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self.port: int | None = None
        self.controller_port: int | None = None
        self.bootstrap: str | None = None
        self.data_dir: Path | None = None
        self.log_file: Path | None = None
        self._log_offsets: dict[Path, int] = {}
        self._t0 = 0.0

    def start(
        self, data_dir: str | os.PathLike, port: int | None = None, controller_port: int | None = None,
        wait: bool = True,
    ) -> str:
        """Start on ``data_dir``, return "127.0.0.1:<port>"; a port left None gets a free one. Without
        `wait`, return once the JVM is spawned (a cluster's nodes serve only once a quorum is up:
        `wait_serving()` each after starting all)."""
        if self.proc is not None and self.proc.poll() is None:
            raise KafkaError(f"already running (pid {self.proc.pid})")
        t0 = time.monotonic()
        java = _java()  # before the jars: a missing java needs no Maven run to report
        libs = ensure_jars(self.log)
        data = Path(data_dir).resolve()
        data.mkdir(parents=True, exist_ok=True)
        self.data_dir = data
        self.port, self.controller_port = _pick_ports(port, controller_port)
        self.bootstrap = f"127.0.0.1:{self.port}"
        props = data / "server.properties"
        # Rewritten on every start: the ports may differ, and config changes in code apply.
        props.write_text(server_properties(data, self.port, self.controller_port, self.node_id,
                                           self.voters, self.cluster_size))
        self.log_file = data / "kafka.out"
        if is_formatted(data):
            # Formatting again would fail (or, forced, lose the cluster id): start on the data as is.
            self.log(f"starting on the existing data in {data / 'kraft-logs'} (topics and messages kept)")
        else:
            self._format(java, libs, props)
        self._spawn(t0, wait)
        return self.bootstrap

    def _format(self, java: str, libs: Path, props: Path) -> None:
        assert self.data_dir is not None
        data = self.data_dir
        self.log(f"formatting KRaft storage in {data / 'kraft-logs'} ...")
        sysprops = [f"-Dlog4j2.configurationFile={LOG4J_CONFIG}", f"-Dkafka.logs.dir={data}"]
        fmt = subprocess.run(
            [
                java,
                *JVM_OPTS,
                *sysprops,
                "-cp",
                str(libs / "*"),
                "kafka.tools.StorageTool",
                "format",
                # a static quorum (voters) needs no initial controllers; a lone node is its own
                *([] if self.voters else ["--standalone"]),
                "-t",
                self.cluster_id or random_cluster_id(),
                "-c",
                str(props),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        if fmt.returncode != 0:
            lines = fmt.stdout.strip().splitlines() or ["(no output)"]
            raise KafkaError(
                f"kafka storage format of {data} failed (exit {fmt.returncode}): {_shorten(lines[-1])}\n"
                f"{fmt.stdout[-4000:]}"
            )

    def restart(self, down_s: float = 0.0) -> str:
        """Stop the broker and start it again on the same ports and data (a broker restart as
        clients see it); `down_s` keeps it down that long."""
        if self.data_dir is None:
            raise KafkaError("restart() needs a broker started with start()")
        self.stop()
        time.sleep(down_s)
        self._spawn(time.monotonic())
        return self.bootstrap

    def _spawn(self, t0: float, wait: bool = True) -> None:
        assert self.data_dir is not None and self.log_file is not None
        cp = str(ensure_jars(self.log) / "*")
        sysprops = [f"-Dlog4j2.configurationFile={LOG4J_CONFIG}", f"-Dkafka.logs.dir={self.data_dir}"]
        # The logs are appended to across starts: remember where this start's lines begin.
        self._log_offsets = {p: (p.stat().st_size if p.exists() else 0)
                             for p in (self.data_dir / "server.log", self.log_file)}
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
        self._t0 = t0
        if wait:
            self.wait_serving()

    def wait_serving(self) -> None:
        """Return once the broker serves (raise KafkaError, with its logs' tails, if it cannot)."""
        t0 = self._t0
        try:
            self._wait_serving(t0)
        except BaseException:
            self.stop()
            raise
        took = time.monotonic() - t0
        self.log(f"started at {self.bootstrap} (pid {self.pid}, {took:.1f}s, logs in {self.data_dir})")

    def _tails(self) -> str:
        return "\n".join(f"tail of {p}:\n{_log_tail(p, offset=off)}" for p, off in self._log_offsets.items())

    def _wait_serving(self, t0: float) -> None:
        assert self.proc is not None and self.port is not None and self.bootstrap is not None
        assert self.data_dir is not None
        server_log = self.data_dir / "server.log"
        deadline = t0 + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                cause = _cause(self._log_offsets) or "no error in its logs"
                code = self.proc.returncode
                raise KafkaError(
                    f"Kafka exited with code {code} during start-up: {cause}\n{self._tails()}",
                    log_file=server_log,
                )
            if _port_open(self.port) and _serving(self.bootstrap, timeout=2.0):
                return
            time.sleep(0.1)
        cause = _cause(self._log_offsets)
        raise KafkaTimeout(
            f"Kafka not serving at {self.bootstrap} after {self.start_timeout:.0f}s"
            f"{': ' + cause if cause else ''}\n{self._tails()}",
            log_file=server_log,
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


def _read_state(state_dir: Path) -> dict | None:
    try:
        st = json.loads((state_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return st if isinstance(st, dict) else None


def _write_state(state_dir: Path, st: dict) -> None:
    tmp = state_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(st, indent=2) + "\n")
    tmp.replace(state_dir / STATE_FILE)


def _has_state(state_dir: Path) -> bool:
    return (state_dir / STATE_FILE).exists() or (state_dir / DATA_SUBDIR).exists()


def _no_state(state_dir: Path) -> NoBrokerState:
    return NoBrokerState(
        f"no broker state in {state_dir} (no {STATE_FILE}, no {DATA_SUBDIR}/); pass --state-dir DIR or set "
        "KVIDX_STATE_DIR to where `kvidx kafka up` ran"
    )


@contextlib.contextmanager
def _locked(state_dir: Path) -> Iterator[None]:
    """Serialize up/down/reset on one state dir (a second `up` waits, then finds the broker running)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / LOCK_FILE, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _running_pid(state_dir: Path, st: dict | None) -> int | None:
    """The pid of the state's broker if that broker still runs."""
    if not st or not isinstance(st.get("pid"), int):
        return None
    props = Path(st.get("data_dir") or state_dir / DATA_SUBDIR) / "server.properties"
    return st["pid"] if _is_broker_pid(st["pid"], props) else None


def up(state_dir: str | os.PathLike | None = None, log: Log = _default_log,
       brokers: int | None = None) -> dict:
    """Start a detached broker whose data lives in ``<state_dir>/data``; idempotent. With `brokers`
    > 1, a cluster of that many KRaft nodes (kvidx.kafka.cluster: a controller quorum of them all,
    topics with 3 replicas and min.insync.replicas 2 by default), in ``<state_dir>/data/node<i>``; None:
    as many as the state dir already holds (one for a new one).

    A broker that stopped or died restarts on its data (topics and messages kept) and on its previous
    ports if they are free; a taken port is replaced by a free one and logged in one line.
    Returns the state dict also written to ``<state_dir>/kafka.json``:
    ``{"pid", "bootstrap", "port", "controller_port", "data_dir", "log", "version", "started_at"}``.
    """
    from kvidx.kafka.cluster import nodes_in

    sd = _state_dir(state_dir)
    _java()  # fail in one line before anything else happens
    with _locked(sd):
        st = _read_state(sd)
        data = sd / DATA_SUBDIR
        have = nodes_in(data) or (1 if is_formatted(data) else 0)
        size = brokers or (st or {}).get("brokers") or have or 1
        if have and size != have:
            raise KafkaError(f"{data} holds the data of {have} broker(s), not {size}: pass --brokers {have}, "
                             "another --state-dir, or `kvidx kafka reset` it first")
        if size > 1:
            return _up_cluster(sd, data, size, st, log)
        if _running_pid(sd, st):
            assert st is not None
            log(f"already running at {st['bootstrap']} (pid {st['pid']}, data {st['data_dir']})")
            return st
        old_port, old_ctl = _listener_ports(data / "server.properties")
        if st:  # kafka.json is what clients were told; server.properties is the fallback
            old_port, old_ctl = st.get("port") or old_port, st.get("controller_port") or old_ctl
        port = old_port if old_port and port_free(old_port) else None
        # A new controller port is fine: tried with Kafka 4.1.1 (formatted --standalone, also after
        # kill -9, several times in a row), the single voter elects itself and serves on its data.
        ctl = old_ctl if old_ctl and port_free(old_ctl) else None
        taken = {p: port_owner(p) for p in (old_port, old_ctl) if p and p not in (port, ctl)}
        k = LocalKafka(log=log)
        bootstrap = k.start(data, port=port, controller_port=ctl)
        if old_ctl and k.controller_port != old_ctl:
            log(f"controller port {old_ctl} is taken by {taken[old_ctl]}; now on {k.controller_port}")
        if old_port and k.port != old_port:
            log(f"broker port {old_port} is taken by {taken[old_port]}; moved to {bootstrap}: "
                f"export KAFKA_BOOTSTRAP_SERVERS={bootstrap}")
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
        _write_state(sd, st)
        k.detach()
        return st


def _up_cluster(sd: Path, data: Path, size: int, st: dict | None, log: Log) -> dict:
    from kvidx.kafka.cluster import running_pids, stop_cluster, up_cluster

    if st and st.get("brokers") == size:
        running = running_pids(st)
        if len(running) == size:
            log(f"already running at {st['bootstrap']} ({size} brokers, pids "
                f"{', '.join(map(str, running))}, data {data})")
            return st
        if running:  # some nodes died: restart the whole cluster on its data, on the same ports
            stop_cluster(st, log)
    st = up_cluster(data, size, st, log)
    _write_state(sd, st)
    return st


def _stop(sd: Path, st: dict | None, log: Log) -> bool:
    """Stop the state's broker if it runs and record it as stopped; True if it was running."""
    if st and st.get("brokers", 1) > 1:
        from kvidx.kafka.cluster import stop_cluster

        stopped = stop_cluster(st, log)
        nodes = [{**n, "pid": None} for n in st["nodes"]]
        _write_state(sd, {**st, "nodes": nodes, "stopped_at": time.time()})
        return stopped
    pid = _running_pid(sd, st)
    if pid:
        log(f"stopping pid {pid} ...")
        _terminate_pid(pid, timeout=20.0)
    elif st and isinstance(st.get("pid"), int) and _pid_alive(st["pid"]):
        log(f"pid {st['pid']} is not this broker any more; not signalling it")
    if st and st.get("pid") is not None:
        _write_state(sd, {**st, "pid": None, "stopped_at": time.time()})
    return pid is not None


def down(state_dir: str | os.PathLike | None = None, log: Log = _default_log) -> bool:
    """Stop the broker recorded in ``<state_dir>/kafka.json``; its data stays for the next `up`
    (:func:`reset` deletes it). Returns True if a running broker was stopped.

    Raises :class:`NoBrokerState` if the dir holds no broker at all (likely the wrong dir).
    """
    sd = _state_dir(state_dir)
    if not _has_state(sd):
        raise _no_state(sd)
    with _locked(sd):
        stopped = _stop(sd, _read_state(sd), log)
    data = sd / DATA_SUBDIR
    log(f"{'stopped' if stopped else 'not running'}; data kept in {data} "
        "(`kvidx kafka up` restarts on it, `kvidx kafka reset` deletes it)")
    return stopped


def reset(state_dir: str | os.PathLike | None = None, log: Log = _default_log) -> Path:
    """Stop the broker if it runs and delete all its topics and messages (its data dir and
    kafka.json); the next `up` starts an empty broker. Returns the deleted data dir.

    Raises :class:`NoBrokerState` if there is nothing to delete.
    """
    sd = _state_dir(state_dir)
    if not _has_state(sd):
        raise _no_state(sd)
    with _locked(sd):
        st = _read_state(sd)
        _stop(sd, st, log)
        data = sd / DATA_SUBDIR
        shutil.rmtree(data, ignore_errors=True)
        (sd / STATE_FILE).unlink(missing_ok=True)
    log(f"deleted {data}")
    return data


def status(state_dir: str | os.PathLike | None = None) -> dict:
    """``{"running": bool, "serving": bool, "state_dir": str, ...state}``; running=False when there is
    no state or its broker is not running."""
    sd = _state_dir(state_dir)
    st = _read_state(sd) or {}
    if st.get("brokers", 1) > 1:
        from kvidx.kafka.cluster import running_pids

        st = {**st, "nodes_running": len(running_pids(st))}
        running = st["nodes_running"] == st["brokers"]
        serving = running and _brokers_listed(st["bootstrap"], timeout=3.0) == st["brokers"]
    else:
        running = _running_pid(sd, st) is not None
        serving = running and _port_open(st["port"]) and _serving(st["bootstrap"], timeout=3.0)
    return {**st, "state_dir": str(sd), "has_data": (sd / DATA_SUBDIR).exists(),
            "running": running, "serving": serving}


# ---- CLI --------------------------------------------------------------------------------------


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    msg = lines[0] if lines else type(e).__name__
    log_file = getattr(e, "log_file", None)
    if log_file is not None and Path(log_file).exists():
        msg += f" (broker log: {log_file})"
    return f"error: {msg}"


def _cli(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Launcher failures become one `error: ...` line on stderr and exit 1, never a traceback."""

    @functools.wraps(fn)
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (RuntimeError, OSError) as e:  # OSError covers TimeoutError, PermissionError, ...
            print(_one_line(e), file=sys.stderr, flush=True)
            return 1
        except KeyboardInterrupt:  # LocalKafka stops a half-started broker itself
            print("kafka: interrupted", file=sys.stderr, flush=True)
            return 130

    return run


@_cli
def _cmd_up(args: argparse.Namespace) -> int:
    st = up(args.state_dir, brokers=args.brokers)
    # shell-ready: a comment, then the export (`eval "$(kvidx kafka up)"` sets the variable)
    what = f"{st['brokers']} brokers" if st.get("brokers", 1) > 1 else "kafka"
    print(f"# {what} serving at {st['bootstrap']}")
    print(f"export KAFKA_BOOTSTRAP_SERVERS={st['bootstrap']}")
    return 0


@_cli
def _cmd_fetch(args: argparse.Namespace) -> int:
    print(ensure_jars())
    return 0


@_cli
def _cmd_down(args: argparse.Namespace) -> int:
    down(args.state_dir)
    return 0


@_cli
def _cmd_reset(args: argparse.Namespace) -> int:
    sd = _state_dir(args.state_dir)
    if not _has_state(sd):
        raise _no_state(sd)
    if not args.yes:
        if not sys.stdin.isatty():
            print(f"error: reset deletes all topics and messages of the broker at {sd / DATA_SUBDIR}; "
                  "no terminal to confirm on: pass --yes", file=sys.stderr)
            return 2
        # The prompt goes to stderr (stdout stays for output), like input() does without readline.
        print(f"delete all topics and messages of the broker at {sd / DATA_SUBDIR}? [y/N] ",
              end="", file=sys.stderr, flush=True)
        answer = sys.stdin.readline()  # "" at EOF: no
        if answer.strip().lower() not in ("y", "yes"):
            print("kafka: nothing deleted", file=sys.stderr)
            return 1
    reset(sd)
    return 0


@_cli
def _cmd_status(args: argparse.Namespace) -> int:
    st = status(args.state_dir)
    if not st["running"]:
        where = f"state dir {st['state_dir']}"
        if st.get("nodes_running"):
            print(f"kafka: {st['nodes_running']} of {st['brokers']} brokers running ({where}; "
                  "`kvidx kafka up` restarts the others)")
        elif st["has_data"]:
            print(f"kafka: not running ({where}; data kept, `kvidx kafka up` restarts it)")
        else:
            print(f"kafka: not running ({where}: no broker there)")
        return 1
    state = "serving" if st["serving"] else "running, NOT serving"
    pids = ", ".join(str(n["pid"]) for n in st["nodes"]) if st.get("brokers", 1) > 1 else st["pid"]
    print(f"# kafka: {state} at {st['bootstrap']} (pid {pids}, data {st['data_dir']})")
    print(f"export KAFKA_BOOTSTRAP_SERVERS={st['bootstrap']}")
    return 0 if st["serving"] else 2
