"""Which queues live workers serve now, and whether their models chat; and
those the gateway lists, declared queues included.

Read from what workers write on every heartbeat: ``<ns>:served:<queue>`` (a
sorted set of worker names by the time until which each counts as live:
``tokenfleet.shared.redis.liveness``) and each worker's hash ``<ns>:workers:<name>``
(``model``; ``chat``: 1 when its tokenizer has a chat template; ``fim``: 1
when it declares fill-in-the-middle tokens; ``tools``: the tool-call format of
its chat template, "" when it takes no tools: ``tokenfleet.workers.tool_template``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenfleet.shared.wire.declared import declared_queues_async
from tokenfleet.shared.wire.keys import partitions_of, queue_of_partition
from tokenfleet.shared.redis.liveness import live_since


@dataclass(frozen=True)
class Served:
    queue: str
    workers: list[str]
    models: list[str]  # what the workers loaded ("tiny", a path, a hub id)
    # Whether the queue's model has a chat template: False if a live worker says
    # it has none, None if one does not say (a worker older than the field).
    chat: bool | None
    fim: bool | None = None  # the same for fill-in-the-middle tokens (insert mode)
    # The chat template's tool-call format ("" for none), if every live worker
    # says the same; None if one does not say (older), "" if one takes no tools.
    tools: str | None = None

    def as_openai(self) -> dict[str, Any]:
        """An OpenAI ``model`` object; ``created`` is unknown to the fleet, so 0."""
        return {"id": self.queue, "object": "model", "created": 0, "owned_by": "tokenfleet",
                "root": self.models[0] if len(self.models) == 1 else None,
                "workers": len(self.workers), "chat": self.chat}


def worker_sets(client: Any, queue: str, partitions: int) -> list[str]:
    """The sorted sets naming the queue's workers: one per partition (a worker of a
    partitioned queue serves one partition of it)."""
    return [client.keys.queue_workers(part) for part in partitions_of(queue, partitions)]


def worker_fields(client: Any, names: list[str]) -> Any:
    """A pipeline reading what each named worker says of its model."""
    pipe = client.redis.pipeline(transaction=False)
    for name in names:
        pipe.hmget(client.keys.worker(name), ["model", "chat", "fim", "tools"])
    return pipe


def served_of(queue: str, names: list[str], replies: list[list[bytes | None]]) -> Served:
    """The queue as its live workers' hashes (``worker_fields``'s replies) describe it."""
    rows = [[(v.decode() if v is not None else None) for v in row] for row in replies]
    models = sorted({row[0] for row in rows if row[0]})
    return Served(queue, names, models, _all_say({row[1] for row in rows}),
                  _all_say({row[2] for row in rows}), _one_format({row[3] for row in rows}))


async def served(client: Any, queue: str) -> Served | None:
    """The queue's live workers, or None if it has none (an asyncio client)."""
    since = live_since(await client.clock.aread(client.redis))
    names = [name.decode() for key in worker_sets(client, queue, await client.partitions(queue))
             for name in await client.redis.zrangebyscore(key, since, "+inf")]
    if not names:
        return None
    return served_of(queue, names, await worker_fields(client, names).execute())


def served_now(client: Any, queue: str) -> Served | None:
    """``served`` for a blocking client: the same reads, the same answer."""
    since = live_since(client.clock.read(client.redis))
    names = [name.decode() for key in worker_sets(client, queue, client.partitions(queue))
             for name in client.redis.zrangebyscore(key, since, "+inf")]
    if not names:
        return None
    return served_of(queue, names, worker_fields(client, names).execute())


def _all_say(flags: set[str | None]) -> bool | None:
    """False if a live worker says no, True if every one says yes, else None
    (one does not say: a worker older than the field)."""
    return False if "0" in flags else (True if flags == {"1"} else None)


def _one_format(formats: set[str | None]) -> str | None:
    """The tool-call format all live workers share; "" if one takes no tools,
    "other" if they differ (no one parser fits every answer), None if one
    does not say."""
    if None in formats:
        return None
    if len(formats) == 1:
        return next(iter(formats))
    return "" if "" in formats else "other"


async def served_queues(client: Any) -> list[Served]:
    """Every queue with a live worker, by name."""
    queues = {queue_of_partition(client.keys.served_model(key.decode()))
              async for key in client.redis.scan_iter(match=client.keys.served_pattern(),
                                                       count=500)}
    found = [await served(client, queue) for queue in sorted(queues)]
    return [s for s in found if s is not None]


async def listed(client: Any, queue: str) -> Served | None:
    """The queue as ``/v1/models`` shows it: served now, or declared
    (``tokenfleet queue create``), whose pool may be scaled to zero: a job sent
    to it waits for the pool to grow, so it is listed with no workers."""
    found = await served(client, queue)
    if found is None and await client.redis.exists(client.keys.declared(queue)):
        return Served(queue, [], [], None)
    return found


async def listed_queues(client: Any) -> list[Served]:
    """Every queue served now or declared, by name."""
    found = {s.queue: s for s in await served_queues(client)}
    for declared in await declared_queues_async(client.redis, client.keys):
        found.setdefault(declared.queue, Served(declared.queue, [], [], None))
    return [found[queue] for queue in sorted(found)]
