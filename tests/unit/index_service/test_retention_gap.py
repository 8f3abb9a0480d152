"""What the follower counts as lost to the events topic's retention (index_service.follower.retention_gap):
only messages no snapshot of the partition had folded. The real-broker case is
tests/integration/test_retention_gap.py."""

from index_service.follower import retention_gap


def test_nothing_lost_while_a_snapshot_reaches_the_oldest_offset_kept():
    assert retention_gap([100, 9000], 5000) == 0  # an idle model's old snapshot beside a busy one's
    assert retention_gap([5000], 5000) == 0
    assert retention_gap([], 5000) == 0  # no snapshot: the partition is read from its start


def test_lost_from_the_furthest_snapshot_to_the_oldest_offset_kept():
    assert retention_gap([147], 220) == 73
    assert retention_gap([100, 300], 5000) == 4700
