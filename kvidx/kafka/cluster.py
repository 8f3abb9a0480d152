"""A local Kafka cluster of several KRaft nodes on 127.0.0.1, the way production runs Kafka: a
controller quorum of 3, topics with 3 replicas and `min.insync.replicas` 2 by default. For the tests
of leader and controller failover (tests/integration/test_replication.py) and for trying kvidx
against a replicated cluster by hand; `kvidx kafka up` stays a single broker."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

from kvidx.kafka.local import LocalKafka, Log, _default_log, free_ports, random_cluster_id

_LEADER = re.compile(r"Completed transition to Leader\(localVoterNode=VoterNode\("
                     r"voterKey=ReplicaKey\(id=(\d+),.*?, epoch=(\d+),")


class LocalKafkaCluster:
    """`size` broker+controller nodes (node ids 1..size), every one a voter of the quorum.

    ``start(data_dir)`` formats and starts them together and returns the bootstrap list once every
    node serves; `kill`, `pause`, `resume` and `restart` act on one node as a crash, a hung JVM, its
    recovery and a restart look to clients.
    """

    def __init__(self, size: int = 3, log: Log = _default_log, start_timeout: float = 180.0) -> None:
        if size < 1:
            raise ValueError("a cluster needs at least one node")
        self.size = size
        self.log = log
        self.start_timeout = start_timeout
        self.nodes: dict[int, LocalKafka] = {}
        self.bootstrap = ""

    def start(self, data_dir: str | os.PathLike, ports: list[int] | None = None) -> str:
        """Format (or restart on their data) and start the nodes in `data_dir`/node<i>; `ports`: the
        broker ports then the controller ports to use (default: free ones). Returns the bootstrap list
        once every node serves."""
        data = Path(data_dir).resolve()
        ports = ports or free_ports(2 * self.size)
        broker_ports, controller_ports = ports[:self.size], ports[self.size:]
        # a static quorum: its voters are read from the configuration at every start, so a restart on
        # other ports is fine as long as every node gets the same list
        voters = ",".join(f"{i + 1}@127.0.0.1:{p}" for i, p in enumerate(controller_ports))
        cluster_id = random_cluster_id()  # used only by nodes not formatted yet
        for i in range(self.size):
            node = LocalKafka(self.log, self.start_timeout, node_id=i + 1, voters=voters,
                              cluster_size=self.size, cluster_id=cluster_id)
            self.nodes[i + 1] = node
            node.start(data / f"node{i + 1}", broker_ports[i], controller_ports[i], wait=False)
        try:
            for node in self.nodes.values():
                node.wait_serving()
        except BaseException:
            self.stop()
            raise
        self.bootstrap = ",".join(f"127.0.0.1:{p}" for p in broker_ports)
        return self.bootstrap

    def node(self, node_id: int) -> LocalKafka:
        return self.nodes[node_id]

    def kill(self, node_id: int) -> None:
        """SIGKILL: a crashed broker (its data stays; `restart` brings it back)."""
        node = self.nodes[node_id]
        if node.proc is not None and node.proc.poll() is None:
            node.proc.kill()
            node.proc.wait()
        node.proc = None

    def pause(self, node_id: int) -> None:
        """SIGSTOP: a hung broker (connections open, nothing answered) until `resume`."""
        os.kill(self._pid(node_id), signal.SIGSTOP)

    def resume(self, node_id: int) -> None:
        os.kill(self._pid(node_id), signal.SIGCONT)

    def restart(self, node_id: int) -> None:
        node = self.nodes[node_id]
        if node.proc is not None and node.proc.poll() is None:
            node.stop()
        node._spawn(time.monotonic())

    def _pid(self, node_id: int) -> int:
        proc = self.nodes[node_id].proc
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"node {node_id} is not running")
        return proc.pid

    def leader(self, topic: str, partition: int = 0, timeout: float = 10.0) -> int:
        """The node that leads `topic`'s partition now."""
        from confluent_kafka.admin import AdminClient

        md = AdminClient({"bootstrap.servers": self.bootstrap}).list_topics(topic, timeout=timeout)
        return md.topics[topic].partitions[partition].leader

    def active_controller(self, timeout: float = 60.0) -> int:
        """The node that leads the controller quorum now: the newest epoch any node's log says it
        became the leader in (clients of a KRaft cluster are never told the active controller; the
        quorum's transitions are logged at INFO by kvidx/kafka/log4j2.yaml)."""
        deadline = time.monotonic() + timeout
        while True:
            best: tuple[int, int] | None = None  # (epoch, node)
            for node_id, node in self.nodes.items():
                if node.proc is None or node.proc.poll() is not None or node.data_dir is None:
                    continue
                try:
                    text = (node.data_dir / "server.log").read_text(errors="replace")
                except OSError:
                    continue
                for m in _LEADER.finditer(text):
                    if int(m.group(1)) == node_id and (best is None or int(m.group(2)) > best[0]):
                        best = (int(m.group(2)), node_id)
            if best is not None:
                return best[1]
            if time.monotonic() > deadline:
                raise RuntimeError("no node of the cluster says it leads the controller quorum")
            time.sleep(0.5)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM every node at once (one by one, the last ones wait for a quorum that is gone),
        SIGKILL what is left after `timeout`."""
        procs = [n.proc for n in self.nodes.values() if n.proc is not None and n.proc.poll() is None]
        for proc in procs:
            os.kill(proc.pid, signal.SIGCONT)  # a paused node cannot stop
            proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for node in self.nodes.values():
            node.proc = None

    def __enter__(self) -> LocalKafkaCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- a detached cluster managed through a state dir (`kvidx kafka up --brokers N`) ---------------


def nodes_in(data: Path) -> int:
    """Nodes of the cluster whose data is in `data` (0: none there)."""
    return sum(1 for _ in data.glob("node*/kraft-logs/meta.properties"))


def running_pids(st: dict) -> list[int]:
    """The pids of the state's nodes that still run (checked as Kafka brokers on their own data)."""
    from kvidx.kafka.local import _is_broker_pid

    return [n["pid"] for n in st.get("nodes", []) if isinstance(n.get("pid"), int)
            and _is_broker_pid(n["pid"], Path(n["data_dir"]) / "server.properties")]


