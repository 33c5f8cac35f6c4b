"""The output thread: each step the engine thread hands over becomes text, ends and
Redis writes (``OutputProcessor``, then ``Publisher``), in order.

Step N's writes go out only once step N-1's are stored, so no token is sent before
the one it follows; Redis stores them while this thread takes the next step, and
Torch (and a GPU's step) releases the GIL, so all of it overlaps the forward pass.
While Redis refuses the writes this thread is held, and the engine thread once it
is ``STEPS_AHEAD`` steps ahead (``tokenfleet.workers.engine_loop``).

This thread is the only one that calls the processor and the publisher's ``send``
and ``collect``. ``sent`` is replaced whole, never changed in place: the heartbeat
reads it (a job whose end is not stored yet still runs), and a stop hands its jobs
back once this thread has ended.
"""

from __future__ import annotations

import logging
import queue
import threading

from redis.exceptions import RedisError

from tokenfleet.workers.engine import Engine
from tokenfleet.workers.output_processor import OutputProcessor
from tokenfleet.workers.publisher import Publisher, is_transient
from tokenfleet.workers.sequence import Made, SeqOutput

log = logging.getLogger(__name__)

# Tries of a step's writes that Redis refused for a reason of the write itself
# (not its own state: see publisher.is_transient) before its jobs are given up.
MAX_STORE_TRIES = 5
# Steps the engine may run ahead of the output thread. Past that it waits:
# while Redis refuses a step's writes the engine is held after a step or two,
# and a stop string found late costs a job at most this many extra steps.
STEPS_AHEAD = 2


class OutputThread:
    """Stores the steps the engine thread puts on ``steps`` until ``stop`` is set and the last is
    stored, or until a stop gives up a step Redis refuses (``given_up``)."""

    def __init__(self, processor: OutputProcessor, publisher: Publisher, engine: Engine,
                 held: set[str], *,
                 slots_freed: threading.Event, stopping: threading.Event) -> None:
        self.processor = processor
        self.publisher = publisher
        self.engine = engine
        self.steps: queue.Queue[list[Made]] = queue.Queue(maxsize=STEPS_AHEAD)
        # The ids of the jobs the worker runs now, which the feeders skip: a job
        # leaves it here once its end is stored, or when it is dropped.
        self.held = held
        self.slots_freed = slots_freed  # wakes a feeder waiting for a free slot
        self.stopping = stopping  # the worker stops: a refused step is given up
        self.sent: list[SeqOutput] = []  # the step whose writes Redis is storing
        self.given_up = False  # stopping while Redis refuses: store no more
        self.stop = threading.Event()  # end once the steps handed over are stored
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self._run()
        finally:
            self.done.set()

    def _run(self) -> None:
        while not self.given_up:
            try:
                made = self.steps.get_nowait()
            except queue.Empty:
                self.collect()  # nothing to overlap with: store the last step now
                if self.given_up:
                    return
                if self.stop.is_set() and self.steps.empty():
                    return
                try:
                    made = self.steps.get(timeout=0.1)
                except queue.Empty:
                    continue
            self._output(made)

    def _output(self, made: list[Made]) -> None:
        """A step's text and ends, then its writes, once the last step's are stored."""
        outputs = self.processor.process(made)
        dropped = self.collect()
        if dropped:
            outputs = [o for o in outputs if o.seq.job_id not in dropped]
        # Named as sent before the send: a send that raises part-way has its
        # pending writes collected (or handed back) with these outputs.
        self.sent = outputs
        self.publisher.send(outputs)

    def collect(self) -> set[str]:
        """Wait until the step sent last is stored. Returns the ids of the jobs
        dropped here: a newer attempt owns them, or their log lacks tokens this
        worker made (Redis lost them), or their step was given up.

        While Redis refuses the writes (a lost connection, OOM, READONLY after a
        failover, MISCONF, NOSCRIPT) the step is sent again with backoff: a token
        that is not stored must not be followed by the next one. Nothing Redis
        refused is taken for stored. A step is given up only when the worker
        stops (its jobs are handed back), or after MAX_STORE_TRIES refusals for a
        reason of the write itself (a wrong key type, a bug), which no wait cures.
        """
        if not self.publisher.in_flight:
            return set()
        outputs = self.sent
        backoff, tries = 0.05, 0
        while True:
            try:
                stored = self.publisher.collect()
                break
            except RedisError as exc:
                tries += 1
                self.engine.stats.store_retries += 1
                if self.stopping.is_set():
                    # The worker hands the step's jobs back (``sent`` stays: sent,
                    # not stored, and so do the steps queued after it).
                    self.publisher.discard()
                    self.given_up = True
                    return set()
                if not is_transient(exc) and tries >= MAX_STORE_TRIES:
                    log.error("giving up a step's writes after %d tries (%s)", tries, exc)
                    self.publisher.discard()
                    self.sent = []
                    gone = {o.seq.job_id for o in outputs}
                    self.drop(gone, "its step could not be stored")
                    return gone
                log.warning("redis refused a step's writes (%s: %s); sending them again "
                            "in %.2fs", type(exc).__name__, exc, backoff)
                self.stopping.wait(backoff)
                backoff = min(backoff * 2, 2.0)
        self.sent = []
        finished = [o.seq.job_id for o in outputs if o.finished]
        if finished:
            self.held.difference_update(finished)
            self.slots_freed.set()
        self.drop(stored.fenced, "a newer attempt owns it")
        self.drop(stored.untrusted, "its log lacks tokens made here (Redis lost them)")
        return stored.fenced | stored.untrusted

    def drop(self, job_ids: set[str], why: str) -> None:
        """Forget jobs here without writing anything more for them. Their stream
        entries stay pending and untouched, so once idle they are reclaimed (by
        any worker, this one too: they are no longer held) as a new attempt that
        resumes from the job's log."""
        for job_id in job_ids:
            log.warning("dropping job %s here: %s", job_id, why)
            self.engine.drop(job_id)
            self.held.discard(job_id)
        if job_ids:
            self.slots_freed.set()
