"""A consumer's view of a job: the token log and the live channel merged into one
contiguous stream of events, whatever tokens each event carries."""

from __future__ import annotations

from tokenfleet.client.protocol import EventCursor
from tokenfleet.shared.wire.serialization import end_event, parse_event, token_event
from tokenfleet.shared.wire.schemas import FinishReason, JobStatus, TokenEvent


def tokens(events: list[TokenEvent]) -> tuple[list[int], str]:
    return [t for e in events for t in e.token_ids], "".join(e.text for e in events)


def test_events_of_several_tokens_follow_each_other_and_the_end_closes_the_stream() -> None:
    cursor = EventCursor()
    assert cursor.feed(token_event(0, [7], ["a"]))
    assert cursor.feed(token_event(1, [8, 9, 10], ["b", "", "cd"]))
    assert cursor.feed(token_event(4, [11], ["e"]))
    assert cursor.feed(end_event(JobStatus.SUCCEEDED, FinishReason.LENGTH, None))
    events = cursor.take()
    assert [(e.index, e.end) for e in events] == [(0, 1), (1, 4), (4, 5)]
    assert tokens(events) == ([7, 8, 9, 10, 11], "abcde") and cursor.ended
    assert cursor.log_after() == "(0-5"  # the next entry: the one that ends past token 5


def test_an_event_seen_already_is_skipped_and_one_past_a_gap_asks_for_the_log() -> None:
    cursor = EventCursor()
    cursor.feed(token_event(0, [1, 2], ["a", "b"]))
    assert cursor.feed(token_event(0, [1, 2], ["a", "b"]))  # a redelivery
    assert not cursor.feed(token_event(3, [4], ["d"]))  # token 2 is missing: re-read the log
    assert tokens(cursor.take()) == ([1, 2], "ab")


def test_an_event_that_overlaps_what_was_seen_gives_only_its_new_tokens() -> None:
    # The log lost tokens a consumer had been sent (a failover), and a new
    # attempt made them again, cut into events at other tokens.
    cursor = EventCursor()
    cursor.feed(token_event(0, [1, 2, 3], ["a", "bb", ""]))
    assert cursor.feed(token_event(2, [3, 4, 5, 6], ["", "cc", "d", "e"]))
    events = cursor.take()
    assert tokens(events) == ([1, 2, 3, 4, 5, 6], "abbccde")
    assert [(e.index, e.end) for e in events] == [(0, 3), (3, 6)]
    assert events[1].offsets == [2, 3, 4]


def test_an_event_cut_after_a_token_keeps_each_tokens_text() -> None:
    event = parse_event(token_event(10, [1, 2, 3, 4], ["a", "", "bc", "d"]))
    assert isinstance(event, TokenEvent) and event.offsets == [1, 1, 3, 4]
    assert event.after(10) is event
    rest = event.after(12)
    assert (rest.index, rest.token_ids, rest.text, rest.offsets) == (12, [3, 4], "bcd", [2, 3])
    last = event.after(13)
    assert (last.index, last.token_ids, last.text, last.offsets) == (13, [4], "d", None)
