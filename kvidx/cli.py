"""`kvidx`: one command for every part of the pipeline. `kvidx <command> --help` for each. Parsing only:
each command's body is in the package it runs (relays/main.py, streams/main.py, index_service/main.py,
kvidx/shadow.py, kvidx/demo.py, and the tools' own modules)."""

from __future__ import annotations

import argparse
import os
import sys


def _command(module: str, name: str):
    """A command's body, `module.name(args)`, imported only when that command runs: parsing loads no
    process's code (each process assembles itself in its own package)."""

    def run(args) -> int:
        import importlib

        return getattr(importlib.import_module(module), name)(args)

    return run


def _logging(level: str, command: str | None = None) -> None:
    from kvidx import logfmt

    logfmt.configure(level)
    if command == "worker":  # faust sets up logging again when it starts: in the same format
        logfmt.use_in_faust()


def _unchecked_arg(sp) -> None:
    sp.add_argument("--allow-unchecked-engine-version", action="store_true",
                    help="an engine whose releases a conformance kit checks (vLLM): run a release kvidx "
                         "was not checked against, read as the nearest checked one, with a warning at "
                         "start-up (and kvidx_relay_engine_version_unchecked on /metrics); check it "
                         "instead with tests/conformance/run.sh (docs/engines.md)")


def _replication_args(sp) -> None:
    sp.add_argument("--replication-factor", type=_positive, default=None, metavar="N",
                    help="replicas of every topic this command creates (default: "
                         "$KVIDX_TOPIC_REPLICATION, else the cluster's default.replication.factor; "
                         "never 1 on a cluster of 2+ brokers)")
    sp.add_argument("--min-insync-replicas", type=_positive, default=None, metavar="N",
                    help="min.insync.replicas of the topics it creates (default: "
                         "$KVIDX_MIN_INSYNC_REPLICAS, else the cluster's; at least 2 with 3+ replicas)")


def _rate(raw: str) -> float:
    try:
        rate = float(raw)
    except ValueError:
        rate = -1.0
    if not rate >= 0 or rate == float("inf"):
        raise argparse.ArgumentTypeError(f"{raw!r} is not a rate (requests a second, 0 for no limit)")
    return rate


def _positive(raw: str) -> int:
    if not raw.isdigit() or int(raw) < 1:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a positive count")
    return int(raw)


def _common(sp, kafka=True, shards=True):
    """Options every folding or Kafka command shares."""
    if kafka:
        sp.add_argument("--bootstrap", help="Kafka bootstrap servers (default: $KAFKA_BOOTSTRAP_SERVERS)")
        sp.add_argument("--topic-prefix", default=os.environ.get("KVIDX_TOPIC_PREFIX", ""),
                        help="prefix of every topic name (several deployments on one cluster)")
        _replication_args(sp)
    sp.add_argument("--index-block-size", type=int, default=None, metavar="N",
                    help="tokens per canonical index block, for tuning: it must divide every engine's "
                         "block size (SGLang pages may be smaller: partial-block keys credit them to the "
                         "page) (default: the model's in --config, else 16)")
    if shards:
        sp.add_argument("--unreported-eviction-kinds", nargs="*", default=[], metavar="KIND",
                        help="KV-cache group kinds whose evictions engines do not report (e.g. "
                             "mamba): credit relying on them is flagged as an upper bound")


