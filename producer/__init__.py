"""The producer side: submit jobs, read their state, stream their tokens."""

from producer.aio import AsyncFleetClient
from producer.client import FleetClient
from shared.errors import JobNotFound, NoWorker, QueueFull

__all__ = ["AsyncFleetClient", "FleetClient", "JobNotFound", "NoWorker", "QueueFull"]
