"""Every Redis key and channel name the fleet uses, in one place.

Redis Cluster runs a script only when all its keys hash to one slot. Every key
of a queue and of its jobs carries the queue's hash tag, ``{<model>}``, and a
job id carries its queue (``<model>:<32 hex>``), so the keys of any job follow
from its id alone: a submit (the queue stream and the new record) and a step's
finish (all of a worker's jobs and the dead letters) each touch one slot. A
queue is the unit that spreads over the shards; on a single Redis the tags
change nothing.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from tokenfleet.shared.redis.url import is_cluster

# The consumer group every worker of a queue joins.
GROUP = "workers"

# Priority levels, highest first. Each level of a model has a stream of its own;
# "normal" keeps the plain queue name, so the stream a KEDA scaler or a dashboard
# watches by default is <ns>:q:<model>.
PRIORITIES = ("high", "normal", "low", "batch")
# The batch level takes only the slots the live levels (the others) leave free,
# and gives them back when live jobs wait (workers/preemption.py).
BATCH = "batch"
LIVE_PRIORITIES = tuple(p for p in PRIORITIES if p != BATCH)

# A queue (model) name. Checked with fullmatch: with re.match and '^...$' a name
# ending in a newline passed ('$' matches before a final '\n') and its jobs
# waited forever on a stream no worker reads.
QUEUE_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
QUEUE_NAME_RULE = "1 to 64 letters, digits, '_', '.' or '-'"


def is_queue_name(name: str) -> bool:
    return QUEUE_NAME.fullmatch(name) is not None


# A partition of a queue of P > 1 partitions: ``<queue>#<p>``, p from 0 to P - 1,
# a queue of its own in every key (its hash tag is ``{<queue>#<p>}``, its jobs'
# ids start ``<queue>#<p>:``), so P partitions spread one model over P slots. A
# queue of one partition is the queue itself: its names are those it always had.
# '#' is in no queue name, so a partition's tag never names another queue.
PARTITION_NAME = re.compile(r"([A-Za-z0-9_.\-]{1,64})#(0|[1-9][0-9]{0,3})")
# The most partitions a queue may have.
MAX_PARTITIONS = 1024


def is_partition_name(name: str) -> bool:
    """A queue's name or one of its partitions' (``default``, ``default#2``)."""
    return is_queue_name(name) or PARTITION_NAME.fullmatch(name) is not None


def partition(model: str, index: int, count: int) -> str:
    """The name of partition ``index`` of a queue of ``count`` partitions: the
    queue's own name when it has one partition."""
    return model if count <= 1 else f"{model}#{index}"


def partitions_of(model: str, count: int) -> list[str]:
    """Every partition of a queue of ``count`` partitions."""
    return [partition(model, i, count) for i in range(max(1, count))]


def queue_of_partition(name: str) -> str:
    """The queue a partition belongs to (``default#2`` -> ``default``)."""
    return name.partition("#")[0]


# A tenant's name (``submit(tenant=...)``, an API key's tenant), checked with
# fullmatch. No ':' in it: a tenant's streams are named '<level>:<tenant>'
# (``level_queue``).
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
TENANT_NAME_RULE = "1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit"
# A job with no tenant is this tenant's (for fair share, limits and ownership);
# its streams are the level streams a fleet without tenants has always had.
DEFAULT_TENANT = "default"


def is_tenant_name(name: str) -> bool:
    return TENANT_NAME.fullmatch(name) is not None


def named_tenant(tenant: str | None) -> str | None:
    """The tenant whose streams are its own, or None for the default tenant."""
    return None if tenant in (None, DEFAULT_TENANT) else tenant


def level_queue(model: str, priority: str, tenant: str | None = None) -> str:
    """The queue name of one priority level of a model: ``default``, ``default:high``;
    of a named tenant's share of it: ``default:normal:acme``, ``default:high:acme``."""
    tenant = named_tenant(tenant)
    if tenant is not None:
        return f"{model}:{priority}:{tenant}"
    return model if priority == "normal" else f"{model}:{priority}"


def level_priority(level: str) -> str:
    """The priority of a level's queue name (``level_queue``'s inverse)."""
    parts = level.split(":")
    return parts[1] if len(parts) > 1 else "normal"


def level_tenant(level: str) -> str:
    """The tenant of a level's queue name (``level_queue``'s inverse)."""
    parts = level.split(":")
    return parts[2] if len(parts) >= 3 else DEFAULT_TENANT


# Placement by prefix (workers/affinity.py): a worker's own stream of one level
# and tenant is that level's name with the worker's tag after it:
# ``default:normal:default:w3f2a1b9c0d``, its stream ``<ns>:q:{default}:normal:default:w3f2a1b9c0d``.
# The tag is a hash of the worker's name, which may hold any character (':' too).
def owner_tag(worker: str) -> str:
    """The tag of ``worker``'s own streams: 'w' and 10 hex of its name's SHA-1."""
    return "w" + hashlib.sha1(worker.encode()).hexdigest()[:10]


def owned_level(level: str, tag: str) -> str:
    """The name of the stream of ``level`` (a level's queue name) that ``tag``'s
    worker owns."""
    return f"{model_of(level)}:{level_priority(level)}:{level_tenant(level)}:{tag}"


def level_owner(level: str) -> str | None:
    """The owner's tag of a worker's own level, None for a shared one."""
    parts = level.split(":")
    return parts[3] if len(parts) == 4 else None


def shared_level(level: str) -> str:
    """The shared level a worker's own level belongs to (itself for a shared one)."""
    if level_owner(level) is None:
        return level
    return level_queue(model_of(level), level_priority(level), level_tenant(level))


def model_streams(keys: Keys, model: str, tenants: Iterable[str]) -> list[str]:
    """Every stream of a model: each level's, the default tenant's and then each
    named tenant's (``tenants``, as ``Keys.tenants`` lists them)."""
    from tokenfleet.shared.wire.topology import QueueTopology

    streams: list[str] = QueueTopology(keys, model, 1, tuple(tenants)).streams()
    return streams


def model_of(level: str) -> str:
    """The model (queue) of a level's queue name: ``default:high`` -> ``default``."""
    return level.partition(":")[0]


def new_job_id(model: str, hex_id: str) -> str:
    """A job's id: its queue (or partition), then a random part
    (``default:3f2a...``, ``default#2:3f2a...``)."""
    return f"{model}:{hex_id}"


def job_model(job_id: str) -> str | None:
    """The queue (or partition: ``default#2``) a job id names, or None for an
    id that names none."""
    model, sep, rest = job_id.partition(":")
    return model if sep and rest and is_partition_name(model) else None


def job_id_in(name: str, prefix: str) -> str:
    """The job id in a job's key or channel name that starts with ``prefix``
    (``keys.events("")``, say): ``_tagged``'s inverse."""
    return _untagged(name.removeprefix(prefix))


def _untagged(name: str) -> str:
    """A key name's part after its prefix, its hash tag's braces taken out."""
    return name.replace("{", "", 1).replace("}", "", 1)


def _tagged(job_id: str) -> str:
    """The id as it goes into key names: its queue part in a hash tag."""
    model = job_model(job_id)
    return job_id if model is None else f"{{{model}}}{job_id[len(model):]}"


class JobKeys(NamedTuple):
    """The keys and channels of one job (``Keys.of_job``)."""

    job: str
    out: str
    events: str
    ends: str


# What names each of a job's keys: ``<ns>:<kind>:<tagged job id>``.
JOB_KINDS = JobKeys(job="job", out="out", events="ev", ends="end")


@lru_cache(maxsize=8192)
def _job_keys(namespace: str, job_id: str) -> JobKeys:
    head, tail = f"{namespace}:", f":{_tagged(job_id)}"
    return JobKeys(*(head + kind + tail for kind in JOB_KINDS))


@dataclass(frozen=True)
class Keys:
    namespace: str = "tokenfleet"
    # The per-job channels (``events``, ``ends``) are shard channels: scripts
    # SPUBLISH to them and readers SSUBSCRIBE on the node that owns their slot,
    # so a token crosses no cluster bus. True on a Redis Cluster (``for_url``),
    # where a classic PUBLISH goes to every node; a single Redis keeps classic
    # pub/sub. Publishers and subscribers of one fleet must agree: both follow
    # the kind of URL they are given.
    sharded: bool = False

    @classmethod
    def for_url(cls, namespace: str, url: str) -> Keys:
        """The keys of ``namespace`` on the Redis ``url`` names (sharded
        channels on a cluster)."""
        return cls(namespace, sharded=is_cluster(url))

    def queue(self, level: str) -> str:
        """Stream, group ``workers``: queued or running jobs of one level of a
        model: ``<ns>:q:{default}`` (normal), ``<ns>:q:{default}:high``; a named
        tenant's share of a level ``<ns>:q:{default}:normal:acme``. Field ``data``
        the entry JSON, ``w`` its weight in tokens."""
        model, sep, priority = level.partition(":")
        return f"{self.namespace}:q:{{{model}}}{sep}{priority}"

    def queues_pattern(self) -> str:
        return f"{self.namespace}:q:*"

    def queue_of(self, stream: str) -> str:
        """The level's queue name of a stream key (``queue``'s inverse)."""
        return _untagged(stream.removeprefix(f"{self.namespace}:q:"))

    def job(self, job_id: str) -> str:
        """Hash: the job record."""
        return f"{self.namespace}:{JOB_KINDS.job}:{_tagged(job_id)}"

    def out(self, job_id: str) -> str:
        """Stream: the job's token log, for replay by late subscribers."""
        return f"{self.namespace}:{JOB_KINDS.out}:{_tagged(job_id)}"

    def events(self, job_id: str) -> str:
        """Pub/sub channel: live events of one job (a script's key: tagged too)."""
        return f"{self.namespace}:{JOB_KINDS.events}:{_tagged(job_id)}"

    def ends(self, job_id: str) -> str:
        """Pub/sub channel: one job's end event only, for a waiter that wants no
        tokens (``wait``, the gateway's plain completions)."""
        return f"{self.namespace}:{JOB_KINDS.ends}:{_tagged(job_id)}"

    def of_job(self, job_id: str) -> JobKeys:
        """A job's record, log and channels at once (cached: a step's
        publisher names hundreds of them, the same jobs step after step)."""
        return _job_keys(self.namespace, job_id)

    def dlq(self, model: str) -> str:
        """Stream: a queue's jobs that failed past their retries or could not be parsed."""
        return f"{self.namespace}:dlq:{{{model_of(model)}}}"

    def worker(self, name: str) -> str:
        """Hash with a TTL: heartbeat and stats of one worker process."""
        return f"{self.namespace}:workers:{name}"

    def workers_pattern(self) -> str:
        return f"{self.namespace}:workers:*"

    def backlog(self, model: str) -> str:
        """Counter: queued work of a model in tokens (prompt estimate + max_new_tokens)."""
        return f"{self.namespace}:backlog:{{{model}}}"

    def queue_workers(self, model: str) -> str:
        """Sorted set: workers of a model, scored by the time until which each
        counts as live (``tokenfleet.shared.redis.liveness``)."""
        return f"{self.namespace}:served:{{{model}}}"

    def served_until(self, model: str) -> str:
        """String with a TTL: the time (Redis's clock) until which the model's
        latest heartbeat keeps its worker live, kept after that worker left the
        served set (a warm shutdown takes it out). ``submit.lua``
        queues ahead for ``no_worker_grace_s`` past it: a queue whose only
        worker restarts keeps taking jobs."""
        return f"{self.namespace}:served-until:{{{model}}}"

    def limits(self, model: str) -> str:
        """Hash with a TTL: the limits each worker of a model holds its requests
        to (worker name -> ``QueueLimits`` JSON), for ``submit.lua``."""
        return f"{self.namespace}:limits:{{{model}}}"

    def declared(self, model: str) -> str:
        """Hash: a queue declared as served by an autoscaled pool (``tokenfleet
        queue create``): ``min_workers``, ``created_at``. While it exists,
        ``submit.lua`` queues the model's jobs with no live worker, so the
        backlog that wakes a pool scaled to zero can form."""
        return f"{self.namespace}:declared:{{{model}}}"

    def partitions(self, model: str) -> str:
        """String: how many partitions the queue has (``tokenfleet queue create
        --partitions``); none: one, the queue itself."""
        return f"{self.namespace}:partitions:{{{model}}}"

    def declared_pattern(self) -> str:
        return f"{self.namespace}:declared:*"

    @property
    def declared_index(self) -> str:
        """Set: the declared queues' names, so that a page lists them without a
        scan of the keyspace (``declare`` and ``undeclare`` keep it)."""
        return f"{self.namespace}:declared-index"

    @property
    def history(self) -> str:
        """Stream, trimmed to an hour as it is written: each worker's sample
        every 10 s (tokens/s, running, waiting, its queue's backlog, tokens per
        tenant), the console's lines and shares (``shared/wire/fleet_history.py``)."""
        return f"{self.namespace}:history"

    def declared_model(self, key: str) -> str:
        """The model of a ``declared`` key."""
        return _untagged(key.removeprefix(f"{self.namespace}:declared:"))

    def served_pattern(self) -> str:
        return f"{self.namespace}:served:*"

    def served_model(self, key: str) -> str:
        """The model of a ``queue_workers`` key."""
        return _untagged(key.removeprefix(f"{self.namespace}:served:"))

    def owners(self, model: str) -> str:
        """Hash: owner tag -> JSON {"worker": name, "slots": n} of each worker
        that owns streams in a queue (or partition) with placement on
        (``workers/affinity.py``): ``submit.lua`` places jobs on a live one's."""
        return f"{self.namespace}:owners:{{{model}}}"

    def owned_levels(self, model: str) -> str:
        """Set: the owned levels (``owned_level``) that have a stream in a queue
        (or partition): what the depth counts, and the streams a peer steals from
        or takes over."""
        return f"{self.namespace}:owned:{{{model}}}"

    def held(self, model: str, tag: str) -> str:
        """Sorted set: the prefix keys (``shared/wire/prefixes.py``) the worker of
        ``tag`` started jobs of in a queue (or partition), scored by when it last
        did; trimmed to ``TOKENFLEET_AFFINITY_HELD``."""
        return f"{self.namespace}:held:{{{model}}}:{tag}"

    def tenants(self, model: str) -> str:
        """Set: the named tenants that have streams in a model's queue (submit
        adds a tenant with its first job), for the feeder and the depth."""
        return f"{self.namespace}:tenants:{{{model}}}"

    def fair(self, model: str, priority: str) -> str:
        """Hash: tenant -> virtual tokens served at one level of a model, by
        every worker of the queue (weighted fair share, ``fair.lua``)."""
        return f"{self.namespace}:fair:{{{model}}}:{priority}"

    def idempotency(self, model: str, key: str) -> str:
        """String with a TTL: '<job id> <fingerprint of the request>' of a key.
        A key is the queue's: the same key on two queues names two jobs."""
        return f"{self.namespace}:idem:{{{model}}}:{key}"

    def file(self, file_id: str) -> str:
        """Hash: one uploaded or made file's record (``producer/files/records.py``); its
        bytes live in the file store (``TOKENFLEET_FILES_URL``), never in Redis."""
        return f"{self.namespace}:file:{file_id}"

    @property
    def files(self) -> str:
        """Sorted set: every file id, scored by its creation time (for listing)."""
        return f"{self.namespace}:files"

    def tenant_files(self, tenant: str) -> str:
        """Sorted set: one tenant's file ids, scored by creation time: what its
        listing reads (never another tenant's records) and its file count."""
        return f"{self.namespace}:files:t:{tenant}"

    def response(self, response_id: str) -> str:
        """String: a stored response's record, JSON (``producer/openai/stored_responses.py``):
        its job, its request as a chat, its input items, and its final object once
        its job ended; kept ``TOKENFLEET_RESPONSES_TTL`` from its creation."""
        return f"{self.namespace}:resp:{{{response_id}}}"

    def responses_pending(self) -> str:
        """Sorted set: background responses whose end no gateway stored yet, scored
        by when a gateway's sweep should look at each next."""
        return f"{self.namespace}:resp-pending"

    def batch(self, batch_id: str) -> str:
        """Hash: one batch's record (``producer/client/batch_records.py``): OpenAI's batch
        object's fields, its tenant and the driver's position in its input. The
        batch's other keys share its hash tag, so one transaction covers them."""
        return f"{self.namespace}:batch:{{{batch_id}}}"

    def batch_lease(self, batch_id: str) -> str:
        """String with a TTL: the driver that works on the batch now (renewed)."""
        return f"{self.batch(batch_id)}:lease"

    def batch_running(self, batch_id: str) -> str:
        """Hash: line index -> job id of the batch's lines queued or running."""
        return f"{self.batch(batch_id)}:running"

    def batch_done(self, batch_id: str) -> str:
        """Bitmap: bit i set once line i's result is written to a part."""
        return f"{self.batch(batch_id)}:done"

    def batch_dups(self, batch_id: str) -> str:
        """Set: indexes of the lines whose custom_id an earlier line has."""
        return f"{self.batch(batch_id)}:dups"

    @property
    def batches(self) -> str:
        """Sorted set: every batch id, scored by its creation time (for listing)."""
        return f"{self.namespace}:batches"

    @property
    def active_batches(self) -> str:
        """Set: the batches not yet ended, which the drivers work on."""
        return f"{self.namespace}:batches:active"

    def tenant_batches(self, tenant: str) -> str:
        """Sorted set: one tenant's batch ids, scored by creation time (its listing)."""
        return f"{self.namespace}:batches:t:{tenant}"

    @property
    def tenant_indexes_done(self) -> str:
        """String: set once every file and batch made before the tenants' own
        indexes existed is in its tenant's (``producer/files/tenant_indexes.py``)."""
        return f"{self.namespace}:tenant-indexes"

    def tenant_open_batches(self, tenant: str) -> str:
        """Set: one tenant's batches not yet ended: its open-batch count, and the
        batches whose lines share its window (``TOKENFLEET_BATCH_WINDOW``)."""
        return f"{self.namespace}:batches:open:{tenant}"

    @property
    def webhook_outbox(self) -> str:
        """Stream: webhook events waiting for delivery (``shared/webhook_outbox.py``);
        a consumer group of deliverers reads it, so an event survives a crash."""
        return f"{self.namespace}:webhooks:outbox"

    def job_webhooks(self, model: str) -> str:
        """Stream: a queue's job events (``job.completed``, ...) waiting for
        delivery, in the queue's slot: the script that ends a job adds its event
        in the same step (``job_webhook.lua``). Deliverers read it as they read
        ``webhook_outbox``."""
        return f"{self.namespace}:webhooks:outbox:{{{model_of(model)}}}"

    def job_webhooks_pattern(self) -> str:
        return f"{self.namespace}:webhooks:outbox:*"

    def webhook_lane(self, tenant: str) -> str:
        """Sorted set: one tenant's events waiting for delivery (their ids),
        scored by the time of their next attempt (new ones by their arrival; one
        being posted by its lease's end), so a retry outlives the deliverer that
        scheduled it and deliverers take the tenants' events in turn."""
        return f"{self.namespace}:webhooks:lane:{tenant}"

    @property
    def webhook_lanes(self) -> str:
        """Set: the tenants whose lane may hold events."""
        return f"{self.namespace}:webhooks:lanes"

    def webhook_event(self, event_id: str) -> str:
        """Hash: one undelivered event (type, data, URL, tenant) with its
        attempts so far, last status and error, next attempt time (deleted once
        it is delivered or given up)."""
        return f"{self.namespace}:webhooks:event:{event_id}"

    @property
    def webhook_attempts(self) -> str:
        """Stream, capped: every delivery attempt (event, URL, status or error)."""
        return f"{self.namespace}:webhooks:attempts"

    @property
    def webhook_dead(self) -> str:
        """Stream: the default tenant's events not delivered within
        ``webhook_retry_s``, with their last error (capped: ``webhook_tenant_dead``)."""
        return f"{self.namespace}:webhooks:dead"

    def webhook_dead_of(self, tenant: str) -> str:
        """Stream: a tenant's dead letters, each tenant's capped on its own."""
        return self.webhook_dead if tenant == DEFAULT_TENANT else f"{self.webhook_dead}:{tenant}"

    def webhook_dead_pattern(self) -> str:
        return f"{self.webhook_dead}:*"

    def api_key(self, digest: str) -> str:
        """String: one API key's record (``ApiKey`` JSON), under the SHA-256 of
        the key (hex): the key itself is never stored."""
        return f"{self.namespace}:apikey:{digest}"

    @property
    def api_keys(self) -> str:
        """Hash: every API key, key id -> the SHA-256 its record is under (for
        ``keys list`` and ``keys revoke``; a gateway reads ``api_key`` alone)."""
        return f"{self.namespace}:apikeys"

    @property
    def api_keys_made(self) -> str:
        """String: when the fleet's first API key was made (seconds since the epoch).
        Set by ``create_key``, never removed by a revoke: an ``auto`` gateway asks
        for keys once it exists, even when no key is left."""
        return f"{self.namespace}:apikeys:made"

    @property
    def api_keys_used(self) -> str:
        """Hash: key id -> when a gateway last served a request made with it
        (written at most once a minute per key and gateway: ``KeyBook.note_use``)."""
        return f"{self.namespace}:apikeys:used"

    def console_sign_in(self, digest: str) -> str:
        """String with a TTL: the SHA-256 of the key a console sign-in was made
        with, under the SHA-256 of the sign-in's token (the browser's cookie):
        the cookie holds no key, and signing out deletes it."""
        return f"{self.namespace}:console:signin:{digest}"

    def rate_requests(self, key_id: str) -> str:
        """Sorted set: the requests of one key in the last minute (member the
        request id, score its time); tagged by the key id, as is ``rate_tokens``,
        so ``rate_take.lua`` touches one slot."""
        return f"{self.namespace}:rate:{{{key_id}}}:requests"

    def rate_tokens(self, key_id: str) -> str:
        """Sorted set: one key's token charges of the last minute (member
        '<request id> <tokens>', score its time)."""
        return f"{self.namespace}:rate:{{{key_id}}}:tokens"

    def rate_token_total(self, key_id: str) -> str:
        """Counter: the sum of ``rate_tokens``' charges, kept with them."""
        return f"{self.namespace}:rate:{{{key_id}}}:total"

    def tenant_jobs(self, tenant: str) -> str:
        """Sorted set: a tenant's jobs queued or running (and reservations for
        jobs being submitted), scored by when they were admitted, for a key's
        ``max_queued``."""
        return f"{self.namespace}:tenant:{{{tenant}}}:jobs"

    @property
    def tenant_refusals(self) -> str:
        """Hash: '<tenant>:<reason>' -> requests of the tenant the gateways refused
        for that reason (``tenant_refusals``: a counter, never reset; a tenant
        name has no ':'). One key, so the exporter reads every count at once."""
        return f"{self.namespace}:refusals"

    @property
    def cancels(self) -> str:
        """Pub/sub channel: ids of running jobs whose cancel was asked for."""
        return f"{self.namespace}:cancels"

    @property
    def celery_prefix(self) -> str:
        """Celery's own keys (a prefix): its broker queues and remote control,
        under one hash tag, so that on a Redis Cluster they all live on the node
        Celery is given."""
        return f"{{{self.namespace}:celery}}:"
