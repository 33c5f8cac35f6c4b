"""Remote control: ``celery -A tokenfleet.workers.app inspect engine_stats``, ``... control drain``.

A command finds the engine by the node name Celery gives it (``state.consumer.hostname``)
in the bootstep's registry (``bootstep.engine_of``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery.worker.control import control_command, inspect_command

from tokenfleet.workers.bootstep import engine_of

if TYPE_CHECKING:
    from tokenfleet.workers.service import Worker


def _engine(state: Any) -> Worker | None:
    return engine_of(state.consumer.hostname)


@inspect_command()
def engine_stats(state: Any) -> dict[str, Any]:
    """The engine's figures: batch in use, peak batch, tokens, jobs by status."""
    worker = _engine(state)
    if worker is None:
        return {"error": "engine not started"}
    return worker.heartbeat.describe()


@control_command()
def drain(state: Any) -> dict[str, Any]:
    """Stop taking new jobs; the running ones finish."""
    worker = _engine(state)
    if worker is None:
        return {"error": "engine not started"}
    worker.paused.set()
    return {"ok": "draining"}


@control_command()
def resume(state: Any) -> dict[str, Any]:
    """Take new jobs again after a drain."""
    worker = _engine(state)
    if worker is None:
        return {"error": "engine not started"}
    worker.paused.clear()
    return {"ok": "resumed"}
