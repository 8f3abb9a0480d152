"""`kvidx`: one command for every part of the pipeline. `kvidx <command> --help` for each."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys


def _logging(level: str, command: str | None = None) -> None:
    from kvidx import logfmt

    logfmt.configure(level)
    if command == "worker":  # faust sets up logging again when it starts: in the same format
        logfmt.use_in_faust()


def _relay_options(args):
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


def _unchecked_engine_version(args, log: logging.Logger) -> None:
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

    adapter, opts = engines.get(args.engine), _relay_options(args)
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


def cmd_relay(args) -> int:
    import threading

    from kvidx.kafka.reach import require_broker, resolve_bootstrap, wait_for_broker
    from relays.sinks import KafkaSink

    log = logging.getLogger("kvidx.relay")
    if args.sglang_router_keys and args.engine != "sglang":
        sys.exit(f"error: --sglang-router-keys is for --engine sglang, not {args.engine}")
    _check_relay_inputs(args)
    from kvidx.config import load_config
    config = load_config(args.config)  # the same source the worker and the service read
    if args.index_block_size is None:
        args.index_block_size = config.model(args.model).index_block_size
    from kvidx import engines

    adapter = engines.get(args.engine)
    _unchecked_engine_version(args, log)
    factory = None
    if adapter.make_relay is not None:
        try:
            factory = _relay_factory(args)
            factory(args.model, "check", args.index_block_size)  # an unknown engine version fails here
        except ValueError as e:
            sys.exit(f"error: {e}")
    bootstrap = resolve_bootstrap(args.bootstrap)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if args.play:
        require_broker(bootstrap)  # a one-shot command: exit at once
    else:
        log.info("event=waiting_for_broker bootstrap=%s", bootstrap)
        if not wait_for_broker(bootstrap, log, stop):  # a service: retry, one line per attempt
            return 0
    from kvidx.kafka.topics import ensure_topics
    from schemas.events import topic_names
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
        start_http_server(args.metrics_port, addr=args.metrics_host)
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
        args.dp_rank, args.bind, args.lmcache_controller_endpoint, args.record, args.resync_blocks_per_s,
        args.resync_jitter, args.status_interval)
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

    opts = _relay_options(args)
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


def cmd_resync(args) -> int:
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


def _die_with_parent() -> None:
    """In the supervised child: get SIGTERM when the supervisor dies, even by SIGKILL (Linux), so a
    killed supervisor never leaves an orphan worker behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _shard_settings(args):
    """How shards are made, for every command that folds events: --config, with --index-block-size for
    the models it leaves out and --unreported-eviction-kinds over its own."""
    from kvidx.config import ShardSettings, load_config

    return ShardSettings(load_config(getattr(args, "config", None)), args.index_block_size, {},
                         tuple(args.unreported_eviction_kinds) or None)


EX_CONFIG = 78  # sysexits.h: a configuration error; the supervisor stops instead of restarting
EX_TEMPFAIL = 75  # sysexits.h: try again later (the data dir's lock is held): the supervisor waits
SUPERVISOR_PID = "KVIDX_SUPERVISOR_PID"


