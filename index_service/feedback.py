"""The audit's caps in a service instance: the credit factors of the compacted feedback topic, followed
from its beginning, applied to every lookup answer (kvidx.index.answer's `feedback`): a replica whose
engine reuses less than the index credits has its resumable tokens multiplied by its factor
(kvidx/ops/feedback.py computes and publishes them)."""

from __future__ import annotations

import logging
import threading
import time

import msgspec
from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from kvidx.kafka.background import Background
from kvidx.kafka.log import consumer, partitions, topic_prefix
from kvidx.kafka.topics import create_topics
from schemas.answers import ReplicaAnswer
from schemas.feedback import FEEDBACK_TOPIC, CreditFactor

log = logging.getLogger("kvidx.service.feedback")


def feedback_topic(names: dict[str, str]) -> str:
    return topic_prefix(names) + FEEDBACK_TOPIC


def ensure_feedback_topic(bootstrap: str, names: dict[str, str]) -> str:
    t = feedback_topic(names)
    create_topics(bootstrap, [], partitions=1, compacted=[t])
    return t


class FeedbackTable:
    """(model, replica, dp_rank, prefix) -> CreditFactor; applied to lookup answers by the service."""

    def __init__(self, clock=time.time):
        self.factors: dict[tuple[str, str, int, int], CreditFactor] = {}
        self.by_model: dict[str, dict[tuple[str, int, int], CreditFactor]] = {}
        self.clock = clock
        self.lock = threading.Lock()
        self.capped_answers = 0

    def put(self, f: CreditFactor) -> None:
        with self.lock:
            self.factors[f.key] = f
            self.by_model.setdefault(f.model, {})[f.key[1:]] = f

    def remove(self, key: tuple) -> None:
        key = (*key, 0) if len(key) == 3 else tuple(key)  # keys written before prefixes existed
        with self.lock:
            self.factors.pop(key, None)
            self.by_model.get(key[0], {}).pop(key[1:], None)

    def apply(self, model: str, replicas: list[ReplicaAnswer], block_size: int, now: float | None = None,
              prefix: int | None = None) -> list[ReplicaAnswer]:
        """Cap the resumable tokens of replicas with a factor < 1 (in place); re-sorted if any was."""
        table = self.by_model.get(model)
        if not table:
            return replicas
        now = self.clock() if now is None else now
        capped = False
        for r in replicas:
            # the prompt's prefix on that replica, where there is evidence for it, else the replica's
            f = table.get((r.replica, r.dp_rank, prefix)) if prefix else None
            if f is None or f.expires_at <= now:
                f = table.get((r.replica, r.dp_rank, 0))
            if f is None or f.factor >= 1.0 or f.expires_at <= now:
                continue
            orig = r.resumable_tokens
            new = int(orig * f.factor) // block_size * block_size
            if new < orig:
                r.index_resumable_tokens = orig
                r.resumable_tokens = new
                r.feedback_capped = True
                r.credit_factor = f.factor
                capped = True
        if capped:
            self.capped_answers += 1
            replicas.sort(key=lambda a: -a.resumable_tokens)
        return replicas


class FeedbackFollower(FeedbackTable, Background):
    """A FeedbackTable kept current from the compacted feedback topic (read from its beginning)."""

    thread_name = "kvidx-feedback"

    def __init__(self, bootstrap: str, topic: str):
        FeedbackTable.__init__(self)
        Background.__init__(self)
        self.bootstrap = bootstrap
        self.topic = topic
        self.applied = 0

    def run(self) -> None:
        # a waiting fetch returns as soon as a report arrives: the long wait only saves idle CPU
        c = consumer(self.bootstrap, "feedback", **{"fetch.wait.max.ms": 500})
        try:
            parts = partitions(c, self.topic, timeout_s=60)
            c.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in parts])
            while not self.stop_event.is_set():
                for m in c.consume(500, 0.2):
                    if m.error():
                        continue
                    if m.value() is None:
                        try:
                            self.remove(tuple(msgspec.msgpack.decode(m.key())))
                        except (msgspec.DecodeError, TypeError):
                            pass
                        continue
                    try:
                        self.put(msgspec.msgpack.decode(m.value(), type=CreditFactor))
                        self.applied += 1
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        log.warning("event=feedback_undecodable offset=%d", m.offset())
        finally:
            c.close()
