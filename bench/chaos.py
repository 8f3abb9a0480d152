"""A chaos campaign: the whole pipeline on a local 3-broker KRaft cluster while a seeded fault schedule
kills and hangs its parts, and a checker holds every lookup answer against the engines' true state.

    python bench/chaos.py --brokers 3 --minutes 3 --seed 1 [--json]

What runs (every part a real process, on 127.0.0.1):
- a cluster of `--brokers` Kafka nodes (kvidx.kafka.cluster.LocalKafkaCluster; topics with 3 replicas
  and min.insync.replicas 2 on 3 brokers);
- simulated vLLM 0.32 engines (kvidx.engines.vllm.sim, in this process) of 2 models, publishing real
  KV events over ZMQ, each subscribed by its own `kvidx relay` process;
- 2 `kvidx worker` processes (one consumer group) and 2 `kvidx serve` instances;
- a router loop (this process): lookup at a random instance (the other one if it does not answer),
  route to the replica with the longest prefix, serve the request on that engine, report usage.

Faults, from the seed: `relay_kill`, `worker_kill`, `instance_kill` (kill -9, restarted 1-3 s later),
`leader_kill` (the broker leading a model's events partition, restarted 5-15 s later),
`controller_kill` (the active controller, likewise), `broker_stop` (SIGSTOP of a random broker for
5-60 s, then SIGCONT), `disk_full` (a worker's data dir, its own tmpfs, filled to the last byte for
10-30 s: needs root to mount; left out otherwise) and `double` (two of these at once, at most one of
them a broker), `follower_stall` (every Kafka client thread of a service instance, librdkafka's
`rdk:*` threads, stopped with ptrace for 5-60 s while its HTTP side answers on: its follower hears
nothing and its writes queue, as in a one-sided partition; needs ptrace, left out otherwise).

The checker. The engines are the ground truth: after every request the simulator's cached blocks are
recorded with the time. For every replica in an answer, `cached_tokens` must not exceed what the engine
held at some moment within the lag the answer states (`freshness.last_event_age_ms`, from the sending
of the lookup back to that age, 50 ms of slack): otherwise the answer is `beyond_lag`. An answer is
exact when every replica's credit equals what its engine held at some moment in the last second. A
404 for a model whose replicas the index has known (an instance that lost the model) is a blind
lookup. After the run (load stopped, every fault healed) the engines' final states are compared, for
a sample of the served prompts, with: every live instance, a fresh follower (snapshots + events), the
events topic folded offline (kvidx.ops.replay) and the compacted snapshots alone; every differing
(source, prompt, replica) is an acknowledged event lost (`acked_lost`).

Output: per fault kind its count, recovery time p50/p99 (from the fault until every service instance
has answered 5 times in a row exactly after the fault ended; 0 where no answer in between was
inexact), blind lookups while it lasted; totals; RSS drift of every process in MB per hour (a line
fitted to its samples of the current incarnation, from its 60th second or all of them if it was
restarted late: a short run's figure is mostly warm-up, a JVM's heap filling up to its -Xmx); with
--json the last line is one JSON object (issue 39's interface). Exit 1 on any lost event, answer
beyond its lag or blind lookup, with the seed and schedule printed.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python bench/chaos.py`
    sys.path.insert(0, str(ROOT))

from kvidx import index  # noqa: E402
from kvidx.client import KvidxClient, KvidxError, Retry, UnknownModel  # noqa: E402
from kvidx.core.hashing import prompt_hashes  # noqa: E402
from kvidx.engines.vllm.sim import SimVllmEngine, chain_digests  # noqa: E402
from kvidx.sim.prompts import workload_requests  # noqa: E402

KINDS = ("relay_kill", "worker_kill", "instance_kill", "leader_kill", "controller_kill", "broker_stop",
         "disk_full", "follower_stall", "double")
INJECTED = KINDS
BROKER_KINDS = ("leader_kill", "controller_kill", "broker_stop")
SINGLE = tuple(k for k in KINDS if k != "double")
WORKER_DISK_MB = 256  # each worker's data dir is a tmpfs of this size (disk_full fills it)
MODELS = ("chaos-a", "chaos-b")
ENGINES_PER_MODEL = 2
ENGINE_BLOCK = 32
INDEX_BLOCK = 16
ENGINE_BLOCKS = 48  # small: evictions all the time
EXACT_WINDOW_S = 1.0  # an answer is exact when it equals an engine state of the last second
SLACK_S = 0.05  # the engine's event time vs when this process records the state
STREAK = 5  # exact answers in a row that end a fault's recovery
HISTORY_S = 4 * 3600.0  # engine states kept for the checker: longer than any run's stated lags


def say(msg: str) -> None:
    print(f"[chaos] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- processes -----------------------------------------------------------------------------------
class Proc:
    """One kvidx process (`kvidx.cli` args), restartable after a kill -9; its log appends."""

    def __init__(self, name: str, args: list[str], log: Path) -> None:
        self.name, self.args, self.log = name, args, log
        self.proc: subprocess.Popen | None = None
        self.incarnation = 0
        self.lock = threading.Lock()  # two faults on one process (a kill during a full disk)

    def start(self) -> None:
        """Start it, unless it runs."""
        with self.lock:
            if self.proc is not None and self.proc.poll() is None:
                return
            self._spawn()

    def _spawn(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, "-m", "kvidx.cli", *self.args], cwd=ROOT, env=env,
                                     stdout=open(self.log, "a"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.incarnation += 1

    def kill9(self) -> None:
        with self.lock:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill9()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None


# ---- ground truth --------------------------------------------------------------------------------
class Truth:
    """Every engine's cached blocks after each of its requests, timed, for as long as an answer's
    stated lag can reach back (an answer folded from a restarted relay's replay of the engine's
    buffer states the age of that buffer's events: minutes). A state is the set of the engine's block
    digests (shared with the engine, and with the state before when a request changed nothing)."""

    def __init__(self, engines: dict[str, SimVllmEngine]) -> None:
        self.engines = engines
        # index block hash -> the engine blocks (digests) holding it: one for a block's second half,
        # any number for its first (engine blocks with the same first half and different second ones)
        self.blocks_of: dict[int, set[bytes]] = {}
        self.times: dict[str, list[float]] = {r: [] for r in engines}
        self.states: dict[str, list[frozenset[bytes]]] = {r: [] for r in engines}
        self.forgotten: dict[str, float] = dict.fromkeys(engines, 0.0)  # states before this are gone
        self.lock = threading.Lock()
        for r in engines:
            self._record(r)

    def serve(self, replica: str, prompt: list[int], output: list[int]) -> int:
        e = self.engines[replica]
        kv_len = len(prompt) + max(len(output) - 1, 0)
        tokens = (prompt + output)[:kv_len]
        digests = chain_digests(tokens, ENGINE_BLOCK, e._root)
        ih = prompt_hashes(tokens, INDEX_BLOCK)
        for i, d in enumerate(digests):
            self.blocks_of.setdefault(ih[2 * i], set()).add(d)
            self.blocks_of.setdefault(ih[2 * i + 1], set()).add(d)
        reused = e.serve(prompt, output)
        self._record(replica)
        return reused

    def _record(self, replica: str) -> None:
        e = self.engines[replica]
        with e._lock:
            state = frozenset(e._cached)
        now = time.time()
        with self.lock:
            times, states = self.times[replica], self.states[replica]
            times.append(now)
            states.append(states[-1] if states and states[-1] == state else state)
            if now - times[0] > 2 * HISTORY_S:  # forget what no answer can refer to
                cut = bisect.bisect_left(times, now - HISTORY_S) - 1
                self.forgotten[replica] = times[cut]
                del times[:cut], states[:cut]

    def credits(self, replica: str, hashes: list[int], t0: float, t1: float) -> list[int]:
        """The prefix (tokens) of `hashes` the engine held in each state it was in during [t0, t1]."""
        with self.lock:
            times, states = self.times[replica], self.states[replica]
            lo = max(0, bisect.bisect_right(times, t0) - 1)
            hi = bisect.bisect_right(times, t1)
            window = states[lo:max(hi, lo + 1)]
        blocks = [self.blocks_of.get(h, ()) for h in hashes]
        out = []
        for s in window:
            n = 0
            for ds in blocks:
                if not any(d in s for d in ds):
                    break
                n += 1
            out.append(n * INDEX_BLOCK)
        return out

    def now(self, replica: str, hashes: list[int]) -> int:
        return self.credits(replica, hashes, time.time(), time.time())[-1]


class Answer(NamedTuple):
    t: float  # when it came (a blind one: when the 404 came)
    exact: bool
    blind: bool
    instance: str


# ---- the fault schedule --------------------------------------------------------------------------
@dataclass
class Fault:
    kind: str
    at: float  # seconds after the load started
    targets: list[str] = field(default_factory=list)  # filled when injected for broker faults
    hold_s: float = 0.0  # kill -> restart, or SIGSTOP -> SIGCONT
    parts: list[Fault] = field(default_factory=list)  # a double's two faults
    start: float = 0.0  # wall clock, when injected
    end: float = 0.0  # wall clock, when the last restart / resume was issued
    error: str | None = None
    note: str | None = None

    def describe(self) -> dict:
        d = {"kind": self.kind, "at_s": round(self.at, 1), "hold_s": round(self.hold_s, 1),
             "targets": self.targets}
        if self.parts:
            d["parts"] = [p.describe() for p in self.parts]
        if self.error:
            d["error"] = self.error
        if self.note:
            d["note"] = self.note
        return d


def plan(seed: int, seconds: float, relays: list[str], workers: list[str], instances: list[str],
         gap: tuple[float, float] = (6.0, 12.0), kinds: tuple[str, ...] = INJECTED) -> list[Fault]:
    """The faults of a run, all drawn from the seed; at most one broker down or hung at a time, and
    20 s after a broker fault ends before the next (the restarted broker rejoins the ISR)."""
    rng = random.Random(seed)

    def one(kind: str) -> Fault:
        f = Fault(kind, 0.0)
        if kind == "relay_kill":
            f.targets, f.hold_s = [rng.choice(relays)], rng.uniform(1, 3)
        elif kind == "worker_kill":
            f.targets, f.hold_s = [rng.choice(workers)], rng.uniform(1, 3)
        elif kind == "instance_kill":
            f.targets, f.hold_s = [rng.choice(instances)], rng.uniform(1, 3)
        elif kind in ("leader_kill", "controller_kill"):
            f.targets, f.hold_s = [MODELS[rng.randrange(len(MODELS))]] if kind == "leader_kill" else [], \
                rng.uniform(5, 15)
        elif kind == "broker_stop":
            f.targets, f.hold_s = [f"broker-{rng.randint(1, 3)}"], rng.uniform(5, 60)
        elif kind == "disk_full":
            f.targets, f.hold_s = [rng.choice(workers)], rng.uniform(10, 30)
        elif kind == "follower_stall":
            f.targets, f.hold_s = [rng.choice(instances)], rng.uniform(5, 60)
        return f

    faults: list[Fault] = []
    deck: list[str] = []  # every kind once, in a seeded order, then again: short runs see them all
    t, broker_free = 10.0, 0.0
    while t < seconds - 30:
        if not deck:
            deck = rng.sample(kinds, len(kinds))
        busy = t < broker_free  # a broker is still down or catching up: no broker fault now
        pick = next((k for k in deck if not busy or (k not in BROKER_KINDS and k != "double")), None)
        if pick is None:
            pick = rng.choice(("relay_kill", "worker_kill", "instance_kill"))
        else:
            deck.remove(pick)
        if pick == "double":
            a, b = rng.sample([k for k in SINGLE if k in kinds], 2)
            if a in BROKER_KINDS and b in BROKER_KINDS:
                b = rng.choice(("relay_kill", "worker_kill", "instance_kill"))
            f = Fault("double", t, parts=[one(a), one(b)])
            f.hold_s = max(p.hold_s for p in f.parts)
        else:
            f = one(pick)
            f.at = t
        broker = any(k in BROKER_KINDS for k in [f.kind, *(p.kind for p in f.parts)])
        if broker:
            broker_free = t + f.hold_s + 20
        faults.append(f)
        t += f.hold_s + rng.uniform(*gap) if broker else rng.uniform(*gap)
    return faults


# ---- the campaign --------------------------------------------------------------------------------
class Campaign:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.seed = args.seed
        self.rng = random.Random(args.seed ^ 0x5EED)
        self.tmp = Path(tempfile.mkdtemp(prefix="kvidx-chaos-"))
        self.procs: dict[str, Proc] = {}
        self.disks: dict[str, Path] = {}  # worker -> its tmpfs data dir
        self.injectable: tuple[str, ...] = INJECTED
        self.cluster = None
        self.engines: dict[str, SimVllmEngine] = {}
        self.model_of: dict[str, str] = {}
        self.faults: list[Fault] = []
        self.rss: dict[str, list[tuple[int, float, float]]] = {}  # name -> (incarnation, t, MB)
        self.answers: list[Answer] = []
        self.beyond: list[str] = []
        self.unverifiable = 0  # credits whose stated lag reaches before the checker's history (HISTORY_S)
        self.lookups = 0
        self.unanswered = 0
        self.blind = 0
        self.missing_replica = 0  # answers without a replica of the model (credited 0 for it)
        self.write_errors = 0  # routes and usage reports no instance took
        self.served: dict[str, list[list[int]]] = {m: [] for m in MODELS}
        self.stop_load = threading.Event()
        self.stall_lock = threading.Lock()
        self.stalled: set[str] = set()  # instances whose Kafka threads are stopped now

    # -- setup
    def start(self) -> None:
        from kvidx.kafka.cluster import LocalKafkaCluster
        from kvidx.kafka.topics import ensure_topics
        from schemas.events import topic_names

        say(f"seed {self.seed}; work dir {self.tmp}")
        self.cluster = LocalKafkaCluster(self.args.brokers, log=lambda m: None)
        t0 = time.monotonic()
        self.bootstrap = self.cluster.start(self.tmp / "kafka")
        say(f"{self.args.brokers} brokers at {self.bootstrap} in {time.monotonic() - t0:.0f} s")
        self.prefix = f"chaos{self.seed}."
        self.names = topic_names(self.prefix)
        repl = ensure_topics(self.bootstrap, self.names)
        say(f"topics {self.prefix}*: {repl.factor if repl else '?'} replicas")
        common = ["--bootstrap", self.bootstrap, "--topic-prefix", self.prefix]
        # no --metrics-port for relays and workers: the harness never reads them, and a port picked free
        # here can be taken before the process binds it (a relay once exited at start on EADDRINUSE)
        for model in MODELS:
            for ei in range(ENGINES_PER_MODEL):
                replica = f"{model}-e{ei}"
                e = SimVllmEngine(num_blocks=ENGINE_BLOCKS, block_size=ENGINE_BLOCK,
                                  endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
                self.engines[replica], self.model_of[replica] = e, model
                self.procs[f"relay-{replica}"] = Proc(f"relay-{replica}", [
                    "relay", *common, "--model", model, "--replica", replica, "--endpoint", e.endpoint,
                    "--replay-endpoint", e.replay_endpoint],
                    self.tmp / f"relay-{replica}.log")
        self._mount_disks()
        for i in range(2):
            self.procs[f"worker-{i}"] = Proc(f"worker-{i}", [
                "worker", *common, "--data-dir", str(self.tmp / f"worker-{i}"), "--snapshot-interval", "1",
                "--web-port", "0", "--no-supervise", "--session-timeout", "6"], self.tmp / f"worker-{i}.log")
        self.urls: dict[str, str] = {}
        for i in range(2):
            port = free_port()
            self.urls[f"serve-{i}"] = f"http://127.0.0.1:{port}"
            self.procs[f"serve-{i}"] = Proc(f"serve-{i}", [
                "serve", *common, "--port", str(port), "--instance-name", f"chaos-{i}"],
                self.tmp / f"serve-{i}.log")
        for p in self.procs.values():
            p.start()
        self.truth = Truth(self.engines)
        self.clients = {n: KvidxClient(u, timeout=2.0, retry=Retry(attempts=1)) for n, u in self.urls.items()}
        self.work = {m: workload_requests(self.seed * 101 + mi, 4000, systems=3, sys_len=(64, 160),
                                          user_len=(16, 64)) for mi, m in enumerate(MODELS)}
        self.cursor = dict.fromkeys(MODELS, 0)
        self._warm_up()

    def _warm_up(self, timeout: float = 240.0) -> None:
        """Every engine serves once; wait until both instances answer every replica of each model."""
        time.sleep(1.0)  # the relays' subscriptions reach the publishers
        for replica in self.engines:
            prompt, output = self._next(self.model_of[replica])
            self.truth.serve(replica, prompt, output)
        deadline = time.monotonic() + timeout
        while True:
            for p in self.procs.values():
                if p.proc.poll() is not None:
                    raise RuntimeError(f"{p.name} exited at start: {p.log.read_text()[-2000:]}")
            if all(self._knows_all(c) for c in self.clients.values()):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the instances did not learn every replica in time")
            time.sleep(1.0)
        say("pipeline up: every instance answers every replica")

    def _knows_all(self, client: KvidxClient) -> bool:
        try:
            for model in MODELS:
                got = {a.replica for a in client.lookup(model, token_ids=[1] * 64).replicas}
                if got != {r for r, m in self.model_of.items() if m == model}:
                    return False
            return True
        except KvidxError:
            return False

    def _next(self, model: str) -> tuple[list[int], list[int]]:
        work = self.work[model]
        i = self.cursor[model]
        self.cursor[model] = i + 1
        return work[i % len(work)]

    # -- the router and the checker
    def route_loop(self, seconds: float, faults: threading.Thread) -> None:
        """The load, for `seconds` and on until every fault has ended 20 s ago (it heals under load)."""
        period = 1.0 / self.args.rate
        t0 = time.monotonic()
        n = 0
        next_t = time.monotonic()
        while True:
            if time.monotonic() - t0 >= seconds and not faults.is_alive():
                ends = [f.end for f in self.faults if f.end]
                if not ends or time.time() - max(ends) >= 20:
                    break
            next_t += period
            self._one(n)
            n += 1
            time.sleep(max(0.0, next_t - time.monotonic()))

    def _one(self, n: int) -> None:
        model = MODELS[n % len(MODELS)]
        prompt, output = self._next(model)
        replicas = [r for r, m in self.model_of.items() if m == model]
        hashes = prompt_hashes(prompt, INDEX_BLOCK)
        order = list(self.clients)
        self.rng.shuffle(order)
        answer, t_send, t_recv, blind = None, 0.0, 0.0, False
        used = order[0]  # the instance the router writes its decision to: the one that answered
        for name in order:
            used = name
            t_send = time.time()
            try:
                answer = self.clients[name].lookup(model, token_ids=prompt)
            except UnknownModel:
                blind = True  # the instance answers, and has lost a model it knew
                answer = None
                break
            except KvidxError:
                continue  # down, not ready (503), timed out: the router asks the other one
            t_recv = time.time()
            break
        self.lookups += 1
        if blind:
            self.blind += 1
            self.answers.append(Answer(time.time(), False, True, used))
        elif answer is None:
            self.unanswered += 1
        else:
            self.answers.append(Answer(t_recv, self._check(answer, replicas, hashes, t_send, t_recv), False,
                                       used))
        # route to the longest prefix (a random replica one time in five: the caches churn)
        by = {a.replica: a.cached_tokens for a in answer.replicas} if answer is not None else {}
        best = max(replicas, key=lambda r: (by.get(r, 0), self.rng.random()))
        if self.rng.random() < 0.2:
            best = self.rng.choice(replicas)
        rid = f"chaos-{self.seed}-{n}"
        client = self.clients[used]
        try:
            client.route(rid, model, best, token_ids=prompt, credited_tokens=by.get(best, 0), ttl_s=5)
        except KvidxError:
            self.write_errors += 1
        reused = self.truth.serve(best, prompt, output)
        try:
            client.usage(rid, model, best, len(prompt), cached_tokens=reused)
        except KvidxError:
            self.write_errors += 1
        self.served[model].append(prompt)

    def _check(self, answer, replicas: list[str], hashes: list[int], t_send: float, t_recv: float) -> bool:
        exact = True
        by = {a.replica: a for a in answer.replicas}
        for r in replicas:
            a = by.get(r)
            credit = a.cached_tokens if a is not None else 0
            if a is None:
                self.missing_replica += 1
            if credit and a is not None:
                age = a.freshness.last_event_age_ms
                if age is None:
                    allowed = 0
                else:
                    since = t_send - age / 1000 - SLACK_S
                    if since < self.truth.forgotten[r]:  # the stated lag reaches past the kept states
                        allowed = None
                        self.unverifiable += 1
                    else:
                        allowed = max(self.truth.credits(r, hashes, since, t_recv))
                if allowed is not None and credit > allowed:
                    self.beyond.append(f"t={t_recv:.3f} replica={r} credit={credit} allowed={allowed} "
                                       f"age_ms={age} seq={a.freshness.seq} epoch={a.freshness.epoch}")
            if credit not in self.truth.credits(r, hashes, t_send - EXACT_WINDOW_S, t_recv):
                exact = False
        return exact

    # -- faults
    def fault_loop(self, t0: float) -> None:
        """Each fault at its time, in its own thread (a full disk lasts while other faults come)."""
        running = []
        for f in self.faults:
            wait = t0 + f.at - time.monotonic()
            if self.stop_load.wait(max(0.0, wait)):
                break
            th = threading.Thread(target=self._run_fault, args=(f,), daemon=True, name=f"fault-{f.kind}")
            th.start()
            running.append(th)
        for th in running:
            th.join()

    def _run_fault(self, f: Fault) -> None:
        if f.kind == "double":
            f.start = time.time()
            threads = [threading.Thread(target=self._inject, args=(p,)) for p in f.parts]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            f.end = max(p.end for p in f.parts)
            f.targets = [t for p in f.parts for t in p.targets]
            f.error = "; ".join(p.error for p in f.parts if p.error) or None
            f.note = "; ".join(p.note for p in f.parts if p.note) or None
        else:
            self._inject(f)
        say(f"fault {f.kind} {f.targets} held {f.hold_s:.1f} s" + (f" ({f.error})" if f.error else "")
            + (f" [{f.note}]" if f.note else ""))

    def _inject(self, f: Fault) -> None:
        f.start = time.time()
        try:
            if f.kind in ("relay_kill", "worker_kill", "instance_kill"):
                p = self.procs[self._proc_name(f)]
                p.kill9()
                time.sleep(f.hold_s)
                p.start()
            elif f.kind in ("leader_kill", "controller_kill"):
                node = self._broker_target(f)
                named = f"{f.targets[0]}->broker-{node}" if f.kind == "leader_kill" else f"broker-{node}"
                f.targets = [named]
                self.cluster.kill(node)
                time.sleep(f.hold_s)
                self.cluster.restart(node)
            elif f.kind == "broker_stop":
                node = int(f.targets[0].rsplit("-", 1)[1])
                self.cluster.pause(node)
                time.sleep(f.hold_s)
                self.cluster.resume(node)
            elif f.kind == "disk_full":
                self._disk_full(f)
            elif f.kind == "follower_stall":
                self._follower_stall(f)
        except Exception as e:  # noqa: BLE001 - recorded with the fault, the campaign goes on
            f.error = f"{type(e).__name__}: {e}"
        f.end = time.time()

    def _follower_stall(self, f: Fault) -> None:
        """Stall the instance's Kafka threads; the other instance if that one is stalled already (a
        process has one tracer: two stalls of one instance at once cannot be)."""
        with self.stall_lock:
            free = [n for n in dict.fromkeys([f.targets[0], *self.urls]) if n not in self.stalled]
            if not free:
                f.note = "every instance was stalled already"
                return
            name = free[0]
            self.stalled.add(name)
        try:
            if name != f.targets[0]:
                f.note = f"{f.targets[0]} was stalled already: {name} instead"
                f.targets = [name]
            pid = self.procs[name].pid
            if pid is None:
                f.note = f"{name} was down (another fault): nothing to stall"
            else:
                failed = stall_threads(pid, "rdk:", f.hold_s)
                f.note = "; ".join(n for n in (f.note, failed) if n) or None
        finally:
            with self.stall_lock:
                self.stalled.discard(name)

    def _disk_full(self, f: Fault) -> None:
        """Fill the worker's data dir (its own tmpfs) to the last byte, hold, free it; a worker that
        exited on the full disk is restarted then (it runs unsupervised here)."""
        filler = self.disks[f.targets[0]] / "filler"
        chunk = b"\0" * (1 << 20)
        with open(filler, "wb", buffering=0) as out:
            try:
                while True:
                    out.write(chunk)
            except OSError:
                pass
            try:
                while True:  # the last bytes
                    out.write(b"\0" * 4096)
            except OSError:
                pass
        time.sleep(f.hold_s)
        filler.unlink()
        p = self.procs[f.targets[0]]
        if p.pid is None:
            f.note = f"{p.name} exited on the full disk (code {p.proc.returncode}); restarted"
            p.start()

    def _mount_disks(self) -> None:
        """Each worker's data dir on its own tmpfs (disk_full fills it): root only; else no disk_full."""
        self.disks: dict[str, Path] = {}
        for i in range(2):
            d = self.tmp / f"worker-{i}"
            d.mkdir()
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={WORKER_DISK_MB}m", "tmpfs", str(d)],
                               capture_output=True, text=True)
            if r.returncode != 0:
                say(f"no disk_full: cannot mount a tmpfs ({(r.stderr or r.stdout).strip()[:200]})")
                self._umount_disks()
                return
            self.disks[f"worker-{i}"] = d

    def _umount_disks(self) -> None:
        for d in self.disks.values():
            subprocess.run(["umount", "-l", str(d)], capture_output=True)
        self.disks = {}

    def _proc_name(self, f: Fault) -> str:
        t = f.targets[0]
        return f"relay-{t}" if f.kind == "relay_kill" else t

    def _broker_target(self, f: Fault) -> int:
        if f.kind == "controller_kill":
            return self.cluster.active_controller()
        from kvidx.core.groups import shard_key
        from kvidx.kafka.topics import partition_for
        partition = partition_for(shard_key(f.targets[0], 0).encode(), self._partitions())
        return self.cluster.leader(self.names["events"], partition)

    def _partitions(self) -> int:
        from confluent_kafka.admin import AdminClient
        md = AdminClient({"bootstrap.servers": self.bootstrap}).list_topics(self.names["events"], timeout=10)
        return len(md.topics[self.names["events"]].partitions)

    # -- RSS
    def rss_loop(self, every: float = 5.0) -> None:
        while not self.stop_load.wait(every):
            now = time.time()
            pids = {n: (p.incarnation, p.pid) for n, p in self.procs.items()}
            for node_id, node in self.cluster.nodes.items():
                alive = node.proc is not None and node.proc.poll() is None
                pids[f"broker-{node_id}"] = (id(node.proc), node.proc.pid if alive else None)
            pids["chaos"] = (0, os.getpid())
            for name, (inc, pid) in pids.items():
                mb = _rss_mb(pid) if pid else None
                if mb is not None:
                    self.rss.setdefault(name, []).append((inc, now, mb))

    def rss_drift(self) -> tuple[dict[str, float], dict[str, float]]:
        """MB per hour of each process (a line fitted to the RSS of its longest-lived incarnation, from
        its 60th second: past a JVM's heap warming up to its -Xmx), and the minutes that fit spans: a
        process killed every few minutes has no long life to fit, and its window says so."""
        out, window = {}, {}
        for name, samples in sorted(self.rss.items()):
            lives: dict[int, list[tuple[float, float]]] = {}
            for inc, t, mb in samples:
                lives.setdefault(inc, []).append((t, mb))
            pts = max(lives.values(), key=lambda p: p[-1][0] - p[0][0])
            warm = [(t, mb) for t, mb in pts if t - pts[0][0] >= 60]
            pts = warm if len(warm) >= 3 else pts
            if len(pts) < 3 or pts[-1][0] - pts[0][0] < 10:
                continue
            t, mb = np.array(pts).T
            out[name] = round(float(np.polyfit(t - t[0], mb, 1)[0]) * 3600, 1)
            window[name] = round((t[-1] - t[0]) / 60, 1)
        return out, window

    # -- the final check
    def final_check(self, timeout: float = 150.0) -> dict[str, int]:
        """Differences between the engines' final states and every copy of the index, per source."""
        from index_service.follower import KafkaFollower
        from index_service.store import ShardStore
        from kvidx.kafka.snapshots import read_snapshots
        from kvidx.ops.replay import replay

        sample = {m: _distinct(ps)[-150:] for m, ps in self.served.items()}
        want = {m: [{r: self.truth.now(r, prompt_hashes(p, INDEX_BLOCK)) for r in self._replicas(m)}
                    for p in ps] for m, ps in sample.items()}

        def diffs_http(client: KvidxClient) -> list[str]:
            out = []
            for m, ps in sample.items():
                for p, w in zip(ps, want[m], strict=True):
                    try:
                        got = {a.replica: a.cached_tokens for a in client.lookup(m, token_ids=p).replicas}
                    except KvidxError as e:
                        return [f"{m}: {e}"]
                    out += [f"{m} {r} prompt={len(p)} index={got.get(r, 0)} engine={w[r]}"
                            for r in w if got.get(r, 0) != w[r]]
            return out

        def diffs_shards(shards: dict) -> list[str]:
            out = []
            for m, ps in sample.items():
                shard = shards.get(m)
                if shard is None:
                    return [f"{m}: no shard"]
                for p, w in zip(ps, want[m], strict=True):
                    got = {a.replica: a.cached_tokens
                           for a in index.lookup(shard, prompt_hashes(p, INDEX_BLOCK), len(p), time.time())}
                    out += [f"{m} {r} prompt={len(p)} index={got.get(r, 0)} engine={w[r]}"
                            for r in w if got.get(r, 0) != w[r]]
            return out

        def until_equal(name: str, diffs) -> int:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    d = diffs()
                except Exception as e:  # noqa: BLE001 - a source that cannot be read is all wrong
                    d = [f"{type(e).__name__}: {e}"]
                if not d or time.monotonic() > deadline:
                    break
                time.sleep(3.0)
            if d:
                say(f"final {name}: {len(d)} differences, e.g. " + " | ".join(d[:5]))
            return len(d)

        result = {}
        for name, client in self.clients.items():
            result[f"live-{name}"] = until_equal(f"live-{name}", lambda c=client: diffs_http(c))
        result["snapshots"] = until_equal(
            "snapshots", lambda: diffs_shards(read_snapshots(self.bootstrap, self.names["snapshots"])))
        result["events_fold"] = until_equal("events_fold", lambda: diffs_shards(
            {m: replay(self.bootstrap, self.names, m, until=time.time() + 1, pending=False,
                       use_checkpoints=False, progress=False).shard for m in MODELS}))
        store = ShardStore(INDEX_BLOCK)
        follower = KafkaFollower(store, self.bootstrap, self.names["events"], self.names["snapshots"]).start()
        try:
            deadline = time.monotonic() + timeout
            while not store.ready and follower.error is None and time.monotonic() < deadline:
                time.sleep(0.2)
            result["fresh_follower"] = until_equal("fresh_follower", lambda: diffs_shards(store.shards))
        finally:
            follower.stop()
        return result

    def _replicas(self, model: str) -> list[str]:
        return [r for r, m in self.model_of.items() if m == model]

    # -- the run
    def run(self) -> dict:
        seconds = self.args.minutes * 60
        traced = can_ptrace()
        if not traced:
            say("no follower_stall: this process may not ptrace its children")
        kinds = tuple(k for k in INJECTED if (k != "disk_full" or self.disks)
                      and (k != "follower_stall" or traced))
        self.faults = plan(self.seed, seconds, list(self.engines), ["worker-0", "worker-1"],
                           ["serve-0", "serve-1"], kinds=kinds)
        self.injectable = kinds
        say(f"{len(self.faults)} faults planned over {seconds:.0f} s at {self.args.rate} lookups/s")
        t0 = time.monotonic()
        threads = [threading.Thread(target=self.fault_loop, args=(t0,), daemon=True, name="faults"),
                   threading.Thread(target=self.rss_loop, daemon=True, name="rss")]
        for th in threads:
            th.start()
        self.route_loop(seconds, threads[0])
        self.stop_load.set()
        say(f"load stopped after {self.lookups} lookups; checking the final index")
        final = self.final_check()
        return self.report(final)

    def report(self, final: dict[str, int]) -> dict:
        drift, window = self.rss_drift()
        times = [a.t for a in self.answers]
        kinds: dict[str, list[float]] = {k: [] for k in KINDS}
        blind_by: dict[str, int] = dict.fromkeys(KINDS, 0)
        for f in self.faults:
            if not f.start:
                continue
            rec = _recovery(self.answers, times, f.start, f.end, list(self.clients))
            kinds[f.kind].append(rec)
            lo, hi = bisect.bisect_left(times, f.start), bisect.bisect_right(times, f.end + rec)
            blind_by[f.kind] += sum(1 for a in self.answers[lo:hi] if a.blind)
        out = {
            "faults": {k: len(v) for k, v in kinds.items()},
            "recovery_s": {k: {"p50": round(float(np.percentile(v, 50)), 2),
                               "p99": round(float(np.percentile(v, 99)), 2)} for k, v in kinds.items() if v},
            "acked_lost": sum(final.values()),
            "beyond_lag": len(self.beyond),
            "unverifiable": self.unverifiable,
            "blind_lookups": self.blind,
            "lookups": self.lookups,
            "rss_drift_mb_per_h": drift,
            "rss_window_min": window,
            "seed": self.seed,
            "minutes": self.args.minutes,
            "unanswered": self.unanswered,
            "missing_replica": self.missing_replica,
            "write_errors": self.write_errors,
            "exact_fraction": round(sum(1 for a in self.answers if a.exact) / max(1, len(self.answers)), 4),
            "final_differences": final,
            "blind_by_kind": {k: v for k, v in blind_by.items() if v},
            "injectable": list(self.injectable),
            "notes": [f"{f.kind} at {f.at:.0f} s: {f.note}" for f in self.faults if f.note],
        }
        return out

    def close(self) -> None:
        self.stop_load.set()
        for c in getattr(self, "clients", {}).values():
            c.close()
        for p in self.procs.values():
            p.kill9()
        for e in self.engines.values():
            e.close()
        if self.cluster is not None:
            self.cluster.stop()
        self._umount_disks()
        if not self.args.keep:
            shutil.rmtree(self.tmp, ignore_errors=True)


