"""The engine step: schedule, run the model, apply the results. No I/O here."""

from __future__ import annotations

import logging
import time
from typing import Protocol

from tokenfleet.workers.scheduler import Batch, Scheduler, SeqOutput
from tokenfleet.workers.stats import WorkerStats

log = logging.getLogger(__name__)


class Runner(Protocol):
    """Knows tensors, not jobs: one new token for every sequence of a batch."""

    def run(self, batch: Batch) -> list[int]: ...

    def reset(self) -> None: ...


class Engine:
    def __init__(self, scheduler: Scheduler, runner: Runner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.stats = WorkerStats()

    def step(self) -> list[SeqOutput]:
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        token_ids = self._run(batch)
        ran = batch if token_ids is not None else None
        outputs = self.scheduler.postprocess(ran, token_ids or [])
        self.stats.record(ran, outputs, time.perf_counter() - started)
        return outputs

    def _run(self, batch: Batch | None) -> list[int] | None:
        if batch is None:
            return []
        try:
            return self.runner.run(batch)
        except Exception as exc:
            log.exception("forward pass of %d sequence(s) failed", len(batch.seqs))
            # The cache may be half-updated: drop it, the scheduler re-prefills.
            self.runner.reset()
            self.scheduler.recover(batch, f"{type(exc).__name__}: {exc}")
            return None
