"""`kvidx ... --help` (no Kafka): every option of every subcommand explains itself, a default is shown
once and never as None, the common options work before and after the command, old names still parse."""

import argparse
import subprocess
import sys

import pytest

from kvidx.cli import build_parser
from kvidx.clihelp import HelpFormatter, subparsers_of

PARSER = build_parser()
ALL = [PARSER, *subparsers_of(PARSER)]


@pytest.mark.parametrize("parser", ALL, ids=[p.prog for p in ALL])
def test_every_option_has_help_and_one_default(parser: argparse.ArgumentParser):
    fmt = HelpFormatter(parser.prog)
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction) or a.help == argparse.SUPPRESS:
            continue
        assert a.help, f"{parser.prog} {a.option_strings}: no help"
        text = fmt._expand_help(a)
        assert "None" not in text, f"{parser.prog} {a.option_strings}: {text}"
        assert text.count("default:") <= 1, f"{parser.prog} {a.option_strings}: {text}"
    assert parser.formatter_class is HelpFormatter
    parser.format_help()  # renders


def test_worker_and_serve_are_described():
    for name in ("worker", "serve"):
        assert len(PARSER._subparsers._group_actions[0].choices[name].description) > 100


@pytest.mark.parametrize("argv,level", [
    (["--log-level", "debug", "serve"], "DEBUG"),
    (["serve", "--log-level", "warning"], "WARNING"),
    (["--log-level", "debug", "serve", "--log-level", "Error"], "ERROR"),
    (["kafka", "up", "--log-level", "error"], "ERROR"),
])
def test_log_level_before_or_after_the_command(argv, level):
    assert build_parser().parse_args(argv).log_level == level


def test_log_level_default_and_bad_choice(capsys):
    assert build_parser().parse_args(["serve"]).log_level in ("DEBUG", "INFO", "WARNING", "ERROR")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--log-level", "loud"])
    assert "invalid choice" in capsys.readouterr().err


def test_kafka_config_after_the_command():
    p = build_parser()
    assert p.parse_args(["serve", "--kafka-config", "k.json"]).kafka_config == "k.json"
    assert p.parse_args(["--kafka-config", "k.json", "serve"]).kafka_config == "k.json"
    assert p.parse_args(["serve"]).kafka_config is None


def test_engine_block_size_and_its_deprecated_alias(capsys):
    p = build_parser()
    assert p.parse_args(["relay", "--model", "m", "--engine-block-size", "64"]).block_size == 64
    assert p.parse_args(["relay", "--model", "m", "--block-size", "32"]).block_size == 32
    assert "deprecated" in capsys.readouterr().err
    relay_help = PARSER._subparsers._group_actions[0].choices["relay"].format_help()
    assert "--engine-block-size" in relay_help and "--block-size" not in relay_help


def test_version():
    out = subprocess.run([sys.executable, "-m", "kvidx.cli", "--version"], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("kvidx ") and len(out.split()) == 2
