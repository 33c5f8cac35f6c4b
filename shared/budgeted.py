"""Work that can grow with its input, run in a child process that ends when
its time budget runs out.

A grammar compile is the case: xgrammar expands a pattern's repetition counts
into rules, so 47 bytes of JSON schema (``"[a-z]{1,10000}"``) take seconds and
the time grows with the count. A thread could be abandoned but not stopped:
it would burn a core for as long as the compile runs, and the next schema
another. A child ends at the budget and takes its memory with it.

One server process per process and preload (a plain interpreter, ``python -c
SERVER``: nothing of the parent is re-run in it, as ``multiprocessing`` would
re-import a script without a ``__main__`` guard) imports xgrammar once, then
forks a runner for each child asked for: a fork of a single-threaded process
costs milliseconds, where a new interpreter would import torch again. A runner
takes tasks one at a time on its own two pipes, JSON in length-prefixed
frames, and is kept for the next task while it lives. Once a task says it is
ready (its setup done: imports, a vocabulary read), the runner arms
``faulthandler``'s timer, a C thread that ends the process at the budget even
while the compile holds the interpreter: so no pid is ever killed from
outside. Runners and the server run below the parent's priority: serving
tokens goes first.
"""

from __future__ import annotations

import atexit
import faulthandler
import importlib
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson

# Imported by the server before it forks any runner, unless told others.
PRELOAD = ("xgrammar", "tokenfleet.shared.grammar_check")
# How long the server may take to start or a task to get ready (imports, a
# vocabulary read) before it is treated as hung: a bound, not the work's budget.
SETUP_S = 120.0
# The parent's own wait past the budget, for a runner to end itself and say so.
GRACE_S = 1.0
# How much lower the children's priority is than their parent's (nice increment).
NICENESS = 5
# Idle runners kept for the next task; more are let go when they finish.
IDLE_KEPT = 4
_HEADER = struct.Struct(">I")
SERVER = ("import sys; from tokenfleet.shared.budgeted import server; "
          "server(int(sys.argv[1]), sys.argv[2:])")


class OverBudget(Exception):
    """The task did not finish within its budget; its runner ended."""


class ChildFailed(Exception):
    """The task raised (its message), or its runner ended without an answer
    (killed by the system: out of memory, say)."""


