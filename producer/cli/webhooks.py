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
    from tokenfleet.cli.common import apply_env
    from tokenfleet.workers.preflight import need_extra

    need_extra("webhooks deliver", "gateway")  # httpx
    apply_env(redis_url=redis_url)
    asyncio.run(_deliver())


async def _deliver() -> None:
    from tokenfleet.client.aio import AsyncFleetClient
    from tokenfleet.webhooks.delivery import Deliverer

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
    """Events waiting for their next attempt (each tenant's lane), and the dead letters."""
    from tokenfleet.cli.keys import _client

    with _client(redis_url) as client:
        r, keys = client.redis, client.keys
        waiting = []
        for tenant in sorted(t.decode() for t in r.smembers(keys.webhook_lanes)):
            for raw, next_at in r.zrange(keys.webhook_lane(tenant), 0, 99, withscores=True):
                state = {k.decode(): v.decode() for k, v in
                         r.hgetall(keys.webhook_event(raw.decode())).items()}
                state.pop("data", None)
                waiting.append({"id": raw.decode(), "tenant": tenant, "next_at": next_at,
                                **state})
        dead = [{k.decode(): v.decode() for k, v in fields.items()}
                for stream in _dead_lists(r, keys)
                for _, fields in r.xrevrange(stream, count=100)]
    if as_json:
        click.echo(json.dumps({"waiting": waiting, "dead": dead}, indent=2))
        return
    click.echo(f"waiting for an attempt: {len(waiting)}")
    for one in waiting:
        click.echo(_line(one, "tenant", "attempts", "last_error"))
    click.echo(f"dead letters ({keys.webhook_dead}[:<tenant>]): {len(dead)}")
    for one in dead:
        click.echo(_line(one, "tenant", "attempts", "last_error"))


@webhooks.command()
@click.argument("event_ids", nargs=-1)
@click.option("--all", "every", is_flag=True, help="every dead letter")
@redis_option
def retry(event_ids: tuple[str, ...], every: bool, redis_url: str | None) -> None:
    """Send dead letters (EVENT_IDS, or --all) again: back to the outbox under
    their own ids, so a receiver that saw one drops the repeat."""
    from tokenfleet.cli.keys import _client
    from tokenfleet.webhooks.resend import resend

    if not event_ids and not every:
        raise click.UsageError("name the events to send again (their ids), or --all")
    wanted = set(event_ids)
    with _client(redis_url) as client:
        r, keys = client.redis, client.keys
        again = 0
        for stream in _dead_lists(r, keys):
            for entry_id, raw in r.xrange(stream):
                fields = {k.decode(): v.decode() for k, v in raw.items()}
                if not every and fields.get("id") not in wanted:
                    continue
                resend(r, keys, stream, entry_id, fields)
                wanted.discard(fields.get("id", ""))
                again += 1
    click.echo(f"sent {again} dead letter(s) again")
    if wanted:
        from tokenfleet.cli.common import JobFailed

        raise JobFailed(f"no dead letter with id {', '.join(sorted(wanted))}")


@webhooks.command()
@click.option("--tenant", required=True, help="the tenant whose receiver verifies with it")
def secret(tenant: str) -> None:
    """Print TENANT's signing secret (whsec_...) for its receiver: derived from
    TOKENFLEET_WEBHOOK_SECRET and the tenant's name; the default tenant's is
    TOKENFLEET_WEBHOOK_SECRET itself."""
    from tokenfleet.shared.wire.keys import TENANT_NAME_RULE, is_tenant_name
    from tokenfleet.shared.settings import Settings
    from tokenfleet.webhooks.signing import tenant_secret

    if not is_tenant_name(tenant):
        raise click.BadParameter(f"must be {TENANT_NAME_RULE}", param_hint="--tenant")
    operator = Settings().webhook_secret  # the environment as it is now
    if not operator:
        raise click.UsageError("TOKENFLEET_WEBHOOK_SECRET is not set: events go out unsigned, "
                               "and there is no tenant secret to derive")
    click.echo(tenant_secret(operator, tenant))


def _dead_lists(r: Any, keys: Any) -> list[str]:
    """The dead-letter streams: the default tenant's, then each other tenant's."""
    others = sorted(k.decode() for k in r.scan_iter(match=keys.webhook_dead_pattern(),
                                                     count=500))
    return [keys.webhook_dead, *others]


def _line(event: dict[str, Any], *fields: str) -> str:
    return "  " + "  ".join([event.get("id", "?"), event.get("type", ""), event.get("url", ""),
                             *(f"{f}={event.get(f, '')}" for f in fields)])
