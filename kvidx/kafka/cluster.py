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

    def start(self, data_dir: str | os.PathLike) -> str:
        data = Path(data_dir).resolve()
        ports = free_ports(2 * self.size)
        broker_ports, controller_ports = ports[:self.size], ports[self.size:]
        voters = ",".join(f"{i + 1}@127.0.0.1:{p}" for i, p in enumerate(controller_ports))
        cluster_id = random_cluster_id()
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
