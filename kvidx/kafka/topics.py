"""Creating the index's topics with the right settings (idempotent)."""

from __future__ import annotations

import os
from collections.abc import Iterable

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


def create_topics(
    bootstrap: str,
    names: Iterable[str],
    partitions: int = 4,
    compacted: Iterable[str] = (),
    timeout: float = 30.0,
    retention_ms: int | None = None,
) -> None:
    """Create topics (replication factor 1), waiting for completion; existing topics are fine.

    Names in ``compacted`` get ``cleanup.policy=compact`` (they are created even if not in ``names``).
    """
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    compacted = set(compacted)
    wanted = list(dict.fromkeys([*names, *sorted(compacted)]))
    if not wanted:
        return
    admin = AdminClient({**client_config(), "bootstrap.servers": bootstrap})
    new = [
        NewTopic(
            n,
            num_partitions=partitions,
            replication_factor=1,
            config={"cleanup.policy": "compact"} if n in compacted
            else ({"retention.ms": str(retention_ms)} if retention_ms else {}),
        )
        for n in wanted
    ]
    futures = admin.create_topics(new, operation_timeout=timeout, request_timeout=timeout)
    for name, fut in futures.items():
        try:
            fut.result(timeout=timeout)
        except KafkaException as e:
            if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise RuntimeError(f"creating topic {name!r} failed: {e}") from e


def topic_partitions() -> int:
    """Partitions of the topics this deployment creates: $KVIDX_TOPIC_PARTITIONS, else 4. A model's
    replica groups spread over distinct partitions up to this many (docs/scaling.md)."""
    raw = os.environ.get("KVIDX_TOPIC_PARTITIONS", "4")
    if not raw.isdigit() or int(raw) < 1:
        raise SystemExit(f"error: KVIDX_TOPIC_PARTITIONS={raw!r}: give a positive partition count")
    return int(raw)


def ensure_topics(bootstrap: str, names: dict[str, str], partitions: int | None = None) -> None:
    """The topics of one deployment (schemas.events.topic_names): events, routes and dead letters
    kept for days, the snapshot topic compacted, the control topic with one partition (one order),
    engine usage reports (the audit's other half) kept as long as the routes. Existing topics keep
    their partitions; new ones get `partitions` (default: topic_partitions())."""
    partitions = partitions or topic_partitions()
    retained = [names["events"], names["dead_letters"], names["routes"]]
    retained += [names[k] for k in ("usage", "hints") if k in names]
    create_topics(bootstrap, retained,
                  partitions=partitions, compacted=[names["snapshots"]], retention_ms=EVENTS_RETENTION_MS)
    create_topics(bootstrap, [names["control"]], partitions=1)
    if "registrations" in names:  # one partition: one order of registrations and removals
        create_topics(bootstrap, [], partitions=1, compacted=[names["registrations"]])
    if "instances" in names:  # one partition: every instance reads all announcements
        create_topics(bootstrap, [], partitions=1, compacted=[names["instances"]])
