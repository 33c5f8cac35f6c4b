"""The priority rule: of every 7 jobs a busy worker takes, 4 high, 2 normal, 1 low."""

from __future__ import annotations

from collections import Counter

from tokenfleet.workers.feeder import Turns


def test_turns_deal_four_two_one_round_after_round() -> None:
    turns = Turns()
    dealt: Counter[str] = Counter()
    for _ in range(70):
        dealt.update({k: v for k, v in turns.deal(1).items() if v})
    assert dealt == {"high": 40, "normal": 20, "low": 10}


def test_a_large_deal_has_every_level_in_it() -> None:
    # The batch level is dealt nothing: it takes only what the live levels leave.
    assert Turns().deal(7) == {"high": 4, "normal": 2, "low": 1, "batch": 0}
    assert sum(Turns().deal(20).values()) == 20
