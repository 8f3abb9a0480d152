"""librdkafka's log lines (logger kvidx.kafka.client): the benign idempotence-PID retry of a producer
starting against a fresh broker is DEBUG, every other line keeps librdkafka's level."""

import logging

import pytest

from kvidx.kafka.config import client_config

LOG = client_config()["logger"]
GETPID = ("[thrd:main]: Failed to acquire idempotence PID from broker 127.0.0.1:9092/1: "
          "Broker: Coordinator load in progress: retrying")


def _log(level: int, facility: str, text: str) -> None:
    LOG.log(level, "%s [%s] %s", facility, "rdkafka#producer-1", text)  # confluent-kafka's call


@pytest.mark.parametrize("level", [logging.INFO, logging.DEBUG])
def test_pid_retry_is_debug(caplog, level):
    with caplog.at_level(level, logger=LOG.name):
        _log(logging.WARNING, "GETPID", GETPID)
    got = [r for r in caplog.records if r.name == LOG.name]
    if level == logging.INFO:
        assert got == []
    else:
        assert [r.levelname for r in got] == ["DEBUG"] and "idempotence PID" in got[0].getMessage()


def test_real_problems_keep_their_level(caplog):
    with caplog.at_level(logging.INFO, logger=LOG.name):
        _log(logging.ERROR, "FAIL", "127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed")
        _log(logging.WARNING, "GETPID", "[thrd:main]: Failed to acquire idempotence PID: fatal error")
    assert [r.levelname for r in caplog.records if r.name == LOG.name] == ["ERROR", "WARNING"]


def test_broker_version_guess_of_a_hung_broker_is_debug(caplog):
    # a hung broker times out ApiVersionRequest; the relay's broker_not_answering line says it instead
    with caplog.at_level(logging.INFO, logger=LOG.name):
        _log(logging.ERROR, "FAIL", "127.0.0.1:9092/1: ApiVersionRequest failed: Local: Timed out: "
             "probably due to broker version < 0.10 (see api.version.request configuration)")
    assert [r for r in caplog.records if r.name == LOG.name] == []
