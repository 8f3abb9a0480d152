import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import uvicorn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from kafka_broker import kafka_bootstrap_session  # noqa: E402

from kvidx.kafka.topics import ensure_topics  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"
LLAMA = FIXTURES / "vllm-0.32" / "llama_c4"
GEMMA = FIXTURES / "vllm-0.32" / "gemma2_swa"


def wait_for(cond, timeout: float = 30.0, what: str = "condition") -> None:
    """Poll `cond` until it holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class ServerThread:
    """uvicorn on a free loopback port, in a thread."""

    def __init__(self, app, **config):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", **config))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on port {self.port}")
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


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
