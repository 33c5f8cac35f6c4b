"""One worker process's moving parts, wired together and run on threads.

- the engine loop (this is where the model runs): admit and step, handing
  each step's token ids to the output thread and going back to the next step;
  between steps, batch-level jobs are handed back for live jobs that wait
  (``tokenfleet.workers.preemption``);
- the output thread: text, stop strings, metrics and the step's Redis writes;
- the feeders: read the streams with credits and hand sequences to the engine
  (one per partition of the queue this worker serves: a worker named for a
  queue of P partitions serves all of them, one named for a partition
  ``<queue>#<p>`` that one only);
- the heartbeat: the worker's stats hash, and the idle-time renewal of the
  entries it is still generating (so a long job is never reclaimed from a live
  worker);
- the cancel listener: cancels of running jobs, applied between steps;
- the metrics port's HTTP server (``metrics_port``): ``/metrics``, and the
  ``/healthz`` and ``/readyz`` probes (``tokenfleet.workers.health``).

The worker owns each of them: ``start`` starts them, and ``stop`` is the one
way they end, for a warm shutdown, a terminate and a failed device alike.

Torch (and a GPU's step) releases the GIL, so the output thread's work and
its Redis I/O overlap the forward pass instead of following it.
Celery (``tokenfleet.workers.bootstep``) and the embedded demo both run this class.

When the device fails for good (``DeviceFailure``), or ``max_failed_steps``
steps in a row raise, the worker stops: it hands its jobs back, leaves the
fleet, sets ``fatal`` and calls ``on_fatal(FATAL_EXIT_CODE)``: its process is
to exit non-zero, so a supervisor restarts it.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from redis.exceptions import RedisError

from tokenfleet.shared import liveness
from tokenfleet.shared.clock import FleetClock
from tokenfleet.shared.keys import (GROUP, PRIORITIES, Keys, level_priority, level_tenant,
                                    partitions_of, queue_of_partition)
from tokenfleet.shared.limits import worker_limits
from tokenfleet.shared.redis_cluster import reread_slot_map
from tokenfleet.shared.redis_conn import connect, node_client
from tokenfleet.shared.schemas import FinishReason
from tokenfleet.shared.serialization import dumps
from tokenfleet.shared.settings import Settings
from tokenfleet.workers import exit_codes, limits
from tokenfleet.workers.admission import Admission
from tokenfleet.workers.budget import resolved
from tokenfleet.workers.engine import DeviceFailure, Engine, take_outputs
from tokenfleet.workers.feeder import Feeder
from tokenfleet.workers.health import Health, Phase, StatusServer
from tokenfleet.workers.metrics import Metrics
from tokenfleet.workers.preemption import Preemption
from tokenfleet.workers.publisher import Publisher, is_transient
from tokenfleet.workers.sequence import Made, Sequence, SeqOutput
from tokenfleet.workers.shared_credits import SharedCredits

log = logging.getLogger(__name__)

# How this process exits when the engine stops (see workers/exit_codes.py).
FATAL_EXIT_CODE = exit_codes.FATAL
JOB_FAULT_EXIT_CODE = exit_codes.JOB_FAULT
# Tries of a step's writes that Redis refused for a reason of the write itself
# (not its own state: see publisher.is_transient) before its jobs are given up.
MAX_STORE_TRIES = 5
# How long ``stop`` waits for a thread it told to end. An engine thread still
# running after that may be inside a step that does not return (a hung device).
JOIN_S = 10.0
# The pause after a step that raised, before the next one.
STEP_ERROR_PAUSE_S = 0.1
# Steps the engine may run ahead of the output thread. Past that it waits:
# while Redis refuses a step's writes the engine is held after a step or two,
# and a stop string found late costs a job at most this many extra steps.
STEPS_AHEAD = 2
# How soon a thread waiting for the GIL gets it (Python's switch interval; 5 ms
# by default, half of a 10 ms GPU step): the engine thread, back from a step
# that released the GIL, waits this long at most while the output thread runs.
GIL_SWITCH_S = 0.0005
# How long a starting worker waits for its cancel listener before it serves anyway.
CANCEL_LISTENER_WAIT_S = 10.0
# How long a queue's last heartbeat is remembered (``Keys.served_until``): a
# submit to a queue served within it that finds no live worker is told to
# retry (WorkersGone), not that the name is unknown.
SERVED_MEMORY_S = 86_400


class Worker:
    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        tokenizer: Any,
        *,
        name: str,
        model_name: str | None = None,
        redis: Any = None,
        status: StatusServer | None = None,
    ) -> None:
        self.settings = settings
        self.name = name
        self.queue = settings.queue
        self.model_name = model_name or settings.model
        self.keys = Keys.for_url(settings.namespace, settings.redis_url)
        self.redis = redis or connect(settings.redis_url)
        # Numbers, not "auto": build_worker sizes them for the engine.
        self.max_batch, _ = resolved(settings)
        # Every time this worker stores or judges against another host's (its
        # heartbeat, deadlines, a job's times) is on Redis's clock.
        self.clock = FleetClock()
        engine.clock = self.clock.now
        self.engine = engine
        self.publisher = Publisher(self.redis, self.keys, settings, name, fleet_clock=self.clock)
        # Ids of the jobs this worker runs now (shared: the feeder thread reads
        # it, the output thread updates it). A job leaves it when its end is
        # stored or when it is dropped here, never earlier: the feeder skips
        # the entries of held jobs, so a job left in it would be stranded.
        self._held: set[str] = set()
        # Preempted, not yet handed back (the engine thread's; see _preempt).
        self._preempted: list[Sequence] = []
        self.preemption = Preemption(settings.preempt_batch, self.max_batch,
                                     held=engine.unfinished, num_held=lambda: engine.num_held,
                                     hand_back=self._preempt)
        self.admission = Admission(tokenizer, settings, engine.max_model_len,
                                   vocab_size=engine.vocab_size, refusal=engine.refusal)
        # The partitions this worker serves, and a feeder for each (``start``
        # reads how many the queue has); the feeders share these two events.
        self.partitions = [self.queue]
        self.feeders: list[Feeder] = []
        self._feeder_threads: list[threading.Thread] = []
        self.paused = threading.Event()  # set: read nothing new (a drain)
        self.slots_freed = threading.Event()
        self.metrics = Metrics(self.queue, engine.stats, clock=self.clock.now)
        # The metrics port: the Celery bootstep starts it before the model
        # loads (a probe then reads "loading") and hands it over; else it is
        # this worker's to start and stop.
        self._own_status = status is None
        self.status = status or StatusServer(Health(settings.liveness_s))
        self.status.show(self.metrics.registry)
        self.health = self.status.health
        self.health.intake_paused = self.paused.is_set
        # What this worker allows, published with each heartbeat: submit.lua holds
        # every request to the queue to it, whoever submits.
        self.limits = worker_limits(settings, engine.max_model_len)
        self._sent: list[SeqOutput] = []  # the step whose writes Redis is storing
        # Steps the engine thread made, for the output thread (token ids only).
        self._steps: queue.Queue[list[Made]] = queue.Queue(maxsize=STEPS_AHEAD)
        self._unhanded: list[Made] = []  # made after the output thread had ended
        self._output_done = threading.Event()
        self._stop_output = threading.Event()  # end once the steps handed over are stored
        self._store_given_up = False  # stopping while Redis refuses: store no more
        self._wake = threading.Event()
        self._idle = threading.Event()  # set by the engine loop when it has nothing to do
        self._stop_intake = threading.Event()
        self._stop_engine = threading.Event()
        self._engine_done = threading.Event()  # set when the engine loop has returned
        self._stop_lock = threading.Lock()
        self._stopped = False
        self._engine_thread = _thread(self._engine_loop, "engine")
        self._output_thread = _thread(self._output_loop, "output")
        self._heartbeat_thread = _thread(self._heartbeat_loop, "heartbeat")
        self._cancel_thread = _thread(self._cancel_loop, "cancels")
        # Set once the cancel listener is subscribed: a cancel is a publish, heard
        # only by a listener already there, so no job starts before it is.
        self._listening = threading.Event()
        self._stopper: threading.Thread | None = None  # runs ``stop`` after a failure
        # While steps raise: how many in a row and the last error (the heartbeat
        # shows it); "" once a step succeeds.
        self.failing = ""
        # Set when the device failed for good (or steps kept raising); the
        # process is to exit with FATAL_EXIT_CODE. ``on_fatal`` (the Celery
        # bootstep's) is called once, after the worker stopped.
        self.fatal = threading.Event()
        self.fatal_reason: str | None = None
        self._failure: DeviceFailure | None = None
        self.on_fatal: Callable[[int], None] | None = None

    # -- life cycle -------------------------------------------------------------

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        """The worker's threads, which ``start`` starts and ``stop`` ends."""
        return (self._engine_thread, self._output_thread, *self._feeder_threads,
                self._heartbeat_thread, self._cancel_thread)

    def start(self) -> None:
        # Before any job's deadline is judged; from the queue's node, which this
        # worker cannot do without anyway (a Cluster's default node may be dead).
        self.clock.sync(node_client(self.redis, self.keys.queue(self.queue)))
        self._serve_partitions()
        for feeder in self.feeders:
            feeder.ensure_group()
        if self.settings.metrics_port and not self.status.serving:
            self.status.serve(self.settings.metrics_port)
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_S))
        self._cancel_thread.start()
        if not self._listening.wait(CANCEL_LISTENER_WAIT_S):
            log.warning("the cancel listener is not subscribed after %.0f s; serving anyway "
                        "(a cancel of a running job may go unheard until it is)",
                        CANCEL_LISTENER_WAIT_S)
        # One beat before the feeders read: a peer takes the pending entries of
        # a consumer the served set does not list as live for a dead worker's
        # (``Feeder._reclaim``), so this worker must be listed before it holds any.
        try:
            self._beat()
        except (RedisError, OSError) as exc:  # the heartbeat thread beats on
            log.warning("first heartbeat failed: %s", exc)
        for thread in self.threads:
            if thread is not self._cancel_thread:
                thread.start()
        self.health.set(Phase.SERVING)
        parts = f", partitions {', '.join(self.partitions)}" if len(self.partitions) > 1 else ""
        port = self.settings.metrics_port
        metrics = (f"metrics http://0.0.0.0:{port}/metrics" if port and self.status.serving
                   else "no metrics port (--metrics-port)")
        log.info("worker %s started: queue %r, model %s, engine %s, %s (max batch %d, "
                 "prefetch %d%s)", self.name, self.queue, self.settings.model,
                 self.settings.engine, metrics, self.max_batch, self.settings.prefetch, parts)

    def _serve_partitions(self) -> None:
        """The partitions this worker serves, a feeder for each: every one of a
        queue of P > 1 partitions named by its queue's name, or the one partition
        named (``<queue>#<p>``). Warns when the one named takes no jobs."""
        queue = queue_of_partition(self.queue)
        count = max(1, int(self.redis.get(self.keys.partitions(queue)) or 1))
        if self.queue == queue:
            self.partitions = partitions_of(queue, count)
        elif self.queue not in partitions_of(queue, count):
            log.warning("queue %r has %d partitions (%s): no job is queued for %r; serve "
                        "them all with TOKENFLEET_QUEUE=%s", queue, count,
                        ", ".join(partitions_of(queue, count)), self.queue, queue)
        shared = SharedCredits(self.partitions)
        self.feeders = [
            Feeder(self.redis, self.keys, self.settings, self.name, part, self.admission,
                   self.publisher, sink=self._receive, credits=self.credits,
                   holds=self._held.__contains__, batch_credits=self.batch_credits,
                   shared=shared, paused=self.paused, slots_freed=self.slots_freed)
            for part in self.partitions]
        self._feeder_threads = [_thread(partial(feeder.run, self._stop_intake), f"feeder-{part}")
                                for feeder, part in zip(self.feeders, self.partitions)]

    def stop(self, grace_s: float | None = None) -> None:
        """Stop the worker: the one way its threads and its metrics server end.

        It stops reading, lets the jobs running finish within ``grace_s``
        (default ``drain_grace_s``), ends every thread and the metrics server,
        hands the unfinished jobs back to the queue (another worker resumes each
        from its streamed tokens) and leaves the fleet. An engine thread that
        has not ended ``JOIN_S`` after it was told to may still run its jobs and
        write for them: then none is handed back (their entries stay pending,
        and once this worker has left the served set a live worker of the queue
        takes them as a dead worker's, fencing any late write), and the log
        says so.

        Any thread but the engine's may call it, more than once: a later call
        returns when the first has finished.
        """
        with self._stop_lock:
            if not self._stopped:
                self._stopped = True
                self._stop(self.settings.drain_grace_s if grace_s is None else grace_s)

    def _stop(self, grace: float) -> None:
        started = time.monotonic()
        self.health.set(Phase.DRAINING)  # not ready from now on: a probe sees the drain
        self._stop_intake.set()
        # The feeders hand over what they have already read, then end.
        feeder_ended = all([_join(thread, grace + JOIN_S) for thread in self._feeder_threads])
        self._drain(grace)
        self._stop_engine.set()  # the engine loop, the heartbeat and the cancel listener end
        self._wake.set()
        engine_ended = _join(self._engine_thread, JOIN_S)
        # The output thread stores what the engine handed over, then ends.
        self._stop_output.set()
        if not _join(self._output_thread, JOIN_S):
            log.warning("the output thread did not end within %.0fs", JOIN_S)
            engine_ended = False  # it may still write for its jobs: hand none back
        for thread in (self._heartbeat_thread, self._cancel_thread):
            if not _join(thread, JOIN_S):
                log.warning("the %s thread did not end within %.0fs", thread.name, JOIN_S)
        if self._own_status:
            self.status.close()
        handed = 0
        if engine_ended:
            handed = self._hand_back_all()
        else:
            log.error("the engine thread did not end within %.0fs of the stop (a step that does "
                      "not return?): it may still run its %d job(s), so none is handed back; "
                      "a live worker of the queue takes their entries as a dead worker's once "
                      "this one has left", JOIN_S, len(self.engine.unfinished()))
        if not feeder_ended:
            log.warning("a feeder did not end within %.0fs: entries it reads now stay "
                        "pending, for a live worker of the queue to take once this one has "
                        "left", grace + JOIN_S)
        self._leave()
        finished = sum(self.engine.stats.jobs.values())
        log.info("worker %s stopped: %d job(s) finished here, %d handed back to the queue; "
                 "the stop took %.1f s", self.name, finished, handed, time.monotonic() - started)

    def _drain(self, grace: float) -> None:
        """Let the engine run until it has no work, its loop has ended, or
        ``grace`` seconds have passed."""
        deadline = time.monotonic() + grace
        while self.busy and time.monotonic() < deadline:
            self._idle.clear()
            if self._engine_done.is_set():  # checked after clear(): its last set() is seen
                return
            self._wake.set()
            self._idle.wait(min(0.5, max(0.0, deadline - time.monotonic())))

    def _hand_back_all(self) -> int:
        """Hand back every job not ended here: the engine's, a failure's
        suspects, and those of the step whose writes Redis never stored
        (``_sent``: their ends too). Only once the engine thread has ended.
        Returns how many went back."""
        failure = self._failure
        suspects = failure.suspects if failure is not None else []
        handed_over = [*self._drain_steps(), *self._unhanded]
        left = [*self.engine.unfinished(), *suspects, *(o.seq for o in self._sent),
                *(m.seq for m in handed_over), *self._preempted]
        # The jobs of a step that failed may have caused it (on a GPU a bad
        # input can trip a device-side assert): theirs counts as an attempt.
        # requeue.lua skips the jobs that are no longer this worker's.
        handed = self._hand_back(left, frozenset(s.job_id for s in suspects))
        for seq in left:
            self.engine.drop(seq.job_id)
        self._held.clear()
        return handed

    def _hand_back(self, seqs: Iterable[Sequence], suspects: frozenset[str] = frozenset()) -> int:
        """Hand ``seqs`` back to the queue; how many went back."""
        left = list({id(s): s for s in seqs}.values())
        if not left:
            return 0
        try:
            handed: int = self.publisher.hand_back(left, suspects)
        except RedisError as exc:
            # Redis refuses: the entries stay pending and are reclaimed later.
            log.warning("could not hand jobs back (%s); they will be reclaimed", exc)
            return 0
        return handed

    def _leave(self) -> None:
        """Take this worker out of the fleet's view (its heartbeat and the served set)."""
        try:
            self.redis.delete(self.keys.worker(self.name))
            for part in self.partitions:
                self.redis.zrem(self.keys.queue_workers(part), self.name)
                limits.withdraw(self.redis, self.keys, part, self.name)
        except RedisError as exc:
            log.warning("could not remove the heartbeat (%s); it expires", exc)

    @property
    def busy(self) -> bool:
        return self.engine.has_work or not self._steps.empty()

    def credits(self) -> int:
        """The live levels' credits: free slots plus prefetch. With preemption
        on, a slot a batch job holds counts as free: a live job takes it."""
        return (self.max_batch + self.settings.prefetch - self.engine.num_held
                + self.preemption.free_for_live())

    def batch_credits(self) -> int:
        """The batch level's credits: free slots only, never prefetch (a batch
        job waiting here would hold a live job's place)."""
        return self.max_batch - self.engine.num_held

    def _preempt(self, seqs: list[Sequence]) -> None:
        """Give batch jobs' slots to live ones (engine thread, between steps):
        the engine frees their slots and cache at the next step, which runs
        the live jobs. Each leaves ``_held`` before its new entry exists, so
        the feeder never skips that entry as one of a job held here. The
        hand-back itself follows that step (``_hand_back_preempted``): the
        live jobs' first tokens do not wait on Redis for it."""
        for seq in seqs:
            seq.handed_back = True
            self._held.discard(seq.job_id)
            self.engine.drop(seq.job_id)
        self._preempted.extend(seqs)
        self.engine.stats.preempted += len(seqs)

    def _hand_back_preempted(self) -> None:
        """Engine thread: hand back the jobs preempted before the last step."""
        if self._preempted:
            seqs, self._preempted = self._preempted, []
            log.info("handed %d preempted job(s) back to the queue", self._hand_back(seqs))

    def cancel(self, job_id: str) -> None:
        self.engine.abort(job_id, FinishReason.CANCELLED)
        self._wake.set()

    # -- the engine loop ------------------------------------------------------

    def _receive(self, seqs: list[Sequence]) -> None:
        self._held.update(s.job_id for s in seqs)
        for seq in seqs:
            self.metrics.started(seq.created_at)
            self.engine.add(seq)
        self._wake.set()

    def _engine_loop(self) -> None:
        try:
            self._run_engine()
        finally:
            self._engine_done.set()
            self._idle.set()  # wakes a drain that waits for the engine

    def _run_engine(self) -> None:
        in_a_row = 0  # steps that raised, in a row
        while not self._stop_engine.is_set():
            self.health.turn()  # back in the loop: live (a step in progress is judged by this)
            if not self.engine.has_work:
                self._idle.set()
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            self._idle.clear()
            failed_before = self.engine.stats.failed_steps
            try:
                self.preemption.turn()
                self._step()
                self._hand_back_preempted()
            except DeviceFailure as failure:
                self._fail(failure)
                break
            except Exception as exc:
                in_a_row += 1
                limit = self._step_failed(exc, in_a_row)
                if limit is not None:
                    self._fail(limit)
                    break
                self._stop_engine.wait(STEP_ERROR_PAUSE_S)
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
                      in_a_row, self.settings.max_failed_steps)
        if in_a_row < self.settings.max_failed_steps:
            return None
        return DeviceFailure(f"{in_a_row} steps failed in a row, the last with {error}",
                             self.engine.taken())

    def _step(self) -> None:
        """Engine thread: one step, its token ids handed to the output thread."""
        made = self.engine.advance()
        self._hand_over(made)

    def _hand_over(self, made: list[Made]) -> None:
        """Queue a step for the output thread; wait while it is ``STEPS_AHEAD``
        steps behind (Redis refuses, or the output work outlasts a step)."""
        while not self._output_done.is_set():
            try:
                self._steps.put(made, timeout=0.1)
                return
            except queue.Full:
                self.health.turn()  # waiting on Redis, not stuck in a step
                continue
        self._unhanded.extend(made)  # stopped: handed back with the rest

    def _drain_steps(self) -> list[Made]:
        """Take every step still queued for the output thread."""
        left: list[Made] = []
        while True:
            try:
                left.extend(self._steps.get_nowait())
            except queue.Empty:
                return left

    # -- the output thread ---------------------------------------------------------

    def _output_loop(self) -> None:
        try:
            self._run_output()
        finally:
            self._output_done.set()

    def _run_output(self) -> None:
        """Store each step the engine hands over, in order, until the engine
        loop has ended and its last step is stored (or given up on a stop)."""
        while not self._store_given_up:
            try:
                made = self._steps.get_nowait()
            except queue.Empty:
                self._collect()  # nothing to overlap with: store the last step now
                if self._store_given_up:
                    return
                if self._stop_output.is_set() and self._steps.empty():
                    return
                try:
                    made = self._steps.get(timeout=0.1)
                except queue.Empty:
                    continue
            self._output(made)

    def _output(self, made: list[Made]) -> None:
        """Output thread: a step's text and ends, then its writes. Step N's
        writes go out only once step N-1's are stored, so no token is sent
        before the one it follows; Redis stores them while the output thread
        takes the next step."""
        outputs = take_outputs(made)
        for o in outputs:
            if o.seq.finish_reason is FinishReason.STOP:
                self.engine.forget(o.seq)  # the engine may have run it on: stop it
        self.engine.stats.record_outputs(outputs)
        self.metrics.step_done(outputs)
        dropped = self._collect()
        if dropped:
            outputs = [o for o in outputs if o.seq.job_id not in dropped]
        # Named as sent before the send: a send that raises part-way has its
        # pending writes collected (or handed back) with these outputs.
        self._sent = outputs
        self.publisher.send(outputs)

    def _collect(self) -> set[str]:
        """Wait until the step sent last is stored. Returns the ids of the jobs
        dropped here: a newer attempt owns them, or their log lacks tokens this
        worker made (Redis lost them), or their step was given up.

        While Redis refuses the writes (a lost connection, OOM, READONLY after a
        failover, MISCONF, NOSCRIPT) the output thread is held, and the engine
        once it is ``STEPS_AHEAD`` steps ahead, and the step sent again with
        backoff: a token that is not stored must not be followed by the next
        one. Output thread. Nothing Redis refused is taken for stored. A step is given up
        only when the worker stops (its jobs are handed back), or after
        MAX_STORE_TRIES refusals for a reason of the write itself (a wrong key
        type, a bug), which no wait cures.
        """
        if not self.publisher.in_flight:
            return set()
        outputs = self._sent
        backoff, tries = 0.05, 0
        while True:
            try:
                stored = self.publisher.collect()
                break
            except RedisError as exc:
                tries += 1
                self.engine.stats.store_retries += 1
                if self._stop_engine.is_set():
                    # Stopping: stop() hands the step's jobs back (``_sent``
                    # stays: sent, not stored, and so do the steps queued
                    # after it), another worker redoes them.
                    self.publisher.discard()
                    self._store_given_up = True
                    return set()
                if not is_transient(exc) and tries >= MAX_STORE_TRIES:
                    log.error("giving up a step's writes after %d tries (%s)", tries, exc)
                    self.publisher.discard()
                    self._sent = []
                    gone = {o.seq.job_id for o in outputs}
                    self._drop(gone, "its step could not be stored")
                    return gone
                log.warning("redis refused a step's writes (%s: %s); sending them again "
                            "in %.2fs", type(exc).__name__, exc, backoff)
                self._stop_engine.wait(backoff)
                backoff = min(backoff * 2, 2.0)
        self._sent = []
        finished = [o.seq.job_id for o in outputs if o.finished]
        if finished:
            self._held.difference_update(finished)
            self.slots_freed.set()
        self._drop(stored.fenced, "a newer attempt owns it")
        self._drop(stored.untrusted, "its log lacks tokens made here (Redis lost them)")
        return stored.fenced | stored.untrusted

    def _drop(self, job_ids: set[str], why: str) -> None:
        """Forget jobs here without writing anything more for them. Their stream
        entries stay pending and untouched, so once idle they are reclaimed
        (by any worker, this one too: they are no longer held) as a new
        attempt that resumes from the job's log."""
        for job_id in job_ids:
            log.warning("dropping job %s here: %s", job_id, why)
            self.engine.drop(job_id)
            self._held.discard(job_id)
        if job_ids:
            self.slots_freed.set()

    def _fail(self, failure: DeviceFailure) -> None:
        """The engine can run no more steps: stop reading now, and stop the
        worker from a thread of its own (``stop`` waits for the output thread,
        which first stores the last good step). Engine thread."""
        log.critical("worker %s gives up: %s; handing its jobs back", self.name, failure)
        self.fatal_reason = str(failure)
        self._failure = failure
        self.health.set(Phase.FAILED, str(failure))
        self._stop_intake.set()
        self._stopper = _thread(self._stop_failed, "stop")
        self._stopper.start()

    def _stop_failed(self) -> None:
        try:
            # The grace is the last good step's time to be stored while Redis refuses.
            self.stop(grace_s=max(5.0, self.settings.heartbeat_s))
        finally:  # the process exits even if the stop went wrong
            self.fatal.set()
            if self.on_fatal is not None:
                by_jobs = self._failure is not None and self._failure.by_jobs
                self.on_fatal(JOB_FAULT_EXIT_CODE if by_jobs else FATAL_EXIT_CODE)

    # -- side loops ------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        while True:
            try:
                self._beat()
            except (RedisError, OSError) as exc:  # OOM, READONLY too: beat on
                log.warning("heartbeat failed: %s", exc)
            if self._stop_engine.wait(self.settings.heartbeat_s):
                return

    def describe(self) -> dict[str, Any]:
        """What the heartbeat stores and ``inspect engine_stats`` returns."""
        return {
            "name": self.name, "host": socket.gethostname(), "pid": os.getpid(),
            "queue": self.queue, "model": self.model_name, "device": self.settings.device,
            "chat": int(self.admission.has_chat_template),  # for the gateway's chat
            "fim": int(self.admission.fim is not None),  # and its suffix
            "tools": self.admission.tool_format,  # and its tool_choice "auto"
            "max_batch": self.max_batch, "prefetch": self.settings.prefetch,
            "running": self.engine.num_running, "waiting": self.engine.num_waiting,
            "draining": int(self.paused.is_set() or self._stop_intake.is_set()),
            "fatal": self.fatal_reason or "", "failing": self.failing,
            "stats": self.engine.stats.as_dict(), "last_seen": self.clock.now(),
        }

    def _observe_queue(self) -> None:
        """Queue gauges for the metrics: depth, lag and pending per level and
        per tenant, backlog."""
        streams = [level for feeder in self.feeders for level in feeder.levels]
        pipe = self.redis.pipeline(transaction=False)
        for _name, stream in streams:
            pipe.xlen(stream)
            pipe.xinfo_groups(stream)
        for part in self.partitions:
            pipe.get(self.keys.backlog(part))
        replies = pipe.execute(raise_on_error=False)
        levels = {p: {"depth": 0, "pending": 0, "lag": 0} for p in PRIORITIES}
        tenants: dict[str, dict[str, int]] = {}
        for i, (name, _stream) in enumerate(streams):
            depth, groups = replies[2 * i], replies[2 * i + 1]
            depth = depth if isinstance(depth, int) else 0
            group: dict[str, Any] = next(
                (g for g in groups if g["name"] == GROUP.encode()), {}
            ) if isinstance(groups, list) else {}
            pending = int(group.get("pending") or 0)
            lag = group.get("lag")
            one = {"depth": depth, "pending": pending,
                   "lag": lag if lag is not None else max(0, depth - pending)}
            for into in (levels[level_priority(name)],
                         tenants.setdefault(level_tenant(name), {"depth": 0, "pending": 0})):
                for k in into:
                    into[k] += one[k]
        backlog = sum(int(b or 0) for b in replies[2 * len(streams):]
                      if not isinstance(b, Exception))
        self.metrics.queue_state(levels, backlog, self.engine.num_running, tenants)

    def _beat(self) -> None:
        if self.settings.metrics_port:
            self._observe_queue()
        try:  # a fresh reading of Redis's clock when due, from the queue's node
            self.clock.read(node_client(self.redis, self.keys.queue(self.queue)))
        except (RedisError, OSError) as exc:  # the last reading carries on meanwhile
            log.warning("reading Redis's clock failed: %s", exc)
            reread_slot_map(self.redis)
        key = self.keys.worker(self.name)
        # The jobs still being worked on: running, waiting, and those the step
        # in flight finished (their end is not stored yet). ``_sent`` belongs to
        # the engine thread; reading the list it points to now is enough here.
        sent = [o.seq for o in self._sent if o.finished]
        running = [*self.engine.unfinished(), *sent]
        info: dict[Any, Any] = self.describe()
        info["stats"] = dumps(info["stats"])
        # Until when this worker counts as live: every reader compares this
        # with Redis's clock too (shared.liveness), and the hash expires about then.
        info["alive_until"] = liveness.alive_until(self.settings.heartbeat_s, info["last_seen"])
        # The queue's renewals go first and alone: on a Redis Cluster this
        # worker's hash may live on another node than its queue, and that node's
        # death must not stop what keeps the queue served and its jobs owned.
        pipe = self.redis.pipeline(transaction=False)
        # Who serves this model, for submit(require_worker=True) and the status view.
        for part in self.partitions:
            pipe.zadd(self.keys.queue_workers(part), {self.name: info["alive_until"]})
            # Kept past this worker's leaving: submits wait out a restart for
            # no_worker_grace_s after it, and a name served within a day is
            # not an unknown one (submit.lua).
            pipe.set(self.keys.served_until(part), repr(info["alive_until"]),
                     ex=SERVED_MEMORY_S)
            limits.publish(pipe, self.keys, part, self.name, self.limits.model_dump_json(),
                           self.settings.heartbeat_s)
        # Touch the pending entries still being worked on: their idle time
        # restarts, so the reclaim (XPENDING + XCLAIM) elsewhere never takes a job from a live worker.
        by_stream: dict[str, list[Any]] = {}
        for seq in running:
            if seq.entry_id:
                by_stream.setdefault(self.keys.queue(seq.queue), []).append(seq.entry_id)
        for stream, ids in by_stream.items():
            pipe.xclaim(stream, GROUP, self.name, 0, ids, justid=True)
        pipe.execute()
        for part in self.partitions:
            limits.forget_dead(self.redis, self.keys, part, info["last_seen"])
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(key, mapping=info)
        pipe.expire(key, math.ceil(liveness.live_for_s(self.settings.heartbeat_s)))
        pipe.execute()

    def _cancel_loop(self) -> None:
        # On a Redis Cluster a PUBLISH reaches the subscribers of every node, and
        # a cancel is published by a script on the node of the job's queue: the
        # listener subscribes there, on the node this worker needs anyway, not
        # on the node of the channel's own slot, whose death would deafen it.
        # After a loss the slot map is read again, so it follows a replica that
        # took its queue's node's place.
        queue_key = self.keys.queue(self.partitions[0])
        while not self._stop_engine.is_set():
            pubsub = node_client(self.redis, queue_key).pubsub()
            try:
                pubsub.subscribe(self.keys.cancels)
                while not self._stop_engine.is_set():
                    message = pubsub.get_message(timeout=0.5)
                    if message is None:
                        continue
                    if message["type"] == "subscribe":
                        # From this reply on, every cancel reaches this listener.
                        self._listening.set()
                    elif message["type"] == "message":
                        self.cancel(message["data"].decode())
            except (RedisError, OSError) as exc:
                log.warning("cancel listener lost redis (%s); resubscribing", exc)
                self._stop_engine.wait(0.5)
                reread_slot_map(self.redis)
            finally:
                pubsub.close()


def _thread(target: Callable[[], None], name: str) -> threading.Thread:
    return threading.Thread(target=target, name=f"tokenfleet-{name}", daemon=True)


def _join(thread: threading.Thread, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``thread`` to end; whether it has
    (a thread never started has)."""
    if thread.ident is not None:
        thread.join(timeout)
    return not thread.is_alive()
