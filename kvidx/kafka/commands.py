"""`kvidx kafka fetch|up|down|status|reset`: the parser only. The launcher (kvidx.kafka.local, ~900
lines) is imported when one of these commands runs, never by the production commands (relay, worker,
serve), which talk to an existing cluster."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def _command(name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from kvidx.kafka import local

        return getattr(local, name)(args)

    return run


def add_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``kafka {fetch,up,down,status,reset}``. Each leaf sets ``func(args) -> int`` (exit code)."""
    p = subparsers.add_parser(
        "kafka",
        help="run a local single-node Kafka broker (no Docker)",
        description="Run a real single-node Kafka broker (KRaft) on 127.0.0.1 with java; the jars "
        "are fetched once with Maven into ~/.cache/kvidx (override: KVIDX_KAFKA_HOME). Its topics "
        "and messages survive `down`, crashes and reboots; only `reset` deletes them.",
    )
    sub = p.add_subparsers(dest="kafka_cmd", metavar="{fetch,up,down,status,reset}", required=True)
    sp = sub.add_parser("fetch", help="fetch the Kafka jars with Maven (once; cached)",
                        description="Download Apache Kafka's jars from Maven Central into the cache "
                        "(~/.cache/kvidx, or $KVIDX_KAFKA_HOME) and print where they are.")
    sp.set_defaults(func=_command("_cmd_fetch"))

    def state_arg(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--state-dir",
            type=Path,
            default=None,
            metavar="DIR",
            help="where kafka.json and the broker's data live (default: $KVIDX_STATE_DIR/kafka if "
            "set, else ${XDG_STATE_HOME:-~/.local/state}/kvidx/kafka)",
        )

    sp = sub.add_parser(
        "up",
        help="start the broker in the background (idempotent; keeps its data)",
        description="Start a detached broker, wait until it serves, print the bootstrap servers and "
        "an export line for KAFKA_BOOTSTRAP_SERVERS. A broker that was stopped or died restarts on "
        "its topics and messages, on its previous ports if they are free.",
    )
    state_arg(sp)
    sp.set_defaults(func=_command("_cmd_up"))
    sp = sub.add_parser(
        "down",
        help="stop the broker (its topics and messages are kept)",
        description="Stop the broker (SIGTERM, SIGKILL after 20 s). Its data stays: the next `up` "
        "finds every topic and message again; `reset` deletes them. Exit 1 if the state dir holds "
        "no broker.",
    )
    state_arg(sp)
    sp.set_defaults(func=_command("_cmd_down"))
    sp = sub.add_parser(
        "status",
        help="show whether the broker runs and serves",
        description="Exit 0 if serving, 1 if not running, 2 if running but not serving.",
    )
    state_arg(sp)
    sp.set_defaults(func=_command("_cmd_status"))
    sp = sub.add_parser(
        "reset",
        help="stop the broker and delete all its topics and messages",
        description="Stop the broker if it runs and delete its data dir, after asking on the "
        "terminal. Without a terminal it refuses (exit 2) unless --yes is given.",
    )
    state_arg(sp)
    sp.add_argument("--yes", action="store_true", help="delete without asking")
    sp.set_defaults(func=_command("_cmd_reset"))
    return p
