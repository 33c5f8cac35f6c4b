"""The Celery bootstep that runs the engine inside each worker process, and the
registry the remote-control commands find that engine in."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from celery import bootsteps
from celery.exceptions import ImproperlyConfigured, WorkerShutdown

from tokenfleet.shared.settings import Settings, get_settings
from tokenfleet.workers.celery_quiet import stop_quietly

if TYPE_CHECKING:
    from tokenfleet.workers.health import StatusServer
    from tokenfleet.workers.service import Worker

log = logging.getLogger(__name__)

# How often Celery's main thread looks whether the engine gave up on its device.
FATAL_CHECK_S = 0.5

# The engine each worker of this process runs, by Celery node name, while it
# runs: remote-control commands get the node name from Celery, not the engine.
_engines: dict[str, Worker] = {}


def engine_of(hostname: str) -> Worker | None:
    """The engine the Celery worker ``hostname`` runs, None before it started or after it stopped."""
    return _engines.get(hostname)


def _check_model(name: str) -> None:
    """A model that names nothing loadable ends the process with the code that
    tells ``tokenfleet worker`` not to restart it (``tokenfleet worker`` checks
    first; this covers a directory gone since, or ``celery -A`` run by hand)."""
    from tokenfleet.shared import models
    from tokenfleet.workers.null_runner import NULL_MODEL
    from tokenfleet.workers.supervisor import CONFIG_EXIT_CODE

    if name == NULL_MODEL:
        return
    try:
        models.check(name)
        models.resolve(name)  # a hf: model must be in the cache by now
    except Exception as exc:  # ModelError, or the Hugging Face cache's own errors
        log.error("cannot serve model %r: %s", name, exc)
        raise WorkerShutdown(CONFIG_EXIT_CODE) from None


class EngineStep(bootsteps.StartStopStep):
    """Loads the model at worker start, drains on warm shutdown, and shuts the
    worker down (warm, exiting with the engine's code) when its device fails.

    The consumer name in the stream's group is the Celery node name
    (``<name>-gpu<i>@host``): stable per host and GPU, so a restarted process first
    re-reads the entries its predecessor held.
    """

    label = "tokenfleet engine"
    # ``parent.timer`` exists once the Timer step ran.
    requires = {"celery.worker.components:Timer"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.worker: Worker | None = None
        self.status: StatusServer | None = None
        self.exit_code: int | None = None
        self._watch: Any = None

    def start(self, parent: Any) -> None:
        from tokenfleet.workers.health import Health, StatusServer

        # Celery starts a shutdown only when WorkerShutdown is raised in its main
        # thread; a device fails in the engine's. With the event loop, timer
        # entries run in the main thread (without it, in a thread of their own,
        # where the exception would be lost).
        if parent.hub is None:
            raise ImproperlyConfigured("the tokenfleet engine needs Celery's event loop: "
                                       "a Redis broker and the solo pool (-P solo)")
        stop_quietly(parent)  # Celery installed its signal handlers before the steps start
        settings = get_settings()
        # The probes answer from before the model loads: live, not ready yet.
        status = StatusServer(Health(settings.liveness_s))
        if settings.metrics_port:
            status.serve(settings.metrics_port)
        self.status = status
        try:
            self._start_worker(parent, settings, status)
        except BaseException:  # the port is free again for the next start
            status.close()
            self.status = None
            raise
        self._watch = parent.timer.call_repeatedly(FATAL_CHECK_S, self._exit_if_fatal, priority=10)

    def _start_worker(self, parent: Any, settings: Settings, status: StatusServer) -> None:
        from tokenfleet.shared.wire.keys import Keys
        from tokenfleet.shared.redis.connect import connect
        from tokenfleet.workers.build import build_worker
        from tokenfleet.workers.identity import check_name

        # Before the model loads: a second process under a live name is refused at once.
        redis = connect(settings.redis_url)
        try:
            check_name(redis, Keys(settings.namespace), parent.hostname)
        finally:
            redis.close()
        _check_model(settings.model)
        worker = build_worker(settings, name=parent.hostname, status=status)
        worker.on_fatal = self._on_fatal
        self.worker = worker
        worker.start()
        _engines[parent.hostname] = worker

    def _on_fatal(self, code: int) -> None:
        """Called once, from the thread that stopped the worker after its device
        failed: remembered for the main thread."""
        self.exit_code = code

    def _exit_if_fatal(self) -> None:
        if self.exit_code is not None:
            # Celery's warm shutdown, as on SIGTERM, but exiting with the code.
            raise WorkerShutdown(self.exit_code)

    def stop(self, parent: Any) -> None:
        if self.worker is not None:
            log.info("draining: finishing jobs in flight (grace %.0fs)",
                     self.worker.settings.drain_grace_s)
        self._stop(parent, grace_s=None)

    def terminate(self, parent: Any) -> None:
        self._stop(parent, grace_s=0)

    def _stop(self, parent: Any, grace_s: float | None) -> None:
        """Stop the engine: within ``grace_s``, or the settings' drain grace if None."""
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self.worker is not None:
            self.worker.stop(grace_s=grace_s)
            self.worker = None
        if self.status is not None:  # after the drain: a probe saw it as not ready
            self.status.close()
            self.status = None
        _engines.pop(parent.hostname, None)
