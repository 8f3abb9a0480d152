"""Waiting until Kafka acknowledged what a command produced: no command reports success for events
the cluster did not take.

A producer's `flush(t)` returns how many messages are still waiting after `t` seconds; a process that
exits then loses them, and a summary that counted only the delivery callbacks' errors said 0. Here
the wait goes on through a leader election or a controller failover (librdkafka keeps retrying the
messages) up to a deadline, with a line every few seconds, and what is still waiting then is
reported as not delivered.
"""

from __future__ import annotations

import logging
import time

DELIVERY_DEADLINE_S = 120.0  # a controller failover takes seconds, a leader's broker session 9-18 s
PROGRESS_EVERY_S = 5.0

log = logging.getLogger("kvidx.kafka")


class NotDelivered(RuntimeError):
    """Messages Kafka did not acknowledge by the deadline (the commands print it in one line, exit 1)."""


def flush_until(producer, deadline_s: float = DELIVERY_DEADLINE_S, what: str = "messages") -> int:
    """Flush until every message handed to `producer` is acknowledged or refused, or `deadline_s`
    passed; returns how many are still waiting (0: all answered; refusals are the callbacks')."""
    t0 = time.monotonic()
    waiting = producer.flush(min(PROGRESS_EVERY_S, deadline_s))
    while waiting and time.monotonic() - t0 < deadline_s:
        log.warning("event=kafka_delivery_waiting what=%r waiting=%d for_s=%.0f deadline_s=%.0f", what,
                    waiting, time.monotonic() - t0, deadline_s)
        waiting = producer.flush(min(PROGRESS_EVERY_S, max(0.1, deadline_s - (time.monotonic() - t0))))
    return waiting


def require_delivered(producer, what: str, deadline_s: float = DELIVERY_DEADLINE_S, refused: int = 0,
                      bootstrap: str = "") -> None:
    """`flush_until`, then raise NotDelivered naming how many of `what` were not delivered (still
    waiting, plus `refused`: those the delivery callbacks saw fail)."""
    waiting = flush_until(producer, deadline_s, what)
    if waiting or refused:
        where = f" at {bootstrap}" if bootstrap else ""
        raise NotDelivered(f"{waiting + refused} {what} not delivered to Kafka{where} "
                           f"({waiting} unacknowledged after {deadline_s:.0f} s, {refused} refused)")
