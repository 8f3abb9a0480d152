"""A follower's thread: a daemon loop with a stop event, whose failure is kept (for /healthz and the
caller) and logged once, instead of dying silently with its thread."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("kvidx.kafka")


class Background:
    thread_name = "kvidx-background"

    def __init__(self) -> None:
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._guarded, name=self.thread_name, daemon=True)
        self.error: BaseException | None = None

    def start(self):
        self.thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.stop_event.set()
        self.thread.join(timeout_s)

    def run(self) -> None:
        raise NotImplementedError

    def failed(self, e: BaseException) -> None:
        """How a failure is told (a traceback by default: it is a bug or an outage to look into)."""
        log.exception("event=%s_failed", self.thread_name)

    def _guarded(self) -> None:
        try:
            self.run()
        except BaseException as e:  # noqa: BLE001 - kept and told, never lost with the thread
            self.error = e
            self.failed(e)