def up_cluster(data: Path, size: int, st: dict | None, log: Log) -> dict:
    """Start the cluster on `data` (formatting it the first time), on its previous ports if all are
    free (else on new ones, said in one line), detached; returns the state to record."""
    from kvidx.kafka.local import kafka_version, port_free

    old = [n["port"] for n in (st or {}).get("nodes", [])] + \
        [n["controller_port"] for n in (st or {}).get("nodes", [])]
    ports = old if len(old) == 2 * size and all(port_free(p) for p in old) else None
    if old and ports is None:
        log("the previous ports are not all free: the cluster moves to new ones (clients need the new "
            "KAFKA_BOOTSTRAP_SERVERS)")
    cluster = LocalKafkaCluster(size, log=log)
    bootstrap = cluster.start(data, ports)
    nodes = [{"node_id": i, "pid": n.pid, "port": n.port, "controller_port": n.controller_port,
              "data_dir": str(n.data_dir)} for i, n in cluster.nodes.items()]
    for n in cluster.nodes.values():
        n.detach()
    return {"brokers": size, "bootstrap": bootstrap, "nodes": nodes, "pid": None, "data_dir": str(data),
            "log": str(data / "node1" / "server.log"), "version": kafka_version(), "started_at": time.time()}


def stop_cluster(st: dict, log: Log, timeout: float = 20.0) -> bool:
    """SIGTERM every running node at once, SIGKILL what is left after `timeout`; True if any ran."""
    from kvidx.kafka.local import _pid_alive

    pids = running_pids(st)
    for pid in pids:
        log(f"stopping pid {pid} ...")
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(_pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids:
        if _pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    return bool(pids)

