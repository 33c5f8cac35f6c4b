"""A Prometheus histogram that takes many equal observations in one call.

The engine observes the inter-token latency of every token, and in one step
most sequences share it (their last token came in the step before): a step
costs one ``observe(value, count)`` per distinct value, where
``prometheus_client.Histogram`` takes one locked ``observe`` per token. It
exposes the samples prometheus_client's own histogram does (``_bucket`` with
``le``, ``_count``, ``_sum``, ``_created``) through the public collector API.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterator, Sequence

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString


class StepHistogram(Collector):
    """One labelled child per label value, made on first use (``labels``)."""

    def __init__(self, name: str, documentation: str, label: str, buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        self._name, self._doc, self._label = name, documentation, label
        self._bounds = [float(b) for b in buckets]
        self._children: dict[str, _Child] = {}
        registry.register(self)

    def labels(self, value: str) -> _Child:
        return self._children.setdefault(value, _Child(self._bounds))

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self._name, self._doc, labels=[self._label])]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._doc, labels=[self._label])
        for value, child in list(self._children.items()):
            counts, total = child.snapshot()
            cumulative, running = [], 0
            for bound, n in zip([*map(floatToGoString, self._bounds), "+Inf"], counts):
                running += n
                cumulative.append((bound, running))
            family.add_metric([value], cumulative, total)
            family.samples.append(Sample(f"{self._name}_created", {self._label: value},
                                         child.created))
        yield family


class _Child:
    def __init__(self, bounds: list[float]) -> None:
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self._sum = 0.0
        self._lock = threading.Lock()  # a scrape reads counts and sum together
        self.created = time.time()

    def observe(self, value: float, count: int = 1) -> None:
        """``count`` observations of ``value``."""
        at = bisect.bisect_left(self._bounds, value)  # le: a value on a bound counts in it
        with self._lock:
            self._counts[at] += count
            self._sum += value * count

    def snapshot(self) -> tuple[list[int], float]:
        with self._lock:
            return list(self._counts), self._sum
