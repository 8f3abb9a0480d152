"""Creating the index's topics with the right settings (idempotent)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import Gauge

from kvidx.kafka.config import client_config

EVENTS_RETENTION_MS = 7 * 24 * 3600 * 1000  # the events topic is the history for replay and audit


def partition_for(key: bytes, partitions: int) -> int:
    """The partition the relays' producer puts a key in: librdkafka's default partitioner
    (consistent_random) is CRC-32 of the key modulo the partition count."""
    import zlib

    return zlib.crc32(key) % partitions


def group_partition(model: str, group: int, partitions: int) -> int:
    """The partition of a model's replica group (kvidx.core.groups): group 0's key where the default
    partitioner puts it (the model's name: as without groups), group g the g-th partition after it,
    so that a model's groups spread over distinct partitions (and workers) rather than where their
    keys happen to hash."""
    return (partition_for(model.encode(), partitions) + group) % partitions


REPLICATION_ENV = "KVIDX_TOPIC_REPLICATION"
MIN_INSYNC_ENV = "KVIDX_MIN_INSYNC_REPLICAS"
ADMIN_DEADLINE_S = 120.0  # a controller failover takes seconds; a broker that hangs longer is an outage
ADMIN_RETRY_S = 2.0

log = logging.getLogger("kvidx.kafka")


class KafkaAdminError(RuntimeError):
    """An admin call the cluster did not answer or refused, in one line (the commands print it as
    `error: ...` and exit 1; the service shows it on /healthz)."""


@dataclass(frozen=True)
class Replication:
    """How many copies the topics kvidx creates keep: `factor` replicas of every partition, and
    `min_insync` of them acknowledging every write (None: the cluster's own setting)."""

    factor: int
    min_insync: int | None
    brokers: int


def _env_count(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise SystemExit(f"error: {name}={raw!r}: give a positive count")
    return int(raw)


def _broker_defaults(admin, timeout: float) -> tuple[int, dict[str, str]]:
    """(live brokers, a broker's default.replication.factor and min.insync.replicas): asked of each
    broker in turn for a few seconds, so that one that hangs does not hold the answer up."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import ConfigResource, ResourceType

    md = admin.list_topics(timeout=timeout)
    brokers = sorted(md.brokers)
    wanted = ("default.replication.factor", "min.insync.replicas")
    last: BaseException = TimeoutError("the cluster lists no brokers")
    for b in brokers:
        res = ConfigResource(ResourceType.BROKER, str(b))
        try:
            entries = admin.describe_configs([res], request_timeout=5.0)[res].result(timeout=6.0)
        except (KafkaException, TimeoutError) as e:
            last = e
            continue
        return len(brokers), {k: entries[k].value for k in wanted if k in entries and entries[k].value}
    raise last


def replication(admin, timeout: float = 30.0) -> Replication:
    """What the deployment asks ($KVIDX_TOPIC_REPLICATION, $KVIDX_MIN_INSYNC_REPLICAS, or the commands'
    --replication-factor / --min-insync-replicas), else the cluster's own defaults, read from a broker.
    Never one copy on a multi-broker cluster: a default of 1 there becomes min(3, brokers); with 3+
    copies, at least 2 must acknowledge a write (docs/capacity.md), so `acks=all` means two disks."""
    brokers, defaults = _broker_defaults(admin, timeout)
    asked, asked_isr = _env_count(REPLICATION_ENV), _env_count(MIN_INSYNC_ENV)
    cluster_isr = int(defaults.get("min.insync.replicas", "1"))
    factor = asked or int(defaults.get("default.replication.factor", "1"))
    if asked is None and factor == 1 and brokers > 1:
        factor = min(3, brokers)
    isr = asked_isr
    if isr is None and factor >= 3 and cluster_isr < 2:
        isr = 2
    if isr is not None and isr > factor:
        raise KafkaAdminError(f"min.insync.replicas {isr} is more than the {factor} replicas asked: "
                              "every write would be refused")
    return Replication(factor, isr, brokers)


def _admin_call(what: str, call, deadline_s: float = ADMIN_DEADLINE_S):
    """`call()` until it answers: a controller failover or a hung broker is waited out with one line
    per attempt and a back-off (as the other broker problems are), then one line and exit 1."""
    from confluent_kafka import KafkaException

    from kvidx.kafka.reach import HINT

    t0 = time.monotonic()
    attempt, pause = 0, ADMIN_RETRY_S
    while True:
        attempt += 1
        try:
            return call()
        except KafkaAdminError:
            raise
        except (KafkaException, TimeoutError) as e:  # timed out, no controller, ...
            why = _one_line(e)
            if time.monotonic() - t0 + pause > deadline_s:
                raise KafkaAdminError(f"{what}: the Kafka cluster did not answer in {deadline_s:.0f} s "
                                      f"({why}): {HINT}") from None
            log.warning("event=kafka_admin_retry what=%r attempt=%d retry_in_s=%g reason=%r",
                        what, attempt, pause, why)
            time.sleep(pause)
            pause = min(pause * 2, 15.0)


def _one_line(e: BaseException) -> str:
    err = e.args[0] if e.args else None
    text = err.str() if hasattr(err, "str") else str(e) or f"{type(e).__name__}: no answer in time"
    return " ".join(text.split())[:300]


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    config: dict[str, str]


def _specs(names: Iterable[str], partitions: int, compacted: Iterable[str] = (),
           retention_ms: int | None = None) -> list[TopicSpec]:
    """Names in ``compacted`` get ``cleanup.policy=compact`` (they are made even if not in ``names``);
    the others `retention_ms`, if given."""
    compacted = set(compacted)
    kept = {"retention.ms": str(retention_ms)} if retention_ms else {}
    return [TopicSpec(n, partitions, {"cleanup.policy": "compact"} if n in compacted else dict(kept))
            for n in dict.fromkeys([*names, *sorted(compacted)])]


def create_topics(
    bootstrap: str,
    names: Iterable[str],
    partitions: int = 4,
    compacted: Iterable[str] = (),
    timeout: float = 30.0,
    retention_ms: int | None = None,
    deadline_s: float = ADMIN_DEADLINE_S,
) -> Replication | None:
    """Create topics at the deployment's replication (`replication()`), waiting for completion;
    existing topics are fine (one with fewer replicas than asked is reported). A cluster that does
    not answer is waited out up to `deadline_s` (`_admin_call`)."""
    return make_topics(bootstrap, _specs(names, partitions, compacted, retention_ms), timeout, deadline_s)


def make_topics(bootstrap: str, specs: list[TopicSpec], timeout: float = 30.0,
                deadline_s: float = ADMIN_DEADLINE_S) -> Replication | None:
    if not specs:
        return None
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({**client_config(), "bootstrap.servers": bootstrap})
    repl = _admin_call("reading the cluster's replication defaults", lambda: replication(admin, timeout),
                       deadline_s)
    md = _admin_call("listing the topics", lambda: admin.list_topics(timeout=timeout), deadline_s)
    # only what is missing is created: any live broker answers a metadata request, while a creation
    # goes to one broker, which may be the one that hangs (then a fresh client may ask another)
    missing = [s for s in specs if s.name not in md.topics]
    if missing:
        def create() -> None:
            _create(AdminClient({**client_config(), "bootstrap.servers": bootstrap}), missing, repl,
                    min(timeout, 10.0))

        _admin_call(f"creating topics {', '.join(s.name for s in missing)}", create, deadline_s)
        md = _admin_call("reading the topics' replicas", lambda: admin.list_topics(timeout=timeout),
                         deadline_s)
    for spec in specs:
        report_replicas(spec.name, _replicas(md, spec.name), repl.factor)
    return repl


def _create(admin, specs: list[TopicSpec], repl: Replication, timeout: float) -> None:
    """One CreateTopics round; a topic that exists already counts as made."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import NewTopic

    isr = {} if repl.min_insync is None else {"min.insync.replicas": str(repl.min_insync)}
    new = [NewTopic(s.name, num_partitions=s.partitions, replication_factor=repl.factor,
                    config={**s.config, **isr}) for s in specs]
    futures = admin.create_topics(new, operation_timeout=timeout, request_timeout=timeout)
    for name, fut in futures.items():
        try:
            fut.result(timeout=timeout)
        except KafkaException as e:
            code = e.args[0].code()
            if code == KafkaError.TOPIC_ALREADY_EXISTS:
                continue
            # INVALID_REPLICATION_FACTOR: fewer brokers up than replicas asked, as while one restarts
            # (on a cluster too small for good, each attempt's line says so, and the deadline ends it)
            if e.args[0].retriable() or code in (KafkaError._TIMED_OUT, KafkaError.NOT_CONTROLLER,
                                                 KafkaError.REQUEST_TIMED_OUT,
                                                 KafkaError.INVALID_REPLICATION_FACTOR):
                raise  # _admin_call waits it out
            raise KafkaAdminError(f"creating topic {name!r} failed: {_one_line(e)}") from None


def _replicas(md, topic: str) -> int:
    """The fewest replicas any partition of `topic` has (0: not listed)."""
    t = md.topics.get(topic)
    if t is None or t.error is not None or not t.partitions:
        return 0
    return min(len(p.replicas) for p in t.partitions.values())


TOPIC_REPLICAS = Gauge("kvidx_topic_replicas", "Replicas of each topic this process uses (the fewest of "
                       "any partition), against kvidx_topic_replicas_asked", ["topic"])
TOPIC_REPLICAS_ASKED = Gauge("kvidx_topic_replicas_asked", "Replicas the deployment asks for each topic",
                             ["topic"])


def report_replicas(topic: str, replicas: int, asked: int) -> None:
    """A topic made earlier with fewer replicas than asked: one warning line and the gauges (Kafka
    does not add replicas to an existing topic by itself: `kvidx kafka topics` shows them all)."""
    TOPIC_REPLICAS.labels(topic).set(replicas)
    TOPIC_REPLICAS_ASKED.labels(topic).set(asked)
    if 0 < replicas < asked:
        log.warning("event=topic_under_replicated topic=%s replicas=%d asked=%d hint=%r", topic, replicas,
                    asked, "add replicas with kafka-reassign-partitions; `kvidx kafka topics` lists them")


def topic_partitions() -> int:
    """Partitions of the topics this deployment creates: $KVIDX_TOPIC_PARTITIONS, else 4. A model's
    replica groups spread over distinct partitions up to this many (docs/scaling.md)."""
    raw = os.environ.get("KVIDX_TOPIC_PARTITIONS", "4")
    if not raw.isdigit() or int(raw) < 1:
        raise SystemExit(f"error: KVIDX_TOPIC_PARTITIONS={raw!r}: give a positive partition count")
    return int(raw)


def ensure_topics(bootstrap: str, names: dict[str, str], partitions: int | None = None) -> Replication | None:
    """The topics of one deployment (schemas.events.topic_names): events, routes and dead letters
    kept for days, the snapshot topic compacted, the control topic with one partition (one order),
    engine usage reports (the audit's other half) kept as long as the routes; the registrations and
    instances topics compacted with one partition (one order; every instance reads all). Existing
    topics keep their partitions; new ones get `partitions` (default: topic_partitions())."""
    return make_topics(bootstrap, deployment_topics(names, partitions or topic_partitions()))


def deployment_topics(names: dict[str, str], partitions: int) -> list[TopicSpec]:
    retained = [names["events"], names["dead_letters"], names["routes"]]
    retained += [names[k] for k in ("usage", "hints") if k in names]
    return [*_specs(retained, partitions, [names["snapshots"]], EVENTS_RETENTION_MS),
            *_specs([names["control"]], 1),
            *_specs([], 1, [names[k] for k in ("registrations", "instances") if k in names])]


def topic_report(bootstrap: str, prefix: str = "", timeout: float = 30.0) -> tuple[Replication, list[dict]]:
    """`kvidx kafka topics`: every topic of the deployment (and faust's, named after its app id) with
    its partitions, replicas (the fewest of any partition), replicas in sync now and
    min.insync.replicas, against what the deployment asks (`replication()`)."""
    from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

    from schemas.events import topic_names

    admin = AdminClient({**client_config(), "bootstrap.servers": bootstrap})
    repl = _admin_call("reading the cluster's replication defaults", lambda: replication(admin, timeout))
    md = _admin_call("listing the topics", lambda: admin.list_topics(timeout=timeout))
    ours = set(topic_names(prefix).values())
    names = sorted(n for n in md.topics if n in ours or n.startswith(prefix + "kvidx-worker"))
    isr_asked = repl.min_insync
    configs = {}
    if names:
        res = [ConfigResource(ResourceType.TOPIC, n) for n in names]
        futures = _admin_call("reading the topics' settings",
                              lambda: admin.describe_configs(res, request_timeout=timeout))
        for r, fut in futures.items():
            entries = fut.result(timeout=timeout)
            configs[r.name] = int(entries["min.insync.replicas"].value)
    rows = []
    for n in names:
        parts = md.topics[n].partitions.values()
        replicas = min(len(p.replicas) for p in parts)
        rows.append({"topic": n, "partitions": len(parts), "replicas": replicas,
                     "in_sync": min(len(p.isrs) for p in parts), "min_insync": configs.get(n),
                     "asked": repl.factor,
                     "ok": replicas >= repl.factor and (isr_asked is None or configs.get(n, 0) >= isr_asked)})
    for n in sorted(ours - set(names)):
        rows.append({"topic": n, "partitions": 0, "replicas": 0, "in_sync": 0, "min_insync": None,
                     "asked": repl.factor, "ok": None})
    return repl, rows