def _supervise(what: str) -> int:
    """Run this same command as a child process and start it again when it dies (a faust worker
    exits when the broker goes away for too long); SIGTERM/SIGINT stop both within seconds. A child
    that exits with EX_CONFIG (data dir in use, port taken ...) has said why: restarting cannot help.
    A crash loses nothing: events are acknowledged only once a snapshot holds them."""
    import subprocess
    import threading
    import time

    log = logging.getLogger("kvidx.supervisor")
    env = dict(os.environ, KVIDX_SUPERVISED="1", **{SUPERVISOR_PID: str(os.getpid())})
    stopping = threading.Event()
    child: subprocess.Popen | None = None

    def stop(signum, _frame):
        stopping.set()
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    backoff = 1.0
    while not stopping.is_set():
        started = time.monotonic()
        child = subprocess.Popen([sys.executable, "-m", "kvidx.cli", *sys.argv[1:]], env=env,
                                 preexec_fn=_die_with_parent)
        while True:
            try:
                code = child.wait(0.2)
                break
            except subprocess.TimeoutExpired:
                if stopping.is_set() and _stop_child(child, log):
                    code = child.returncode
                    break
        if stopping.is_set():
            return 0
        if code == EX_CONFIG:
            log.error("event=supervisor_stop what=%s reason=configuration_error (see the line above)", what)
            return 2
        if time.monotonic() - started > 60:
            backoff = 1.0
        if code == EX_TEMPFAIL:  # e.g. the data dir still locked by a worker that is stopping
            log.warning("event=waiting what=%s reason=%r retry_in_s=%.1f", what,
                        "the data dir is locked (see the line above)", backoff)
            backoff = min(backoff, 5.0)
        else:
            log.warning("event=child_exited what=%s code=%s restart_in_s=%.1f", what, code, backoff)
        if stopping.wait(backoff):  # a SIGTERM during the back-off ends it at once
            return 0
        backoff = min(backoff * 2, 30.0)
    return 0


def _stop_child(child, log, grace_s: float = 5.0) -> bool:
    """After SIGTERM was passed on: wait up to grace_s, then SIGKILL (nothing acknowledged is lost by
    a kill: the events after the last snapshot are redelivered)."""
    import subprocess

    try:
        child.wait(grace_s)
    except subprocess.TimeoutExpired:
        log.warning("event=child_kill reason=did_not_stop_in_s=%g", grace_s)
        child.kill()
        child.wait()
    return True


def _config_error(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(EX_CONFIG)


def cmd_worker(args) -> int:
    from kvidx.kafka.reach import resolve_bootstrap

    b = resolve_bootstrap(args.bootstrap)  # a missing address is a configuration error: before anything
    for port, opt in ((args.web_port, "--web-port"), (args.metrics_port, "--metrics-port")):
        if port and _port_in_use("127.0.0.1" if opt == "--web-port" else args.metrics_host, port):
            _config_error(f"port {port} is in use (another worker?): pass {opt} N (--web-port 0 turns "
                          "faust's web server off)")
    if not args.no_supervise and not os.environ.get("KVIDX_SUPERVISED"):
        return _supervise("worker")
    import faust

    from kvidx.kafka.reach import wait_for_broker
    from kvidx.kafka.topics import ensure_topics
    from schemas.events import topic_names
    from streams.worker import create_app

    log = logging.getLogger("kvidx.streams")
    stop = _stop_on_sigterm()
    if os.environ.get(SUPERVISOR_PID):
        _stop_without_supervisor(int(os.environ[SUPERVISOR_PID]), log)
    log.info("event=worker_start kafka=%s data_dir=%s", b, args.data_dir)
    if not wait_for_broker(b, log, stop):
        return 0
    t = topic_names(args.topic_prefix)
    repl = ensure_topics(b, t)
    try:
        app, worker = create_app(
            b, args.data_dir, app_id=args.topic_prefix + "kvidx-worker", events_topic=t["events"],
            snapshot_topic=t["snapshots"], dead_letter_topic=t["dead_letters"],
            snapshot_interval=args.snapshot_interval, settings=_shard_settings(args),
            metrics_port=args.metrics_port, metrics_host=args.metrics_host, web_port=args.web_port,
            session_timeout=args.session_timeout, replication_factor=repl.factor if repl else 1)
    except Exception as e:  # noqa: BLE001 - rocksdict raises plain Exceptions
        text = str(e).lower()
        if "lock" in text:
            holder = _lock_holder(str(e))
            msg = (f"--data-dir {args.data_dir} is in use by another worker{holder} (its RocksDB LOCK is "
                   "held): give each worker its own --data-dir")
            if os.environ.get("KVIDX_SUPERVISED"):  # the supervisor waits for the lock to free
                print(f"error: {msg}; waiting for it to be released", file=sys.stderr, flush=True)
                sys.exit(EX_TEMPFAIL)
            _config_error(msg)
        if "address already in use" in text:
            _config_error(f"--metrics-port {args.metrics_port} is in use: pass another port")
        raise
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # faust installs its own handlers
    log.info("event=worker_waiting_for topic=%s group=%s", t["events"], args.topic_prefix + "kvidx-worker")
    faust.Worker(app, loglevel=args.log_level.lower()).execute_from_commandline()
    return 0


def _lock_holder(error: str) -> str:
    """" (pid N)" of the process holding the RocksDB LOCK named in `error` (Linux /proc/locks), or ""."""
    import re

    m = re.search(r"(/\S+/LOCK)\b", error)
    if not m:
        return ""
    try:
        inode = os.stat(m.group(1)).st_ino
        with open("/proc/locks") as f:
            for line in f:  # "1: POSIX  ADVISORY  WRITE 4242 08:01:1234567 0 EOF"
                fields = line.split()
                if len(fields) > 5 and fields[5].rsplit(":", 1)[-1] == str(inode):
                    return f" (pid {fields[4]})"
    except (OSError, ValueError):
        pass
    return ""


def _stop_without_supervisor(supervisor: int, log: logging.Logger, grace_s: float = 10.0) -> None:
    """In the supervised worker: once its supervisor is gone (killed with -9: Linux's parent-death
    signal has already asked faust to stop), make sure the worker is gone within `grace_s`, even
    if faust's shutdown waits on something; its partitions then go to the other workers once the
    group's session times out, and its events after the last snapshot are redelivered to them."""
    import threading
    import time

    def watch() -> None:
        while os.getppid() == supervisor:
            time.sleep(0.5)
        log.warning("event=supervisor_gone action=stop grace_s=%g", grace_s)
        os.kill(os.getpid(), signal.SIGTERM)  # where there is no parent-death signal
        time.sleep(grace_s)
        log.error("event=stop_timeout action=kill grace_s=%g", grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="supervisor-watch").start()


def _stop_on_sigterm():
    """An Event set by SIGTERM (for the waits before a service has started)."""
    import threading

    ev = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: ev.set())
    return ev


