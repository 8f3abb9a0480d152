"""What callers may make the service do, checked before it costs anything: the endpoint allow-list
(every address a registration or a feed gives the service, before a connection, a DNS lookup or a
record is made), the names that reach logs, metrics and topics (length and characters), the bounds of
block sizes and counts, and decoding with the nesting depth bounded.

The allow-list (`kvidx serve --allow-endpoints`, or `allow_endpoints` in --config): comma-separated
CIDRs (`10.0.0.0/8`, `fd00::/8`, a bare address) and host-name patterns (`*.svc.cluster.local`,
`vllm-0`; fnmatch-style, case-insensitive: `*` matches any characters, dots included). `ipc://`
endpoints are this machine's: allowed where loopback is. `any` allows everything (an operator's
explicit choice).
The default, DEFAULT_ALLOW: loopback and the private ranges (RFC 1918, IPv6 unique-local) and the
host `localhost`; host names are never resolved to decide (a name that resolves somewhere private is
still refused unless a pattern names it), and link-local (169.254.0.0/16: cloud metadata services) and
public addresses are refused.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import msgspec

DEFAULT_ALLOW = ("127.0.0.0/8", "::1/128", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7",
                 "localhost")
MAX_NAME = 256  # a model, replica, endpoint, worker id, tenant ...: longer is refused
MAX_BLOCK_SIZE = 1 << 16  # tokens per block: engines use 16 .. 1,024; Dynamo's and the conductor's too
MAX_DP_RANK = (1 << 16) - 1
MAX_DEPTH_ERROR = "nested too deeply"
# requests a second each client may make to the write and admin routes (index_service.limits), and
# `kvidx serve`'s defaults for them; 0: no limit
DEFAULT_RATES = {"write": 20_000.0, "admin": 20.0}
# control characters (C0, DEL, C1) and Unicode line/paragraph separators: a name with one could forge a
# log line or a metric line
_BAD_CHARS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def name_error(field: str, value: str, max_len: int = MAX_NAME, empty_ok: bool = False) -> str | None:
    """Why `value` cannot be a name (None: it can), naming the field; the value itself is not echoed
    back where it holds a control character."""
    if not value and not empty_ok:
        return f"{field} must not be empty"
    if len(value) > max_len:
        return f"{field} is {len(value)} characters long, at most {max_len}"
    m = _BAD_CHARS.search(value)
    if m is not None:
        return f"{field} holds a control character (U+{ord(m.group()):04X} at {m.start()}): not allowed"
    return None


# Names in request structs: what msgspec checks while decoding (its message names the field).
NAME_PATTERN = "^[^\x00-\x1f\x7f-\x9f\u2028\u2029]*$"


def endpoint_host(endpoint: str) -> tuple[str | None, str | None]:
    """(host, None) for "tcp://host:port", "http(s)://host[:port]/...", "host:port" or "[v6]:port";
    ("", None) for ipc:// (this machine); (None, why) when no host can be read."""
    scheme, sep, rest = endpoint.partition("://")
    if sep and scheme.lower() == "ipc":
        return "", None
    if sep and scheme.lower() == "inproc":
        return None, "inproc:// is inside one process: not an engine's endpoint"
    try:
        host = urlsplit(endpoint if sep else f"//{endpoint}").hostname
    except ValueError as e:
        return None, str(e)
    return (host, None) if host else (None, "no host in it")


class EndpointAllowList:
    """CIDRs and host patterns; `error(field, endpoint)` says why an endpoint is refused (None: allowed)."""

    def __init__(self, entries: list[str] | tuple[str, ...] = DEFAULT_ALLOW):
        self.text = ",".join(entries)
        self.any = False
        self.nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        self.patterns: list[str] = []
        for e in (x.strip() for x in entries):
            if not e:
                continue
            if e.lower() == "any":
                self.any = True
                continue
            try:
                self.nets.append(ipaddress.ip_network(e, strict=False))
                continue
            except ValueError:
                pass
            if "/" in e or not re.fullmatch(r"[A-Za-z0-9*?.\-_]+", e):
                raise ValueError(f"allow-list entry {e!r} is neither a CIDR nor a host pattern")
            self.patterns.append(e.lower())
        self.loopback = self.any or any(n.overlaps(ipaddress.ip_network("127.0.0.1/32")) for n in self.nets
                                        if n.version == 4)

    @classmethod
    def parse(cls, text: str) -> EndpointAllowList:
        """`--allow-endpoints` text; ValueError naming the entry that is neither CIDR nor pattern."""
        return cls([x for x in text.split(",") if x.strip()])

    def allows_host(self, host: str) -> bool:
        if self.any:
            return True
        if host == "":  # ipc://: this machine
            return self.loopback
        try:
            ip = ipaddress.ip_address(host.strip("[]").split("%")[0])
        except ValueError:
            name = host.lower().rstrip(".")
            return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)
        if ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in n for n in self.nets)

    def error(self, field: str, endpoint: str) -> str | None:
        bad = name_error(field, endpoint)
        if bad is not None:
            return bad
        host, why = endpoint_host(endpoint)
        if host is None:
            return f"{field} {endpoint!r}: {why}"
        if not self.allows_host(host):
            return (f"{field} {endpoint!r} is outside the endpoint allow-list ({self.text}; "
                    "kvidx serve --allow-endpoints): no connection is made")
        return None


def int_error(field: str, value: Any, low: int, high: int) -> str | None:
    """Why `value` is not an integer in low..high (None: it is), naming the field."""
    if not isinstance(value, int) or isinstance(value, bool):
        return f"{field} must be an integer"
    if not low <= value <= high:
        return f"{field} must be in {low}..{high}, got {value if abs(value) < 1 << 80 else 'a huge number'}"
    return None


def bounded(decode: Callable[[bytes], Any], body: bytes) -> Any:
    """decode(body), with a body nested deeper than the decoder's recursion limit a msgspec.DecodeError
    (the caller's 400) rather than a RecursionError (a 500 and a traceback)."""
    try:
        return decode(body)
    except RecursionError:
        raise msgspec.DecodeError(MAX_DEPTH_ERROR) from None
