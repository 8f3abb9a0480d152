"""`kvidx serve`, assembled: the store, its follower of the topics, the routers' APIs (kvidx's, Dynamo's,
the conductor's, LMCache's, SGLang's gRPC), credentials and TLS, the fan-out to the instances holding
a split model's other groups, and the HTTP server. The command line is parsed by kvidx/cli.py."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time

from kvidx.runtime import port_in_use, shard_settings


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


def serve(args) -> int:
    import socket

    from index_service.app import create_app
    from index_service.auth import log_auth_state
    from index_service.conductor_api import ConductorRegistry
    from index_service.dynamo_api import DynamoRegistry
    from index_service.feedback import FeedbackFollower, ensure_feedback_topic
    from index_service.follower import KafkaFollower
    from index_service.http_protocol import serve as serve_http
    from index_service.registrations import RegistrationLog
    from index_service.sglang_indexer import SglangIndexer, add_sglang_peer_route, remote_prefix, start_server
    from index_service.status_routes import ops_app
    from index_service.store import ShardStore
    from kvidx.engines.lmcache.actuator import HintActuators
    from kvidx.kafka.publish import Publisher
    from kvidx.kafka.reach import resolve_bootstrap
    from kvidx.kafka.topics import ensure_topics
    from relays.managed import mooncake_relay_starter, vllm_relay_starter
    from relays.sinks import KafkaSink
    from schemas.events import topic_names
    from schemas.hints import encode_hint
    from schemas.routes import encode_route
    from schemas.usage import encode_usage

    log = logging.getLogger("kvidx.service")
    b = resolve_bootstrap(args.bootstrap)
    credentials = _load_credentials(args)
    tls = _tls_files(args)
    if port_in_use(args.host, args.port):
        sys.exit(f"error: {args.host}:{args.port} is in use (another kvidx serve?): pass --port N")
    if args.ops_port is not None and (args.ops_port == args.port or port_in_use(args.host, args.ops_port)):
        sys.exit(f"error: --ops-port {args.ops_port} is in use (or is --port): pass another port")
    _check_lookup_port(args, tls)
    sglang_addresses = _sglang_indexer_addresses(args.sglang_indexer, args.host, args.port)
    t = topic_names(args.topic_prefix)
    settings = shard_settings(args)
    allow = allow_list(args, settings.config)
    from kvidx.core.groups import parse_groups

    groups = None
    if args.groups:
        try:
            groups = parse_groups(args.groups)
        except ValueError as e:
            sys.exit(f"error: {e}")
    store = ShardStore(settings.index_block_size, config=settings.config,
                       unreported_eviction_kinds=settings.unreported_eviction_kinds, groups=groups)
    publishers = [Publisher(b, t["routes"], encode_route), Publisher(b, t["hints"], encode_hint)]
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
    usage = Publisher(b, t["usage"], encode_usage, linger_ms=5)
    app = create_app(store, max_tokens=args.max_tokens, credentials=credentials, publish_usage=usage,
                     dynamo=dynamo, conductor=conductor,
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
    front = None
    if args.lookup_port is not None:  # Dynamo's queries from the compiled core's threads
        from index_service.conductor_api import ConductorPaths
        from index_service.lookup_front import FrontCollector, LookupFront

        try:
            front = LookupFront(args.host, args.lookup_port, store, dynamo, credentials,
                                conductor=ConductorPaths(None, store, conductor))
        except (OSError, RuntimeError) as e:
            sys.exit(f"error: --lookup-port {args.lookup_port}: {e}")
        app.state.metrics.registry.register(FrontCollector(front))
        log.info("event=lookup_front url=http://%s:%d routes=POST /query,/query_by_hash (Dynamo's; the "
                 "conductor's msgpack /query)", args.host, front.port)
    apis = ["kvidx", "dynamo", "conductor", *(["lmcache"] if args.lmcache_lookup else []),
            *(["sglang-grpc"] if sglang else [])]
    log_auth_state(credentials, apis)
    follower.start()
    log.info("event=serving url=%s://%s:%d kafka=%s ready=%r", scheme, args.host, args.port, b,
             "GET /healthz answers 200 once the shards are rebuilt (503 with the reason until then)")
    try:
        ops = (ops_app(app), args.ops_port) if args.ops_port is not None else None
        serve_http(app, args.host, args.port, ops=ops, log_level="warning",
              **(tls.uvicorn_options() if tls is not None else {}))
    finally:
        if front is not None:
            front.close()
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
        # the decisions, hints and reports still buffered reach the broker, within one 10 s budget
        deadline = time.monotonic() + 10.0
        for p in (*publishers, usage):
            p.close(max(0.1, deadline - time.monotonic()))
        actuators.close()
    return 0


def _check_lookup_port(args, tls) -> None:
    """--lookup-port's limits, each a one-line exit."""
    p = args.lookup_port
    if p is None:
        return
    if not 0 <= p < 65536 or p in (args.port, args.ops_port):
        sys.exit(f"error: --lookup-port {p}: give a free port other than --port and --ops-port")
    if tls is not None:
        sys.exit("error: --lookup-port serves plain HTTP; with --tls-cert, Dynamo's queries are on --port")
    if args.groups:
        sys.exit("error: --lookup-port answers from this instance's shards alone; with --groups (a split "
                 "model), Dynamo's queries are on --port, which asks the other instances")
    if p and port_in_use(args.host, p):
        sys.exit(f"error: --lookup-port {p} is in use: pass another port")


def allow_list(args, config):
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
        if int(port) in ports or port_in_use(h, int(port)):
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