def _port_in_use(host: str, port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        except OSError:
            return True
    return False


def _load_credentials(args):
    """The tokens `kvidx serve` accepts (index_service.auth): --auth-token-file, else $KVIDX_API_TOKEN
    (one token, every scope), else None (every API open); exits with one line if they cannot be read."""
    from index_service.auth import Credentials, CredentialsError

    if args.auth_token_file:
        try:
            return Credentials.from_file(args.auth_token_file, peer_name=args.peer_credential)
        except CredentialsError as e:
            sys.exit(f"error: --auth-token-file {e}")
    token = os.environ.get("KVIDX_API_TOKEN", "").strip()
    return Credentials.from_token(token) if token else None


def _tls_files(args):
    """--tls-cert, --tls-key, --tls-client-ca as index_service.auth.TlsFiles (None without a certificate);
    exits with one line if they cannot be used."""
    from index_service.auth import CredentialsError, TlsFiles

    if not (args.tls_cert or args.tls_key or args.tls_client_ca):
        return None
    if not (args.tls_cert and args.tls_key):
        sys.exit("error: --tls-cert and --tls-key go together (--tls-client-ca needs them too)")
    tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_client_ca)
    try:
        tls.check()
    except CredentialsError as e:
        sys.exit(f"error: --tls-cert/--tls-key/--tls-client-ca: {e}")
    return tls


