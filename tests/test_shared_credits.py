"""The credits a worker's partitions' feeders share: dealt in turn among the
partitions with work, all of them to the one busy partition."""

from __future__ import annotations

from tokenfleet.workers.shared_credits import SharedCredits

PARTS = ["q#0", "q#1", "q#2"]


def test_one_credit_at_a_time_goes_to_the_partitions_in_turn() -> None:
    credits = SharedCredits(PARTS)
    took = []
    for _ in range(9):
        # Whichever feeder asks first, only the one whose turn it is gets the credit.
        taker = next(p for p in reversed(PARTS) if credits.share(p, 1))
        credits.found(taker, 1)
        took.append(taker)
    assert took == PARTS * 3


def test_busy_partitions_share_the_credits_and_an_empty_one_leaves_them_its_part() -> None:
    credits = SharedCredits(PARTS)
    assert [credits.share(p, 7) for p in PARTS] == [3, 2, 2]
    credits.found("q#1", 0)  # empty: out of the deal until it finds an entry again
    credits.found("q#2", 0)
    assert credits.share("q#0", 7) == 7
    assert credits.share("q#1", 7) == 3  # asking again, it is dealt in (after q#0: 4)
    credits.found("q#2", 5)
    assert credits.share("q#0", 6) == 3 and credits.share("q#2", 6) == 3
    assert credits.share("q#0", 0) == 0


def test_a_queue_of_one_partition_gets_every_credit() -> None:
    credits = SharedCredits(["q"])
    assert credits.share("q", 5) == 5
    credits.found("q", 0)
    assert credits.share("q", 5) == 5