def _add_relay(sub, engine_names) -> None:
    """`kvidx relay`: the options every engine's relay takes, then each engine's own (the registry)."""
    from kvidx import engines
    from kvidx.clihelp import DeprecatedAlias

    r = sub.add_parser("relay", help="relay one engine's KV events to Kafka",
                       description="Subscribe to an engine's KV-cache events (or play a recording), "
                                   "re-hash blocks canonically and publish versioned batches to Kafka.")
    _common(r, shards=False)
    r.add_argument("--engine", default=engines.DEFAULT, choices=engine_names,
                   help="the engine whose events are relayed")
    r.add_argument("--url", help="an engine polled over HTTP: its base URL (trtllm-serve's, whose POST "
                   "/kv_cache_events is polled)")
    # dest block_size: the name the relay code reads; --block-size is its old, deprecated spelling
    r.add_argument("--engine-block-size", dest="block_size", type=int, metavar="N",
                   help="the engine's tokens per block, where its events do not say (TensorRT-LLM's polls)")
    r.add_argument("--block-size", dest="block_size", type=int, action=DeprecatedAlias,
                   new="--engine-block-size")
    r.add_argument("--engine-version", help="the engine's release (checked against the versions the "
                   "adapter was verified with; default: the newest checked)")
    _unchecked_arg(r)
    r.add_argument("--model", required=True, help="model name the events belong to (Kafka key)")
    r.add_argument("--endpoint", help="engine event endpoint, e.g. tcp://127.0.0.1:5557")
    r.add_argument("--replay-endpoint", help="engine replay endpoint, e.g. tcp://127.0.0.1:5558")
    r.add_argument("--bind", action="store_true", help="bind the SUB socket (engine PUB connects)")
    r.add_argument("--replica", help="replica name (default: the endpoint)")
    r.add_argument("--dp-rank", type=int, default=None, help="data-parallel rank of this publisher")
    r.add_argument("--dp-size", type=int, default=1,
                   help="data parallelism: relay every rank's publisher (endpoint port + rank)")
    r.add_argument("--record", help="also append every raw engine message to this frames.jsonl")
    r.add_argument("--play", help="publish a recording (frames.jsonl) instead of a live socket")
    r.add_argument("--deliver-timeout", type=float, default=120.0, metavar="S",
                   help="with --play: how long to wait for Kafka to acknowledge every batch (through a "
                        "leader's or the controller's failover) before exiting 1 with the count not "
                        "delivered")
    r.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on PORT")
    r.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics server")
    r.add_argument("--config", help="deployment configuration (.toml/.json): the model's KV-cache groups "
                   "where its engine's events do not name them; every key: docs/config.md")
    r.add_argument("--resync-blocks-per-s", type=float, default=50_000,
                   help="pace of a mirror replay (asked with `kvidx resync` or SIGUSR1)")
    r.add_argument("--resync-jitter", type=float, default=5.0, metavar="S",
                   help="a replay starts at a random time within S seconds (relays asked together "
                        "do not send together)")
    r.add_argument("--status-interval", type=float, default=30.0, metavar="S",
                   help="log a one-line status (engine messages, batches, last event age, batches "
                        "waiting for Kafka) every S seconds")
    r.set_defaults(func=_command("relays.main", "relay"), engine_options=engines.add_relay_args(r))


def _add_resync(sub) -> None:
    """`kvidx resync`."""
    rs = sub.add_parser("resync", help="ask relays to replay their mirrors (shallowest blocks first)",
                        description="Publish a resync request on the control topic: the matching relays "
                                    "clear their replica in the index and replay their mirror, paced.")
    rs.add_argument("--bootstrap", help="Kafka bootstrap servers (default: $KAFKA_BOOTSTRAP_SERVERS)")
    rs.add_argument("--topic-prefix", default=os.environ.get("KVIDX_TOPIC_PREFIX", ""),
                    help="prefix of every topic name (several deployments on one cluster)")
    rs.add_argument("--model", default="*", help="model, or * for all")
    rs.add_argument("--replica", default="*", help="replica, or * for all of the model")
    rs.add_argument("--reason", default="operator", help="recorded in the relays' logs")
    rs.add_argument("--replica-groups", type=int, default=0, metavar="G",
                    help="re-group a live model: each relay whose replica's group changes among G groups "
                         "clears it in the old group and replays its mirror into the new one (nothing is "
                         "lost: a relay's mirror is all the index knows of its replica); set "
                         "replica_groups = G in --config too, for relays started later (docs/scaling.md)")
    rs.set_defaults(func=_command("relays.main", "resync"))