class Children:
    """Runners forked from one preloaded server, each running one task at a time."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD) -> None:
        self._server = _server(preload)
        self._idle: list[_Runner] = []
        self._lock = threading.Lock()

    def run(self, task: Callable[..., Any], args: list[Any], budget_s: float) -> Any:
        """``task(ready, *args)`` in a runner: its JSON answer, ``OverBudget``
        when it has not returned ``budget_s`` after calling ``ready()``, or
        ``ChildFailed``. ``task`` is a module-level function (named to the
        runner by its import path). Blocks this thread for at most the
        server's start, the task's setup and ``budget_s`` (and a grace)."""
        with self._lock:
            runner = self._idle.pop() if self._idle else None
        runner = runner or self._fork()
        kept = False
        try:
            runner.send([f"{task.__module__}:{task.__qualname__}", args, budget_s])
            first = runner.receive(SETUP_S)
            if first == ["ready"]:
                first = runner.receive(budget_s + GRACE_S, ended=OverBudget)
            kind, value = first
            kept = True
            if kind == "error":
                raise ChildFailed(value)
            return value
        finally:
            with self._lock:
                if kept and len(self._idle) < IDLE_KEPT:
                    self._idle.append(runner)
                    runner = None
            if runner is not None:
                runner.close()

    def close(self) -> None:
        """Let the idle runners go (each ends on its pipe's end); the server
        stays for the process's other users, and ends with the process."""
        with self._lock:
            idle, self._idle = self._idle, []
        for runner in idle:
            runner.close()

    def _fork(self) -> _Runner:
        tasks_r, tasks_w = os.pipe()
        answers_r, answers_w = os.pipe()
        try:
            self._server.fork(tasks_r, answers_w)
        finally:
            os.close(tasks_r)
            os.close(answers_w)
        return _Runner(tasks_w, answers_r)


class _Server:
    """The process that forks runners: one per process and preload, started on
    first use, started again if it died."""

    def __init__(self, preload: tuple[str, ...]) -> None:
        self._preload = preload
        self._lock = threading.Lock()
        self._running: tuple[subprocess.Popen[bytes], socket.socket] | None = None

    def fork(self, tasks: int, answers: int) -> None:
        """A runner reading ``tasks`` and writing ``answers`` (the parent closes its copies)."""
        with self._lock:
            for attempt in range(2):  # a server that died is started again, once
                proc, sock = self._started()
                try:
                    socket.send_fds(sock, [b"fork"], [tasks, answers])
                    if sock.recv(16):  # the runner's pid: it exists
                        return
                except OSError:
                    pass
                sock.close()
                proc.wait()
                self._running = None
        raise ChildFailed("the compile server did not start a runner")

    def stop(self) -> None:
        """End the server (it ends on its socket's end); its runners end on theirs."""
        with self._lock:
            if self._running is not None:
                proc, sock = self._running
                sock.close()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                self._running = None

    def _started(self) -> tuple[subprocess.Popen[bytes], socket.socket]:
        if self._running is None:
            ours, theirs = socket.socketpair()
            proc = subprocess.Popen([sys.executable, "-c", SERVER, str(theirs.fileno()),
                                     *self._preload],
                                    pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
            theirs.close()
            # Waiting for its imports is setup: the first fork's answer waits for them.
            ours.settimeout(SETUP_S)
            self._running = (proc, ours)
        return self._running


_servers: dict[tuple[str, ...], _Server] = {}  # one per preload: a process's children share it
_servers_lock = threading.Lock()


def _server(preload: tuple[str, ...]) -> _Server:
    with _servers_lock:
        return _servers.setdefault(preload, _Server(preload))


@atexit.register
def _stop_servers() -> None:
    with _servers_lock:
        for server in _servers.values():
            server.stop()


class _Runner:
    def __init__(self, tasks: int, answers: int) -> None:
        self._tasks, self._answers = tasks, answers

    def send(self, message: Any) -> None:
        try:
            _write(self._tasks, message)
        except OSError as exc:
            raise ChildFailed(f"the process took no task ({exc})") from None

    def receive(self, timeout_s: float, ended: type[Exception] = ChildFailed) -> Any:
        deadline = time.monotonic() + timeout_s
        header = self._read(_HEADER.size, deadline, ended)
        return orjson.loads(self._read(_HEADER.unpack(header)[0], deadline, ended))

    def _read(self, size: int, deadline: float, ended: type[Exception]) -> bytes:
        data = bytearray()
        while len(data) < size:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._answers], [], [], left)[0]:
                raise OverBudget()
            chunk = os.read(self._answers, size - len(data))
            if not chunk:  # it ended: at its budget (``ended``), or killed
                raise ended("the process ended without an answer")
            data += chunk
        return bytes(data)

    def close(self) -> None:
        # The runner reads the end of its task pipe and exits (or has ended).
        os.close(self._tasks)
        os.close(self._answers)


def _write(fd: int, message: Any) -> None:
    body = orjson.dumps(message)
    view = memoryview(_HEADER.pack(len(body)) + body)
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd: int, size: int) -> bytes | None:
    data = bytearray()
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def server(fd: int, preload: list[str]) -> None:
    """The server: import what tasks need (``preload``), then fork a runner for
    each pair of pipes sent on the socket ``fd``, until the socket ends."""
    os.nice(NICENESS)
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:  # xgrammar is optional: its tasks then fail with a sentence
            pass
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # runners are reaped as they end
    sock = socket.socket(fileno=fd)
    while True:
        message, fds, _, _ = socket.recv_fds(sock, 16, 2)
        if not message:
            return
        pid = os.fork()
        if pid == 0:
            sock.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _serve(*fds)
            os._exit(0)
        for passed in fds:
            os.close(passed)
        sock.sendall(str(pid).encode())


def _serve(tasks: int, answers: int) -> None:
    """A runner: each task it is sent, within the budget the task carries."""
    with open(os.devnull, "w") as quiet:
        while True:
            header = _read_exactly(tasks, _HEADER.size)
            body = None if header is None else _read_exactly(tasks, _HEADER.unpack(header)[0])
            if body is None:
                return
            name, args, budget_s = orjson.loads(body)

            def ready(budget_s: float = budget_s) -> None:
                _write(answers, ["ready"])
                # Ends this process at the budget, from a C thread: no GIL needed.
                faulthandler.dump_traceback_later(budget_s, exit=True, file=quiet)

            module, _, function = name.partition(":")
            try:
                result = getattr(importlib.import_module(module), function)(ready, *args)
            except Exception as exc:  # a sentence for the parent, never a pickled exception
                faulthandler.cancel_dump_traceback_later()
                _write(answers, ["error", str(exc) or type(exc).__name__])
            else:
                faulthandler.cancel_dump_traceback_later()
                _write(answers, ["ok", result])
