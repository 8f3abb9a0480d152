"""An operator's mistakes get one clear line within seconds, never a traceback or a silent wait: every
command with an unreachable broker and with a missing input file, the kafka commands from another
directory, and the services stopping on SIGTERM while they wait for a broker (no broker needed). The
worker supervisor's configuration errors and a relay at a dead engine, on a real broker:
tests/integration/test_operator_errors.py."""

import time
import urllib.error
import urllib.request

import pytest

from tests.commands import DEAD, LIMIT_S, Running, run
from tests.helpers import LLAMA

FRAMES = str(LLAMA / "frames.jsonl")
REQUESTS = str(LLAMA / "requests.jsonl")
ONE_SHOT_UNREACHABLE = [
    ["relay", "--model", "m", "--play", FRAMES],
    ["replay", "--model", "m", "--until", "now"],
    ["checkpoint"],
    ["audit", "--from", "-1d"],
    ["feedback"],
    ["resync", "--model", "m"],
    ["demo", "--kafka"],
    ["simulate", "--kafka"],
]


@pytest.mark.parametrize("args", ONE_SHOT_UNREACHABLE, ids=lambda a: a[0])
def test_one_shot_commands_name_the_unreachable_broker(args):
    out = run([*args, "--bootstrap", DEAD])
    assert f"cannot reach Kafka at {DEAD}" in out and "connection refused" in out, out
    assert len([ln for ln in out.splitlines() if ln.strip()]) <= 3, out  # not 194 librdkafka lines


def test_no_bootstrap_at_all_is_one_line():
    out = run(["replay", "--model", "m", "--until", "now"])
    assert "KAFKA_BOOTSTRAP_SERVERS" in out and len(out.strip().splitlines()) == 1, out


@pytest.mark.parametrize("args", [
    ["relay", "--model", "m", "--endpoint", "tcp://127.0.0.1:5557"],
    ["serve", "--port", "0"],
    ["worker", "--web-port", "0"],
], ids=lambda a: a[0])
def test_services_say_which_broker_they_wait_for_and_stop_on_sigterm(args, tmp_path):
    extra = ["--data-dir", str(tmp_path / "w")] if args[0] == "worker" else []
    r = Running([*args, *extra, "--bootstrap", DEAD])
    try:
        line = r.wait_line("event=broker_unreachable", DEAD)
        assert "connection refused" in line
        r.wait_line("event=broker_unreachable", "attempt=2", timeout=LIMIT_S)  # keeps trying, says so
    finally:
        took = r.stop()
    assert took < 3.0, f"SIGTERM took {took:.1f}s:\n{r.output()}"
    assert "Traceback" not in r.output(), r.output()
    if args[0] == "worker":  # no second child was started after the SIGTERM
        assert r.output().count("event=worker_start") == 1, r.output()


def test_serve_healthz_says_why_it_is_not_ready():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = Running(["serve", "--port", str(port), "--bootstrap", DEAD])
    try:
        r.wait_line("event=serving", f":{port}")
        r.wait_line("event=broker_unreachable")
        deadline = time.monotonic() + LIMIT_S
        while True:  # the ready line comes as uvicorn binds: give it the moment it takes
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5)
                raise AssertionError("/healthz answered 200 without a broker")
            except urllib.error.HTTPError as e:
                assert e.code == 503
                assert f"cannot reach Kafka at {DEAD}" in e.read().decode()
                break
            except urllib.error.URLError:
                assert time.monotonic() < deadline, "the service does not listen"
                time.sleep(0.05)
    finally:
        r.stop()


@pytest.mark.parametrize("args,path", [
    (["relay", "--model", "m", "--play", "/nonexistent/frames.jsonl"], "/nonexistent/frames.jsonl"),
    (["relay", "--model", "m", "--play", REQUESTS], REQUESTS),
    (["replay", "--model", "m", "--until", "now", "--prompts", "/nonexistent/p.json"], "/nonexistent/p.json"),
    (["serve", "--auth-token-file", "/nonexistent/token"], "/nonexistent/token"),
    (["shadow", "--recording", "/nonexistent/f.jsonl", "--requests", REQUESTS], "/nonexistent/f.jsonl"),
    (["shadow", "--recording", FRAMES, "--requests", "/nonexistent/r.jsonl"], "/nonexistent/r.jsonl"),
    (["shadow", "--engine", "trtllm", "--recording", FRAMES, "--requests", REQUESTS], FRAMES),
    (["shadow", "--engine", "sglang", "--recording", FRAMES, "--requests", REQUESTS], FRAMES),
    (["relay", "--engine", "sglang", "--model", "m", "--play", FRAMES], FRAMES),
], ids=["relay-missing", "relay-requests-log", "replay-prompts", "serve-token", "shadow-recording",
        "shadow-requests", "shadow-trtllm-on-vllm", "shadow-sglang-on-vllm", "relay-sglang-on-vllm"])
def test_bad_input_files_are_named(args, path):
    # the broker is unreachable too: the file is checked first, before anything touches Kafka
    bootstrap = ["--bootstrap", DEAD] if args[0] in ("relay", "replay", "serve") else []
    out = run([*args, *bootstrap])
    assert path in out and out.startswith("error:"), out
    assert len(out.strip().splitlines()) == 1, out
    if "sglang" in args:
        assert "use --engine vllm" in out, out


