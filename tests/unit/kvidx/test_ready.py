"""`kvidx wait-ready`: 0 once the URL answers 200 while the process runs; one line naming the process
and its log's last line when the process dies first; the last answer when it never gets ready."""

import http.server
import subprocess
import sys
import threading

import pytest

from kvidx.ready import wait_ready


@pytest.fixture
def server():
    status = {"code": 503}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = b'{"status": "ok"}' if status["code"] == 200 else b'{"error": "rebuilding shards"}'
            self.send_response(status["code"])
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/healthz", status
    httpd.shutdown()
    httpd.server_close()


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvidx.cli", "wait-ready", *args], capture_output=True,
                          text=True, timeout=60)


def test_ready_once_the_url_answers_200_while_the_process_runs(server, tmp_path):
    url, status = server
    status["code"] = 200
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        p = cli(url, "--pid", str(sleeper.pid), "--log", str(tmp_path / "x.log"), "--timeout", "30")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert p.returncode == 0 and p.stderr == "", p.stderr


def test_a_process_that_died_is_named_with_its_logs_last_line(server, tmp_path):
    """Another process answering on the port (200 here) does not make a dead process ready."""
    url, status = server
    status["code"] = 200
    log = tmp_path / "worker.log"
    log.write_text("event=worker_start\nerror: port 6066 is in use (another worker?): pass --web-port N\n")
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(78)"])
    dead.wait()
    p = cli(url, "--pid", str(dead.pid), "--log", str(log))
    assert p.returncode == 1
    assert p.stderr.strip() == (f"error: pid {dead.pid} exited before {url} answered; {log}'s last line: "
                                "error: port 6066 is in use (another worker?): pass --web-port N")


def test_never_ready_says_the_last_answer(server, tmp_path):
    url, _ = server  # 503 throughout
    reason = wait_ready(url, None, None, timeout_s=0.3, interval_s=0.05)
    assert reason == f'{url} not ready after 0.3 s (last answer: 503 {{"error": "rebuilding shards"}})'
    p = cli(url, "--timeout", "0")
    assert p.returncode == 2 and p.stderr.strip() == "error: --timeout must be > 0 seconds"
