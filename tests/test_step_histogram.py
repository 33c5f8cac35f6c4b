"""The inter-token histogram: its samples are what prometheus_client's own
Histogram shows for the same observations, counts taken in one call."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from tokenfleet.workers.metrics import LATENCY
from tokenfleet.workers.step_histogram import StepHistogram

# On a bound (le counts it), between bounds, below the first, past the last.
OBSERVED = [(0.001, 3), (0.004, 64), (0.01, 1), (0.0001, 2), (90.0, 1), (0.25, 5)]


def exposition(make: type) -> list[str]:
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
    # prometheus_client's own adds a _created sample: the one difference
    return [line for line in generate_latest(registry).decode().splitlines()
            if "_created" not in line]


def test_many_equal_observations_in_one_call_expose_what_one_at_a_time_does() -> None:
    assert exposition(StepHistogram) == exposition(Histogram)
