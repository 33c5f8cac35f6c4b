"""``tokenfleet queue create|list|delete`` and ``tokenfleet metrics-exporter``:
what an operator runs for a pool that scales with its backlog."""

from __future__ import annotations

import json
import signal
import threading
from typing import Any

import click

redis_option = click.option("--redis-url", default=None,
                            help="Redis URL (default: $TOKENFLEET_REDIS_URL)")


def _client(redis_url: str | None) -> Any:
    from tokenfleet import FleetClient
    from tokenfleet.cli.common import apply_env

    apply_env(redis_url=redis_url)
    return FleetClient()


def _queue_name(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from tokenfleet.shared.wire.declared import check_queue_name

    try:
        check_queue_name(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


@click.group("queue")
def queue() -> None:
    """Queues served by an autoscaled pool: submit accepts their jobs with no live worker."""


@queue.command("create")
@click.argument("name", callback=_queue_name)
@click.option("--min-workers", type=click.IntRange(min=0), default=0, show_default=True,
              help="the pool's floor (its ScaledObject's minReplicaCount), shown and exported")
@click.option("--partitions", type=click.IntRange(min=1), default=None,
              help="spread the queue over P partitions NAME#0 ... NAME#P-1, which every worker "
                   "of NAME reads; unchanged when not given, 1 at first")
@redis_option
def create(name: str, min_workers: int, partitions: int | None, redis_url: str | None) -> None:
    """Declare NAME as served by an autoscaled pool (or change its --min-workers
    or --partitions)."""
    from tokenfleet.shared.redis.clock import redis_now
    from tokenfleet.shared.wire.declared import declare

    with _client(redis_url) as client:
        new = declare(client.redis, client.keys, name, min_workers, redis_now(client.redis),
                      partitions)
        count = client.partitions(name)
    parts = f", {count} partitions" if count > 1 else ""
    click.echo(f"{'declared' if new else 'updated'} queue {name!r} (min workers {min_workers}"
               f"{parts}): submits queue its jobs with no live worker")


@queue.command("list")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@redis_option
def list_queues(as_json: bool, redis_url: str | None) -> None:
    """The declared queues, their floor, live workers and backlog."""
    from tokenfleet.client.fleet import fleet_status

    with _client(redis_url) as client:
        rows = [q for q in fleet_status(client)["queues"] if q["min_workers"] is not None]
    if as_json:
        click.echo(json.dumps([{k: q[k] for k in ("queue", "min_workers", "workers", "depth",
                                                  "backlog_tokens")} for q in rows], indent=2))
        return
    if not rows:
        click.echo("no declared queues: `tokenfleet queue create NAME` declares one")
        return
    click.echo(f"{'queue':<24} {'min workers':>11} {'workers':>7} {'backlog':>7} "
               f"{'backlog tokens':>14}")
    for q in rows:
        click.echo(f"{q['queue']:<24} {q['min_workers']:>11} {q['workers']:>7} "
                   f"{q['depth']:>7} {q['backlog_tokens']:>14}")


@queue.command("delete")
@click.argument("name", callback=_queue_name)
@redis_option
def delete(name: str, redis_url: str | None) -> None:
    """Take NAME's declaration away: with no live worker, submits are refused again
    (NoWorker). Jobs already queued stay queued."""
    from tokenfleet.shared.wire.declared import undeclare

    with _client(redis_url) as client:
        if not undeclare(client.redis, client.keys, name):
            raise click.ClickException(f"queue {name!r} is not declared "
                                       "(`tokenfleet queue list` shows those that are)")
    click.echo(f"queue {name!r} is no longer declared")


@click.command("metrics-exporter")
@click.option("--host", default="0.0.0.0", show_default=True)
@click.option("--port", type=int, default=9400, show_default=True)
@redis_option
def metrics_exporter(host: str, port: int, redis_url: str | None) -> None:
    """Serve every queue's backlog from Redis as Prometheus metrics (/metrics): what a
    KEDA ScaledObject scales a pool on, workers or none; and each tenant's refusals."""
    from tokenfleet.workers.preflight import need_extra, need_free_port

    need_extra("metrics-exporter", "exporter")
    from prometheus_client import start_http_server

    from tokenfleet.exporter.backlog import registry

    need_free_port(host, port, f"--port {port}")
    client = _client(redis_url)
    client.redis.ping()  # a wrong URL or password now, not at the first scrape
    server, thread = start_http_server(port, addr=host, registry=registry(client.redis,
                                                                           client.keys))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    click.echo(f"serving queue backlog metrics on http://{host}:{port}/metrics")
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        thread.join()
        client.close()
