"""Kafka broker for the test session, plus topic helpers.

Used from tests/integration/conftest.py, e.g.::

    from tests.integration.kafka_broker import kafka_bootstrap_session

    @pytest.fixture(scope="session")
    def kafka_bootstrap():
        yield from kafka_bootstrap_session()

Broker choice, first that applies:
1. env ``KAFKA_BOOTSTRAP_SERVERS`` (e.g. from ``kvidx kafka up``): used as is, never stopped;
2. a reachable Docker engine and testcontainers: ``KafkaContainer`` in KRaft mode
   (image from env ``KVIDX_KAFKA_IMAGE``, default confluentinc/cp-kafka:7.6.0);
3. otherwise :class:`kvidx.kafka.local.LocalKafka` (java + jars cached in ~/.cache/kvidx) in a
   temp dir, stopped and deleted afterwards.
Set ``KVIDX_KAFKA_NO_DOCKER=1`` to skip the Docker probe.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

DEFAULT_IMAGE = "confluentinc/cp-kafka:7.6.0"


def docker_available(timeout: float = 5.0) -> bool:
    """True if a Docker engine answers ``docker info`` quickly and testcontainers is importable."""
    if os.environ.get("KVIDX_KAFKA_NO_DOCKER"):
        return False
    try:
        import testcontainers  # noqa: F401
    except ImportError:
        return False
    if not shutil.which("docker"):
        return False
    try:
        res = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return res.returncode == 0 and bool(res.stdout.strip())


def _kafka_container_cls():
    try:
        from testcontainers.community.kafka import KafkaContainer
    except ImportError:  # older testcontainers
        from testcontainers.kafka import KafkaContainer
    return KafkaContainer


def kafka_bootstrap_session() -> Iterator[str]:
    """Generator for a session-scoped fixture: yields a bootstrap string, cleans up after."""
    env = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if env:
        yield env
        return

    if docker_available():
        image = os.environ.get("KVIDX_KAFKA_IMAGE", DEFAULT_IMAGE)
        with _kafka_container_cls()(image).with_kraft() as kafka:
            yield kafka.get_bootstrap_server()
        return

    from kvidx.kafka.local import LocalKafka

    data_dir = tempfile.mkdtemp(prefix="kvidx-kafka-")
    kafka = LocalKafka()
    try:
        bootstrap = kafka.start(data_dir)
        yield bootstrap
    finally:
        kafka.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


from kvidx.kafka.topics import create_topics  # noqa: E402,F401  (re-exported for tests)
