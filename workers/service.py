"""One worker process's moving parts, wired together and run on threads: the engine
thread (``engine_loop``), the output thread (``output_thread``), a feeder per partition
served (``partitions``, ``feeder``), the heartbeat, the cancel listener (``cancels``)
and the metrics port's server (``/metrics``, ``/healthz``, ``/readyz``: ``health``).

The worker owns each of them: ``start`` starts them, and ``stop`` is the one way
they end, for a warm shutdown, a terminate and a failed device alike. Celery
(``tokenfleet.workers.bootstep``) and the embedded demo both run this class.

When the device fails for good (``DeviceFailure``), or ``max_failed_steps`` steps
in a row raise, the worker stops: it hands its jobs back, leaves the fleet, sets
``fatal`` and calls ``on_fatal`` with ``exit_codes.FATAL`` (or ``JOB_FAULT``): its
process is to exit non-zero, so a supervisor restarts it.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from tokenfleet.shared.redis.clock import FleetClock
from tokenfleet.shared.redis.connect import connect, node_client
from tokenfleet.shared.settings import Settings
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.limits import worker_limits
from tokenfleet.workers import exit_codes
from tokenfleet.workers.admission import Admission
from tokenfleet.workers.budget import resolved
from tokenfleet.workers.cancels import CancelListener
from tokenfleet.workers.engine import DeviceFailure, Engine
from tokenfleet.workers.engine_loop import EngineLoop
from tokenfleet.workers.feeder import Feeder
from tokenfleet.workers.health import Health, Phase, StatusServer
from tokenfleet.workers.heartbeat import Heartbeat
from tokenfleet.workers.leaving import hand_back, leave, unplace
from tokenfleet.workers.metrics import Metrics
from tokenfleet.workers.output_processor import OutputProcessor
from tokenfleet.workers.output_thread import OutputThread
from tokenfleet.workers.partitions import feeders, served_partitions
from tokenfleet.workers.publisher import Publisher

log = logging.getLogger(__name__)

# How long ``stop`` waits for a thread it told to end. An engine thread still
# running after that may be inside a step that does not return (a hung device).
JOIN_S = 10.0


class Worker:
    def __init__(self, settings: Settings, engine: Engine, tokenizer: Any, *, name: str,
                 model_name: str | None = None, redis: Any = None,
                 status: StatusServer | None = None) -> None:
        self.settings, self.name = settings, name
        self.queue = settings.queue
        self.model_name = model_name or settings.model
        self.keys = Keys.for_url(settings.namespace, settings.redis_url)
        self.redis = redis or connect(settings.redis_url)
        # Numbers, not "auto": build_worker sizes them for the engine.
        self.max_batch, _ = resolved(settings)
        self.clock = FleetClock()  # every time shared with other hosts is Redis's
        engine.clock = self.clock.now
        self.engine = engine
        self.publisher = Publisher(self.redis, self.keys, settings, name, fleet_clock=self.clock)
        self.admission = Admission(tokenizer, settings, engine.max_model_len,
                                   vocab_size=engine.vocab_size, refusal=engine.refusal)
        # Published with each heartbeat: submit.lua holds every request to them.
        self.limits = worker_limits(settings, engine.max_model_len)
        held: set[str] = set()  # the ids of the jobs running here (OutputThread.held)
        # The partitions served, a feeder for each: ``start`` reads them (``partitions``).
        self.partitions = [self.queue]
        self.feeders: list[Feeder] = []
        self._feeder_threads: list[threading.Thread] = []
        self.paused = threading.Event()  # set: read nothing new (a drain)
        self.slots_freed = threading.Event()
        self.stop_intake = threading.Event()
        self.stopping = threading.Event()  # the engine loop and the side threads end
        self.metrics = Metrics(self.queue, engine.stats, clock=self.clock.now)
        # The metrics port: the Celery bootstep starts it before the model loads (a
        # probe then reads "loading") and hands it over; else it is this worker's.
        self._own_status = status is None
        self.status = status or StatusServer(Health(settings.liveness_s))
        self.status.show(self.metrics.registry)
        self.health = self.status.health
        self.health.intake_paused = self.paused.is_set
        processor = OutputProcessor(engine.forget, engine.stats, on_outputs=self.metrics.step_done)
        self.output = OutputThread(processor, self.publisher, engine, held,
                                   slots_freed=self.slots_freed, stopping=self.stopping)
        self.engine_loop = EngineLoop(
            engine, settings, self.max_batch, health=self.health, metrics=self.metrics,
            held=held, hand_back=partial(hand_back, self.publisher), steps=self.output.steps,
            output_done=self.output.done, stopping=self.stopping, on_failure=self._fail)
        self.heartbeat = Heartbeat(self)
        self.cancels = CancelListener(self.redis, self.keys, lambda: self.partitions[0],
                                      self.engine_loop.cancel, self.stopping)
        self._engine_thread = _thread(self.engine_loop.run, "engine")
        self._output_thread = _thread(self.output.run, "output")
        self._heartbeat_thread = _thread(self.heartbeat.run, "heartbeat")
        self._cancel_thread = _thread(self.cancels.run, "cancels")
        self._stop_lock = threading.Lock()
        self._stopped = False
        # Set when the device failed for good (or steps kept raising); ``on_fatal``
        # (the Celery bootstep's) is called once, after the worker stopped.
        self.fatal = threading.Event()
        self.fatal_reason: str | None = None
        self._failure: DeviceFailure | None = None
        self.on_fatal: Callable[[int], None] | None = None

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        """The worker's threads, which ``start`` starts and ``stop`` ends."""
        return (self._engine_thread, self._output_thread, *self._feeder_threads,
                self._heartbeat_thread, self._cancel_thread)

    @property
    def busy(self) -> bool:
        return self.engine_loop.busy

    def start(self) -> None:
        # Before any job's deadline is judged; from the queue's node, which this
        # worker cannot do without anyway (a Cluster's default node may be dead).
        self.clock.sync(node_client(self.redis, self.keys.queue(self.queue)))
        self.partitions = served_partitions(self)
        self.feeders = feeders(self)
        self._feeder_threads = [_thread(partial(feeder.run, self.stop_intake), f"feeder-{part}")
                                for feeder, part in zip(self.feeders, self.partitions)]
        for feeder in self.feeders:
            feeder.ensure_group()
        if self.settings.metrics_port and not self.status.serving:
            self.status.serve(self.settings.metrics_port)
        sys.setswitchinterval(self.settings.gil_switch_ms / 1000)
        self._cancel_thread.start()
        self.cancels.wait_listening()
        self.heartbeat.first_beat()
        for thread in self.threads[:-1]:  # the cancel listener's has started
            thread.start()
        self.health.set(Phase.SERVING)
        parts = f", partitions {', '.join(self.partitions)}" if len(self.partitions) > 1 else ""
        port = self.settings.metrics_port
        metrics = (f"metrics http://0.0.0.0:{port}/metrics" if port and self.status.serving
                   else "no metrics port (--metrics-port)")
        log.info("worker %s started: queue %r, model %s, engine %s, %s (max batch %d, "
                 "prefetch %d%s)", self.name, self.queue, self.settings.model,
                 self.settings.engine, metrics, self.max_batch, self.settings.prefetch, parts)

    def stop(self, grace_s: float | None = None) -> None:
        """The one way the worker's threads and its metrics server end: stop
        reading, let the running jobs finish within ``grace_s`` (default
        ``drain_grace_s``), end every thread, hand the unfinished jobs back
        (another worker resumes each from its streamed tokens) and leave the
        fleet. An engine thread still running ``JOIN_S`` after it was told to end
        may still write for its jobs: then none is handed back (a live worker
        takes their entries as a dead worker's, fencing any late write). Any
        thread but the engine's may call it, more than once: a later call
        returns when the first has finished."""
        with self._stop_lock:
            if not self._stopped:
                self._stopped = True
                self._stop(self.settings.drain_grace_s if grace_s is None else grace_s)

    def _stop(self, grace: float) -> None:
        started = time.monotonic()
        self.health.set(Phase.DRAINING)  # not ready from now on: a probe sees the drain
        self.stop_intake.set()
        # The feeders hand over what they have already read, then end.
        feeder_ended = all([_join(thread, grace + JOIN_S) for thread in self._feeder_threads])
        if self.settings.affinity and feeder_ended:
            # Nobody reads its own streams now: their waiting jobs go to the shared ones.
            unplace(self.redis, self.keys, self.name, self.partitions)
        self.engine_loop.drain(grace)
        self.stopping.set()  # the engine loop, the heartbeat and the cancel listener end
        self.engine_loop.wake.set()
        engine_ended = _join(self._engine_thread, JOIN_S)
        # The output thread stores what the engine handed over, then ends.
        self.output.stop.set()
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
            log.error("the engine thread did not end within %.0fs of the stop (a step that "
                      "does not return?): of its %d job(s) none is handed back; a live worker "
                      "takes them once this one has left", JOIN_S, len(self.engine.unfinished()))
        if not feeder_ended:
            log.warning("a feeder did not end within %.0fs: entries it reads now stay pending, "
                        "for a live worker to take once this one has left", grace + JOIN_S)
        leave(self.redis, self.keys, self.name, self.partitions)
        finished = sum(self.engine.stats.jobs.values())
        log.info("worker %s stopped: %d job(s) finished here, %d handed back to the queue; "
                 "the stop took %.1f s", self.name, finished, handed, time.monotonic() - started)

    def _hand_back_all(self) -> int:
        """Hand back every job not ended here: the engine's, a failure's suspects,
        and those of the step whose writes Redis never stored (their ends too).
        Only once the engine and output threads have ended. How many went back."""
        suspects = self._failure.suspects if self._failure is not None else []
        left = [*self.engine.unfinished(), *suspects, *(o.seq for o in self.output.sent),
                *self.engine_loop.left_over()]
        # The jobs of a step that failed may have caused it (a bad input can trip a
        # device-side assert): theirs counts as an attempt. requeue.lua skips the
        # jobs that are no longer this worker's.
        handed = hand_back(self.publisher, left, frozenset(s.job_id for s in suspects))
        for seq in left:
            self.engine.drop(seq.job_id)
        self.engine_loop.held.clear()
        return handed

    def _fail(self, failure: DeviceFailure) -> None:
        """Engine thread: no more steps can run. Stop reading now, and stop from a
        thread of its own (``stop`` waits for the output thread to store the last
        good step)."""
        log.critical("worker %s gives up: %s; handing its jobs back", self.name, failure)
        self.fatal_reason = str(failure)
        self._failure = failure
        self.health.set(Phase.FAILED, str(failure))
        self.stop_intake.set()
        _thread(self._stop_failed, "stop").start()

    def _stop_failed(self) -> None:
        try:
            # The grace is the last good step's time to be stored while Redis refuses.
            self.stop(grace_s=max(5.0, self.settings.heartbeat_s))
        finally:  # the process exits even if the stop went wrong
            self.fatal.set()
            if self.on_fatal is not None:
                by_jobs = self._failure is not None and self._failure.by_jobs
                self.on_fatal(exit_codes.JOB_FAULT if by_jobs else exit_codes.FATAL)


def _thread(target: Callable[[], None], name: str) -> threading.Thread:
    return threading.Thread(target=target, name=f"tokenfleet-{name}", daemon=True)


def _join(thread: threading.Thread, timeout: float) -> bool:
    """Wait up to ``timeout`` s for ``thread`` to end; whether it has (one never started has)."""
    if thread.ident is not None:
        thread.join(timeout)
    return not thread.is_alive()
