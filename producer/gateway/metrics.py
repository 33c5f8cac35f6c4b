"""The gateway's own Prometheus metrics, served on ``GET /metrics`` without a key.

What the HTTP front sees, per gateway process (aggregate across replicas with
``sum``):

- ``tokenfleet_gateway_requests_total{route, method, status, tenant}``: every
  request answered, refusals included (a 401 too). ``route`` is the route's
  template (``/v1/jobs/{job_id}``), never the raw path, and ``other`` for a
  path no route serves; ``tenant`` the API key's, empty without one;
  ``status`` 499 where the client left before any answer;
- ``tokenfleet_gateway_request_duration_seconds{route}``: from the request's
  arrival to its answer's last byte (a stream's whole life);
- ``tokenfleet_gateway_time_to_first_token_seconds{route}``: from the request's
  arrival to its stream's first chunk of generated text, as the client gets it
  (queueing, the worker's prefill and the pub/sub hop included);
- ``tokenfleet_gateway_open_streams{route}``: Server-Sent Event streams open now;
- ``tokenfleet_gateway_redis_connections_in_use``, ``..._max``,
  ``tokenfleet_gateway_redis_waiting`` (commands waiting for a connection now),
  ``tokenfleet_gateway_redis_waits_total`` and ``..._wait_timeouts_total`` (waits
  that ended in a 503): the gateway's bounded pool (a Cluster's per-node pools
  are not shown);
- ``tokenfleet_gateway_batch_lines_fed_total``, ``..._collected_total``: the
  batch driver's lines queued as jobs and written to the batch's files;
- ``tokenfleet_gateway_webhook_deliveries_total{outcome}``: ``delivered``,
  ``failed`` (tried again later), ``dead`` (given up), ``dropped`` (no URL).

A gateway reachable from the internet shows its tenants' names and traffic on
``/metrics``: keep that path off the public route (the ingress or proxy), as
for vLLM's server.

Each app has a registry of its own (not prometheus_client's global one), so
several gateways run in one process, as in the tests.
"""

from __future__ import annotations

import re
import time
import weakref
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PATH = "/metrics"
LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# A request that never got an answer: its client hung up first (nginx's code).
CLIENT_LEFT = 499


class GatewayMetrics:
    """The metrics of one gateway app; ``app.state`` is read at each scrape for
    its pool, batch driver and webhook deliverer."""

    def __init__(self, state: Any) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("tokenfleet_gateway_requests", "Requests the gateway answered, "
                                "by route template, method, status and tenant",
                                ["route", "method", "status", "tenant"], registry=r)
        self.duration = Histogram("tokenfleet_gateway_request_duration_seconds",
                                  "From a request's arrival to its answer's last byte",
                                  ["route"], buckets=LATENCY, registry=r)
        self.ttft = Histogram("tokenfleet_gateway_time_to_first_token_seconds",
                              "From a request's arrival to the first streamed chunk of "
                              "generated text", ["route"], buckets=LATENCY, registry=r)
        self.streams = Gauge("tokenfleet_gateway_open_streams", "Server-Sent Event streams "
                             "open now", ["route"], registry=r)
        r.register(_Background(state))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def first_token(scope: Scope) -> None:
    """Note that the request's first chunk of generated text goes out now (its
    TTFT); only the first call of a request counts."""
    timing = scope.get("state", {}).get("timing")
    if isinstance(timing, _Timing) and not timing.first_token_seen:
        timing.first_token_seen = True
        timing.metrics.ttft.labels(route_of(scope)).observe(time.monotonic() - timing.started)


def route_of(scope: Scope) -> str:
    """The template of the route that serves the request (``other``: none does).
    A request answered before routing (a 401) is matched here."""
    route = scope.get("route")
    if route is not None:
        return getattr(route, "path", None) or "other"
    app = scope.get("app")
    templates = _TEMPLATES.get(app) if app is not None else None
    if templates is None:
        templates = _templates(getattr(getattr(app, "router", None), "routes", ()), "")
        if app is not None:
            _TEMPLATES[app] = templates
    path = scope.get("path", "")
    return next((template for regex, template in templates if regex.match(path)), "other")


# Each app's route templates, read once from its routes.
_TEMPLATES: weakref.WeakKeyDictionary[Any, list[tuple[re.Pattern[str], str]]] = (
    weakref.WeakKeyDictionary())