def _add_worker(sub) -> None:
    """`kvidx worker`."""
    w = sub.add_parser("worker", help="run a stream worker (faust) folding events into RocksDB shards",
                       description="Consume the events topic, fold each model's batches into its shard "
                                   "(RocksDB under --data-dir) and publish compacted shard snapshots, "
                                   "from which lookup services start. Offsets are committed only once a "
                                   "snapshot holds the events, so a crash loses nothing; several workers "
                                   "share the partitions. By default a supervisor restarts the worker "
                                   "when it exits (e.g. the broker was unreachable for too long).")
    _common(w)
    w.add_argument("--data-dir", default="var/worker", help="RocksDB and faust state")
    w.add_argument("--config", help="deployment configuration (.toml or .json), the same file `serve` "
                   "reads: per-model index block size, eviction kinds, pools; every key: docs/config.md")
    w.add_argument("--snapshot-interval", type=float, default=2.0, help="seconds between shard snapshots")
    w.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on PORT")
    w.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics server")
    w.add_argument("--web-port", type=int, default=6066, help="faust's web port on 127.0.0.1 (0: off)")
    w.add_argument("--session-timeout", type=float, default=30.0, metavar="S",
                   help="seconds before a dead worker's partitions move to the others")
    w.add_argument("--no-supervise", action="store_true",
                   help="run faust in this process (default: a supervisor restarts it when it dies)")
    w.set_defaults(func=_command("streams.main", "worker"))


