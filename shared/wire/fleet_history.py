"""The fleet's last 15 minutes, as the console draws them: each worker's
heartbeat adds a sample every ``HISTORY_EVERY_S`` to one stream
(``Keys.history``), trimmed by age as it is written, so the stream holds at
most ``HISTORY_S / HISTORY_EVERY_S`` samples per worker whatever the traffic.

A sample is a worker's own view: its tokens/s, its running and waiting jobs,
and the backlog (in tokens) of the queue it serves. A page reads the window
once (``read``) and sums it into ``POINTS`` buckets (``series``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenfleet.shared.wire.keys import Keys

HISTORY_S = 900  # the window the console shows
HISTORY_EVERY_S = 10.0  # one sample per worker this often
POINTS = 30  # the buckets a sparkline draws (30 s each)


@dataclass(frozen=True)
class Sample:
    worker: str
    queue: str
    at: float  # Redis's clock, from the entry id
    tokens_per_s: float
    running: int
    waiting: int
    backlog_tokens: int


def add(pipe: Any, keys: Keys, *, worker: str, queue: str, tokens_per_s: float,
        running: int, waiting: int, backlog_tokens: int, now: float) -> None:
    """Queue the XADD of one sample on ``pipe``, trimming what is older than
    the window (``MINID``, approximate: whole nodes of the stream go at once)."""
    oldest_ms = int((now - HISTORY_S) * 1000)
    pipe.xadd(keys.history, {"w": worker, "q": queue, "tps": f"{tokens_per_s:.2f}",
                             "run": running, "wait": waiting, "bl": backlog_tokens},
              minid=max(oldest_ms, 0), approximate=True)


async def read(r: Any, keys: Keys, now: float) -> list[Sample]:
    """The samples of the window ending ``now``, oldest first."""
    since = f"{int((now - HISTORY_S) * 1000)}-0"
    entries = await r.xrange(keys.history, since, "+")
    samples = []
    for entry_id, fields in entries:
        f = {k.decode(): v.decode() for k, v in fields.items()}
        try:
            samples.append(Sample(f["w"], f["q"], int(entry_id.split(b"-")[0]) / 1000,
                                  float(f["tps"]), int(f["run"]), int(f["wait"]), int(f["bl"])))
        except (KeyError, ValueError):
            continue  # not a sample this version writes: left out of the lines
    return samples


def series(samples: list[Sample], now: float) -> list[dict[str, float]]:
    """``POINTS`` buckets over the window: the fleet's tokens/s (each worker's
    last sample in the bucket, summed) and backlog (each queue's last, summed)."""
    width = HISTORY_S / POINTS
    start = now - HISTORY_S
    by_worker: list[dict[str, float]] = [{} for _ in range(POINTS)]
    by_queue: list[dict[str, int]] = [{} for _ in range(POINTS)]
    for s in samples:
        i = min(POINTS - 1, max(0, int((s.at - start) // width)))
        by_worker[i][s.worker] = s.tokens_per_s
        by_queue[i][s.queue] = s.backlog_tokens
    return [{"at": round(start + (i + 1) * width, 3),
             "tokens_per_s": round(sum(by_worker[i].values()), 2),
             "backlog_tokens": sum(by_queue[i].values())} for i in range(POINTS)]
