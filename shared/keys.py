"""Every Redis key and channel name the fleet uses, in one place."""

from __future__ import annotations

import re
from dataclasses import dataclass

# The consumer group every worker of a queue joins.
GROUP = "workers"

# Priority levels, highest first. Each level of a model has a stream of its own;
# "normal" keeps the plain queue name, so the stream a KEDA scaler or a dashboard
# watches by default is <ns>:q:<model>.
PRIORITIES = ("high", "normal", "low")

# A queue (model) name. Checked with fullmatch: with re.match and '^...$' a name
# ending in a newline passed ('$' matches before a final '\n') and its jobs
# waited forever on a stream no worker reads.
QUEUE_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
QUEUE_NAME_RULE = "1 to 64 letters, digits, '_', '.' or '-'"


def is_queue_name(name: str) -> bool:
    return QUEUE_NAME.fullmatch(name) is not None


def level_queue(model: str, priority: str) -> str:
    """The queue name of one priority level of a model: ``default``, ``default:high``."""
    return model if priority == "normal" else f"{model}:{priority}"


@dataclass(frozen=True)
class Keys:
    namespace: str = "tokenfleet"

    def queue(self, model: str) -> str:
        """Stream of queued jobs for one model (queue name)."""
        return f"{self.namespace}:q:{model}"

    def queues_pattern(self) -> str:
        return f"{self.namespace}:q:*"

    def job(self, job_id: str) -> str:
        """Hash: the job record."""
        return f"{self.namespace}:job:{job_id}"

    def out(self, job_id: str) -> str:
        """Stream: the job's token log, for replay by late subscribers."""
        return f"{self.namespace}:out:{job_id}"

    def events(self, job_id: str) -> str:
        """Pub/sub channel: live events of one job."""
        return f"{self.namespace}:ev:{job_id}"

    def ends(self, job_id: str) -> str:
        """Pub/sub channel: one job's end event only, for a waiter that wants no
        tokens (``wait``, the gateway's plain completions)."""
        return f"{self.namespace}:end:{job_id}"

    @property
    def dlq(self) -> str:
        """Stream: jobs that failed past their retries or could not be parsed."""
        return f"{self.namespace}:dlq"

    def worker(self, name: str) -> str:
        """Hash with a TTL: heartbeat and stats of one worker process."""
        return f"{self.namespace}:workers:{name}"

    def workers_pattern(self) -> str:
        return f"{self.namespace}:workers:*"

    def backlog(self, model: str) -> str:
        """Counter: queued work of a model in tokens (prompt estimate + max_new_tokens)."""
        return f"{self.namespace}:backlog:{model}"

    def queue_workers(self, model: str) -> str:
        """Sorted set: live workers of a model, scored by their last heartbeat."""
        return f"{self.namespace}:served:{model}"

    def served_pattern(self) -> str:
        return f"{self.namespace}:served:*"

    def idempotency(self, key: str) -> str:
        """String with a TTL: '<job id> <fingerprint of the request>' of a key."""
        return f"{self.namespace}:idem:{key}"

    @property
    def cancels(self) -> str:
        """Pub/sub channel: ids of running jobs whose cancel was asked for."""
        return f"{self.namespace}:cancels"

    @property
    def celery_prefix(self) -> str:
        """Prefix of Celery's own keys (its broker queues, pidbox)."""
        return f"{self.namespace}:celery:"
