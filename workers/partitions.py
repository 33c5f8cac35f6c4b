"""The partitions a worker serves, and a feeder for each.

A worker named for a queue of P > 1 partitions serves every one of them; one named
for a partition (``<queue>#<p>``) serves that one only. The feeders share one pool
of credits (``SharedCredits``) and the worker's pause and free-slot events.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tokenfleet.shared.wire.keys import partitions_of, queue_of_partition
from tokenfleet.workers.feeder import Feeder
from tokenfleet.workers.shared_credits import SharedCredits

if TYPE_CHECKING:
    from tokenfleet.workers.service import Worker

log = logging.getLogger(__name__)


def served_partitions(worker: Worker) -> list[str]:
    """The partitions ``worker`` serves, read from Redis (how many the queue has).
    Warns when the one it is named for takes no jobs."""
    queue = queue_of_partition(worker.queue)
    count = max(1, int(worker.redis.get(worker.keys.partitions(queue)) or 1))
    if worker.queue == queue:
        return partitions_of(queue, count)
    if worker.queue not in partitions_of(queue, count):
        log.warning("queue %r has %d partitions (%s): no job is queued for %r; serve "
                    "them all with TOKENFLEET_QUEUE=%s", queue, count,
                    ", ".join(partitions_of(queue, count)), worker.queue, queue)
    return [worker.queue]


def feeders(worker: Worker) -> list[Feeder]:
    """A feeder for each of ``worker.partitions``, handing its jobs to the engine loop."""
    shared = SharedCredits(worker.partitions)
    loop = worker.engine_loop
    return [Feeder(worker.redis, worker.keys, worker.settings, worker.name, part,
                   worker.admission, worker.publisher, sink=loop.receive, credits=loop.credits,
                   holds=loop.held.__contains__, batch_credits=loop.batch_credits,
                   shared=shared, paused=worker.paused, slots_freed=worker.slots_freed,
                   slots=worker.max_batch)
            for part in worker.partitions]
