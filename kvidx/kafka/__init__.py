"""Local single-node Kafka broker for development and tests (see kvidx.kafka.local)."""

from kvidx.kafka.local import LocalKafka, add_cli, down, ensure_jars, status, up

__all__ = ["LocalKafka", "add_cli", "down", "ensure_jars", "status", "up"]