def test_kafka_status_and_down_from_another_directory(tmp_path):
    state = tmp_path / "state"
    for cmd in ("status", "down"):
        out = run(["kafka", cmd], cwd=tmp_path, KVIDX_STATE_DIR=str(state))
        assert str(state) in out, out


@pytest.mark.parametrize("args, says", [
    (["serve", "--port", "18931", "--sglang-indexer", "qwen"], "expected MODEL=[HOST:]PORT"),
    (["serve", "--port", "18931", "--sglang-indexer", "qwen=18931"], "port 18931 is in use (or is --port)"),
    (["serve", "--port", "18931", "--sglang-indexer", "qwen=18932", "--sglang-indexer", "qwen=18933"],
     "model 'qwen' is given twice"),
    (["relay", "--engine", "vllm", "--model", "m", "--play", FRAMES, "--sglang-router-keys"],
     "--sglang-router-keys is for --engine sglang, not vllm"),
    (["relay", "--engine", "sglang", "--model", "m", "--play", FRAMES, "--cpu-chunk-blocks", "4"],
     "--cpu-chunk-blocks is for --engine vllm or lmcache, not sglang"),
], ids=["sglang-no-port", "sglang-http-port", "sglang-twice", "router-keys-not-sglang",
        "vllm-option-on-sglang"])
def test_new_router_api_flags_refuse_mistakes_in_one_line(args, says):
    out = run([*args, "--bootstrap", DEAD])
    assert says in out and out.startswith("error:") and len(out.strip().splitlines()) == 1, out


def test_relay_options_of_other_engines_carry_no_sglang_option():
    """`kvidx relay --engine mooncake` (whose relay takes its options as keywords) is not handed
    SGLang's router-keys option."""
    from argparse import Namespace

    from kvidx import engines
    from relays.main import relay_options as _relay_options

    args = Namespace(engine="mooncake", model="m", engine_version=None, block_size=None, config=None,
                     cpu_chunk_blocks=1, sglang_router_keys=False)
    opts = _relay_options(args)
    assert opts.extra == {}
    engines.get("mooncake").make_relay("m", "pool", 16, None, opts)  # no TypeError
    assert _relay_options(Namespace(**{**vars(args), "engine": "sglang", "sglang_router_keys": True})
                          ).extra == {"router_keys": True}


def test_an_unchecked_vllm_release_is_refused_in_one_line_or_run_with_a_warning():
    out = run(["relay", "--model", "m", "--engine-version", "0.35.0", "--play", FRAMES, "--bootstrap", DEAD])
    assert out.startswith("error: vLLM '0.35.0' was not checked") and len(out.strip().splitlines()) == 1, out
    assert "tests/conformance/run.sh vllm 0.35.0" in out and "--allow-unchecked-engine-version" in out
    # with the flag it goes on (to the broker here), said once, read as the newest checked release
    out = run(["relay", "--model", "m", "--engine-version", "0.35.0", "--allow-unchecked-engine-version",
               "--play", FRAMES, "--bootstrap", DEAD])
    assert "event=engine_version_unchecked engine=vllm version=0.35.0 read_as=0.34" in out, out
    assert f"cannot reach Kafka at {DEAD}" in out
    out = run(["relay", "--engine", "sglang", "--model", "m", "--allow-unchecked-engine-version",
               "--endpoint", "tcp://127.0.0.1:5557", "--bootstrap", DEAD])
    assert out.startswith("error: --allow-unchecked-engine-version is for --engine vllm"), out


def test_an_unchecked_release_shows_on_the_relays_metrics():
    import logging
    from argparse import Namespace

    from prometheus_client import REGISTRY

    from relays.main import unchecked_engine_version as _unchecked_engine_version

    args = Namespace(command="relay", engine="vllm", engine_version="0.36.1",
                     allow_unchecked_engine_version=True)
    _unchecked_engine_version(args, logging.getLogger("test"))
    assert REGISTRY.get_sample_value("kvidx_relay_engine_version_unchecked",
                                     {"engine": "vllm", "version": "0.36.1", "read_as": "0.34"}) == 1
    args.engine_version = "0.34.0"  # a checked release: nothing said
    _unchecked_engine_version(args, logging.getLogger("test"))
    assert REGISTRY.get_sample_value("kvidx_relay_engine_version_unchecked",
                                     {"engine": "vllm", "version": "0.34.0", "read_as": "0.34"}) is None


@pytest.mark.parametrize("args", [
    ["relay", "--model", "m", "--endpoint", "tcp://127.0.0.1:5557"],
    ["worker", "--web-port", "0", "--no-supervise"],
], ids=lambda a: a[0])
def test_a_metrics_port_in_use_is_one_line_before_the_broker_wait(args):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t = time.monotonic()
        out = run([*args, "--metrics-port", str(port), "--bootstrap", DEAD])
    assert f"{port} is in use" in out and out.startswith("error:") and len(out.strip().splitlines()) == 1, out
    assert time.monotonic() - t < LIMIT_S, out
