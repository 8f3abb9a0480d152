"""`kvidx relay` and `kvidx resync`, assembled: an engine's relay (its adapter from the registry) between
its live socket, HTTP API or recording and the events topic; a resync request on the control topic.
The command line is parsed by kvidx/cli.py; each function here takes its arguments."""

from __future__ import annotations

import json
import logging
import signal
import sys


def relay_options(args):
    """The --engine's relay options from the command line and --config."""
    from kvidx import engines
    from kvidx.config import load_config
    from kvidx.engines import RelayOptions

    adapter = engines.get(args.engine)
    extra = adapter.relay_extra(args) if adapter.relay_extra is not None else {}
    groups = load_config(getattr(args, "config", None)).model(args.model).group_kinds()
    return RelayOptions(engine_version=args.engine_version, group_kinds=groups,
                        engine_block_size=args.block_size, extra=extra,
                        allow_unchecked_version=getattr(args, "allow_unchecked_engine_version", False))


def unchecked_engine_version(args, log: logging.Logger) -> None:
    """--allow-unchecked-engine-version: only for an engine whose releases a conformance kit checks
    (EngineAdapter.unchecked_read_as); an unpinned release runs read as the nearest pinned one, said
    once at start-up (and, for a relay, on /metrics as kvidx_relay_engine_version_unchecked)."""
    if not getattr(args, "allow_unchecked_engine_version", False):
        return
    from kvidx import engines

    adapter = engines.get(args.engine)
    if adapter.unchecked_read_as is None:
        kits = ", ".join(n for n in engines.names() if engines.get(n).unchecked_read_as is not None)
        sys.exit(f"error: --allow-unchecked-engine-version is for --engine {kits} (a release read as the "
                 f"nearest checked one), not {args.engine}")
    version = args.engine_version or adapter.default_version
    read_as = adapter.unchecked_read_as(version)
    if read_as is None:
        return
    log.warning("event=engine_version_unchecked engine=%s version=%s read_as=%s: this kvidx was not "
                "checked against it; run `bash tests/conformance/run.sh %s %s` to check it", args.engine,
                version, read_as, args.engine, version)
    if args.command == "relay":
        from relays.run import UNCHECKED_VERSION
        UNCHECKED_VERSION.labels(args.engine, version, read_as).set(1)


def _relay_factory(args):
    """model, replica, index block size, dp rank -> the relay logic of the engine named by --engine."""
    from kvidx import engines

    adapter, opts = engines.get(args.engine), relay_options(args)
    return lambda m, r, ibs, rank=None: adapter.make_relay(m, r, ibs, rank, opts)


def _check_relay_inputs(args) -> None:
    """Everything a relay can check before it touches the broker, each failure one line."""
    from kvidx import engines
    from relays.inputs import InputError, check_file, check_recording_engine

    adapter = engines.get(args.engine)
    try:
        if args.play:
            check_file(args.play, adapter.recording, "--play")
            if adapter.recording == "frames":
                check_recording_engine(args.play, args.engine)
        elif adapter.live == "http" and not args.url:
            raise InputError(f"--url http://host:port ({args.engine}'s HTTP endpoint) or --play FILE is "
                             "required")
        elif adapter.live == "zmq" and not args.endpoint:
            raise InputError("--endpoint (the engine's KV-events endpoint) or --play FILE is required")
    except InputError as e:
        sys.exit(f"error: {e}")


