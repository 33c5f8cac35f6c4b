"""``tokenfleet keys``: make, list and revoke the gateway's API keys."""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Literal

import click

from tokenfleet.shared.wire.keys import (DEFAULT_TENANT, TENANT_NAME_RULE, is_queue_name,
                                   is_tenant_name)

if TYPE_CHECKING:
    from tokenfleet import FleetClient
    from tokenfleet.shared.wire.schemas import ApiKey


def _tenant(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if not is_tenant_name(value):
        raise click.BadParameter(f"{value!r}: a tenant is {TENANT_NAME_RULE}")
    if value == DEFAULT_TENANT:
        # Its jobs are those made without a key (an open gateway's, a backend's
        # without tenant=): a key of it would read them all.
        raise click.BadParameter(f"{value!r} is the tenant of the jobs made without a key, "
                                 "which no key may read: name another tenant")
    return value


def _queues(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str] | None:
    if value is None:
        return None
    names = [q.strip() for q in value.split(",") if q.strip()]
    bad = [q for q in names if not is_queue_name(q)]
    if bad or not names:
        raise click.BadParameter(f"{value!r}: give queue (model) names separated by commas")
    return names


redis_option = click.option("--redis-url", default=None,
                            help="Redis URL (default: $TOKENFLEET_REDIS_URL)")


def _client(redis_url: str | None) -> FleetClient:
    from tokenfleet import FleetClient
    from tokenfleet.cli.common import apply_env

    apply_env(redis_url=redis_url)
    return FleetClient()


@click.group()
def keys() -> None:
    """API keys of the gateway: each names a tenant and its limits."""


@keys.command()
@click.option("--tenant", required=True, callback=_tenant,
              help="whose jobs the key makes: another tenant cannot see them")
@click.option("--rpm", type=click.IntRange(min=1), default=None,
              help="requests per minute (submits; default: no limit)")
@click.option("--tpm", type=click.IntRange(min=1), default=None,
              help="tokens per minute: prompt + max new tokens of each submit (default: none)")
@click.option("--queues", callback=_queues, default=None,
              help="the queues (models) it may use, comma-separated (default: every one)")
@click.option("--max-queued", type=click.IntRange(min=1), default=None,
              help="the most jobs of its tenant waiting or running (default: no limit)")
@click.option("--max-priority", type=click.Choice(["low", "normal", "high"]), default="normal",
              show_default=True, help="the highest priority its requests may ask")
@click.option("--admin", is_flag=True,
              help="it sees every tenant's jobs, batches and keys in the console (/console)")
@redis_option
def create(tenant: str, rpm: int | None, tpm: int | None, queues: list[str] | None,
           max_queued: int | None, max_priority: Literal["high", "normal", "low"],
           admin: bool, redis_url: str | None) -> None:
    """Make a key; it is printed once, on the last line (only its SHA-256 is stored)."""
    from tokenfleet.shared.wire.api_keys import create_key, new_key
    from tokenfleet.shared.wire.schemas import ApiKey

    with _client(redis_url) as client:
        key, key_id = new_key()
        record = ApiKey(key_id=key_id, tenant=tenant, rpm=rpm, tpm=tpm, queues=queues,
                        max_queued=max_queued, max_priority=max_priority,
                        admin=admin, created_at=client.clock.read(client.redis))
        create_key(client.redis, client.keys, record, key)
    click.echo(f"key {key_id} for tenant {tenant!r}: {_limits(record)}")
    click.echo("keep it now: it cannot be shown again (revoke it with "
               f"`tokenfleet keys revoke {key_id}`)")
    click.echo(key)


@keys.command("list")
@redis_option
def list_(redis_url: str | None) -> None:
    """The keys in force: id, tenant, limits, when made (no secret is kept to show)."""
    from tokenfleet.shared.wire.api_keys import list_keys

    with _client(redis_url) as client:
        records = list_keys(client.redis, client.keys)
    if not records:
        click.echo("no API keys in force")
        return
    click.echo(f"{'KEY ID':<14}{'TENANT':<20}{'CREATED (UTC)':<22}LIMITS")
    for r in records:
        made = datetime.datetime.fromtimestamp(r.created_at, datetime.UTC)
        click.echo(f"{r.key_id:<14}{r.tenant:<20}{made:%Y-%m-%d %H:%M:%S}   {_limits(r)}")


@keys.command()
@click.argument("key_id")
@redis_option
def revoke(key_id: str, redis_url: str | None) -> None:
    """Delete a key by its id: every gateway refuses it within a second."""
    from tokenfleet.shared.wire.api_keys import revoke_key
    from tokenfleet.cli.common import JobFailed

    with _client(redis_url) as client:
        if not revoke_key(client.redis, client.keys, key_id):
            raise JobFailed(f"no key {key_id!r} (`tokenfleet keys list` shows the key ids)")
    click.echo(f"revoked key {key_id}")


def _limits(record: ApiKey) -> str:
    parts = [f"{name} {value}" for name, value in
             (("rpm", record.rpm), ("tpm", record.tpm), ("max-queued", record.max_queued))
             if value is not None]
    parts.append("queues " + (",".join(record.queues) if record.queues else "all"))
    parts.append(f"max-priority {record.max_priority}")
    if record.admin:
        parts.append("admin")
    return ", ".join(parts)
