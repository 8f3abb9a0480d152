"""Local single-node Kafka broker for development and tests (see kvidx.kafka.local)."""

from kvidx.kafka.local import (
    KafkaError,
    LocalKafka,
    add_cli,
    default_state_dir,
    down,
    ensure_jars,
    reset,
    status,
    up,
)

__all__ = ["KafkaError", "LocalKafka", "add_cli", "default_state_dir", "down", "ensure_jars", "reset",
           "status", "up"]
