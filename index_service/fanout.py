"""Answering for replica groups this instance does not hold (kvidx.core.groups): ask the instances
that hold them, merge (schemas.answers.merge_replicas).

How instances find each other: what the deployment already has. Each `kvidx serve` announces itself
on the compacted topic `kvidx.instances.v1` (key = its name; its URL, the groups it holds, a
timestamp) every few seconds and reads everyone's announcements (`Announcer`); an instance whose last
announcement is older than three intervals is taken for gone. Or a static list (`--peer URL=G,G`).

A lookup asks, for the groups it misses, the fewest live instances that hold them (their own
`POST /v1/lookup` or `/v1/rank` with `?local=1&groups=...`: answered from their shard alone, never
fanned out again), all at once, with one timeout; a group no instance answered for in time is named
in the answer (`partial`, `missing_groups`), never waited for longer.

Instances authenticate each other with a token: each request carries this instance's own (its
credentials' `peer` entry, index_service.auth.Credentials.peer_token, read again when the file changes),
which the peer checks like any caller's (scope `read`; `admin` for the /internal/ routes).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgspec

from index_service.wire import Reject
from kvidx.core.groups import parse_groups
from kvidx.kafka.background import Background
from schemas.answers import LOOKUP_ANSWER_DECODER, ReplicaAnswer

log = logging.getLogger("kvidx.service")

ANNOUNCE_VERSION = 1


LOCAL_ONLY = frozenset[int]()  # `?local=1` without groups: every replica of this instance's shard


def local_groups(q) -> frozenset[int] | None:
    """`?local=1[&groups=G,G]` (query params): another instance's fan-out, answered from this instance's
    shard alone (the replicas of those replica groups; LOCAL_ONLY: all of them); None for a router's
    request. Reject(422) for groups that do not parse. Every fanned-out route reads it here."""
    if q.get("local") != "1":
        return None
    spec = q.get("groups")
    if spec is None:
        return LOCAL_ONLY
    try:
        return parse_groups(spec, "query parameter 'groups'")
    except ValueError as e:
        raise Reject(422, str(e)) from None


class Announcement(msgspec.Struct):
    """What an instance says of itself on the instances topic."""
    v: int
    name: str
    url: str  # where its lookup API answers (http://host:port)
    groups: list[int] | None  # the replica groups it holds (None: all)
    ts: float


@dataclass
class Peer:
    name: str
    url: str
    groups: frozenset[int] | None  # None: all
    seen: float  # when it last announced itself (static peers: always now)
    static: bool = False

    def holds(self, group: int) -> bool:
        return self.groups is None or group in self.groups


class PeerDirectory:
    """The other instances and the groups they hold: announced (Kafka) or listed (`--peer`)."""

    def __init__(self, own_name: str, stale_s: float = 6.0):
        self.own_name = own_name
        self.stale_s = stale_s
        self.peers: dict[str, Peer] = {}

    def add_static(self, url: str, groups: frozenset[int] | None) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError("a peer is given as http://host:port (https:// with --tls-cert)")
        self.peers[url] = Peer(url, url.rstrip("/"), groups, 0.0, static=True)

    def announced(self, a: Announcement) -> None:
        if a.name != self.own_name:
            groups = None if a.groups is None else frozenset(a.groups)
            self.peers[a.name] = Peer(a.name, a.url.rstrip("/"), groups, a.ts)

    def gone(self, name: str) -> None:
        """An instance that stopped (its announcement deleted)."""
        self.peers.pop(name, None)

    def alive(self, now: float | None = None) -> list[Peer]:
        now = time.time() if now is None else now
        return sorted((p for p in self.peers.values() if p.static or now - p.seen <= self.stale_s),
                      key=lambda p: p.name)

    def plan(self, groups: list[int], now: float | None = None, skip: frozenset[str] = frozenset()
             ) -> tuple[dict[str, tuple[Peer, list[int]]], list[int]]:
        """The fewest live peers that hold `groups` (greedy: the one holding most of those left first),
        not those in `skip`: (peer name -> (peer, the groups asked of it), the groups nobody holds)."""
        left, asked = set(groups), {}
        peers = [p for p in self.alive(now) if p.name not in skip]
        while left:
            best = max(peers, key=lambda p: sum(1 for g in left if p.holds(g)), default=None)
            mine = sorted(g for g in left if best is not None and best.holds(g))
            if not mine:
                break
            asked[best.name] = (best, mine)
            left -= set(mine)
            peers = [p for p in peers if p.name != best.name]
        return asked, sorted(left)


class PeerError(Exception):
    pass


class Http1Pool:
    """Keep-alive HTTP/1.1 connections to one peer, for the one request shape fan-out sends (a POST with
    a JSON body; the answer framed by Content-Length, as the service sends it). A general client
    (httpx) cost ~1 ms of CPU per request here, more than the lookup it carries. `auth()`: the
    Authorization header line each request carries (b"" for none), asked per request (tokens rotate).
    An https:// peer is reached over TLS with `tls` (index_service.auth.TlsFiles.client_context; the
    system's CAs without one)."""

    def __init__(self, url: str, headers: bytes, auth: Callable[[], bytes] = bytes,
                 tls: ssl.SSLContext | None = None):
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"peer URL {url!r}: fan-out speaks http://host:port or https://host:port")
        self.host, self.port = u.hostname, u.port or (443 if u.scheme == "https" else 80)
        self.tls = (tls or ssl.create_default_context()) if u.scheme == "https" else None
        self.headers = headers
        self.auth = auth
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.idle:  # a kept connection the peer may have closed meanwhile (its keep-alive timeout)
            try:
                return await self._post(self.idle.pop(), path, body)
            except (asyncio.IncompleteReadError, ConnectionError) as e:
                if getattr(e, "partial", b""):  # it had started answering: not a stale connection
                    raise
        return await self._post(await asyncio.open_connection(self.host, self.port, ssl=self.tls), path, body)

    async def _post(self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], path: str, body: bytes
                    ) -> tuple[int, bytes]:
        reader, writer = conn
        try:
            writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n%s\r\n"
                         % (path.encode(), self.host.encode(), len(body), self.headers + self.auth()) + body)
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            status = int(lines[0].split(b" ", 2)[1])
            length = next((int(v) for k, _, v in (ln.partition(b":") for ln in lines[1:])
                           if k.strip().lower() == b"content-length"), None)
            if length is None:
                raise PeerError("answer without Content-Length")
            data = await reader.readexactly(length)
        except BaseException:  # an error, the timeout (cancelled): the connection's state is unknown
            writer.close()
            raise
        if b"connection: close" in head.lower():
            writer.close()
        else:
            self.idle.append((reader, writer))
        return status, data

    def close(self) -> None:
        for _, w in self.idle:
            w.close()
        self.idle.clear()


