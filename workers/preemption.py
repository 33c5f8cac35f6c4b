"""Preemption: live jobs take back the slots batch-level jobs hold.

The batch level (``shared.keys.BATCH``) fills only the slots live jobs leave
free: the feeder reads it for free slots alone, never for prefetch. With
preemption on (``preempt_batch``), the feeder's credits for the live levels
count the slots batch jobs hold as free, so live entries are read while batch
jobs run, and wait in the engine. Between two steps the engine loop calls
``Preemption.turn``: if the live jobs held and the batch jobs held do not fit
in ``max_batch`` slots, it hands back as many batch jobs as it takes for every
live job to have a slot, the newest-started first (they lose the least work).

The worker drops each victim from the engine at once (its slot and cache are
free at the next step, which runs the live jobs) and, once that step is
handed over, hands it back through the drain's path (``Publisher.hand_back``,
``requeue.lua``): a new entry at the end of its batch stream, not counted as an
attempt. Its record is ``queued`` from then on, so any write this worker still
sends for it (a step already handed to the output thread) is refused by the
attempt fence. When a worker takes it again, it resumes from its token log
with the tokens already made as its prefix: greedy sampling gives the same
text, and no token is made twice in the log (each is logged at its own index).

The check is counts only, so a loop turn with nothing waiting costs one
comparison: a live job can wait for a slot only when the engine holds more
sequences than ``max_batch``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from tokenfleet.shared.wire.keys import BATCH, level_priority
from tokenfleet.workers.sequence import Sequence

log = logging.getLogger(__name__)


def is_batch(seq: Sequence) -> bool:
    """Whether ``seq`` came from a batch-level stream (of any tenant)."""
    return level_priority(seq.queue) == BATCH


def count_batch(held: Iterable[Sequence]) -> int:
    return sum(1 for seq in held if is_batch(seq))


def choose_victims(held: Iterable[Sequence], max_batch: int) -> list[Sequence]:
    """The batch jobs to hand back so that every live job in ``held`` has one
    of ``max_batch`` slots: as many as live jobs wait (at most every batch
    job), the newest-started first. With no live job, none: batch jobs beyond
    the slots (reclaimed ones) wait for a batch job's slot as any job would."""
    held = list(held)
    batch = [seq for seq in held if is_batch(seq)]
    live = len(held) - len(batch)
    excess = min(len(batch) - max(0, max_batch - live), live)
    if excess <= 0:
        return []
    batch.sort(key=lambda seq: seq.arrived_at, reverse=True)
    return batch[:excess]


class Preemption:
    """Called by the worker's engine loop between steps (engine thread)."""

    def __init__(self, enabled: bool, max_batch: int,
                 held: Callable[[], list[Sequence]], num_held: Callable[[], int],
                 hand_back: Callable[[list[Sequence]], None]) -> None:
        self.enabled = enabled
        self.max_batch = max_batch
        self._held = held  # every sequence the engine holds (a snapshot)
        self._num_held = num_held
        # Forgets the jobs in the worker and the engine, and hands them back.
        self._hand_back = hand_back
        self.preempted = 0  # jobs handed back so far

    def free_for_live(self) -> int:
        """Slots batch jobs hold that live jobs may take: counted as free in
        the live levels' credits (0 with preemption off)."""
        return count_batch(self._held()) if self.enabled else 0

    def turn(self) -> int:
        """Hand back the batch jobs live jobs wait for; returns how many."""
        if not self.enabled or self._num_held() <= self.max_batch:
            return 0  # every job held has a slot: nothing waits
        victims = choose_victims(self._held(), self.max_batch)
        if victims:
            log.info("preempting %d batch job(s) for live jobs that wait", len(victims))
            self._hand_back(victims)
            self.preempted += len(victims)
        return len(victims)