def cmd_serve(args) -> int:
    import socket

    from index_service.app import create_app
    from index_service.auth import log_auth_state
    from index_service.conductor_api import ConductorRegistry
    from index_service.dynamo_api import DynamoRegistry
    from index_service.follower import KafkaFollower, RoutePublisher
    from index_service.http_protocol import serve
    from index_service.registrations import RegistrationLog
    from index_service.sglang_indexer import SglangIndexer, add_sglang_peer_route, remote_prefix, start_server
    from index_service.status_routes import ops_app
    from index_service.store import ShardStore
    from kvidx.engines.lmcache.actuator import HintActuators
    from kvidx.kafka.reach import resolve_bootstrap
    from kvidx.kafka.topics import ensure_topics
    from kvidx.ops.audit import UsagePublisher
    from kvidx.ops.feedback import FeedbackFollower, ensure_feedback_topic
    from relays.managed import mooncake_relay_starter, vllm_relay_starter
    from relays.sinks import KafkaSink
    from schemas.events import topic_names
    from schemas.hints import encode_hint

    log = logging.getLogger("kvidx.service")
    b = resolve_bootstrap(args.bootstrap)
    credentials = _load_credentials(args)
    tls = _tls_files(args)
    if _port_in_use(args.host, args.port):
        sys.exit(f"error: {args.host}:{args.port} is in use (another kvidx serve?): pass --port N")
    if args.ops_port is not None and (args.ops_port == args.port or _port_in_use(args.host, args.ops_port)):
        sys.exit(f"error: --ops-port {args.ops_port} is in use (or is --port): pass another port")
    sglang_addresses = _sglang_indexer_addresses(args.sglang_indexer, args.host, args.port)
    t = topic_names(args.topic_prefix)
    settings = _shard_settings(args)
    allow = _allow_list(args, settings.config)
    from kvidx.core.groups import parse_groups

    groups = None
    if args.groups:
        try:
            groups = parse_groups(args.groups)
        except ValueError as e:
            sys.exit(f"error: {e}")
    store = ShardStore(settings.index_block_size, config=settings.config,
                       unreported_eviction_kinds=settings.unreported_eviction_kinds, groups=groups)
    publishers = [RoutePublisher(b, t["routes"]), RoutePublisher(b, t["hints"], encode_hint)]
    store.publish_route, store.publish_hint = publishers
    store.act_on_hint = actuators = HintActuators(settings.config)  # models with an LMCache controller
    from index_service.fanout import Announcer, Fanout, PeerDirectory

    name = args.instance_name or f"{socket.gethostname()}:{args.port}"
    directory = PeerDirectory(name)
    try:
        for spec in args.peer:
            url, _, gs = spec.partition("=")
            directory.add_static(url, parse_groups(gs) if gs else None)
    except ValueError as e:
        sys.exit(f"error: --peer {spec!r}: {e}")
    # every instance says which groups it holds; one that holds only some asks the others
    # where the others reach this instance: a wildcard address is no address for them
    host = socket.getfqdn() if args.host in ("0.0.0.0", "::", "") else args.host
    scheme = "https" if tls is not None else "http"
    announcer = Announcer(directory, b, t["instances"], args.url or f"{scheme}://{host}:{args.port}", groups)
    # the fan-out's own token: read for lookups and queries, admin for SGLang's /internal/ prefix queries
    lacking = credentials.peer_lacks(["read", *(["admin"] if sglang_addresses else [])]
                                     ) if groups is not None and credentials is not None else []
    if lacking:
        sys.exit(f"error: --groups: the fan-out to the other instances needs a token of its own with scope "
                 f"{','.join(lacking)}: give the entry named {args.peer_credential!r} in --auth-token-file "
                 f"those scopes")
    peer_token = credentials.peer_token if credentials is not None else None
    fanout = Fanout(directory, args.fanout_timeout_ms / 1000, peer_token,
                    tls.client_context() if tls is not None else None) if groups is not None else None
    feedback: list[FeedbackFollower] = []

    def prepare() -> None:  # once the broker answers: the topics, the feedback follower, the registrations
        ensure_topics(b, t)
        f = FeedbackFollower(b, ensure_feedback_topic(b, t)).start()
        feedback.append(f)
        app.state.feedback = f
        registrations.follow(dynamo.apply_record, _learn_sglang_address(sglang), conductor.apply_record)
        announcer.start()

    follower = KafkaFollower(store, b, t["events"], t["snapshots"], t["routes"], prepare=prepare)
    # Dynamo's indexer API: POST /register starts a relay here that publishes to the events topic; the
    # registrations topic keeps them (this instance takes its own up again after a restart)
    registrations = RegistrationLog(b, t["registrations"])
    relay_sink = KafkaSink(b, t["events"], t["dead_letters"], replica_group=settings.config.replica_group)
    starter = vllm_relay_starter(relay_sink, settings.block_size)
    dynamo = DynamoRegistry(starter, owner=name, log=registrations, allow=allow, store=store)
    # Mooncake conductor's msgpack API: vLLM engines, and Mooncake Store masters as their shared pools
    conductor = ConductorRegistry(starter, owner=name, log=registrations,
                                  start_pool_relay=mooncake_relay_starter(relay_sink, settings.block_size),
                                  set_pool=store.set_registered_pool,
                                  replica_groups=lambda model: settings.config.model(model).replica_groups,
                                  allow=allow, store=store)
    dynamo.others, conductor.others = [conductor], [dynamo]  # an endpoint is followed once
    app = create_app(store, max_tokens=args.max_tokens, credentials=credentials,
                     publish_usage=UsagePublisher(b, t["usage"]), dynamo=dynamo, conductor=conductor,
                     fanout=fanout, lmcache_lookup=args.lmcache_lookup, probes_open=args.ops_port is None,
                     rate_limits={"write": args.write_rate_limit, "admin": args.admin_rate_limit})
    # SGLang's external-indexer API (gRPC): its feed publishes to the events topic, batch by acked batch
    feed = KafkaSink(b, t["events"], t["dead_letters"], replica_group=settings.config.replica_group
                     ) if sglang_addresses else None
    sglang, grpc_servers = [], []
    for model, address in sglang_addresses:
        indexer = SglangIndexer(store, model, feed.publish_acked, registrations.publish_sglang_worker,
                                lambda method, code: app.state.metrics.lookups.labels(f"sglang_{method}",
                                                                                      code).inc(), allow)
        sglang.append(indexer)
        try:
            grpc_servers.append(start_server(indexer, address, credentials=credentials, tls=tls)[0])
        except (OSError, RuntimeError) as e:
            sys.exit(f"error: --sglang-indexer {model}={address}: {e}")
    if sglang:  # a split model's other groups: asked of their holders' --sglang-indexer, over HTTP
        add_sglang_peer_route(app, {i.model: i for i in sglang})
        if fanout is not None:
            async def connect_sglang_fanout() -> None:  # the fan-out's connections live in this loop
                loop = asyncio.get_running_loop()
                for i in sglang:
                    i.remote = remote_prefix(fanout, i.model, loop)

            app.router.on_startup.append(connect_sglang_fanout)
    apis = ["kvidx", "dynamo", "conductor", *(["lmcache"] if args.lmcache_lookup else []),
            *(["sglang-grpc"] if sglang else [])]
    log_auth_state(credentials, apis)
    follower.start()
    log.info("event=serving url=%s://%s:%d kafka=%s ready=%r", scheme, args.host, args.port, b,
             "GET /healthz answers 200 once the shards are rebuilt (503 with the reason until then)")
    try:
        ops = (ops_app(app), args.ops_port) if args.ops_port is not None else None
        serve(app, args.host, args.port, ops=ops, log_level="warning",
              **(tls.uvicorn_options() if tls is not None else {}))
    finally:
        for server in grpc_servers:
            server.stop(2)
        if feed is not None:
            feed.close()
        registrations.close()
        dynamo.stop_all()
        conductor.stop_all()
        for f in feedback:
            f.stop()
        follower.stop()
        announcer.stop()
        for p in publishers:  # the decisions and hints still buffered reach the broker
            p.close()
        actuators.close()
    return 0