class Fanout:
    """The remote half of a lookup over replica groups (see the module docstring)."""

    def __init__(self, directory: PeerDirectory, timeout_s: float = 0.25,
                 auth_token: str | Callable[[], str | None] | None = None, tls: ssl.SSLContext | None = None):
        """`auth_token`: the token sent to the peers, or what gives it per request (e.g.
        Credentials.peer_token); `tls`: how https:// peers are reached (Http1Pool)."""
        self.directory = directory
        self.timeout_s = timeout_s
        self.tls = tls
        self._token = auth_token if callable(auth_token) else (lambda: auth_token)
        # (peer URL, content type) -> its connections (in the serving loop)
        self._pools: dict[tuple[str, str], Http1Pool] = {}

    async def gather(self, model: str, groups: list[int], hashes: Sequence[int], n_tokens: int, rank: bool,
                     top_k: int | None) -> tuple[list[list[ReplicaAnswer]], list[int], int]:
        """The per-replica answers of `groups` from the peers holding them: (one list per peer, the
        groups missing (no live holder, an error or the timeout), how many peers knew the model)."""
        body = msgspec.json.encode({"model": model, "block_hashes": list(hashes), "prompt_tokens": n_tokens,
                                    "top_k": top_k})
        raws, gone, knew = await self.gather_raw("/v1/rank" if rank else "/v1/lookup", groups, body)
        return [LOOKUP_ANSWER_DECODER.decode(r).replicas for r in raws], gone, knew

    async def gather_raw(self, path: str, groups: list[int], body: bytes,
                         content_type: str = "application/json") -> tuple[list[bytes], list[int], int]:
        """The answers of the peers holding `groups` to `POST path?local=1&groups=...` (answered from
        their shards alone): the fewest live holders, all at once, one timeout. (their 200 bodies, the
        groups missing (no live holder, an error or the timeout), how many answered 200)."""
        deadline = time.monotonic() + self.timeout_s
        parts, knew, failed, left = [], 0, set(), list(groups)
        while left:  # a peer that fails: its groups asked of another holder, while time is left
            asked, missing = self.directory.plan(left, skip=frozenset(failed))
            names = list(asked)
            wait = deadline - time.monotonic()
            if not names or wait <= 0:
                return parts, sorted(left), knew
            results = await asyncio.gather(*(self._ask(asked[n][0], path, asked[n][1], body, wait,
                                                       content_type) for n in names))
            left = list(missing)
            for name, res in zip(names, results, strict=True):
                if res is None:
                    failed.add(name)
                    left += asked[name][1]
                elif res is not False:
                    parts.append(res)
                    knew += 1
            if not any(res is None for res in results):
                return parts, sorted(left), knew
        return parts, [], knew

    async def _ask(self, peer: Peer, path: str, groups: list[int], body: bytes, timeout_s: float,
                   content_type: str) -> bytes | bool | None:
        """The peer's answer for `groups`; False if it does not know the model (no replica of those
        groups has published yet: 404); None on an error or the timeout."""
        pool = self._pools.get((peer.url, content_type))
        if pool is None:
            headers = b"Content-Type: %s\r\n" % content_type.encode()
            pool = self._pools[(peer.url, content_type)] = Http1Pool(peer.url, headers, self._auth, self.tls)
        try:
            status, data = await asyncio.wait_for(
                pool.post(f"{path}?local=1&groups={','.join(map(str, groups))}", body), timeout_s)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError, PeerError) as e:
            log.warning("event=fanout_failed peer=%s error=%r", peer.name, str(e)[:200] or type(e).__name__)
            return None
        if status == 404:
            return False
        if status != 200:
            log.warning("event=fanout_failed peer=%s status=%d body=%r", peer.name, status, data[:200])
            return None
        return data

    def _auth(self) -> bytes:
        token = self._token()
        return b"Authorization: Bearer %s\r\n" % token.encode() if token else b""

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()