def _add_serve(sub) -> None:
    """`kvidx serve`."""
    s = sub.add_parser("serve", help="run the lookup service (FastAPI), fed from Kafka",
                       description="Serve the lookup API (POST /v1/lookup, /v1/rank, /v1/routes, "
                                   "/v1/usage; GET /healthz, /metrics, /docs). The instance is a read "
                                   "replica: it rebuilds its shards from the workers' snapshot topic, "
                                   "then follows the events topic itself; /healthz answers 503 until the "
                                   "shards are rebuilt. Any number of instances answer alike. Dynamo's "
                                   "indexer API too (POST /register, /unregister, /query; GET /workers, "
                                   "/health, /dump) and Mooncake conductor's msgpack one (the same paths "
                                   "with Content-Type application/msgpack; GET /services, /global_view): "
                                   "a registration starts a relay here for the engine's publisher, "
                                   "publishing to the events topic (docs/routers.md).")
    _common(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8080, help="HTTP port")
    s.add_argument("--instance-name", default=os.environ.get("KVIDX_INSTANCE_NAME"),
                   help="this instance's stable name (e.g. the pod's): it runs the relays of the Dynamo "
                        "registrations it took, again after a restart (default: HOSTNAME:PORT, or "
                        "$KVIDX_INSTANCE_NAME)")
    s.add_argument("--auth-token-file", metavar="FILE",
                   help="require `Authorization: Bearer <token>` (gRPC: `authorization` metadata) on every "
                        "route and RPC but GET /healthz and /metrics, of a token with the route's scope "
                        "(read, write, admin). FILE: lines `name scope[,scope] token`, or one bare token "
                        "granting every scope; read again when it changes (docs/operations.md, Security). "
                        "Or set $KVIDX_API_TOKEN (one token, every scope). Without either every API is open")
    s.add_argument("--lookup-port", type=int, default=None, metavar="PORT",
                   help="also answer Dynamo's POST /query and /query_by_hash, and Mooncake conductor's "
                        "msgpack /query, on this port (same --host) from the compiled core's own threads, "
                        "one per connection, without the GIL: the "
                        "instance answers those from all its cores, on one copy of the index, with the "
                        "same answers, errors and tokens as --port (plain HTTP; not with --tls-cert or "
                        "--groups; docs/scaling.md)")
    s.add_argument("--ops-port", type=int, default=None, metavar="PORT",
                   help="serve GET /healthz and /metrics open on this port (same --host) for probes and "
                        "scrapers; on --port they then need a token of scope read too")
    s.add_argument("--tls-cert", metavar="FILE",
                   help="serve the HTTP API and SGLang's gRPC API over TLS with this certificate (PEM; with "
                        "--tls-key); the instance announces https://. --ops-port stays plain")
    s.add_argument("--tls-key", metavar="FILE", help="the private key of --tls-cert (PEM)")
    s.add_argument("--tls-client-ca", metavar="FILE",
                   help="mTLS: callers (and the other instances) must present a certificate this CA signed; "
                        "the fan-out checks the other instances' against it and presents --tls-cert")
    s.add_argument("--peer-credential", default="peer", metavar="NAME",
                   help="the entry of --auth-token-file whose token this instance sends to the other "
                        "instances (--groups fan-out; needs read, and admin for SGLang's); a single bare "
                        "token is sent as is")
    s.add_argument("--max-tokens", type=int, default=1_000_000, help="largest prompt a lookup accepts")
    s.add_argument("--config", help="deployment configuration (.toml or .json): per-model block size, "
                   "prices, pools, replica groups; every key: docs/config.md")
    s.add_argument("--groups", metavar="G,G...", help="hold only these replica groups of every model "
                   "(models split with replica_groups in --config; default: all): lookups ask the instances "
                   "holding the others (docs/scaling.md)")
    s.add_argument("--url", help="the URL other instances reach this one at (announced on the instances "
                   "topic; default: http://HOST:PORT, this machine's name for a wildcard HOST)")
    s.add_argument("--peer", action="append", default=[], metavar="URL[=G,G]",
                   help="an instance to ask for the groups it holds (default: all), besides those announced "
                        "on the instances topic; repeatable")
    s.add_argument("--lmcache-lookup", metavar="MODEL",
                   help="answer LMCache's controller lookup (POST /lookup {tokens}: what a router asking "
                        "LMCache's standalone controller sends) for MODEL; LMCache instance ids from the "
                        "model's hints.lmcache_instances in --config (default: the replica names)")
    s.add_argument("--sglang-indexer", action="append", default=[], metavar="MODEL=[HOST:]PORT",
                   help="serve SGLang's external KV indexer API (gRPC kv_indexer.v1.KVIndexer, what "
                        "sgl-router's --kv-indexer-endpoint and SGLang's kv-indexer bridges talk) for MODEL "
                        "on this address (HOST defaults to --host); repeatable, one per model")
    s.add_argument("--fanout-timeout-ms", type=float, default=250.0,
                   help="how long a lookup waits for the instances holding other groups; those that do "
                        "not answer in time are named in the answer (missing_groups)")
    s.add_argument("--allow-endpoints", metavar="CIDR|HOST,...",
                   help="the only endpoints Dynamo's and the conductor's /register and SGLang's feed may "
                        "name (the service connects to them, routers route to them): CIDRs and host "
                        "patterns, e.g. 10.0.0.0/8,*.svc.cluster.local; `any` for all (default: "
                        "allow_endpoints in --config, else loopback, the private ranges and localhost; "
                        "host names only where a pattern names them)")
    from index_service.guard import DEFAULT_RATES
    for scope, what in (("write", "routes, usage reports"), ("admin", "register, unregister, dump")):
        s.add_argument(f"--{scope}-rate-limit", type=_rate, default=DEFAULT_RATES[scope], metavar="N",
                       help=f"requests a second each client (a token's name, else an address) may make to "
                            f"the {scope!r} routes ({what}); bursts of 2N; past it: 429 with Retry-After; "
                            "0: no limit (default: %(default)g)")
    s.set_defaults(func=_command("index_service.main", "serve"))


def _add_shadow(sub, engine_names) -> None:
    """`kvidx shadow`."""
    from kvidx import engines

    sh = sub.add_parser("shadow", help="replay a recording and compare credited with reused tokens",
                        description="Replays a recorded engine stream through the relay and fold code and "
                                    "prints how the index's credit agrees with the engine's own "
                                    "cached_tokens for every request of the request log.")
    _common(sh, kafka=False)
    sh.add_argument("--engine", default=engines.DEFAULT, choices=engine_names,
                    help="trtllm reads a recording of polls (events.jsonl); engines that resume inside "
                         "blocks (SGLang pages below the index block, TensorRT-LLM partial reuse) are "
                         "credited to the token with the default index block size")
    sh.add_argument("--engine-version", help="the engine's release (default: the newest checked)")
    _unchecked_arg(sh)
    sh.add_argument("--recording", required=True, help="frames.jsonl")
    sh.add_argument("--requests", required=True, help="requests.jsonl")
    sh.add_argument("--json", action="store_true", help="print one JSON object")
    sh.add_argument("--pending-ttl", type=float, default=0.0, metavar="S",
                    help="record each request as a routing decision (pending credit for S seconds), as "
                         "routers do with POST /v1/routes; 0: the index alone")
    sh.add_argument("--config", help="deployment configuration (.toml/.json): its [pools] credit a shared "
                    "cache's blocks to the replicas reading it (a Mooncake Store pool); docs/config.md")
    sh.set_defaults(func=_command("kvidx.shadow", "main"))


