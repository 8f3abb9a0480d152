"""`kvidx demo` as a newcomer runs it (in process, no broker): exit 0, the agreement line, and no error
line on a good run. Through Kafka: tests/integration/test_demo.py."""

from tests.commands import demo_agreement, run_demo


def test_demo_in_process():
    p = run_demo()
    assert p.returncode == 0, p.stderr
    assert demo_agreement(p.stdout)["requests"] == 40
    assert "status=404" not in p.stderr and "HTTP/1.1 404" not in p.stderr
    assert "level=WARNING" not in p.stderr and "level=ERROR" not in p.stderr
