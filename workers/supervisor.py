"""``tokenfleet worker``'s parent: starts one child per GPU and watches them.

A child that dies is started again after a backoff (1 s, 2 s, 4 s ... capped),
so a crash costs one process's jobs for ``claim_idle_s`` and not the host's
capacity for good. A child that keeps dying (``max_restarts`` within
``window_s``: a model that does not load, a broken device) is given up on: the
others are stopped too and the parent exits non-zero with a line saying why, so
systemd, Kubernetes or supervisor see the failure instead of a half-fleet. A
child that exits with ``JOB_FAULT_EXIT_CODE`` (its engine stopped on a step
that one of its jobs most likely broke, on a device that works) is restarted
after the first backoff and not counted: a few poison jobs in a row must not
cost the host its workers. A child that exits with ``CONFIG_EXIT_CODE`` failed
for a reason a restart cannot fix (a model that is not there): it is given up
on at once, and the parent exits with 2, as for any other setup mistake.
SIGTERM / SIGINT are passed on to every child (Celery's warm shutdown drains; a
second SIGINT stops it cold), SIGHUP (a closed terminal) as SIGTERM. Each child
runs in a process group of its own, so a Ctrl-C in the terminal reaches it once,
through the parent, not twice (once from the terminal): a second SIGINT would
have made the first Ctrl-C a cold stop.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenfleet.workers import exit_codes

POLL_S = 0.2  # how often the parent looks at its children
STOPPING_POLL_S = 0.02  # ... once they are told to stop: the exit follows theirs at once
JOB_FAULT_EXIT_CODE = exit_codes.JOB_FAULT
CONFIG_EXIT_CODE = exit_codes.CONFIG  # a child's configuration is wrong
SETUP_EXIT_CODE = exit_codes.SETUP  # the parent's code then


def _in_own_group(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A child in a process group of its own: a terminal's signals reach only the parent."""
    return subprocess.Popen(cmd, env=env, process_group=0)


@dataclass
class Child:
    node: str
    cmd: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    failures: deque[float] = field(default_factory=deque)  # when it died, recent ones
    restart_at: float | None = None
    done: bool = False
    code: int = 0


class Supervisor:
    def __init__(
        self,
        children: list[Child],
        *,
        max_restarts: int = 5,
        window_s: float = 300.0,
        max_backoff_s: float = 30.0,
        say: Callable[[str], None] = print,
        popen: Callable[..., Any] | None = None,
    ) -> None:
        self.children = children
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.max_backoff_s = max_backoff_s
        self.say = say
        self.popen = popen or _in_own_group
        self.stopping = False

    def run(self) -> int:
        """Run until every child has ended; the exit code for the parent."""
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._forward)
        for child in self.children:
            self._start(child)
        while not all(c.done for c in self.children):
            now = time.monotonic()
            for child in self.children:
                self._watch(child, now)
            time.sleep(STOPPING_POLL_S if self.stopping else POLL_S)
        return max((c.code for c in self.children), default=0)

    def _start(self, child: Child) -> None:
        child.restart_at = None
        child.proc = self.popen(child.cmd, env=child.env)

    def _watch(self, child: Child, now: float) -> None:
        if child.done:
            return
        if child.proc is None:  # waiting out its backoff
            if self.stopping:
                child.done = True
            elif child.restart_at is not None and now >= child.restart_at:
                self.say(f"restarting {child.node}")
                self._start(child)
            return
        code = child.proc.poll()
        if code is None:
            return
        child.proc = None
        if self.stopping or code == 0:
            child.done, child.code = True, code
            return
        if code == JOB_FAULT_EXIT_CODE:
            self.say(f"{child.node} stopped on a job its engine could not run (exit code "
                     f"{code}; its log above says which); restarting in 1s")
            child.restart_at = now + 1.0
            return
        if code == CONFIG_EXIT_CODE:
            self.say(f"{child.node} cannot start with this configuration (its log above says "
                     "why); a restart would not help: stopping the other workers")
            child.done, child.code = True, SETUP_EXIT_CODE
            self._stop_all()
            return
        child.failures.append(now)
        while child.failures and child.failures[0] < now - self.window_s:
            child.failures.popleft()
        if len(child.failures) >= self.max_restarts:
            self.say(f"{child.node} exited with code {code}, {len(child.failures)} times in "
                     f"{self.window_s:.0f}s: giving up (its log above says why); stopping the "
                     "other workers")
            child.done, child.code = True, code or 1
            self._stop_all()
            return
        delay = min(self.max_backoff_s, 2.0 ** (len(child.failures) - 1))
        self.say(f"{child.node} exited with code {code}; restarting in {delay:.0f}s")
        child.restart_at = now + delay

    def _forward(self, signum: int, _frame: Any) -> None:
        self.stopping = True
        if signum == signal.SIGHUP:
            signum = signal.SIGTERM
        for child in self.children:
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signum)

    def _stop_all(self) -> None:
        self._forward(signal.SIGTERM, None)