def _add_demo(sub) -> None:
    """`kvidx demo`."""
    d = sub.add_parser("demo", help="run the whole pipeline on this machine",
                       description="Simulated vLLM replicas publish real vLLM-format events over ZMQ; "
                                   "relays, shards and the HTTP service run in process (or over Kafka "
                                   "with --kafka); prints lookups and the shadow agreement.")
    d.add_argument("--replicas", type=int, default=3, help="simulated vLLM replicas")
    d.add_argument("--requests", type=int, default=300, help="requests routed through the index")
    d.add_argument("--kafka", action="store_true", help="go through Kafka (starts a local broker "
                   "unless --bootstrap or $KAFKA_BOOTSTRAP_SERVERS is given)")
    d.add_argument("--bootstrap", help="with --kafka: the Kafka bootstrap servers to use")
    d.add_argument("--port", type=int, default=0, help="HTTP port of the service (0: any free port)")
    d.add_argument("--serve", action="store_true", help="keep serving lookups after the demo")
    d.set_defaults(func=_command("kvidx.demo", "main"))


def build_parser() -> argparse.ArgumentParser:
    from kvidx import engines
    from kvidx.clihelp import add_common_options, finish, version

    engine_names = engines.names()  # every --engine takes its choices from the registry
    p = argparse.ArgumentParser(prog="kvidx", description="A fleet-wide KV-cache index for LLM serving.")
    p.add_argument("--version", action="version", version=f"kvidx {version()}")
    add_common_options(p, top=True)  # and on every subcommand, by finish() below
    sub = p.add_subparsers(dest="command", required=True)

    from kvidx.kafka.commands import add_cli
    from kvidx.ops.audit import add_cli as add_audit_cli
    from kvidx.ops.feedback import add_cli as add_feedback_cli
    from kvidx.ops.replay import add_cli as add_replay_cli
    from kvidx.ready import add_cli as add_wait_ready_cli
    from kvidx.simulate import add_cli as add_simulate_cli
    add_cli(sub)
    add_simulate_cli(sub)
    add_replay_cli(sub)  # replay + checkpoint
    add_audit_cli(sub)
    add_feedback_cli(sub)
    _add_relay(sub, engine_names)
    _add_resync(sub)
    _add_worker(sub)
    _add_serve(sub)
    _add_shadow(sub, engine_names)
    _add_demo(sub)
    add_wait_ready_cli(sub)
    return finish(p)  # one help formatter and the common options on every subcommand


_TIME_OPTIONS = ("--from", "--to", "--until", "--since")


def _relative_times(argv: list[str]) -> list[str]:
    """`--from -1d` as the README writes it: argparse takes a value starting with "-" for an option
    unless it is a number, so a relative time is joined to its option (`--from=-1d`)."""
    from kvidx.kafka.log import is_relative_time

    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in _TIME_OPTIONS and i + 1 < len(argv) and is_relative_time(argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(_relative_times(sys.argv[1:] if argv is None else argv))
    _logging(args.log_level, args.command)
    if args.kafka_config:
        from kvidx.kafka.config import load_file
        load_file(args.kafka_config)
    from kvidx.kafka.topics import MIN_INSYNC_ENV, REPLICATION_ENV, KafkaAdminError

    for env, value in ((REPLICATION_ENV, getattr(args, "replication_factor", None)),
                       (MIN_INSYNC_ENV, getattr(args, "min_insync_replicas", None))):
        if value is not None:
            os.environ[env] = str(value)
    from kvidx.kafka.delivery import NotDelivered

    try:
        return args.func(args) or 0
    except (KafkaAdminError, NotDelivered) as e:  # the cluster did not answer in time: one line
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
