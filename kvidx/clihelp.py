"""What every `kvidx` parser shares: one help formatter, the common options, renamed options' old names."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class HelpFormatter(argparse.HelpFormatter):
    """Shows an option's default once, and only a meaningful one: not None, False, empty or suppressed
    (argparse.ArgumentDefaultsHelpFormatter prints "default: None" for every option without one), and
    not when the help already says what its default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if (d is None or d is argparse.SUPPRESS or isinstance(d, bool) or d == "" or d == []
                or "%(default)" in text or "default:" in text):
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            text += " (default: %(default)s)"
        return text


class DeprecatedAlias(argparse.Action):
    """The old spelling of a renamed option: still accepted, hidden from --help, warns on stderr."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs) -> None:
        kwargs["help"] = argparse.SUPPRESS
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"{parser.prog}: warning: {option_string} is deprecated, use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def log_level(value: str) -> str:
    """Case-insensitive log level: `--log-level debug` is DEBUG."""
    return value.upper()


def add_common_options(p: argparse.ArgumentParser, top: bool) -> None:
    """--log-level and --kafka-config. On the top parser they carry the defaults; on every subcommand
    they default to SUPPRESS, so `kvidx --log-level debug serve` is not reset by serve's own default
    and `kvidx serve --log-level debug` works too."""
    level = os.environ.get("KVIDX_LOG_LEVEL", "INFO").upper()
    g = p.add_argument_group("common options (before or after the command)") if not top else p
    g.add_argument("--log-level", type=log_level, choices=LOG_LEVELS, metavar="LEVEL",
                   default=level if top else argparse.SUPPRESS,
                   help=f"log level, any case: {', '.join(LOG_LEVELS)}; or set $KVIDX_LOG_LEVEL "
                        f"(default: {level})")
    g.add_argument("--kafka-config", metavar="FILE", default=None if top else argparse.SUPPRESS,
                   help="JSON file of librdkafka settings for every Kafka client (TLS, SASL ...; or set "
                        "$KVIDX_KAFKA_CONFIG)")


def subparsers_of(p: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """Every parser below p (subcommands, their subcommands ...), each once (aliases share one)."""
    seen: set[int] = set()
    todo = [p]
    while todo:
        for a in todo.pop()._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sp in a.choices.values():
                    if id(sp) not in seen:
                        seen.add(id(sp))
                        todo.append(sp)
                        yield sp


def finish(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give every parser of the tree the shared formatter and the common options."""
    p.formatter_class = HelpFormatter
    for sp in subparsers_of(p):
        sp.formatter_class = HelpFormatter
        add_common_options(sp, top=False)
    return p


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("kvidx")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "0+unknown"
