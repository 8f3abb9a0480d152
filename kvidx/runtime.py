"""What every process's start-up shares: how shards are made from the command line, a SIGTERM before
the process has started its loop, whether a port is taken."""

from __future__ import annotations

import signal


def shard_settings(args):
    """How shards are made, for every command that folds events: --config, with --index-block-size for
    the models it leaves out and --unreported-eviction-kinds over its own."""
    from kvidx.config import ShardSettings, load_config

    return ShardSettings(load_config(getattr(args, "config", None)), args.index_block_size, {},
                         tuple(args.unreported_eviction_kinds) or None)


def stop_on_sigterm():
    """An Event set by SIGTERM (for the waits before a service has started)."""
    import threading

    ev = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: ev.set())
    return ev


def port_in_use(host: str, port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        except OSError:
            return True
    return False
