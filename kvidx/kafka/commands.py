"""`kvidx kafka fetch|up|down|status|reset`: the parser only. The launcher (kvidx.kafka.local, ~900
lines) is imported when one of these commands runs, never by the production commands (relay, worker,
serve), which talk to an existing cluster."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path


def _command(name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from kvidx.kafka import local

        return getattr(local, name)(args)

    return run


def add_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``kafka {fetch,up,down,status,reset,topics}``. Each leaf sets ``func(args) -> int`` (exit
    code)."""
    p = subparsers.add_parser(
        "kafka",
        help="run a local single-node Kafka broker (no Docker); show the topics' replication",
        description="Run a real single-node Kafka broker (KRaft) on 127.0.0.1 with java; the jars "
        "are fetched once with Maven into ~/.cache/kvidx (override: KVIDX_KAFKA_HOME). Its topics "
        "and messages survive `down`, crashes and reboots; only `reset` deletes them.",
    )
    sub = p.add_subparsers(dest="kafka_cmd", metavar="{fetch,up,down,status,reset,topics}", required=True)
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
    sp.add_argument("--brokers", type=_brokers, default=None, metavar="N",
                    help="a cluster of N KRaft nodes (each a broker and a voter of the controller quorum, "
                    "its own ports and data dir; topics get 3 replicas and min.insync.replicas 2 by "
                    "default): the way production runs Kafka (default: as many as the state dir holds, "
                    "1 for a new one)")
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
    sp = sub.add_parser(
        "topics",
        help="show each kvidx topic's replication against what the deployment asks",
        description="List the deployment's topics on any cluster (not only a local one): partitions, "
        "replicas, replicas in sync now and min.insync.replicas, against the replication kvidx creates "
        "topics with ($KVIDX_TOPIC_REPLICATION / --replication-factor, else the cluster's default; "
        "never 1 on 2+ brokers). Exit 0 if every topic has what is asked, 1 if one has fewer "
        "(Kafka does not add replicas to an existing topic: kafka-reassign-partitions does).",
    )
    sp.add_argument("--bootstrap", help="Kafka bootstrap servers (default: $KAFKA_BOOTSTRAP_SERVERS)")
    sp.add_argument("--topic-prefix", default=os.environ.get("KVIDX_TOPIC_PREFIX", ""),
                    help="prefix of the deployment's topic names")
    sp.add_argument("--replication-factor", type=int, default=None, metavar="N",
                    help="the replicas asked (default: $KVIDX_TOPIC_REPLICATION, else the cluster's)")
    sp.add_argument("--min-insync-replicas", type=int, default=None, metavar="N",
                    help="the min.insync.replicas asked (default: $KVIDX_MIN_INSYNC_REPLICAS, else the "
                    "cluster's; at least 2 with 3+ replicas)")
    sp.set_defaults(func=_show_topics)
    return p


def _brokers(raw: str) -> int:
    if not raw.isdigit() or not 1 <= int(raw) <= 9:
        raise argparse.ArgumentTypeError(f"{raw!r}: give a broker count from 1 to 9")
    return int(raw)


def _show_topics(args: argparse.Namespace) -> int:
    from kvidx.kafka.reach import require_broker, resolve_bootstrap
    from kvidx.kafka.topics import topic_report

    bootstrap = resolve_bootstrap(args.bootstrap)
    require_broker(bootstrap)
    repl, rows = topic_report(bootstrap, args.topic_prefix)
    isr = repl.min_insync if repl.min_insync is not None else "the cluster's"
    print(f"cluster: {repl.brokers} broker(s); asked: {repl.factor} replicas, min.insync.replicas {isr}")
    print(f"{'topic':<40} {'partitions':>10} {'replicas':>8} {'in sync':>7} {'min.isr':>7}  status")
    for r in rows:
        status = {True: "ok", False: f"UNDER-REPLICATED (asked {r['asked']})", None: "missing"}[r["ok"]]
        print(f"{r['topic']:<40} {r['partitions']:>10} {r['replicas']:>8} {r['in_sync']:>7} "
              f"{r['min_insync'] if r['min_insync'] is not None else '-':>7}  {status}")
    return 1 if any(r["ok"] is False for r in rows) else 0
