"""A batch driver's record of the batches whose steps failed.

A step's error is one batch's own: the driver goes on with the others, and
the failed batch is tried again after the driver's step time, then twice as
long at each failure more (at most ``RETRY_MAX_S``), each failure a WARNING
naming it. After ``MAX_FAILED_STEPS`` failures in a row (about two minutes
of an error that does not go away) the batch ends ``failed`` (``batch_failed``),
so that a batch cancelled or past its window always ends. A batch whose input
file is gone cannot be helped by waiting: it ends ``failed``
(``file_not_found``) at once. The record lives in the driver's memory: a
driver that takes the batch over counts from naught again.
"""

from __future__ import annotations

import logging
import time

from tokenfleet.client.batch_records import BatchError

log = logging.getLogger("tokenfleet.batches")

MAX_FAILED_STEPS = 10
RETRY_MAX_S = 60.0


class InputGone(Exception):
    """The batch's input file is no longer in the store (deleted)."""

    def __init__(self, file_id: str) -> None:
        super().__init__(f"the input file {file_id} is gone")
        self.file_id = file_id


def input_gone(batch_id: str, gone: InputGone) -> BatchError:
    """The error a batch whose input is gone ends with (logged as a WARNING)."""
    log.warning("batch %s: its input file %s is gone; the batch ends failed (file_not_found)",
                batch_id, gone.file_id)
    return BatchError(code="file_not_found", param="input_file_id",
                      message=f"the input file {gone.file_id} cannot be read: it was deleted "
                              "while the batch ran")


class StepFailures:
    """How many steps of each batch failed in a row, and when it is tried again."""

    def __init__(self, first_wait_s: float) -> None:
        self.first_wait_s = first_wait_s
        self._failed: dict[str, tuple[int, float]] = {}  # batch id: (failures, retry at)

    def keep_only(self, active: set[str]) -> None:
        """Forget the batches no longer active (ended, by this driver or another)."""
        for batch_id in set(self._failed) - active:
            del self._failed[batch_id]

    def resting(self, batch_id: str) -> bool:
        """Whether the batch failed lately and is not to be tried yet."""
        return self._failed.get(batch_id, (0, 0.0))[1] > time.monotonic()

    def succeeded(self, batch_id: str) -> None:
        self._failed.pop(batch_id, None)

    def failed(self, batch_id: str, exc: Exception) -> BatchError | None:
        """One more failed step of the batch: None while it is tried again
        later, else (the last failure allowed) the error it ends with."""
        failures = self._failed.get(batch_id, (0, 0.0))[0] + 1
        why = f"{type(exc).__name__}: {str(exc)[:200]}"
        if failures < MAX_FAILED_STEPS:
            wait = min(self.first_wait_s * 2 ** (failures - 1), RETRY_MAX_S)
            self._failed[batch_id] = (failures, time.monotonic() + wait)
            log.warning("batch %s: step failed (%s); tried again in %.1f s (failure %d of %d)",
                        batch_id, why, wait, failures, MAX_FAILED_STEPS, exc_info=exc)
            return None
        del self._failed[batch_id]
        log.warning("batch %s: step failed %d times in a row (%s); the batch ends failed",
                    batch_id, failures, why, exc_info=exc)
        return BatchError(code="batch_failed", message=f"the batch could not go on: its step "
                                                       f"failed {failures} times in a row "
                                                       f"(last: {why})")
