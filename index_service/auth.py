"""Who may call the lookup service: named bearer tokens with scopes, checked on every route and RPC.

Scopes (docs/operations.md, "Security"):
- `read`: lookups, rank and queries (POST /v1/lookup, /v1/lookup/binary, /v1/rank, GET /v1/models,
  the API documents; Dynamo's /query, /query_by_hash and /health; LMCache's /lookup; the conductor's
  msgpack /query; SGLang's MatchExternalKv, MatchExternalKvPrefix, GetExternalKvHitCounts).
- `write`: what changes the index's answers by reporting (POST /v1/routes, /v1/usage; SGLang's feed
  ApplyExternalKvBatch).
- `admin`: what makes the service connect out, forget, or show the fleet (Dynamo's and the conductor's
  /register and /unregister, /dump, /workers, /services, /global_view) and the instances' internal
  routes (/internal/...).
GET /healthz and /metrics stay open to probes and scrapers (with `kvidx serve --ops-port` they are
served open on that port, and need `read` on the API's). A path not in `PATH_SCOPES` needs `admin`:
a route added without an entry is closed, not open (tests/security/test_auth_matrix.py lists them all).

The credentials file (`kvidx serve --auth-token-file FILE`), one token a line, `#` comments:

    # name      scopes            token
    router-a    read              6f1c9e0d4b...
    bridge      write             91aa27c3e8...
    ops         read,write,admin  0b7d4e58f2...
    peer        read,admin        c2f08a6d11...

`all` stands for every scope. A file holding a single bare token (one word, today's form) grants every
scope. The file is read again when it changes (checked at most once a second, by its inode, size and
mtime after symlinks: a Kubernetes Secret's atomic swap included), so tokens rotate without a restart;
a file that does not parse is refused with one line in the log and the previous tokens stay in force.
Tokens are compared in constant time, against every entry. Names, never tokens, are logged.

`TlsFiles`: the certificate, key and client CA of `kvidx serve --tls-cert/--tls-key/--tls-client-ca`
(TLS, or mTLS with the CA, on the HTTP and gRPC APIs and the fan-out between instances).
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.responses import Response

from index_service.context import JSON, encode, kv

log = logging.getLogger("kvidx.service")

READ, WRITE, ADMIN = "read", "write", "admin"
SCOPES = (READ, WRITE, ADMIN)

# the scope each path needs, whatever the method (a method the route lacks answers 405 once authorized);
# None: open. Paths taken before the routes (hot_path, ConductorPaths) are here too.
PATH_SCOPES: dict[str, str | None] = {
    "/healthz": None,
    "/metrics": None,
    "/v1/lookup": READ,
    "/v1/lookup/binary": READ,
    "/v1/rank": READ,
    "/v1/models": READ,
    "/v1/routes": WRITE,
    "/v1/usage": WRITE,
    "/openapi.json": READ,
    "/docs": READ,
    "/docs/oauth2-redirect": READ,
    "/redoc": READ,
    # Dynamo's indexer API (dynamo_api) and Mooncake conductor's (conductor_api) on the same paths
    "/query": READ,
    "/query_by_hash": READ,
    "/health": READ,
    "/register": ADMIN,
    "/unregister": ADMIN,
    "/workers": ADMIN,
    "/dump": ADMIN,
    "/services": ADMIN,
    "/global_view": ADMIN,
    # LMCache's controller lookup (lmcache_api)
    "/lookup": READ,
}
PREFIX_SCOPES: tuple[tuple[str, str], ...] = (
    ("/static-offline-docs/", READ),  # the API documents' assets (fastapi-offline)
    ("/internal/", ADMIN),  # instance to instance (index_service.fanout)
)
# SGLang's gRPC methods (sglang_indexer), by their full name's last part
RPC_SCOPES: dict[str, str] = {
    "ApplyExternalKvBatch": WRITE,
    "MatchExternalKv": READ,
    "MatchExternalKvPrefix": READ,
    "GetExternalKvHitCounts": READ,
}


def scope_needed(path: str) -> str | None:
    """The scope a request to `path` needs (None: open); `admin` for a path not listed."""
    try:
        return PATH_SCOPES[path]
    except KeyError:
        pass
    for prefix, scope in PREFIX_SCOPES:
        if path.startswith(prefix):
            return scope
    return ADMIN


def rpc_scope_needed(method: str) -> str:
    """The scope a gRPC method ("/package.Service/Method") needs; `admin` for one not listed."""
    return RPC_SCOPES.get(method.rsplit("/", 1)[-1], ADMIN)


class CredentialsError(ValueError):
    """A credentials file that cannot be used (the message names the file and the line)."""


@dataclass(frozen=True)
class Entry:
    name: str
    scopes: frozenset[str]
    expected: bytes  # b"Bearer <token>", what the Authorization header carries


_NAME = re.compile(r"[A-Za-z0-9_.:@-]{1,64}")
_TOKEN = re.compile(r"[\x21-\x7e]+")  # printable ASCII without spaces: what a header carries as is
MIN_TOKEN_CHARS = 16  # of a named token (a bare token of the old form is taken as it is)
BARE = "(token)"  # the name of the old form's one token (no named entry can be called so)


def parse_credentials(text: str, source: str = "credentials") -> tuple[Entry, ...]:
    """The entries of a credentials file's text (module docstring); CredentialsError if it does not parse."""
    lines = [(n, ln.split()) for n, ln in enumerate(text.splitlines(), 1)]
    lines = [(n, words) for n, words in lines if words and not words[0].startswith("#")]
    if not lines:
        raise CredentialsError(f"{source}: no token in it")
    if len(lines) == 1 and len(lines[0][1]) == 1:  # the old form: one bare token, every scope
        token = lines[0][1][0]
        if not _TOKEN.fullmatch(token):
            raise CredentialsError(f"{source}: the token has characters a header cannot carry")
        return (Entry(BARE, frozenset(SCOPES), f"Bearer {token}".encode()),)
    entries, names, tokens = [], set(), set()
    for n, words in lines:
        where = f"{source} line {n}"
        if len(words) != 3:
            raise CredentialsError(f"{where}: expected `name scope[,scope] token`, got {len(words)} words")
        name, scopes_text, token = words
        if not _NAME.fullmatch(name):
            raise CredentialsError(f"{where}: name {name[:64]!r} must be 1-64 of A-Z a-z 0-9 _ . : @ -")
        scopes = set(scopes_text.split(","))
        if "all" in scopes:
            scopes = (scopes - {"all"}) | set(SCOPES)
        unknown = sorted(scopes - set(SCOPES))
        if unknown or not scopes:
            raise CredentialsError(f"{where}: unknown scope {unknown[0] if unknown else ''!r} "
                                   f"(scopes: read, write, admin, all)")
        if len(token) < MIN_TOKEN_CHARS or not _TOKEN.fullmatch(token):
            raise CredentialsError(f"{where}: the token of {name!r} must be at least {MIN_TOKEN_CHARS} "
                                   "printable characters without spaces")
        if name in names:
            raise CredentialsError(f"{where}: name {name!r} is given twice")
        if token in tokens:
            raise CredentialsError(f"{where}: the token of {name!r} is another entry's too")
        names.add(name)
        tokens.add(token)
        entries.append(Entry(name, frozenset(scopes), f"Bearer {token}".encode()))
    return tuple(entries)


