"""The engine thread, where the model runs: admit and step, hand each step's token
ids to the output thread (``tokenfleet.workers.output_thread``) and go back to the
next step. Between steps, batch jobs are handed back for live jobs that wait
(``tokenfleet.workers.preemption``).

A step that raises is counted and paused after; ``max_failed_steps`` in a row, or a
``DeviceFailure`` (the device is gone for good), end the loop and call
``on_failure``, which stops the worker from a thread of its own.

The feeders call ``receive`` and the cancel listener ``cancel``: both only add to the
engine's inbox (thread-safe) and wake the loop. Everything else here is the engine
thread's own, and read by a stop once the thread has ended.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from tokenfleet.shared.settings import Settings
from tokenfleet.shared.wire.schemas import FinishReason
from tokenfleet.workers.engine import DeviceFailure, Engine
from tokenfleet.workers.health import Health
from tokenfleet.workers.metrics import Metrics
from tokenfleet.workers.preemption import Preemption
from tokenfleet.workers.sequence import Made, Sequence

log = logging.getLogger(__name__)

# The pause after a step that raised, before the next one.
STEP_ERROR_PAUSE_S = 0.1


class EngineLoop:
    def __init__(self, engine: Engine, settings: Settings, max_batch: int, *,
                 health: Health, metrics: Metrics, held: set[str],
                 hand_back: Callable[[list[Sequence]], int],
                 steps: queue.Queue[list[Made]], output_done: threading.Event,
                 stopping: threading.Event,
                 on_failure: Callable[[DeviceFailure], None]) -> None:
        self.engine = engine
        self.health = health
        self.metrics = metrics
        self.held = held  # the worker's running jobs (see OutputThread.held)
        self._hand_back = hand_back
        self._output_done = output_done
        self.stopping = stopping  # set: end the loop
        self._on_failure = on_failure
        self.max_failed_steps = settings.max_failed_steps
        self.max_batch, self.prefetch = max_batch, settings.prefetch
        self.preemption = Preemption(settings.preempt_batch, max_batch,
                                     held=engine.unfinished, num_held=lambda: engine.num_held,
                                     hand_back=self._preempt)
        self.steps = steps  # the output thread's: steps made (token ids only)
        self.unhanded: list[Made] = []  # made after the output thread had ended
        self.preempted: list[Sequence] = []  # preempted, not yet handed back
        self.wake = threading.Event()
        self.idle = threading.Event()  # set when the loop has nothing to do
        self.done = threading.Event()  # set when the loop has returned
        # While steps raise: how many in a row and the last error (the heartbeat
        # shows it); "" once a step succeeds.
        self.failing = ""

    def receive(self, seqs: list[Sequence]) -> None:
        """A feeder's new jobs (a feeder thread)."""
        self.held.update(s.job_id for s in seqs)
        for seq in seqs:
            self.metrics.started(seq.created_at)
            self.engine.add(seq)
        self.wake.set()

    def cancel(self, job_id: str) -> None:
        """A cancel heard for a running job (the cancel listener's thread)."""
        self.engine.abort(job_id, FinishReason.CANCELLED)
        self.wake.set()

    def credits(self) -> int:
        """The live levels' credits (a feeder's): free slots plus prefetch. With
        preemption on, a slot a batch job holds counts as free: a live job takes it."""
        return (self.max_batch + self.prefetch - self.engine.num_held
                + self.preemption.free_for_live())

    def batch_credits(self) -> int:
        """The batch level's credits: free slots only, never prefetch (a batch
        job waiting here would hold a live job's place)."""
        return self.max_batch - self.engine.num_held

    @property
    def busy(self) -> bool:
        return self.engine.has_work or not self.steps.empty()

    def drain(self, grace: float) -> None:
        """Wait until the engine has no work, the loop has ended, or ``grace``
        seconds have passed (a stop's caller; the feeders have ended)."""
        deadline = time.monotonic() + grace
        while self.busy and time.monotonic() < deadline:
            self.idle.clear()
            if self.done.is_set():  # checked after clear(): its last set() is seen
                return
            self.wake.set()
            self.idle.wait(min(0.5, max(0.0, deadline - time.monotonic())))

    def run(self) -> None:
        try:
            self._run()
        finally:
            self.done.set()
            self.idle.set()  # wakes a drain that waits for the engine

    def _run(self) -> None:
        in_a_row = 0  # steps that raised, in a row
        while not self.stopping.is_set():
            self.health.turn()  # back in the loop: live (a step in progress is judged by this)
            if not self.engine.has_work:
                self.idle.set()
                self.wake.wait(0.1)
                self.wake.clear()
                continue
            self.idle.clear()
            failed_before = self.engine.stats.failed_steps
            try:
                self.preemption.turn()
                self._hand_over(self.engine.advance())
                self._hand_back_preempted()
            except DeviceFailure as failure:
                self._on_failure(failure)
                return
            except Exception as exc:
                in_a_row += 1
                limit = self._step_failed(exc, in_a_row)
                if limit is not None:
                    self._on_failure(limit)
                    return
                self.stopping.wait(STEP_ERROR_PAUSE_S)
                continue
            # A step the engine recovered from itself (a forward pass retried
            # smaller) shows too, until a step goes through without one.
            in_a_row, retried = 0, self.engine.stats.failed_steps - failed_before
            self.failing = (f"{retried} failed forward pass(es) retried by the engine "
                            "in the last step" if retried else "")

    def _step_failed(self, exc: Exception, in_a_row: int) -> DeviceFailure | None:
        """A step raised outside the engine's own recovery (the code around the
        model, or a job that trips it). It counts as a failed step; once
        ``max_failed_steps`` did in a row, returns the failure that stops the
        worker, with the jobs the engine had taken as its suspects (one of them
        may be the cause: their hand-back counts as an attempt; the jobs still
        in its inbox never ran and are handed back free)."""
        self.engine.stats.failed_steps += 1
        error = f"{type(exc).__name__}: {exc}"
        self.failing = f"{in_a_row} step(s) failed in a row, the last with {error}"
        log.exception("engine step failed (%d in a row; the worker stops at %d)",
                      in_a_row, self.max_failed_steps)
        if in_a_row < self.max_failed_steps:
            return None
        return DeviceFailure(f"{in_a_row} steps failed in a row, the last with {error}",
                             self.engine.taken())

    def _hand_over(self, made: list[Made]) -> None:
        """Queue a step for the output thread; wait while it is ``STEPS_AHEAD``
        (output_thread) steps behind (Redis refuses, or the output work outlasts a step)."""
        while not self._output_done.is_set():
            try:
                self.steps.put(made, timeout=0.1)
                return
            except queue.Full:
                self.health.turn()  # waiting on Redis, not stuck in a step
        self.unhanded.extend(made)  # stopped: handed back with the rest

    def _preempt(self, seqs: list[Sequence]) -> None:
        """Give batch jobs' slots to live ones: the engine frees their slots and
        cache at the next step, which runs the live jobs. Each leaves ``held``
        before its new entry exists, so the feeder never skips that entry as one
        of a job held here. The hand-back itself follows that step
        (``_hand_back_preempted``): the live jobs' first tokens do not wait on
        Redis for it."""
        for seq in seqs:
            seq.handed_back = True
            self.held.discard(seq.job_id)
            self.engine.drop(seq.job_id)
        self.preempted.extend(seqs)
        self.engine.stats.preempted += len(seqs)

    def _hand_back_preempted(self) -> None:
        if self.preempted:
            seqs, self.preempted = self.preempted, []
            log.info("handed %d preempted job(s) back to the queue", self._hand_back(seqs))

    def left_over(self) -> list[Sequence]:
        """Once the loop has ended: the jobs of the steps the output thread never
        took, and those preempted but not handed back yet."""
        queued: list[Made] = []
        while True:
            try:
                queued.extend(self.steps.get_nowait())
            except queue.Empty:
                break
        return [*(m.seq for m in [*queued, *self.unhanded]), *self.preempted]
