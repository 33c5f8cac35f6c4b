"""Small test helpers."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from tokenfleet.workers.bench.procs import free_port  # noqa: F401  (the tests use it too)


def direct_greedy(loaded: tuple[Any, Any], jobs: list[tuple[str, int]]) -> list[str]:
    """The undisturbed run of (prompt, max_new_tokens) jobs: the same engine
    in-process, no Redis, no faults; greedy texts for a fault test to match."""
    from tokenfleet.shared.schemas import SamplingParams
    from tokenfleet.workers.detokenizer import TextStream
    from tokenfleet.workers.hf_engine import HFEngine
    from tokenfleet.workers.runner import HFRunner
    from tokenfleet.workers.scheduler import Scheduler
    from tokenfleet.workers.sequence import Sequence

    model, tok = loaded
    runner = HFRunner(model, tok)
    sched = Scheduler(64, runner.eos_token_ids, runner.max_model_len)
    seqs = [Sequence(str(i), tok(p)["input_ids"], SamplingParams(max_new_tokens=n, temperature=0.0),
                     TextStream(tok)) for i, (p, n) in enumerate(jobs)]
    engine = HFEngine(sched, runner)
    for s in seqs:
        engine.add(s)
    while engine.has_work:
        engine.step()
    return [s.text.text for s in seqs]


# Figures the fault-injection suite prints at the end of the run (name, figures).
FIGURES: list[tuple[str, dict[str, Any]]] = []


def wait_until(condition: Callable[[], Any], timeout: float, what: str,
               interval: float = 0.02) -> Any:
    """Poll an external process's state (a server, a child process) until it holds.

    For state owned by another process there is no event to wait on; the poll is
    bounded, and the failure names what never happened.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class RedisServer:
    """A redis-server the tests own: they may stop, kill and restart it."""

    def __init__(self, appendonly: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: `apt-get install redis-server` "
                        "(.ci/run does this)")
        self.binary = binary
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="tokenfleet-redis-")
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--dir", self.dir, "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", "always"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        wait_until(lambda: _pings(client), timeout=10, what="redis-server to answer PING")
        client.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.exceptions.ConnectionError:
        return False