def _allow_list(args, config):
    """The endpoints registrations and feeds may name (index_service.guard.EndpointAllowList):
    --allow-endpoints, else the configuration's allow_endpoints, else the default; exits with one line
    naming a bad entry."""
    from index_service.guard import DEFAULT_ALLOW, EndpointAllowList

    text = args.allow_endpoints if args.allow_endpoints is not None else (
        ",".join(config.allow_endpoints) if config.allow_endpoints is not None else ",".join(DEFAULT_ALLOW))
    try:
        allow = EndpointAllowList.parse(text)
    except ValueError as e:
        sys.exit(f"error: --allow-endpoints: {e}")
    logging.getLogger("kvidx.service").info("event=endpoint_allow_list entries=%s", allow.text or "(none)")
    return allow


def cmd_shadow(args) -> int:
    from kvidx import engines
    from kvidx.shadow import run_shadow_engine
    from relays.inputs import InputError, check_file, check_recording_engine

    adapter = engines.get(args.engine)
    args.index_block_size = args.index_block_size or 16
    try:  # a missing file, a requests log as the recording, another engine's recording: one line each
        check_file(args.recording, adapter.recording, "--recording")
        check_file(args.requests, "requests", "--requests")
        if adapter.recording == "frames":
            check_recording_engine(args.recording, args.engine)
        from kvidx.config import load_config

        pools = load_config(args.config).pool_readers() if args.config else None
        if adapter.shadow_defaults.get("needs_pools") and not pools:
            raise InputError(f"{args.engine}'s blocks live in a shared pool: pass --config with a "
                             "[pools.\"<the publisher's endpoint>\"] section naming the replicas reading it")
        _unchecked_engine_version(args, logging.getLogger("kvidx.shadow"))
        result, _ = run_shadow_engine(args.engine, args.recording, args.requests,
                                      index_block_size=args.index_block_size,
                                      options=engines.RelayOptions(
                                          engine_version=args.engine_version,
                                          allow_unchecked_version=args.allow_unchecked_engine_version),
                                      unreported_eviction_kinds=tuple(args.unreported_eviction_kinds),
                                      pending_ttl=args.pending_ttl, pools=pools)
    except (InputError, ValueError) as e:  # ValueError: an engine version its adapter was not checked with
        sys.exit(f"error: {e}")
    summary = {**result.agreement.summary(), **result.extra}
    if args.json:
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            print(f"{k:>16}: {v}")
        print(f"{'dead_letters':>16}: {result.dead_letters}")
        for m in result.agreement.mismatches[:10]:
            print(f"  mismatch: request {m['i']}: engine reused {m['reused']}, index credited {m['credited']}"
                  f" of {m['prompt_tokens']} tokens")
    return 0


