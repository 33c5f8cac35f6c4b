"""``tokenfleet deploy keda QUEUE``: the KEDA ScaledObject of a queue's pool,
with a redis-streams trigger for every stream of the queue.

The base manifests' four triggers name the streams of an unpartitioned queue's
default tenant; a queue with partitions or named tenants has more streams
(``QueueTopology``), and a job in one no trigger names would never wake a pool
at zero. This prints the whole list, read from Redis (partition count, tenants
seen so far) and the options, as JSON (which kubectl and kustomize read as YAML).
"""

from __future__ import annotations

import json
from typing import Any

import click
from tokenfleet.shared.wire.topology import QueueTopology

# Jobs waiting or running per worker, as in deploy/kubernetes/base/pool.
PER_WORKER = 32


def scaled_object(topology: QueueTopology, name: str, target: str, auth: str,
                  max_replicas: int) -> dict[str, Any]:
    """The ScaledObject whose formula adds the length of every stream of the queue."""
    triggers: list[dict[str, Any]] = [{
        # Trigger names are the formula's variables: s0, s1, ... (a tenant's
        # name may hold '-' or '.', which the formula cannot).
        "name": f"s{i}",
        "type": "redis-streams",
        "metadata": {"stream": stream, "streamLength": str(PER_WORKER),
                     "activationLagCount": "0"},
        "authenticationRef": {"name": auth},
    } for i, stream in enumerate(topology.streams())]
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": name, "annotations": {
            "tokenfleet/queue": topology.queue,
            "tokenfleet/partitions": str(topology.partitions),
            "tokenfleet/tenants": ",".join(topology.tenants)}},
        "spec": {
            "scaleTargetRef": {"name": target},
            "minReplicaCount": 0,
            "maxReplicaCount": max_replicas,
            "pollingInterval": 5,
            "cooldownPeriod": 300,
            "advanced": {"scalingModifiers": {
                "formula": " + ".join(str(t["name"]) for t in triggers),
                "target": str(PER_WORKER),
                "activationTarget": "0",
                "metricType": "AverageValue",
            }},
            "triggers": triggers,
        },
    }


@click.group("deploy")
def deploy() -> None:
    """Manifests that follow a queue's layout in Redis."""


@deploy.command("keda")
@click.argument("queue_name", metavar="QUEUE")
@click.option("--partitions", type=click.IntRange(1, None), default=None,
              help="Partitions of the queue (default: as `queue create` recorded in Redis)")
@click.option("--tenant", "tenants", multiple=True,
              help="A named tenant to count (repeatable), besides those Redis knows")
@click.option("--offline", is_flag=True,
              help="Read nothing from Redis: only --partitions and --tenant")
@click.option("--name", default=None, help="ScaledObject name (default: tokenfleet-worker-QUEUE)")
@click.option("--target", default=None,
              help="The Deployment to scale (default: tokenfleet-worker-QUEUE)")
@click.option("--auth", default="tokenfleet-redis", show_default=True,
              help="TriggerAuthentication with the Redis address and password")
@click.option("--max-replicas", type=click.IntRange(1, None), default=8, show_default=True)
@click.option("--redis-url", default=None, help="Redis URL (default: $TOKENFLEET_REDIS_URL)")
def keda(queue_name: str, partitions: int | None, tenants: tuple[str, ...], offline: bool,
         name: str | None, target: str | None, auth: str, max_replicas: int,
         redis_url: str | None) -> None:
    """Print QUEUE's ScaledObject: a trigger for each of its streams (every
    partition, level and tenant). Render it again after a new tenant's first job."""
    from tokenfleet.shared.wire.declared import check_queue_name
    from tokenfleet.shared.wire.keys import is_tenant_name

    try:
        check_queue_name(queue_name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="QUEUE") from None
    bad = [t for t in tenants if not is_tenant_name(t)]
    if bad:
        raise click.BadParameter(f"not a tenant name: {bad[0]!r}", param_hint="--tenant")
    if offline:
        from tokenfleet.shared.wire.keys import Keys
        from tokenfleet.shared.settings import get_settings
        from tokenfleet.cli.common import apply_env

        apply_env(redis_url=redis_url)
        settings = get_settings()
        keys = Keys.for_url(settings.namespace, settings.redis_url)
        topology = QueueTopology(keys, queue_name, partitions or 1, tenants)
    else:
        from tokenfleet.cli.queue import _client

        with _client(redis_url) as client:
            topology = QueueTopology.read(client.redis, client.keys, queue_name, tenants)
        if partitions is not None:
            topology = QueueTopology(topology.keys, queue_name, partitions, topology.tenants)
    obj = scaled_object(topology, name or f"tokenfleet-worker-{queue_name}",
                        target or f"tokenfleet-worker-{queue_name}", auth, max_replicas)
    click.echo(json.dumps(obj, indent=2))
