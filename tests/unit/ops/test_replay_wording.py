"""`kvidx replay`'s summary line says how far back a replay is exact in words (a topic never truncated
once read "exact back to unknown")."""

from kvidx.kafka.log import iso
from kvidx.ops.replay import _exact_since


def test_how_far_back_a_replay_is_exact():
    assert _exact_since(0.0) == "a replay is exact back to the topic's first event"
    assert _exact_since(1764500000.0) == f"a replay is exact back to {iso(1764500000.0)}"
    assert "exact for no earlier time" in _exact_since(None)
