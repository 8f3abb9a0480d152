"""The engine registry: engine name -> its adapter (kvidx/engines/<name>/adapter.py).

Every command that takes `--engine` (relay, shadow) or `--engines` (simulate) takes its choices from
here, so they accept the same names, and an unknown name is an error listing the registered ones.
The contract an adapter fulfils is in kvidx/engines/contract.py; adding an engine is a folder, its
registration below, its tests and its fixtures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from schemas.events import EventBatch


@dataclass
class RelayOptions:
    """What a relay needs to know about its engine beyond model, replica and index block size."""
    engine_version: str | None = None  # None: the adapter's newest checked release
    allow_unchecked_version: bool = False  # --allow-unchecked-engine-version: read as the nearest checked
    # KV-cache groups the engine's events leave unnamed (from --config)
    group_kinds: dict[int, tuple[str, int | None]] = field(default_factory=dict)
    engine_block_size: int | None = None  # engines whose events do not carry it (TensorRT-LLM polls)
    extra: dict[str, Any] = field(default_factory=dict)  # adapter-specific (vLLM: cpu_chunk_blocks, lmcache)


@dataclass(frozen=True)
class ShadowResult:
    agreement: Any  # kvidx.shadow.Agreement
    dead_letters: int
    extra: dict  # the adapter's own figures (LMCache's chunk counters ...)
    relays: dict = field(default_factory=dict)  # publisher -> its relay logic, as the replay left it
    set_aside: dict = field(default_factory=dict)  # (reason, event kind) -> single events set aside


def set_aside_counts(relays) -> dict[tuple[str, str], int]:
    """(reason, event kind) -> events set aside, over relays (each counts its own in `.set_aside`)."""
    total: dict[tuple[str, str], int] = {}
    for r in relays:
        for key, n in getattr(r, "set_aside", {}).items():
            total[key] = total.get(key, 0) + n
    return total


@dataclass(frozen=True)
class EngineAdapter:
    name: str
    summary: str
    versions: tuple[str, ...]  # the releases (or series) the adapter was checked against
    default_version: str | None  # what a relay assumes without --engine-version (None: asks the engine)
    recording: str  # what `relay --play` and `shadow` read: "frames" (ZMQ frames.jsonl) or "polls"
    live: str  # how a relay reaches the engine: "zmq" (PUB + replay ROUTER) or "http" (polling)
    # ZMQ engines: (model, replica, index_block_size, dp_rank, options) -> a SequencedRelay
    make_relay: Callable[..., Any] | None
    # the relay's batches of a recording, in time order: (receive time in ns, batch); `.dead_letters`
    # and `.extra()` on the returned object once consumed
    replay: Callable[..., Any]
    conformance: tuple[str, ...] = ()  # fixture folders (tests/fixtures/...) of its checked formats
    sim: str | None = None  # the fleet simulator's engine kind for it, if there is one
    shadow_defaults: dict = field(default_factory=dict)  # e.g. the replica name polls are credited to
    # more shadow figures of this engine: (recording, requests, model, index_block_size, options) -> dict
    shadow_extra: Callable[..., dict] | None = None
    # HTTP engines (relays/poller.py runs them): the relay logic (model, replica, index_block_size,
    # options, epoch=None), the engine's poll source (url), and the recording format of polls
    make_poll_relay: Callable[..., Any] | None = None
    http_source: Callable[[str], Any] | None = None
    read_polls: Callable[..., Any] | None = None
    poll_recorder: Callable[..., Any] | None = None
    # the engine's own `kvidx relay` options: adds them to an argparse argument group; `relay_extra`
    # reads them (args -> RelayOptions.extra). `relay_args_for`: the engines they apply to (default:
    # this one; vLLM's and LMCache's are one publisher's)
    relay_args: Callable[[Any], None] | None = None
    relay_extra: Callable[[Any], dict] | None = None
    relay_args_for: tuple[str, ...] = ()
    # where the relay binds the engine's connector's own feed from the command line (args -> endpoint)
    controller_endpoint: Callable[[Any], str | None] | None = None
    # an engine whose releases a conformance kit checks: release -> the pinned release it is read as
    # under --allow-unchecked-engine-version (None: pinned, or not a release number)
    unchecked_read_as: Callable[[str], str | None] | None = None

    def check_version(self, version: str | None) -> None:
        """Raise ValueError naming the checked releases for a version this adapter was not checked
        against (each adapter's wire module has the rule)."""
        if self.make_relay is not None:
            self.make_relay("check", "check", 16, None, RelayOptions(engine_version=version))


class Batches:
    """An adapter's replay of a recording: iterate for (recv_ns, step) in receive order, where
    `step()` feeds that engine message to its relay and returns the EventBatches it made. A message
    reaches the relay only when its step is called, so a consumer that stops at a time leaves the
    relays exactly as they were then."""

    def __init__(self, it: Iterator[tuple[int, Callable[[], list[EventBatch]]]], dead: Callable[[], int],
                 extra: Callable[[], dict] = dict, default_replica: Callable[[], str] = str,
                 relays: dict | None = None):
        self._it = it
        self.dead_letters = dead  # malformed engine messages met so far
        self.extra = extra  # adapter-specific counters, once consumed
        self.default_replica = default_replica  # who a request without "replica" was sent to
        self.relays = relays if relays is not None else {}  # endpoint -> relay logic, as met

    def __iter__(self):
        return self._it


_REGISTRY: dict[str, EngineAdapter] = {}
DEFAULT = "vllm"  # the engine `--engine` means when it is not given


def default_relay(model: str, replica: str, index_block_size: int, dp_rank: int | None = None) -> Any:
    """The default engine's relay logic with its default options (a recording played without --engine)."""
    return get(DEFAULT).make_relay(model, replica, index_block_size, dp_rank, RelayOptions())


def add_relay_args(parser) -> dict[str, tuple[tuple[str, ...], Any, str]]:
    """Every registered engine's own `kvidx relay` options, in a group per engine; returns dest ->
    (the engines it applies to, its default, its option string) for `misplaced_relay_args`."""
    owners = {}
    for name in names():
        adapter = get(name)
        if adapter.relay_args is None:
            continue
        group = parser.add_argument_group(f"{name} options")
        adapter.relay_args(group)
        applies_to = adapter.relay_args_for or (name,)
        for action in group._group_actions:  # argparse keeps a group's actions only there
            owners[action.dest] = (applies_to, action.default, action.option_strings[0])
    return owners


def misplaced_relay_args(args, owners: dict[str, tuple[tuple[str, ...], Any, str]]) -> str | None:
    """The first engine option given for an engine it does not apply to, as a one-line error."""
    for dest, (engines, default, option) in owners.items():
        if args.engine not in engines and getattr(args, dest, default) != default:
            return f"{option} is for --engine {' or '.join(engines)}, not {args.engine}"
    return None


def register(adapter: EngineAdapter) -> EngineAdapter:
    if adapter.name in _REGISTRY:
        raise ValueError(f"engine {adapter.name!r} is registered already")
    _REGISTRY[adapter.name] = adapter
    return adapter


def get(name: str) -> EngineAdapter:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r} (registered: {', '.join(names())})") from None


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def _register_builtin() -> None:
    from kvidx.engines.lmcache.adapter import ADAPTER as lmcache
    from kvidx.engines.mooncake.adapter import ADAPTER as mooncake
    from kvidx.engines.sglang.adapter import ADAPTER as sglang
    from kvidx.engines.trtllm.adapter import ADAPTER as trtllm
    from kvidx.engines.vllm.adapter import ADAPTER as vllm

    for a in (vllm, sglang, trtllm, lmcache, mooncake):
        register(a)


_register_builtin()
