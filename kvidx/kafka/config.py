"""Kafka client settings shared by every client of the index (TLS, SASL, timeouts ...).

`KVIDX_KAFKA_CONFIG` holds a JSON object of librdkafka settings, e.g.
`{"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "kvidx",
"sasl.password": "...", "ssl.ca.location": "/etc/kafka/ca.pem"}`; `--kafka-config FILE` on the
commands reads the same object from a file. The faust worker gets the same security settings
translated to its own (aiokafka) credentials.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

ENV = "KVIDX_KAFKA_CONFIG"
# librdkafka's own log lines go through Python logging (structured, filterable), not raw stderr
_CLIENT_LOG = logging.getLogger("kvidx.kafka.client")


class _BenignAtDebug(logging.Filter):
    """librdkafka lines that are part of a normal start, logged by it as warnings, become DEBUG.

    An idempotent producer's first request to a broker asks for a producer id; a broker that has just
    started (or moved its transaction coordinator) answers "Coordinator load in progress" and the
    producer retries by itself: "GETPID ... Failed to acquire idempotence PID ...: retrying". If the
    broker never answers, the produced messages time out and the sink logs each delivery failure as an
    error, so nothing real is hidden. Every other line keeps librdkafka's level."""

    def filter(self, record: logging.LogRecord) -> bool:
        # confluent-kafka logs as logger.log(level, "%s [%s] %s", facility, client name, message)
        args = record.args if isinstance(record.args, tuple) else ()
        if record.levelno > logging.DEBUG and len(args) == 3 and (
                (args[0] == "GETPID" and str(args[2]).rstrip().endswith("retrying"))
                # a hung broker times out the version request and librdkafka guesses an ancient
                # broker; the relay's own broker_not_answering line says what is really wrong
                or "probably due to broker version < 0.10" in str(args[2])):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return _CLIENT_LOG.isEnabledFor(logging.DEBUG)  # its level was checked as a warning's
        return True


_CLIENT_LOG.addFilter(_BenignAtDebug())


def client_config() -> dict[str, Any]:
    """The settings every confluent-kafka client of the index starts from."""
    return {"logger": _CLIENT_LOG, **_user_config()}


def _user_config() -> dict[str, Any]:
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return {}
    try:
        conf = json.loads(raw)
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: ${ENV} is not a JSON object: {e}") from None
    if not isinstance(conf, dict):
        raise SystemExit(f"error: ${ENV} must be a JSON object of librdkafka settings")
    return conf


def load_file(path: str) -> None:
    """`--kafka-config FILE`: make the file's settings the process's client settings."""
    with open(path) as f:
        os.environ[ENV] = json.dumps(json.load(f))


def faust_credentials(conf: dict[str, Any]):
    """The faust/aiokafka equivalent of the librdkafka security settings (None: plaintext)."""
    conf = {k: v for k, v in conf.items() if k != "logger"}
    proto = str(conf.get("security.protocol", "PLAINTEXT")).upper()
    if proto == "PLAINTEXT":
        return None
    import ssl

    import faust

    ctx = None
    if proto in ("SSL", "SASL_SSL"):
        ctx = ssl.create_default_context(cafile=conf.get("ssl.ca.location"))
        if conf.get("ssl.certificate.location"):
            ctx.load_cert_chain(conf["ssl.certificate.location"], conf.get("ssl.key.location"),
                                conf.get("ssl.key.password"))
    if proto == "SSL":
        return faust.SSLCredentials(ctx)
    mechanism = str(conf.get("sasl.mechanism", "PLAIN")).upper()
    return faust.SASLCredentials(username=conf.get("sasl.username"), password=conf.get("sasl.password"),
                                 mechanism=mechanism, ssl_context=ctx)