def relay(args) -> int:
    import threading

    from kvidx import engines
    from kvidx.config import load_config
    from kvidx.kafka.reach import require_broker, resolve_bootstrap, wait_for_broker
    from kvidx.kafka.topics import ensure_topics
    from kvidx.runtime import port_in_use
    from relays.sinks import KafkaSink
    from schemas.events import topic_names

    log = logging.getLogger("kvidx.relay")
    if misplaced := engines.misplaced_relay_args(args, getattr(args, "engine_options", {})):
        sys.exit(f"error: {misplaced}")
    _check_relay_inputs(args)
    config = load_config(args.config)  # the same source the worker and the service read
    if args.index_block_size is None:
        args.index_block_size = config.model(args.model).index_block_size
    adapter = engines.get(args.engine)
    unchecked_engine_version(args, log)
    factory = None
    if adapter.make_relay is not None:
        try:
            factory = _relay_factory(args)
            factory(args.model, "check", args.index_block_size)  # an unknown engine version fails here
        except ValueError as e:
            sys.exit(f"error: {e}")
    bootstrap = resolve_bootstrap(args.bootstrap)
    if args.metrics_port and port_in_use(args.metrics_host, args.metrics_port):  # before the broker's wait
        sys.exit(f"error: --metrics-port {args.metrics_port} is in use (another relay?): pass another port")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if args.play:
        require_broker(bootstrap)  # a one-shot command: exit at once
    else:
        log.info("event=waiting_for_broker bootstrap=%s", bootstrap)
        if not wait_for_broker(bootstrap, log, stop):  # a service: retry, one line per attempt
            return 0
    t = topic_names(args.topic_prefix)
    ensure_topics(bootstrap, t)
    sink = KafkaSink(bootstrap, t["events"], t["dead_letters"], replica_group=config.replica_group)
    groups = config.model(args.model).replica_groups
    who = args.replica or args.endpoint
    if groups > 1 and who:  # where this replica's events go (docs/scaling.md)
        log.info("event=replica_group model=%s replica=%s group=%d of=%d", args.model, who,
                 config.replica_group(args.model, who), groups)
    if args.metrics_port:
        from prometheus_client import start_http_server
        try:
            start_http_server(args.metrics_port, addr=args.metrics_host)
        except OSError as e:  # taken since the check above
            sys.exit(f"error: --metrics-port {args.metrics_port}: {e.strerror}: pass another port")
    if adapter.live == "http":
        return _relay_http(adapter, args, sink, stop)
    if args.play:
        from relays.run import play_recording
        n = play_recording(args.play, args.model, sink, args.index_block_size, args.replica, args.dp_rank,
                           relay_factory=factory)
        return _played(sink, {"played_frames": n}, args.deliver_timeout)
    from relays.process import LiveRelaySettings, run_live

    settings = LiveRelaySettings(
        args.model, args.replica or args.endpoint, args.endpoint, args.replay_endpoint, args.dp_size,
        args.dp_rank, args.bind, adapter.controller_endpoint(args) if adapter.controller_endpoint else None,
        args.record, args.resync_blocks_per_s, args.resync_jitter, args.status_interval)
    return run_live(settings, lambda m, r, rank: factory(m, r, args.index_block_size, rank), sink, bootstrap,
                    t["control"], stop)


def _played(sink, summary: dict, deadline_s: float) -> int:
    """A played recording's summary; exit 1, naming the count, unless Kafka took every message."""
    undelivered = sink.drain(deadline_s)
    print(json.dumps({**summary, "delivered": sink.delivered, "undelivered": undelivered,
                      "delivery_errors": sink.errors}))
    if undelivered:
        print(f"error: {undelivered} of {sink.delivered + undelivered} messages (event batches and dead "
              f"letters) were not delivered to Kafka at {sink.bootstrap} within {deadline_s:g} s: "
              "play the recording again once the cluster is healthy", file=sys.stderr)
        return 1
    return 0


def _relay_http(adapter, args, sink, stop) -> int:
    """An engine relayed by polling its HTTP API (TensorRT-LLM's POST /kv_cache_events), or a
    recording of polls."""
    from relays import poller

    opts = relay_options(args)
    if args.play:
        n = poller.play(adapter, args.play, args.model, sink, args.index_block_size, args.replica, opts)
        return _played(sink, {"played_polls": n}, args.deliver_timeout)
    try:
        poller.run(adapter, args.url, args.model, sink, args.index_block_size, opts, args.record, stop,
                   status_every_s=args.status_interval)
    except KeyboardInterrupt:
        pass
    except (ValueError, RuntimeError) as e:  # an engine version this adapter was not checked against
        sys.exit(f"error: {e}")
    finally:
        sink.flush()
    return 0


def resync(args) -> int:
    from kvidx.kafka.log import bootstrap_of
    from relays.control import send_resync
    from schemas.events import topic_names

    if args.replica_groups < 0 or (args.replica_groups and args.model == "*"):
        sys.exit("error: --replica-groups takes a positive group count and one --model")
    send_resync(bootstrap_of(args), topic_names(args.topic_prefix)["control"], args.model, args.replica,
                args.reason, args.replica_groups)
    moved = f" into {args.replica_groups} replica groups" if args.replica_groups else ""
    print(f"resync requested{moved}: model={args.model} replica={args.replica}")
    return 0