def cmd_demo(args) -> int:
    from kvidx.demo import run_demo

    try:
        return run_demo(replicas=args.replicas, requests=args.requests, kafka=args.kafka,
                        bootstrap=args.bootstrap, port=args.port, keep_serving=args.serve)
    except KeyboardInterrupt:
        print("[demo] stopped", file=sys.stderr)
        return 130


def _unchecked_arg(sp) -> None:
    sp.add_argument("--allow-unchecked-engine-version", action="store_true",
                    help="vllm: run a release kvidx was not checked against, read as the nearest checked "
                         "one, with a warning at start-up (and kvidx_relay_engine_version_unchecked on "
                         "/metrics); check it instead with tests/conformance/run.sh (docs/engines.md)")


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
    """`kvidx relay`."""
    from kvidx.clihelp import DeprecatedAlias

    r = sub.add_parser("relay", help="relay one engine's KV events to Kafka",
                       description="Subscribe to an engine's KV-cache events (or play a recording), "
                                   "re-hash blocks canonically and publish versioned batches to Kafka.")
    _common(r, shards=False)
    r.add_argument("--engine", default="vllm", choices=engine_names,
                   help="the engine whose events are relayed")
    r.add_argument("--url", help="trtllm: trtllm-serve's base URL (its POST /kv_cache_events is polled)")
    # dest block_size: the name the relay code reads; --block-size is its old, deprecated spelling
    r.add_argument("--engine-block-size", dest="block_size", type=int, metavar="N",
                   help="trtllm: the engine's tokens per block")
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
                   help="vLLM data parallelism: relay every rank's publisher (endpoint port + rank)")
    r.add_argument("--cpu-chunk-blocks", type=int, default=1,
                   help="vLLM offloading connector: engine blocks per offloaded chunk (CPU events)")
    r.add_argument("--kv-cache-report-mode", choices=("incremental", "full"), default="incremental",
                   help="vllm: 'full' where requests may ask vLLM to re-announce every prefix hit "
                        "(sampling extra_args kv_cache_report_mode=full): a single-group model's chain "
                        "re-stored from the root is then not a second copy")
    r.add_argument("--lmcache-ttl", type=float, default=300.0, metavar="S",
                   help="LMCache chunks re-published through vLLM (no evictions published) age out after "
                        "S seconds (0: never)")
    r.add_argument("--lmcache-capacity-blocks", type=int, default=None,
                   help="cap on LMCache's live index blocks (its max size / chunk size)")
    r.add_argument("--lmcache-controller-endpoint", metavar="ENDPOINT",
                   help="bind a PULL socket for LMCache's admit/evict messages (e.g. tcp://*:9001): with "
                        "them, LMCache's evictions are known and its blocks are no upper bound")
    r.add_argument("--sglang-router-keys", action="store_true",
                   help="SGLang: also index the engine's own page hashes, so that SGLang's router asking "
                        "kvidx serve --sglang-indexer finds this replica (name it by the router's worker URL "
                        "with --replica); one index entry more per page")
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
    r.set_defaults(func=cmd_relay)


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
    rs.set_defaults(func=cmd_resync)


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
    w.set_defaults(func=cmd_worker)