# ---- stalling some threads of a process (follower_stall) ------------------------------------------
_PTRACE_DETACH, _PTRACE_SEIZE, _PTRACE_INTERRUPT = 17, 0x4206, 0x4207
_WALL, _WNOHANG, _PTRACE_EVENT_STOP = 0x40000000, 1, 128


def _libc():
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    libc.ptrace.restype = ctypes.c_long
    return libc


def can_ptrace() -> bool:
    """Whether this process may stop a child's thread (root, or Yama's ptrace_scope allowing it)."""
    child = subprocess.Popen(["sleep", "5"])
    try:
        return stall_threads(child.pid, "", 0.0) is None
    finally:
        child.kill()
        child.wait()


def stall_threads(pid: int, prefix: str, hold_s: float, tries: int = 200) -> str | None:
    """Stop the threads of `pid` whose name starts with `prefix` for `hold_s`, the rest running on; a
    note if it could not. Each is stopped while blocked in a system call (not in the middle of its own
    code, where it may hold a lock another thread needs). The calling thread is their tracer: it alone
    resumes them, and reaps those that exit meanwhile (a kill -9 of the process during the stall)."""
    import ctypes
    libc = _libc()
    status = ctypes.c_int()

    def tids() -> list[int]:
        out = []
        for t in os.listdir(f"/proc/{pid}/task"):
            try:
                if Path(f"/proc/{pid}/task/{t}/comm").read_text().startswith(prefix):
                    out.append(int(t))
            except OSError:
                continue
        return out

    def in_syscall(tid: int) -> bool:
        try:
            return not Path(f"/proc/{pid}/task/{tid}/syscall").read_text().startswith(("-1", "running"))
        except OSError:
            return True  # gone: holds nothing

    def detach(stopped: dict[int, int]) -> None:
        for tid, sig in stopped.items():
            libc.ptrace(_PTRACE_DETACH, tid, None, ctypes.c_void_p(sig))  # ESRCH: it exited

    try:
        targets = tids()
    except OSError:
        return f"pid {pid} is gone"
    if not targets:
        return f"no thread named {prefix}* in pid {pid}"
    for _ in range(tries):
        stopped: dict[int, int] = {}  # tid -> a signal to hand back when it resumes
        for tid in targets:
            if libc.ptrace(_PTRACE_SEIZE, tid, None, None) != 0:
                err = ctypes.get_errno()
                if err == 3:  # ESRCH: exited since listed
                    continue
                detach(stopped)
                return f"ptrace: {os.strerror(err)}"
            libc.ptrace(_PTRACE_INTERRUPT, tid, None, None)
            libc.waitpid(tid, ctypes.byref(status), _WALL)
            stopped[tid] = 0
        if all(in_syscall(t) for t in stopped):
            break
        detach(stopped)  # one was mid-code: let it run a little and try again
        time.sleep(0.01)
    else:
        return f"no moment with every {prefix}* thread of pid {pid} in a system call"
    end = time.monotonic() + hold_s
    while time.monotonic() < end and stopped:
        time.sleep(0.05)
        for tid in list(stopped):
            got = libc.waitpid(tid, ctypes.byref(status), _WALL | _WNOHANG)
            if got == tid:
                s = status.value
                if (s & 0x7F) != 0x7F:  # exited (the process was killed): reaped, done with it
                    del stopped[tid]
                elif (s >> 16) != _PTRACE_EVENT_STOP and ((s >> 8) & 0xFF) != signal.SIGTRAP:
                    stopped[tid] = (s >> 8) & 0xFF  # a signal for it: delivered when it resumes
            elif got < 0:
                del stopped[tid]
    detach(stopped)
    return None