def _templates(routes: Any, prefix: str) -> list[tuple[re.Pattern[str], str]]:
    """Every route's template under ``prefix``, in routing order. A router
    included in another is a route of its own whose ``matches`` takes any path
    in newer FastAPI (``original_router``, matched lazily), so it is walked
    rather than asked."""
    found: list[tuple[re.Pattern[str], str]] = []
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            context = getattr(route, "include_context", None)
            found += _templates(included.routes, prefix + getattr(context, "prefix", ""))
        elif isinstance(getattr(route, "path", None), str):
            template = prefix + route.path
            found.append((compile_path(template)[0], template))
    return found


class _Timing:
    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.started = time.monotonic()
        self.first_token_seen = False


class MeasureRequests:
    """ASGI middleware, outermost: answers ``GET /metrics`` itself (before the
    keys' middleware: a scraper has no key) and measures every other request."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] == PATH and scope["method"] in ("GET", "HEAD"):
            await _answer(send, self.metrics.exposition())
            return
        timing = _Timing(self.metrics)
        scope.setdefault("state", {})["timing"] = timing
        status = CLIENT_LEFT
        stream: str | None = None
        counted = False

        def count() -> None:
            nonlocal counted
            counted = True
            if stream is not None:
                self.metrics.streams.labels(stream).dec()
            route = route_of(scope)
            key = scope.get("state", {}).get("api_key")
            tenant = getattr(key, "tenant", "") or ""
            self.metrics.requests.labels(route, scope["method"], str(status), tenant).inc()
            self.metrics.duration.labels(route).observe(time.monotonic() - timing.started)

        async def send_measured(message: Message) -> None:
            nonlocal status, stream
            if message["type"] == "http.response.start":
                status = message["status"]
                if _is_stream(message):
                    stream = route_of(scope)
                    self.metrics.streams.labels(stream).inc()
            elif (message["type"] == "http.response.body" and not message.get("more_body")
                  and not counted):
                # Counted as the last byte goes, not after: a client that reads
                # /metrics once it has its answer finds the answer counted.
                count()
            await send(message)

        try:
            await self.app(scope, receive, send_measured)
        except Exception:
            status = 500  # answered by Starlette's outermost handler
            raise
        finally:
            if not counted:  # no last byte sent: a failure, or a client gone
                count()


def _is_stream(start: Message) -> bool:
    return any(name.lower() == b"content-type" and value.startswith(b"text/event-stream")
               for name, value in start.get("headers", []))


async def _answer(send: Send, body: bytes) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode()),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class _Background(Collector):
    """The pool's, the batch driver's and the webhook deliverer's counts, read
    from the app's state at each scrape (each is absent until it exists)."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        fleet = getattr(self.state, "fleet", None)
        pool = getattr(getattr(fleet, "redis", None), "connection_pool", None)
        driver = getattr(self.state, "batch_driver", None)
        counts: list[tuple[str, str, float]] = []
        if pool is not None and hasattr(pool, "in_use"):  # a BoundedPool
            for name, text, value in (
                    ("connections_in_use", "Redis connections of the gateway's pool handed "
                     "out now", pool.in_use),
                    ("connections_max", "The pool's bound "
                     "(TOKENFLEET_GATEWAY_REDIS_CONNECTIONS)", pool.max_connections),
                    ("waiting", "Commands waiting for a free Redis connection now",
                     pool.waiting)):
                yield GaugeMetricFamily(f"tokenfleet_gateway_redis_{name}", text, value=value)
            counts += [("redis_waits", "Times a command waited for a free Redis connection",
                        pool.waits),
                       ("redis_wait_timeouts", "Waits for a Redis connection that ended in a "
                        "503 (TOKENFLEET_GATEWAY_REDIS_WAIT_S)", pool.timeouts)]
        if driver is not None:
            counts += [("batch_lines_fed", "Batch lines this gateway's driver queued as jobs",
                        driver.lines_fed),
                       ("batch_lines_collected", "Batch lines this gateway's driver wrote to "
                        "the batch's files once their job ended", driver.lines_collected)]
        for name, text, value in counts:
            yield CounterMetricFamily(f"tokenfleet_gateway_{name}", text, value=value)
        webhooks = getattr(self.state, "webhooks", None)
        if webhooks is not None:
            family = CounterMetricFamily("tokenfleet_gateway_webhook_deliveries", "Webhook "
                                         "delivery attempts by outcome", labels=["outcome"])
            for outcome in ("delivered", "failed", "dead", "dropped"):
                family.add_metric([outcome], webhooks.outcomes[outcome])
            yield family