def _sglang_indexer_addresses(specs: list[str], host: str, http_port: int) -> list[tuple[str, str]]:
    """`--sglang-indexer MODEL=[HOST:]PORT` values as (model, "host:port"); exits with one line if not."""
    out, ports, models = [], {http_port}, set()
    for spec in specs:
        model, _, where = spec.partition("=")
        h, _, port = where.rpartition(":")
        if not model or not port.isdigit() or not 0 < int(port) < 65536:
            sys.exit(f"error: --sglang-indexer {spec!r}: expected MODEL=[HOST:]PORT, e.g. llama=50051")
        if model in models:  # one feed per model and instance: its batches are ordered by it
            sys.exit(f"error: --sglang-indexer {spec!r}: model {model!r} is given twice")
        h = h.strip("[]") or host
        if int(port) in ports or _port_in_use(h, int(port)):
            sys.exit(f"error: --sglang-indexer {spec!r}: port {port} is in use (or is --port)")
        ports.add(int(port))
        models.add(model)
        out.append((model, f"[{h}]:{port}" if ":" in h else f"{h}:{port}"))
    return out


def _learn_sglang_address(indexers):
    def learn(w) -> None:
        for indexer in indexers:
            indexer.learn_address(w)

    return learn


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
    s.set_defaults(func=cmd_serve)


def _add_shadow(sub, engine_names) -> None:
    """`kvidx shadow`."""
    sh = sub.add_parser("shadow", help="replay a recording and compare credited with reused tokens",
                        description="Replays a recorded engine stream through the relay and fold code and "
                                    "prints how the index's credit agrees with the engine's own "
                                    "cached_tokens for every request of the request log.")
    _common(sh, kafka=False)
    sh.add_argument("--engine", default="vllm", choices=engine_names,
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
    sh.set_defaults(func=cmd_shadow)


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
    d.set_defaults(func=cmd_demo)


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
