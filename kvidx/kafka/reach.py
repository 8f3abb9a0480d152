"""Is the Kafka cluster there? One answer for every command, in one line, within seconds.

Without this, an unreachable broker showed as a 30 s silence and a bare TimeoutError, or as hundreds
of librdkafka `Connection refused` lines and a KafkaException traceback. One-shot commands call
`require_broker` and exit non-zero; long-running services call `wait_for_broker`, which logs one line
per attempt and keeps trying (a broker that comes back later is the normal case for a service).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time

HINT = ("is the broker running (`kvidx kafka status`)? --bootstrap or $KAFKA_BOOTSTRAP_SERVERS must name "
        "its address")


class BrokerUnreachable(RuntimeError):
    pass


def resolve_bootstrap(given: str | None) -> str:
    """--bootstrap, else $KAFKA_BOOTSTRAP_SERVERS; exits with one line when neither is set."""
    b = given or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if not b:
        sys.exit("error: no Kafka cluster: pass --bootstrap HOST:PORT or set KAFKA_BOOTSTRAP_SERVERS "
                 "(`kvidx kafka up` starts a local broker)")
    return b


def _tcp_reason(bootstrap: str, timeout_s: float) -> str | None:
    """Why no address of `bootstrap` accepts a TCP connection (None: one does)."""
    reasons = []
    for hostport in bootstrap.split(","):
        hostport = hostport.strip().split("://")[-1]
        host, _, port = hostport.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
                return None
        except ValueError:
            reasons.append(f"{hostport!r} is not HOST:PORT")
        except socket.gaierror:
            reasons.append(f"cannot resolve host {host!r}")
        except ConnectionRefusedError:
            reasons.append("connection refused")
        except TimeoutError:
            reasons.append(f"no answer in {timeout_s:g}s")
        except OSError as e:
            reasons.append(e.strerror or str(e))
    return ", ".join(dict.fromkeys(reasons))


def probe(bootstrap: str, timeout_s: float = 5.0) -> str | None:
    """None if a broker at `bootstrap` answers a metadata request within `timeout_s`; else why not."""
    from confluent_kafka.admin import AdminClient

    from kvidx.kafka.config import client_config

    why = _tcp_reason(bootstrap, min(timeout_s, 3.0))
    if why is not None:
        return why
    # the port is open: a Kafka broker must also answer (TLS/SASL settings come from client_config)
    quiet = logging.getLogger("kvidx.kafka.probe")
    quiet.propagate = False
    conf = {**client_config(), "bootstrap.servers": bootstrap, "logger": quiet,
            "socket.timeout.ms": int(timeout_s * 1000)}
    try:
        md = AdminClient(conf).list_topics(timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 - KafkaException: timeout, auth, protocol
        text = str(e.args[0].str() if e.args and hasattr(e.args[0], "str") else e)
        return f"the port is open but no Kafka broker answered in {timeout_s:g}s ({text})"
    return None if md.brokers else "the cluster lists no brokers"


def message(bootstrap: str, why: str) -> str:
    return f"cannot reach Kafka at {bootstrap} ({why}): {HINT}"


def require_broker(bootstrap: str, timeout_s: float = 5.0) -> None:
    """For one-shot commands: return if the broker answers, else exit 1 with one line."""
    why = probe(bootstrap, timeout_s)
    if why is not None:
        sys.exit(f"error: {message(bootstrap, why)}")


def wait_for_broker(bootstrap: str, log: logging.Logger, stop: threading.Event | None = None,
                    retry_s: float = 5.0, on_attempt=None) -> bool:
    """For services: until the broker answers, log one line per attempt and retry every `retry_s`.
    False if `stop` was set first. `on_attempt(why)` is told each failure (e.g. for /healthz)."""
    attempt = 0
    while True:
        attempt += 1
        why = probe(bootstrap, min(retry_s, 5.0))
        if why is None:
            if attempt > 1:
                log.info("event=broker_reachable bootstrap=%s attempts=%d", bootstrap, attempt)
            return True
        if on_attempt is not None:
            on_attempt(why)
        log.error("event=broker_unreachable bootstrap=%s attempt=%d retry_in_s=%g reason=%r hint=%r",
                  bootstrap, attempt, retry_s, why, HINT)
        if stop is not None:
            if stop.wait(retry_s):
                return False
        else:
            time.sleep(retry_s)
