"""A rolling restart of every stream worker and service instance during a simulated run through Kafka
(`kvidx simulate --kafka --replica-groups G --service-instances N --rolling-restart`).

The workers are real `kvidx worker` processes on the run's topics (they fold the groups and write
the snapshots a restarted instance rebuilds from). At evenly spaced points of the run, one process at
a time is restarted, as a Kubernetes rolling update does (maxSurge 1, maxUnavailable 0, readiness on
/healthz):
- a worker: SIGTERM, then a new one on the same data directory (its groups move to the other worker
  meanwhile, and back);
- a service instance: a new one holding the same groups starts, rebuilds from the snapshots and the
  events after them, and takes the routes of the last pending_ttl_s from the routes topic's lookback
  (here: the run's own record of them); only once it is ready does it take lookups, and the old one
  stops.

What it reports: `blind_lookups`, lookups answered by an instance that was not ready or had not
caught up with the events published before the lookup (the Kafka wait timed out), and
`credit_lost_tokens`, the credit on the chosen replica the full reference instance gave and the
partial instances did not. The goal is 0 of each.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from index_service.store import ShardStore

ROOT = Path(__file__).resolve().parent.parent.parent


class RollingRestart:
    def __init__(self, bootstrap: str, topic_prefix: str, workers: int, pending_ttl_s: float,
                 new_instance: Callable[[frozenset[int] | None], tuple[ShardStore, Any]],
                 stack: list[Callable[[], Any]]):
        """`new_instance(groups)`: a started (store, follower) holding `groups`."""
        self.bootstrap = bootstrap
        self.prefix = topic_prefix
        self.pending_ttl_s = pending_ttl_s
        self.new_instance = new_instance
        self.tmp = Path(tempfile.mkdtemp(prefix="kvidx-sim-workers-"))
        self.workers: list[subprocess.Popen | None] = [None] * workers
        for k in range(workers):
            self._start_worker(k)
        stack.append(self.stop)
        self.routes: deque[tuple[float, tuple]] = deque()  # (expires, add_pending args) of recent routes
        self.plan: list[tuple[str, int]] = []  # what to restart next: ("worker" | "instance", index)
        self.restarted = {"worker": 0, "instance": 0}
        self.rebuild_s: list[float] = []  # wall-clock seconds a new instance took to be ready

    # ---- workers ---------------------------------------------------------------------------------
    def _start_worker(self, k: int) -> None:
        log = open(self.tmp / f"worker{k}.log", "a")
        self.workers[k] = subprocess.Popen(
            [sys.executable, "-m", "kvidx.cli", "worker", "--bootstrap", self.bootstrap, "--topic-prefix",
             self.prefix, "--data-dir", str(self.tmp / f"w{k}"), "--snapshot-interval", "0.5",
             "--web-port", "0", "--no-supervise", "--session-timeout", "6"],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)

    def _restart_worker(self, k: int) -> None:
        w = self.workers[k]
        if w is not None and w.poll() is None:
            w.send_signal(signal.SIGTERM)
            try:
                w.wait(60)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        self._start_worker(k)

    # ---- routes (what a new instance reads back from the routes topic) -----------------------------
    def routed(self, now: float, args: tuple) -> None:
        self.routes.append((now + self.pending_ttl_s, args))
        while self.routes and self.routes[0][0] < now:
            self.routes.popleft()

    # ---- the schedule ------------------------------------------------------------------------------
    def schedule(self, instances: int) -> None:
        self.plan = ([("worker", k) for k in range(len(self.workers))]
                     + [("instance", k) for k in range(instances)])

    def due(self, i: int, n: int) -> tuple[str, int] | None:
        """The restart due at request i of n (evenly spaced over the run's middle), if any."""
        done = sum(self.restarted.values())
        if done >= len(self.plan):
            return None
        at = (done + 1) * n // (len(self.plan) + 1)
        return self.plan[done] if i >= at else None

    def restart(self, what: str, k: int, instances: list[ShardStore], followers: dict[int, Any]) -> None:
        """Restart worker k, or instance k (surge: the new one takes over once ready)."""
        self.restarted[what] += 1
        if what == "worker":
            self._restart_worker(k)
            return
        old = instances[k]
        t0 = time.monotonic()
        store, follower = self.new_instance(old.groups)
        self.rebuild_s.append(time.monotonic() - t0)
        for _, args in self.routes:  # the routes topic's lookback
            model, replica = args[0], args[1]
            if store.holds_replica(model, replica):
                with store.lock:
                    shard = store.shard(model)
                shard.add_pending(*args[1:])
        instances[k] = store
        followers.pop(id(old)).stop()

    def stop(self) -> None:
        for w in self.workers:
            if w is not None and w.poll() is None:
                w.terminate()
        for w in self.workers:
            if w is not None:
                try:
                    w.wait(30)
                except subprocess.TimeoutExpired:
                    w.kill()

    def counters(self) -> dict[str, Any]:
        return {"restarted_workers": self.restarted["worker"],
                "restarted_instances": self.restarted["instance"],
                "instance_rebuild_s_max": round(max(self.rebuild_s), 3) if self.rebuild_s else None}
