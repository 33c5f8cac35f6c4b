"""What a worker process answers on its metrics port: ``/healthz``, ``/readyz``
and ``/metrics``, for a kubelet's probes and Prometheus.

- **live** (``/healthz``): the process runs and its engine thread comes back
  to its loop, between steps or from waiting for work, within ``liveness_s``
  (``TOKENFLEET_LIVENESS_S``). A long step is live until then; a thread stuck
  past it (a device call that never returns) is not, and a restart is what
  frees it. While the model loads there is no engine thread yet: live.
- **ready** (``/readyz``): the model is loaded and the worker reads its queue.
  Not ready while loading, while draining (a warm shutdown, SIGTERM: the jobs
  running finish, no new one is read) or while paused, nor once the worker gave
  up on its device.

Each answers 200 or 503 with a small JSON body that says why. The server starts
before the model loads (``tokenfleet.workers.bootstep``), so a probe sees the
loading as not ready instead of a refused connection, and stops after the drain.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import orjson
from prometheus_client import CollectorRegistry, make_wsgi_app

# How long ``close`` waits for the requests in progress (a probe, a scrape).
CLOSE_WAIT_S = 5.0


class Phase(enum.Enum):
    LOADING = "loading the model"
    SERVING = "serving"
    DRAINING = "draining: finishing the jobs running, reading no new one"
    FAILED = "gave up"


class Health:
    """A worker's phase and its engine thread's last turn, as the probes read them.

    The worker sets the phase; its engine thread calls ``turn`` each time it
    comes back to its loop. ``intake_paused`` tells a paused intake (remote
    control) apart from a serving one.
    """

    def __init__(self, liveness_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.liveness_s = liveness_s
        self.clock = clock
        self.phase = Phase.LOADING
        self.why = ""  # FAILED: the reason
        self.intake_paused: Callable[[], bool] = lambda: False
        # None until the engine thread's first turn: a worker still loading
        # has no thread to judge.
        self._last_turn: float | None = None

    def turn(self) -> None:
        """Engine thread: back in its loop (a float store: no lock needed)."""
        self._last_turn = self.clock()

    def set(self, phase: Phase, why: str = "") -> None:
        # A failure stays: a drain that follows it does not make it healthy.
        if self.phase is not Phase.FAILED:
            self.phase, self.why = phase, why

    def live(self) -> tuple[bool, dict[str, Any]]:
        if self.phase is Phase.FAILED:
            return False, {"live": False, "why": f"the worker gave up: {self.why}"}
        last = self._last_turn
        if last is None:
            return True, {"live": True, "why": self.phase.value}
        away = self.clock() - last
        body = {"engine_away_s": round(away, 3), "bound_s": self.liveness_s}
        if away > self.liveness_s:
            return False, {"live": False, **body, "why": (
                f"the engine thread has not come back to its loop for {away:.1f}s, past "
                f"TOKENFLEET_LIVENESS_S ({self.liveness_s:g}s): a step that does not return")}
        return True, {"live": True, **body, "why": self.phase.value}

    def ready(self) -> tuple[bool, dict[str, Any]]:
        if self.phase is Phase.FAILED:
            return False, {"ready": False, "why": f"the worker gave up: {self.why}"}
        if self.phase is Phase.SERVING and self.intake_paused():
            return False, {"ready": False, "why": "paused: reading no new job"}
        return self.phase is Phase.SERVING, {"ready": self.phase is Phase.SERVING,
                                             "why": self.phase.value}


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a probe in progress never holds the process up

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.answering: list[threading.Thread] = []
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        # ThreadingMixIn's own, keeping each request's thread: a daemon thread
        # is not joined by server_close, and one may still be closing its
        # socket after its client has read the answer.
        thread = threading.Thread(target=self.process_request_thread,
                                  args=(request, client_address), daemon=True)
        self.answering = [t for t in self.answering if t.is_alive()] + [thread]
        thread.start()

    def join_requests(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the requests in progress to end."""
        deadline = time.monotonic() + timeout_s
        for thread in self.answering:
            thread.join(max(0.0, deadline - time.monotonic()))


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # a probe every few seconds is no news


class StatusServer:
    """The HTTP server of a worker's metrics port: ``/healthz`` and ``/readyz``
    from ``health``, anything else the Prometheus metrics of ``registry``
    (none until the worker is built)."""

    def __init__(self, health: Health) -> None:
        self.health = health
        self._metrics = make_wsgi_app(CollectorRegistry(auto_describe=False))
        self._server: tuple[_Server, threading.Thread] | None = None

    def show(self, registry: CollectorRegistry) -> None:
        """Serve ``registry`` on ``/metrics`` from now on."""
        self._metrics = make_wsgi_app(registry)

    def app(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path in ("/healthz", "/readyz"):
            ok, body = self.health.live() if path == "/healthz" else self.health.ready()
            start_response("200 OK" if ok else "503 Service Unavailable",
                           [("Content-Type", "application/json")])
            return [orjson.dumps(body)]
        return self._metrics(environ, start_response)  # type: ignore[no-any-return]

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serve on ``port`` until ``close``."""
        server = make_server(host, port, self.app, _Server, handler_class=_QuietHandler)
        thread = threading.Thread(target=server.serve_forever, name="tokenfleet-status",
                                  daemon=True)
        thread.start()
        self._server = (server, thread)

    @property
    def serving(self) -> bool:
        return self._server is not None

    def close(self) -> None:
        """Stop the server, end its thread and free its port."""
        if self._server is None:
            return
        server, thread = self._server
        self._server = None
        server.shutdown()  # returns once serve_forever has returned: the thread ends
        server.server_close()
        thread.join()
        server.join_requests(CLOSE_WAIT_S)
