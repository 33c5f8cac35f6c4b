"""The processes a benchmark run needs: a redis-server, Celery worker processes,
HTTP servers (the gateway, vLLM's), and what /proc says about them (resident
memory, CPU time)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from tokenfleet.shared.wire.keys import Keys

ROOT = Path(__file__).resolve().parents[2]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _find_prctl() -> Any:
    try:
        import ctypes

        return ctypes.CDLL(None).prctl
    except (OSError, AttributeError):  # not Linux: close() still stops them on a normal exit
        return None


# Looked up here, not in the child: between fork and exec the child must do
# as little as it can (the parent has threads).
_PRCTL = _find_prctl()
PR_SET_PDEATHSIG, SIGTERM = 1, 15


def _die_with_parent() -> None:
    """In the child, before exec: a SIGTERM when the benchmark's process dies, so
    a killed run leaves no redis-server or worker behind."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, SIGTERM)


class BenchError(RuntimeError):
    """The benchmark cannot go on; the message says why and what to do."""


def wait_for(condition: Callable[[], Any], timeout: float, what: str,
             interval: float = 0.02) -> Any:
    """Poll another process's state until it holds (there is no event to wait on)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise BenchError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisProc:
    """A throwaway redis-server on a free port, no persistence."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise BenchError("redis-server is not installed: `apt-get install redis-server`, "
                             "or point the benchmark at a server with --redis-url")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="tokenfleet-bench-redis-")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        try:
            wait_for(lambda: _pings(client), 10, "redis-server to answer PING")
        finally:
            client.close()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.exceptions.ConnectionError:
        return False


class ChildProc:
    """A child process of the benchmark, its output in a log file; ``new_session``:
    in a session of its own, so that what it spawns can be ended with it."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_prefix: str,
                 new_session: bool = False) -> None:
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"tokenfleet-bench-{log_prefix}-",
                                               suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                                     cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=new_session, preexec_fn=_die_with_parent)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self, tail: int = 3000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-tail:]

    def check(self) -> None:
        if not self.alive():
            raise BenchError(f"{self.name} exited ({self.proc.returncode}):\n{self.output()}")

    def _drop_log(self) -> None:
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


class CeleryProc(ChildProc):
    """``celery -A <app> worker -P solo`` as a child process."""

    def __init__(self, app: str, node: str, env: dict[str, str]) -> None:
        self.node = node
        cmd = [sys.executable, "-m", "celery", "-A", app, "worker", "-P", "solo", "-c", "1",
               "-n", node, "--without-mingle", "--without-gossip", "-l", "WARNING"]
        super().__init__(f"worker {node}", cmd, env, node.split("@")[0])

    def close(self, timeout: float = 30) -> None:
        if self.alive():
            self.proc.terminate()  # warm shutdown: nothing is left running by then
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._drop_log()


class ServerProc(ChildProc):
    """An HTTP server on 127.0.0.1, in a session of its own: closing it ends what
    it spawned too (vLLM's server starts its engine core as a second process)."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict[str, str]) -> None:
        self.port = port
        super().__init__(name, cmd, env, name, new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> bytes | None:
        """The body of a 200 answer to GET ``path``; None for anything else."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=2) as answer:
                return bytes(answer.read()) if answer.status == 200 else None
        except (urllib.error.URLError, OSError):
            return None

    def wait_ready(self, path: str, ready: Callable[[bytes], bool], timeout: float) -> None:
        """Until GET ``path`` answers 200 with a body that ``ready`` accepts."""
        def answered() -> bool:
            self.check()
            body = self.get(path)
            return body is not None and ready(body)

        wait_for(answered, timeout, f"{self.name} to serve {self.url}{path}", interval=0.5)

    def close(self, timeout: float = 30) -> None:
        self._signal(signal.SIGTERM)  # it stops what it spawned on its way out
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)  # the whole session, stuck children too
            self.proc.wait(timeout=10)
        self._drop_log()

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise BenchError(f"process {pid} reports no resident memory")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def redis_cpu_seconds(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return sum(fields) - idle, sum(fields)


def wait_quiet(busy_share: float = 0.1, interval_s: float = 0.2, at_most_s: float = 5.0) -> float:
    """Wait until the machine's CPUs are at most ``busy_share`` busy over an
    ``interval_s``, ``at_most_s`` at most (a host busy with something else
    never is). Returns the seconds waited.

    A server taking its turn of a side-by-side run must not share the CPUs with
    the one before it: vLLM's engine spins on a core for about a second after
    its last request, which took a quarter of the next server's burst of 1.4 s
    on two cores."""
    started = time.monotonic()
    while time.monotonic() - started < at_most_s:
        busy, total = _machine_busy()
        time.sleep(interval_s)
        busy2, total2 = _machine_busy()
        if total2 > total and (busy2 - busy) / (total2 - total) <= busy_share:
            break
    return time.monotonic() - started


class Control:
    """``tokenfleet control`` for the bench's workers (``drain``, ``resume``): a
    Celery client of its own on their namespace."""

    def __init__(self, url: str, keys: Keys) -> None:
        from celery import Celery

        from tokenfleet.workers.app import broker_ssl

        self.celery = Celery("tokenfleet-bench", broker=url)
        self.celery.conf.update(
            broker_use_ssl=broker_ssl(url),
            broker_transport_options={"global_keyprefix": keys.celery_prefix},
            accept_content=["json"], task_serializer="json", result_serializer="json")

    def send(self, command: str, nodes: list[str], tries: int = 1) -> None:
        """``control command`` to ``nodes``; asked again, up to ``tries`` times
        in all, of those that did not answer (a worker busy on a loaded machine)."""
        left = list(nodes)
        for _ in range(tries):
            replies = self.celery.control.broadcast(command, destination=left, reply=True,
                                                    timeout=10)
            answered = {node for reply in replies for node in reply}
            left = [node for node in left if node not in answered]
            if not left:
                return
        raise BenchError(f"worker(s) {', '.join(left)} did not answer `control {command}` "
                         f"in {10 * tries} s")

    def close(self) -> None:
        self.celery.close()
