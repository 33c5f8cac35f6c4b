"""What a worker process shows of Celery, and how fast it leaves once stopped.

Celery's own output (its banner, an empty ``[tasks]`` list, its warning about
running as root, "Connected to", "ready.", the lines it prints on each Ctrl-C)
says nothing about the fleet: a worker shows it only at ``--loglevel DEBUG``
(``celery -A ... worker`` run by hand without ``--quiet`` shows it too). The
worker's own lines say what it serves and how it stopped.

A Ctrl-C or SIGTERM stops the worker warm (it drains, exit code 0); a second
Ctrl-C stops it cold (the jobs in flight are handed back at once), as
Celery's own handlers do, without their lines.

A stopped worker process exits at once: the interpreter's teardown of torch
and the model took seconds (3 to 10 on a loaded host) and does nothing the
fleet needs, as every write and hand-back is done by then.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import warnings
from typing import Any

from celery import bootsteps, platforms, signals
from celery.exceptions import SecurityWarning
from celery.worker import state

EX_OK, EX_FAILURE = 0, 1


def _quiet_celery(instance: Any = None, **_: Any) -> None:
    """Before Celery checks its privileges and sets its logging up."""
    if getattr(instance, "quiet", False):
        warnings.filterwarnings("ignore", category=SecurityWarning)
        logging.getLogger("celery").setLevel(logging.WARNING)


def stop_quietly(worker: Any) -> None:
    """Ctrl-C and SIGTERM as Celery handles them, without its lines: call once
    Celery installed its handlers (a bootstep's start), for a ``--quiet`` worker."""
    if getattr(worker, "quiet", False):
        for name in ("SIGINT", "SIGTERM"):
            platforms.signals[name] = _stop


def _stop(signum: int, _frame: Any) -> None:
    # The flags Celery's own handlers set: its loop ends at its next turn.
    if state.should_stop is None or state.should_stop is False:
        state.should_stop = EX_OK  # warm: the engine drains
    elif signum == signal.SIGINT:
        state.should_terminate = EX_FAILURE  # a second Ctrl-C: cold


def _exit_now(sender: Any = None, **_: Any) -> None:
    """Sent last by a warm stop (``WorkController.stop``), after every step stopped."""
    blueprint = getattr(sender, "blueprint", None)
    if blueprint is None or blueprint.state == bootsteps.RUN:
        return  # not stopped through (a stop from inside a signal handler): no shortcut
    logging.shutdown()  # flushes the log's handlers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(sender.exitcode or EX_OK)


signals.celeryd_init.connect(_quiet_celery)
signals.worker_shutdown.connect(_exit_now)
