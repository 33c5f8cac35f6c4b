"""``tokenfleet webhooks deliver|list|retry``: deliver webhook events without a
gateway, see the ones waiting for a retry or given up, and send dead letters again."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import click

redis_option = click.option("--redis-url", default=None,
                            help="Redis URL (default: $TOKENFLEET_REDIS_URL)")


@click.group()
def webhooks() -> None:
    """Webhook events (docs/webhooks.md): every gateway delivers them."""


@webhooks.command()
@redis_option
def deliver(redis_url: str | None) -> None:
    """Deliver the outbox's events until stopped (for a fleet with no gateway)."""
    from tokenfleet.workers.cli import _apply_env
    from tokenfleet.workers.preflight import need_extra

    need_extra("webhooks deliver", "gateway")  # httpx
    _apply_env(redis_url=redis_url)
    asyncio.run(_deliver())


async def _deliver() -> None:
    from tokenfleet.aio import AsyncFleetClient
    from tokenfleet.webhook_delivery import Deliverer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with AsyncFleetClient() as client:
        await client.redis.ping()  # a wrong URL or password now, not in the loop's log
        deliverer = Deliverer(client.redis, client.keys, client.settings).start()
        click.echo(f"delivering webhook events as {deliverer.consumer} (Ctrl-C stops)")
        try:
            await stop.wait()
        finally:
            await deliverer.stop()


@webhooks.command("list")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@redis_option
def list_events(as_json: bool, redis_url: str | None) -> None:
    """Events waiting for their next attempt, and the dead letters."""
    from tokenfleet.workers.keys_cli import _client

    with _client(redis_url) as client:
        r, keys = client.redis, client.keys
        waiting = []
        for raw, next_at in r.zrange(keys.webhook_schedule, 0, 99, withscores=True):
            entry_id, _, stream = raw.decode().partition(" ")
            fields = r.xrange(stream, entry_id, entry_id)
            event_id = fields[0][1].get(b"id", b"").decode() if fields else ""
            state = {k.decode(): v.decode() for k, v in
                     r.hgetall(keys.webhook_event(event_id)).items()} if event_id else {}
            waiting.append({"id": event_id, "next_at": next_at, **state})
        dead = [{k.decode(): v.decode() for k, v in fields.items()}
                for _, fields in r.xrevrange(keys.webhook_dead, count=100)]
    if as_json:
        click.echo(json.dumps({"waiting": waiting, "dead": dead}, indent=2))
        return
    click.echo(f"waiting for a retry: {len(waiting)}")
    for one in waiting:
        click.echo(_line(one, "attempts", "last_error"))
    click.echo(f"dead letters ({keys.webhook_dead}): {len(dead)}")
    for one in dead:
        click.echo(_line(one, "attempts", "last_error"))


@webhooks.command()
@click.argument("event_ids", nargs=-1)
@click.option("--all", "every", is_flag=True, help="every dead letter")
@redis_option
def retry(event_ids: tuple[str, ...], every: bool, redis_url: str | None) -> None:
    """Send dead letters (EVENT_IDS, or --all) again: back to the outbox under
    their own ids, so a receiver that saw one drops the repeat."""
    from tokenfleet.workers.keys_cli import _client

    if not event_ids and not every:
        raise click.UsageError("name the events to send again (their ids), or --all")
    wanted = set(event_ids)
    with _client(redis_url) as client:
        r, keys = client.redis, client.keys
        again = 0
        for entry_id, raw in r.xrange(keys.webhook_dead):
            fields = {k.decode(): v.decode() for k, v in raw.items()}
            if not every and fields.get("id") not in wanted:
                continue
            event = {k: fields[k] for k in ("id", "type", "data", "url") if fields.get(k)}
            r.xadd(keys.webhook_outbox, event)  # first: a crash here leaves a copy, never none
            r.xdel(keys.webhook_dead, entry_id)
            wanted.discard(fields.get("id", ""))
            again += 1
    click.echo(f"sent {again} dead letter(s) again")
    if wanted:
        from tokenfleet.workers.cli import JobFailed

        raise JobFailed(f"no dead letter with id {', '.join(sorted(wanted))}")


def _line(event: dict[str, Any], *fields: str) -> str:
    return "  " + "  ".join([event.get("id", "?"), event.get("type", ""), event.get("url", ""),
                             *(f"{f}={event.get(f, '')}" for f in fields)])