class Announcer(Background):
    """This instance's announcements on the instances topic, and everyone's read into a directory."""

    thread_name = "kvidx-announcer"

    def __init__(self, directory: PeerDirectory, bootstrap: str, topic: str, url: str,
                 groups: frozenset[int] | None, interval_s: float = 2.0):
        self.directory = directory
        self.bootstrap = bootstrap
        self.topic = topic
        self.own = Announcement(ANNOUNCE_VERSION, directory.own_name, url,
                                None if groups is None else sorted(groups), 0.0)
        self.interval_s = interval_s
        super().__init__()

    def run(self) -> None:
        from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

        from kvidx.kafka.config import client_config

        producer = Producer({**client_config(), "bootstrap.servers": self.bootstrap, "linger.ms": 0})
        consumer = Consumer({**client_config(), "bootstrap.servers": self.bootstrap,
                             "group.id": f"kvidx-announcer-{time.time_ns()}", "enable.auto.commit": False})
        consumer.assign([TopicPartition(self.topic, 0, OFFSET_BEGINNING)])
        decode = msgspec.json.Decoder(Announcement).decode
        next_at = 0.0
        key = self.own.name.encode()
        try:
            while not self.stop_event.is_set():
                now = time.time()
                if now >= next_at:
                    next_at = now + self.interval_s
                    self.own.ts = now
                    producer.produce(self.topic, key=key, value=msgspec.json.encode(self.own))
                    producer.poll(0)
                for msg in consumer.consume(100, 0.2):
                    if msg.error():
                        continue
                    if msg.value() is None:  # a stopped instance's tombstone
                        self.directory.gone(msg.key().decode(errors="replace"))
                        continue
                    try:
                        a = decode(msg.value())
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        continue
                    if a.v == ANNOUNCE_VERSION:
                        self.directory.announced(a)
        finally:
            consumer.close()
            producer.produce(self.topic, key=key, value=None)  # stopping: gone at once, not when stale
            producer.flush(5)