@dataclass(frozen=True)
class Refusal:
    """Why a call is refused: 401 (no or a wrong token) or 403 (a token without the scope needed)."""
    status: int
    error: str
    scope: str

    def response(self):
        headers = {"www-authenticate": f'Bearer scope="{self.scope}"'} if self.status == 401 else None
        return Response(encode({"error": self.error}), self.status, headers=headers,
                        media_type=JSON)


def _signature(path: str) -> tuple | None:
    """What changes when the file does: os.stat follows symlinks, so a Kubernetes Secret's swapped
    ..data directory gives a new inode; None while the file is missing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class Credentials:
    """The tokens the service accepts (from a file, re-read when it changes, or fixed) and the one its
    fan-out sends to the other instances (the entry named `peer_name`, or the single bare token)."""

    RECHECK_S = 1.0

    def __init__(self, entries: tuple[Entry, ...], path: str | None = None, peer_name: str = "peer",
                 clock: Callable[[], float] = time.monotonic):
        self.entries = entries
        self.path = path
        self.peer_name = peer_name
        self.clock = clock
        self._signature = _signature(path) if path else None
        self._next_check = clock() + self.RECHECK_S
        self._reload_lock = threading.Lock()

    @classmethod
    def from_token(cls, token: str) -> Credentials:
        """One token granting every scope (the old `auth_token`)."""
        return cls(parse_credentials(token, "token"))

    @classmethod
    def from_file(cls, path: str, peer_name: str = "peer", clock: Callable[[], float] = time.monotonic
                  ) -> Credentials:
        """Credentials read from `path`; CredentialsError (one line naming the file) if they cannot be."""
        signature = _signature(path)  # before the read: a change while reading is read again
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise CredentialsError(f"{path}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise CredentialsError(f"{path}: not text") from None
        credentials = cls(parse_credentials(text, path), path, peer_name, clock)
        credentials._signature = signature
        return credentials

    def refresh(self) -> None:
        """Re-read the file if it changed (at most one look a second, from any thread)."""
        now = self.clock()
        if self.path is None or now < self._next_check or not self._reload_lock.acquire(blocking=False):
            return
        try:
            self._next_check = now + self.RECHECK_S
            signature = _signature(self.path)
            if signature is None or signature == self._signature:
                return  # a file gone mid-swap: the tokens in force stay so until it is back
            self._signature = signature
            try:
                with open(self.path) as f:
                    self.entries = parse_credentials(f.read(), self.path)
            except (OSError, UnicodeDecodeError, CredentialsError) as e:
                log.error("%s", kv(event="credentials_reload_failed", path=self.path,
                                   error=str(e)[:300], kept=",".join(self.names())))
                return
            log.info("%s", kv(event="credentials_reloaded", path=self.path, names=",".join(self.names())))
        finally:
            self._reload_lock.release()

    def match(self, authorization: bytes) -> Entry | None:
        """The entry whose token the header carries; every entry compared in constant time."""
        found = None
        for entry in self.entries:
            if hmac.compare_digest(authorization, entry.expected):
                found = entry
        return found

    def refusal(self, authorization: str | bytes | None, scope: str, what: str) -> Refusal | None:
        """None if the Authorization header's token has `scope`, else why not (`what`: the route or RPC,
        named in the message)."""
        self.refresh()
        if isinstance(authorization, str):
            authorization = authorization.encode("latin-1", "replace")
        entry = self.match(authorization) if authorization else None
        if entry is None:
            return Refusal(401, f"missing or wrong bearer token: {what} needs a token with scope {scope!r} "
                                "(Authorization: Bearer ...)", scope)
        if scope not in entry.scopes:
            return Refusal(403, f"token {entry.name!r} lacks scope {scope!r}, which {what} needs", scope)
        return None

    def peer_token(self) -> str | None:
        """The token this instance's fan-out sends: the entry named `peer_name`'s, or the one bare token."""
        self.refresh()
        entries = self.entries
        chosen = next((e for e in entries if e.name == self.peer_name), None)
        if chosen is None and len(entries) == 1 and entries[0].name == BARE:
            chosen = entries[0]
        return None if chosen is None else chosen.expected.decode()[len("Bearer "):]

    def peer_lacks(self, scopes: list[str]) -> list[str]:
        """Of `scopes`, those this instance's own token (`peer_token`) does not hold (all without one)."""
        token = self.peer_token()
        if token is None:
            return list(scopes)
        return [s for s in scopes if self.refusal(f"Bearer {token}", s, "") is not None]

    def names(self) -> list[str]:
        return [e.name for e in self.entries]


