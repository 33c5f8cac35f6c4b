"""The Celery bootstep that runs the engine inside each worker process."""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps

from tokenfleet.shared.settings import get_settings

log = logging.getLogger(__name__)


class EngineStep(bootsteps.StartStopStep):
    """Loads the model at worker start, drains on warm shutdown.

    The consumer name in the stream's group is the Celery node name
    (``gpu0@host``): stable per host and GPU, so a restarted process first
    re-reads the entries its predecessor held.
    """

    label = "tokenfleet engine"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.worker: Any = None

    def start(self, parent: Any) -> None:
        from celery.worker import state as celery_state

        from tokenfleet.shared.keys import Keys
        from tokenfleet.shared.redis_conn import connect
        from tokenfleet.workers.build import build_worker
        from tokenfleet.workers.identity import check_name

        settings = get_settings()
        # Before the model loads: a second process under a live name is refused at once.
        check_name(connect(settings.redis_url), Keys(settings.namespace), parent.hostname)
        self.worker = build_worker(settings, name=parent.hostname)
        parent.tokenfleet = self.worker  # for the remote-control commands
        # A failed device: Celery's warm shutdown, as on SIGTERM, exiting with ``code``.
        self.worker.on_fatal = lambda code: setattr(celery_state, "should_stop", code)
        self.worker.start()

    def stop(self, parent: Any) -> None:
        if self.worker is not None:
            log.info("draining: finishing jobs in flight (grace %.0fs)",
                     self.worker.settings.drain_grace_s)
            self.worker.stop()
            self.worker = None

    def terminate(self, parent: Any) -> None:
        if self.worker is not None:
            self.worker.stop(grace_s=0)
            self.worker = None
