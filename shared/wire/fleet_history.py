"""The fleet's last hour, as the console shows it: each worker's heartbeat
adds a sample every ``HISTORY_EVERY_S`` to one stream (``Keys.history``),
trimmed by age as it is written, so the stream holds at most
``HISTORY_S / HISTORY_EVERY_S`` samples per worker whatever the traffic.

A sample is a worker's own view: its tokens/s, its running and waiting jobs,
the backlog (in tokens) of the queue it serves, and the tokens of each
tenant's jobs that ended on it (a counter since it started). The fleet page
reads the last ``LINES_S`` and sums them into ``POINTS`` buckets
(``series``); the keys page reads the hour for each tenant's share
(``tenant_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from tokenfleet.shared.wire.keys import Keys

HISTORY_S = 3600  # what the stream keeps: the tenants' shares' window
LINES_S = 900  # what the fleet page's lines draw
HISTORY_EVERY_S = 10.0  # one sample per worker this often
POINTS = 30  # the buckets a line draws (30 s each)


@dataclass(frozen=True)
class Sample:
    worker: str
    queue: str
    at: float  # Redis's clock, from the entry id
    tokens_per_s: float
    running: int
    waiting: int
    backlog_tokens: int
    tenant_tokens: dict[str, int]  # since the worker started


def add(pipe: Any, keys: Keys, *, worker: str, queue: str, tokens_per_s: float,
        running: int, waiting: int, backlog_tokens: int, now: float,
        tenant_tokens: dict[str, int] | None = None) -> None:
    """Queue the XADD of one sample on ``pipe``, trimming what is older than
    the window (``MINID``, approximate: whole nodes of the stream go at once)."""
    oldest_ms = int((now - HISTORY_S) * 1000)
    pipe.xadd(keys.history, {"w": worker, "q": queue, "tps": f"{tokens_per_s:.2f}",
                             "run": running, "wait": waiting, "bl": backlog_tokens,
                             "tt": orjson.dumps(tenant_tokens or {})},
              minid=max(oldest_ms, 0), approximate=True)


async def read(r: Any, keys: Keys, now: float, window_s: float = LINES_S) -> list[Sample]:
    """The samples of the ``window_s`` ending ``now``, oldest first."""
    since = f"{int((now - window_s) * 1000)}-0"
    entries = await r.xrange(keys.history, since, "+")
    samples = []
    for entry_id, fields in entries:
        f = {k.decode(): v.decode() for k, v in fields.items()}
        try:
            samples.append(Sample(f["w"], f["q"], int(entry_id.split(b"-")[0]) / 1000,
                                  float(f["tps"]), int(f["run"]), int(f["wait"]), int(f["bl"]),
                                  orjson.loads(f.get("tt", "{}"))))
        except (KeyError, ValueError):
            continue  # not a sample this version writes: left out of the lines
    return samples


def series(samples: list[Sample], now: float) -> list[dict[str, float]]:
    """``POINTS`` buckets over the window: the fleet's tokens/s (each worker's
    last sample in the bucket, summed) and backlog (each queue's last, summed)."""
    width = LINES_S / POINTS
    start = now - LINES_S
    by_worker: list[dict[str, float]] = [{} for _ in range(POINTS)]
    by_queue: list[dict[str, int]] = [{} for _ in range(POINTS)]
    for s in samples:
        i = min(POINTS - 1, max(0, int((s.at - start) // width)))
        by_worker[i][s.worker] = s.tokens_per_s
        by_queue[i][s.queue] = s.backlog_tokens
    return [{"at": round(start + (i + 1) * width, 3),
             "tokens_per_s": round(sum(by_worker[i].values()), 2),
             "backlog_tokens": sum(by_queue[i].values())} for i in range(POINTS)]


def tenant_tokens(samples: list[Sample]) -> dict[str, int]:
    """Each tenant's tokens over the samples' span: per worker, its last count
    less its first (a worker that restarted counts from zero again: its last)."""
    first: dict[str, dict[str, int]] = {}
    last: dict[str, dict[str, int]] = {}
    for s in samples:
        first.setdefault(s.worker, s.tenant_tokens)
        last[s.worker] = s.tenant_tokens
    out: dict[str, int] = {}
    for worker, counts in last.items():
        for tenant, n in counts.items():
            before = first[worker].get(tenant, 0)
            out[tenant] = out.get(tenant, 0) + (n - before if n >= before else n)
    return out