def _distinct(prompts: list[list[int]]) -> list[list[int]]:
    seen, out = set(), []
    for p in prompts:
        k = tuple(p)
        if k not in seen:
            seen.add(k)
            out.append(p)
    return out


def _recovery(answers: list[Answer], times: list[float], start: float, end: float,
              instances: list[str]) -> float:
    """Seconds from a fault to the moment every instance has given STREAK exact answers in a row after
    the fault ended (its streak's first answer, the latest of them); 0 if every answer from the fault
    until then was exact. A blind answer is an inexact one."""
    i = bisect.bisect_left(times, start)
    j = bisect.bisect_left(times, end)
    dirty = any(not a.exact for a in answers[i:j])
    run = dict.fromkeys(instances, 0)
    began = dict.fromkeys(instances, 0.0)
    for a in answers[j:]:
        if a.exact:
            run[a.instance] += 1
            if run[a.instance] == 1:
                began[a.instance] = a.t
            if all(n >= STREAK for n in run.values()):
                return round(max(0.0, max(began.values()) - start), 2) if dirty else 0.0
        else:
            dirty, run[a.instance] = True, 0
    # not healed by the end of the run: the time to the last answer (the report says which faults)
    return round(answers[-1].t - start, 2) if dirty and answers[i:] else 0.0


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def print_table(r: dict) -> None:
    print(f"{'fault':16} {'count':>5} {'recovery p50 s':>15} {'p99 s':>8} {'blind':>6}")
    for k in KINDS:
        rec = r["recovery_s"].get(k)
        p50, p99 = (f"{rec['p50']:.2f}", f"{rec['p99']:.2f}") if rec else ("-", "-")
        note = "" if k in r["injectable"] else "  (not injected here)"
        print(f"{k:16} {r['faults'][k]:5d} {p50:>15} {p99:>8} {r['blind_by_kind'].get(k, 0):6d}{note}")
    print(f"lookups {r['lookups']} (unanswered {r['unanswered']}, exact {r['exact_fraction']:.2%}, "
          f"a replica missing {r['missing_replica']}; routes/usage not taken {r['write_errors']}); "
          f"acked_lost {r['acked_lost']} {r['final_differences']}; beyond_lag {r['beyond_lag']}; "
          f"blind_lookups {r['blind_lookups']}; unverifiable {r['unverifiable']}")
    for n in r["notes"]:
        print(f"note: {n}")
    print("rss drift MB/h (fitted over minutes): " + ", ".join(
        f"{k} {v:+.1f} ({r['rss_window_min'][k]:g})" for k, v in r["rss_drift_mb_per_h"].items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--brokers", type=int, default=3, help="Kafka nodes (default: 3)")
    ap.add_argument("--minutes", type=float, default=3.0, help="minutes of load and faults (default: 3)")
    ap.add_argument("--seed", type=int, default=1, help="the fault schedule's and workload's seed")
    ap.add_argument("--rate", type=float, default=20.0,
                    help="lookups (and requests) per second (default: 20)")
    ap.add_argument("--json", action="store_true", help="end with the result as one JSON line")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (logs, data) afterwards")
    args = ap.parse_args(argv)
    if args.brokers != 3:
        print("error: the campaign runs on 3 brokers (--brokers 3): its faults assume a quorum of 3",
              file=sys.stderr)
        return 2
    if args.minutes < 1 or args.rate <= 0:
        print("error: --minutes must be at least 1 and --rate positive", file=sys.stderr)
        return 2
    c = Campaign(args)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        c.start()
        r = c.run()
    finally:
        c.close()
    print_table(r)
    bad = r["acked_lost"] or r["beyond_lag"] or r["blind_lookups"]
    if bad:
        print(f"FAILED with seed {c.seed}; replay: python bench/chaos.py --brokers 3 --minutes "
              f"{args.minutes:g} --seed {c.seed} --rate {args.rate:g}")
        print("schedule: " + json.dumps([f.describe() for f in c.faults]))
        for line in c.beyond[:20]:
            print(f"beyond_lag: {line}")
    if args.json:
        print(json.dumps(r))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
