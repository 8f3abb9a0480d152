"""Tests that need a real Kafka broker (or its toolchain: java, the Kafka jars). Every test collected
under this folder is marked `kafka`, so `pytest -m "not kafka and not slow and not load"` runs
exactly the tests that need neither; the broker fixtures live here, out of the unit tests' reach."""

import uuid

import pytest

from kvidx.kafka.topics import ensure_topics
from tests.integration.kafka_broker import kafka_bootstrap_session


def pytest_itemcollected(item):
    # called through this folder's hooks only (node.ihook): every item under tests/integration/
    item.add_marker(pytest.mark.kafka)


@pytest.fixture(scope="session")
def kafka_bootstrap():
    """A real broker: $KAFKA_BOOTSTRAP_SERVERS, else testcontainers (Docker), else a local KRaft
    broker from Kafka's own jars."""
    yield from kafka_bootstrap_session()


@pytest.fixture
def topics(kafka_bootstrap):
    """Fresh topic names for one test (a unique prefix), created on the broker."""
    from schemas.events import topic_names

    prefix = f"t{uuid.uuid4().hex[:8]}."
    names = topic_names(prefix)
    ensure_topics(kafka_bootstrap, names, partitions=4)
    names["prefix"] = prefix
    return names
