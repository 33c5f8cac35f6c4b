"""The engine step: schedule, run the model, apply the results. No I/O here."""

from __future__ import annotations

import logging
import time
from typing import Protocol

from tokenfleet.workers.scheduler import Batch, Scheduler, SeqOutput
from tokenfleet.workers.stats import WorkerStats

log = logging.getLogger(__name__)

# Errors after which the device is no use until the process restarts: a CUDA
# error (an illegal memory access, a device-side assert) poisons the CUDA
# context for good, so every later forward pass fails too.
FATAL_DEVICE_ERRORS = (
    "illegal memory access", "cuda error", "device-side assert", "cublas_status",
    "cudnn_status", "cusparse_status", "nccl error", "unspecified launch failure",
    "misaligned address", "illegal instruction", "uncorrectable ecc",
)
# Not fatal: out of memory ("CUDA out of memory", "CUDA error: out of memory",
# CUBLAS_STATUS_ALLOC_FAILED) frees up with the batch's cache; the batch is
# retried smaller, as for any other failed step.
NOT_FATAL = ("out of memory", "alloc_failed")


def is_fatal_device_error(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}".lower()
    if type(exc).__name__ == "OutOfMemoryError" or any(m in text for m in NOT_FATAL):
        return False
    return any(m in text for m in FATAL_DEVICE_ERRORS)


class DeviceFailure(RuntimeError):
    """The device can no longer run the model: a fatal device error, or
    ``max_failed_steps`` steps failed in a row. The worker must stop and leave
    its jobs to others, instead of spending their attempts here.

    ``batch`` is the batch that failed: its sequences are in no queue of the
    scheduler (a prefill's had left the waiting queue), so whoever hands the
    jobs back takes them from here too.
    """

    def __init__(self, reason: str, batch: Batch) -> None:
        super().__init__(reason)
        self.batch = batch


class Runner(Protocol):
    """Knows tensors, not jobs: one new token for every sequence of a batch."""

    def run(self, batch: Batch) -> list[int]: ...

    def reset(self) -> None: ...


class Engine:
    """Owned by the engine thread."""

    def __init__(self, scheduler: Scheduler, runner: Runner, max_failed_steps: int = 5) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.stats = WorkerStats()
        # Must exceed a poison job's own run of failures (one in its batch, then
        # max_failures alone), so one bad job never stops a worker.
        self.max_failed_steps = max_failed_steps
        self.failed_in_a_row = 0

    def step(self) -> list[SeqOutput]:
        """One step; raises ``DeviceFailure`` when the device is beyond use."""
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
            token_ids = self.runner.run(batch)
        except Exception as exc:
            self.failed_in_a_row += 1
            self.stats.failed_steps += 1
            error = f"{type(exc).__name__}: {exc}"
            # Before the scheduler counts it against any job: a broken device
            # is not the jobs' fault.
            if is_fatal_device_error(exc):
                raise DeviceFailure(f"fatal device error: {error}", batch) from exc
            if self.failed_in_a_row >= self.max_failed_steps:
                raise DeviceFailure(f"{self.failed_in_a_row} steps failed in a row, "
                                    f"the last with {error}", batch) from exc
            log.exception("forward pass of %d sequence(s) failed", len(batch.seqs))
            # The cache may be half-updated: drop it, the scheduler re-prefills.
            self.runner.reset()
            self.scheduler.recover(batch, error)
            return None
        self.failed_in_a_row = 0
        return token_ids
