"""A fault placed, not timed: the worker frozen at a moment it runs a job.

"Wait until N jobs finished, then kill" hits a job in flight only by chance:
on a loaded machine the worker may finish (or not yet start) the rest between
the check and the kill. Frozen with SIGSTOP, a worker writes nothing more, so
the jobs Redis says it runs are the jobs it runs when the fault lands.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

JobIds = Iterable[str] | Callable[[], Iterable[str]]


def running_on(r: Any, keys: Any, node: str, job_ids: Iterable[str]) -> list[str]:
    """The jobs of ``job_ids`` that ``node`` started and has not finished (start.lua
    sets ``status`` running and ``worker``; finish.lua ends both in one step)."""
    ids = list(job_ids)
    pipe = r.pipeline(transaction=False)
    for j in ids:
        pipe.hmget(keys.job(j), "status", "worker")
    return [j for j, (status, worker) in zip(ids, pipe.execute())
            if status == b"running" and worker == node.encode()]


def _stopped(pid: int) -> bool:
    # /proc/PID/stat's third field: T once SIGSTOP has taken hold of every thread.
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")


@contextmanager
def frozen_mid_job(proc: subprocess.Popen[Any], r: Any, keys: Any, node: str, jobs: JobIds,
                   enough: Callable[[list[str]], bool] = bool,
                   timeout: float = 120) -> Iterator[list[str]]:
    """Freeze ``proc`` (the worker ``node``) at a moment it runs jobs of ``jobs``
    that ``enough`` accepts, and yield those jobs; the fault goes in the ``with``
    block (a SIGKILL of the worker, a Redis node's death). The worker goes on
    afterwards unless the block killed it.

    It waits for a started job, freezes the worker, and reads again: a job that
    ended between the two reads lets the worker go on and the wait start over.
    """
    deadline = time.monotonic() + timeout
    while True:
        ids = list(jobs() if callable(jobs) else jobs)
        if enough(running_on(r, keys, node, ids)):
            os.kill(proc.pid, signal.SIGSTOP)
            while proc.poll() is None and not _stopped(proc.pid):
                time.sleep(0.001)
            running = running_on(r, keys, node, ids)
            if proc.poll() is None and enough(running):
                break
            os.kill(proc.pid, signal.SIGCONT)
        if proc.poll() is not None:
            raise AssertionError(f"worker {node} exited (rc {proc.returncode}) before the fault")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {node} to run a job")
        time.sleep(0.02)
    try:
        yield running
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