class RequireScope:
    """ASGI middleware, outermost: every HTTP request needs a token with its path's scope
    (`scope_needed`) before anything else of the app reads it; `probes_open` False: /healthz and
    /metrics need `read` too (they are served open on an ops port). (The routers' lookups are taken
    before the app's middleware and checked there: index_service.hot_path.HotPath.)"""

    def __init__(self, app, credentials: Credentials, probes_open: bool = True):
        self.app = app
        self.credentials = credentials
        self.open_scope = None if probes_open else READ

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            needed = scope_needed(path) or self.open_scope
            if needed is not None:
                header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
                refused = self.credentials.refusal(header, needed, f"{scope['method']} {path}")
                if refused is not None:
                    await refused.response()(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def log_auth_state(credentials: Credentials | None, apis: list[str]) -> None:
    """One line at start-up: the token names in force, or a loud WARNING that every API is open."""
    if credentials is None:
        log.warning("%s", kv(event="auth_disabled", apis=",".join(apis),
                             risk="anyone who reaches the port can register relays, feed, clear and read "
                                  "the index", fix="kvidx serve --auth-token-file FILE (docs/operations.md)"))
    else:
        log.info("%s", kv(event="auth_enabled", apis=",".join(apis), path=credentials.path or "",
                          names=",".join(credentials.names())))


@dataclass(frozen=True)
class TlsFiles:
    """`kvidx serve --tls-cert/--tls-key [--tls-client-ca]`: the certificate the HTTP API and SGLang's gRPC
    API serve TLS with; `ca`: callers must present a certificate it signed (mTLS), and the fan-out
    checks the other instances' against it (presenting this certificate to them). Read at start-up: a
    new certificate needs a restart."""
    cert: str
    key: str
    ca: str | None = None

    def check(self) -> None:
        """CredentialsError (one line naming the file) if the files cannot be used."""
        for path in (self.cert, self.key, *([self.ca] if self.ca else [])):
            try:
                with open(path, "rb"):
                    pass
            except OSError as e:
                raise CredentialsError(f"{path}: {e.strerror or e}") from None
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.cert, self.key)
        except (ssl.SSLError, ValueError) as e:
            raise CredentialsError(f"{self.cert} / {self.key}: not a certificate and its key ({e})") from None
        if self.ca:
            try:
                ssl.create_default_context(cafile=self.ca)
            except ssl.SSLError as e:
                raise CredentialsError(f"{self.ca}: not a CA certificate ({e})") from None

    def uvicorn_options(self) -> dict:
        options = {"ssl_certfile": self.cert, "ssl_keyfile": self.key}
        if self.ca:
            options.update(ssl_ca_certs=self.ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        return options

    def grpc_credentials(self):
        import grpc

        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_server_credentials([(read(self.key), read(self.cert))],
                                           root_certificates=read(self.ca) if self.ca else None,
                                           require_client_auth=self.ca is not None)

    def client_context(self) -> ssl.SSLContext:
        """The fan-out's: peers verified against `ca` (the system's CAs without one), this certificate
        presented to them."""
        ctx = ssl.create_default_context(cafile=self.ca)
        ctx.load_cert_chain(self.cert, self.key)
        return ctx
