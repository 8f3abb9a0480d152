"""One log line format for every `kvidx` command: `ts=... level=... logger=... key=value ...`."""

from __future__ import annotations

import logging

LOG_FORMAT = "ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"


def configure(level: str) -> None:
    """The process's logging: one stderr handler in LOG_FORMAT (unknown levels: INFO)."""
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=LOG_FORMAT)
    # httpx logs every request at INFO: thousands of lines a second from the demo's and simulate's
    # clients, which hide kvidx's own lines. Its warnings and errors still show.
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("httpx").setLevel(logging.WARNING)


def use_in_faust() -> None:
    """faust's worker (mode.Worker) replaces the root handlers when it starts, with handlers built
    from mode's DEFAULT_FORMATTERS ("[ts] [pid] [LEVEL] ..."): make those formatters LOG_FORMAT, so
    the worker's lines (faust's, aiokafka's and kvidx's own) read like every other command's.
    mode builds its logging configuration from this dict each time (create_logconfig's default)."""
    from mode.utils import logging as mode_logging

    for name in ("default", "colored"):
        mode_logging.DEFAULT_FORMATTERS[name] = {"format": LOG_FORMAT}
