"""The inter-token histogram: its samples are what prometheus_client's own
Histogram shows for the same observations, counts taken in one call."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenfleet.workers.metrics import LATENCY
from tokenfleet.workers.step_histogram import StepHistogram

# On a bound (le counts it), between bounds, below the first, past the last.
OBSERVED = [(0.001, 3), (0.004, 64), (0.01, 1), (0.0001, 2), (90.0, 1), (0.25, 5)]


def scraped(make: type) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    if make is Histogram:
        child = Histogram("itl_seconds", "doc", ["queue"], buckets=LATENCY,
                          registry=registry).labels("q")
        for value, count in OBSERVED:
            for _ in range(count):
                child.observe(value)
    else:
        many = StepHistogram("itl_seconds", "doc", "queue", LATENCY, registry).labels("q")
        for value, count in OBSERVED:
            many.observe(value, count)
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_many_equal_observations_in_one_call_expose_what_one_at_a_time_does() -> None:
    mine, theirs = scraped(StepHistogram), scraped(Histogram)
    assert mine.keys() == theirs.keys()  # the same samples: buckets by le, count, sum, created
    for key, value in theirs.items():
        if not key[0].endswith("_created"):  # a timestamp: when each was made
            assert mine[key] == pytest.approx(value), key
