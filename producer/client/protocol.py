"""What the sync and asyncio clients share: how a request becomes Redis writes,
and how a job's token log and live channel become one ordered event sequence.
"""

from __future__ import annotations

import random
import time
import uuid
import zlib
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from tokenfleet.shared.wire import client_scripts
from tokenfleet.shared.wire.client_scripts import (SubmitVerdict, Asked, CancelVerdict, Placement,
                                                   Submitted)
from tokenfleet.shared.wire.errors import (IdempotencyConflict, InvalidRequest, JobNotFound,
                                      LimitExceeded, NoWorker, PromptTooLong, QueueFull,
                                      WorkersGone)
from tokenfleet.shared.wire.keys import (Keys, job_model, new_job_id, partition,
                                    queue_of_partition)
from tokenfleet.shared.wire.limits import client_limits
from tokenfleet.shared.wire.prefixes import PrefixKey, prefix_keys, request_length
from tokenfleet.shared.redis.cluster import ChannelMoved
from tokenfleet.shared.redis.liveness import live_since
from tokenfleet.shared.wire.schemas import (
    EXPIRED_ERROR,
    EndEvent,
    FinishReason,
    GenerationRequest,
    JobState,
    JobStatus,
    QueueEntry,
    SamplingParams,
    TokenEvent,
)
from tokenfleet.shared.wire.scripts import Arg, ScriptCall
from tokenfleet.shared.wire.serialization import dumps, end_event, parse_event
from tokenfleet.shared.settings import Settings
from tokenfleet.shared.wire.structured import from_response_format
from tokenfleet.shared.webhook_destination import destination_problem

SAMPLING_FIELDS = frozenset(SamplingParams.model_fields)
REQUEST_FIELDS = frozenset(GenerationRequest.model_fields) - {"prompt", "sampling"}

# A subscriber that hears nothing for this long re-reads the token log and the
# record, so a lost pub/sub message (a dropped connection, a Redis restart)
# delays it by at most this much and never loses a token.
RECHECK_S = 1.0
# A reader waiting on a queued job wakes this long after its deadline, so the
# deadline has surely passed by its own clock when it looks (is_overdue).
EXPIRE_SLACK_S = 0.005
# How long cancel() waits for a running job to end before it answers.
CANCEL_WAIT_S = 5.0


def build_request(
    prompt: str | GenerationRequest | None, kwargs: dict[str, Any], settings: Settings,
    tenant: str | None = None,
) -> GenerationRequest:
    """Validate what the caller gave: ``InvalidRequest`` (a ``TokenfleetError``
    with JSON-ready ``errors``) if it is wrong. ``tenant``, when given, is the
    job's tenant (over one the request names)."""
    if isinstance(prompt, GenerationRequest):
        if kwargs:
            raise TypeError("pass either a GenerationRequest or keyword arguments, not both")
        # Re-validate: the object may have been built without this fleet's limits.
        given = prompt.model_dump()
        if tenant is not None:
            given["tenant"] = tenant
        return _validated(given, settings)
    kwargs = structured_kwargs(kwargs)
    if tenant is not None:
        kwargs = {**kwargs, "tenant": tenant}
    unknown = set(kwargs) - SAMPLING_FIELDS - REQUEST_FIELDS
    if unknown:
        raise TypeError(f"unknown argument(s) to submit: {', '.join(sorted(unknown))}")
    data: dict[str, Any] = {k: v for k, v in kwargs.items() if k in REQUEST_FIELDS}
    data["sampling"] = {k: v for k, v in kwargs.items() if k in SAMPLING_FIELDS}
    if prompt is not None:
        data["prompt"] = prompt
    return _validated(data, settings)


def structured_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``submit``'s ``response_format`` (OpenAI's shape) and ``json_schema`` (a
    schema, the shortcut) as the request's ``structured_output``; at most one
    of the three."""
    given = [k for k in ("response_format", "json_schema", "structured_output")
             if kwargs.get(k) is not None]
    if len(given) > 1:
        raise InvalidRequest(f"give at most one of {', '.join(given)}")
    rest = {k: v for k, v in kwargs.items() if k not in ("response_format", "json_schema")}
    try:
        if "response_format" in given:
            rest["structured_output"] = from_response_format(kwargs["response_format"])
        elif "json_schema" in given:
            if not isinstance(kwargs["json_schema"], dict):
                raise ValueError("must be a JSON schema: a dict")
            rest["structured_output"] = from_response_format(
                {"type": "json_schema", "json_schema": {"schema": kwargs["json_schema"]}})
    except ValueError as exc:  # not pydantic's: the message names the field
        raise InvalidRequest(f"invalid '{given[0]}': {exc}",
                             [{"loc": [given[0]], "msg": str(exc), "type": "value_error"}]
                             ) from exc
    return rest


def refuse_uncompilable(problem: str | None) -> None:
    """``InvalidRequest`` naming ``structured_output`` for a spec that does not
    compile (``GrammarCheck.problem``'s sentence); nothing when ``problem`` is None."""
    if problem is not None:
        raise InvalidRequest(f"invalid 'structured_output': {problem}",
                             [{"loc": ["structured_output"], "msg": problem,
                               "type": "value_error"}])


def _validated(data: dict[str, Any], settings: Settings) -> GenerationRequest:
    try:
        return GenerationRequest.model_validate(data, context={"settings": settings})
    except ValidationError as exc:
        raise InvalidRequest.from_validation(exc) from exc


def check_webhook_destination(url: str, settings: Settings, field: str = "webhook_url"
                              ) -> None:
    """``InvalidRequest`` naming ``field`` when ``url`` may not be a webhook's
    destination (``webhook_destination``: this process's allowlist, so it is
    checked here, where the request is submitted, not in the wire type)."""
    problem = destination_problem(url, settings)
    if problem:
        raise InvalidRequest(problem, [{"loc": [field], "msg": problem, "type": "value_error"}])


@dataclass(frozen=True)
class Submission:
    job_id: str
    call: ScriptCall[Submitted]


def require_worker_for(require_worker: bool | None, settings: Settings) -> bool:
    """The caller's choice, else the fleet's (``TOKENFLEET_REQUIRE_WORKER``, on by default)."""
    return settings.require_worker if require_worker is None else require_worker


def submission(request: GenerationRequest, keys: Keys, settings: Settings,
               require_worker: bool, now: float, prompt_tokens: int | None = None,
               tenants: tuple[str, ...] = (), partitions: int = 1,
               turn: int = 0) -> Submission:
    """The submit.lua call for one request, made at ``now`` (Redis's clock: the
    one its deadline and the workers' heartbeats are judged by). With
    ``require_worker`` the script refuses a queue no live worker serves
    (``NoWorker``). The script holds the request to the strictest of this
    client's limits and its queue's workers'; its prompt's tokens only where the
    caller counted them (``prompt_tokens``), else the worker that takes it
    counts them. ``tenants``: the queue's named tenants as the caller last
    heard (the script answers TENANTS when it misses one: call again).
    ``partitions``: how many the queue has (``QueuePartitions``); the job goes
    to one of them (``pick_partition`` at ``turn``), whose name its id and keys
    carry."""
    if request.prompt_token_ids is not None:
        prompt_tokens = len(request.prompt_token_ids)  # counted as given
    if request.webhook_url is not None:
        check_webhook_destination(request.webhook_url, settings)
    prefixes = prefix_keys(request, settings.affinity_min_chars) if settings.affinity else []
    queue = pick_partition(request, partitions, turn, prefixes)
    job_id = new_job_id(queue, uuid.uuid4().hex)
    deadline_at = now + request.deadline_s if request.deadline_s else None
    entry = QueueEntry(job_id=job_id, request=request, created_at=now, deadline_at=deadline_at,
                       prefixes=[p.key for p in prefixes])
    # Fields left at their defaults stay off the wire: shorter entries, and a
    # worker from before a new field still reads every request that leaves it unset
    # (a rolling upgrade may start with the producers).
    request_json = request.model_dump_json(exclude_defaults=True)
    record: dict[str, Arg] = {
        "id": job_id,
        "status": JobStatus.QUEUED.value,
        "model": request.model,
        "priority": request.priority,
        "created_at": repr(now),
        "attempts": 0,
        "metadata": dumps(request.metadata),
        "request": request_json,
    }
    if deadline_at is not None:
        record["deadline_at"] = repr(deadline_at)
    if request.tenant is not None:
        record["tenant"] = request.tenant
    if request.webhook_url is not None:
        record["webhook_url"] = request.webhook_url  # job_webhook.lua reads it at the end
    if request.response_id is not None:
        record["response_id"] = request.response_id  # and this, to name the event
    idem = request.idempotency_key
    return Submission(job_id, client_scripts.submit(
        keys, job_id=job_id, model=queue, priority=request.priority,
        tenant=request.tenant, tenants=tenants,
        entry_json=entry.model_dump_json(exclude_defaults=True), record=record, weight=backlog_weight(request),
        limits=client_limits(settings),
        asked=Asked(new_tokens=request.sampling.max_new_tokens,
                    payload_bytes=len(request_json), prompt_tokens=prompt_tokens),
        idempotency_key=idem,
        idempotency_ttl_s=settings.idempotency_ttl_s,
        fingerprint=request.fingerprint() if idem else "",
        placement=Placement(prefixes, request_length(request), live_since(now))
        if prefixes else None,
        live_since=live_since(now) if require_worker else None,
        served_since=(now - settings.no_worker_grace_s
                      if require_worker and settings.no_worker_grace_s > 0 else None)))


def pick_partition(request: GenerationRequest, partitions: int, turn: int = 0,
                   prefixes: Sequence[PrefixKey] = ()) -> str:
    """The partition a new job of ``request`` goes to: the client's ``turn``-th
    (round-robin, so one client's jobs spread evenly, however few); one with an
    idempotency key, the partition its key hashes to, where the key's record
    is (a retry finds its first job); else, with placement on, the one its
    shortest prefix hashes to, where the workers that hold it are listed."""
    if partitions <= 1:
        return request.model
    key = request.idempotency_key or (prefixes[0].key if prefixes else None)
    index = zlib.crc32(key.encode()) if key is not None else turn
    return partition(request.model, index % partitions, partitions)


class QueuePartitions:
    """How many partitions each queue has (``Keys.partitions``, none: one), as a
    client last read them: read again after ``TTL_S``, so a client learns a
    queue's new partitions within that time. And the client's turn: its jobs go
    to the partitions in turn, from a random one (so clients do not all start
    on the first)."""

    TTL_S = 10.0

    def __init__(self) -> None:
        self._of: dict[str, tuple[int, float]] = {}
        self._turn = random.getrandbits(16)

    def cached(self, model: str) -> int | None:
        found = self._of.get(model)
        if found is None or time.monotonic() - found[1] > self.TTL_S:
            return None
        return found[0]

    def heard(self, model: str, raw: bytes | str | None) -> int:
        """Keep what Redis said (``GET`` of ``Keys.partitions``); the count."""
        count = max(1, int(raw or 1))
        self._of[model] = (count, time.monotonic())
        return count

    def turn(self) -> int:
        """The next job's turn (``pick_partition``)."""
        self._turn += 1
        return self._turn


class KnownTenants:
    """The named tenants of each queue as a client last heard them from
    ``submit.lua``: its depth counts every tenant's streams, so the call names
    them all. Tenants are only ever added, so asking again converges."""

    def __init__(self) -> None:
        self._of: dict[str, tuple[str, ...]] = {}

    def of(self, model: str) -> tuple[str, ...]:
        return self._of.get(model, ())

    def heard(self, model: str, result: Submitted) -> bool:
        """True when ``result`` asks for a call naming more tenants (now known)."""
        if result.admission is not SubmitVerdict.TENANTS:
            return False
        self._of[model] = tuple(sorted({*self.of(model), *result.tenants}))
        return True


def backlog_weight(request: GenerationRequest) -> int:
    """The job's work in tokens, for the backlog gauge: the prompt is not
    tokenized on this side, so its tokens are estimated at 4 bytes each."""
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids) + request.sampling.max_new_tokens
    text = request.prompt or "".join(m.content for m in request.messages or [])
    return -(-len(text.encode()) // 4) + request.sampling.max_new_tokens


def submitted_id(result: Submitted, request: GenerationRequest,
                 settings: Settings) -> str | None:
    """The id of the job that runs (queued now, or by an earlier request under the
    same idempotency key), None when no live worker serves the queue (the caller
    lists the served ones in its ``NoWorker``)."""
    if result.admission is SubmitVerdict.FULL:
        limit = result.limit or client_limits(settings).queue
        raise QueueFull(request.model, result.depth or 0, limit.value, limit.why)
    if result.admission is SubmitVerdict.OVER_LIMIT and result.limit is not None:
        if result.name == "prompt_tokens":
            raise PromptTooLong(result.value or 0, result.limit.value, result.limit.by,
                                result.limit.why)
        raise LimitExceeded(result.name or "", result.value or 0, result.limit.value,
                            result.limit.by, result.limit.why)
    if result.admission is SubmitVerdict.CONFLICT:
        raise IdempotencyConflict(request.idempotency_key or "")
    return result.job_id


def no_worker(request: GenerationRequest, result: Submitted, served: list[str], now: float,
              settings: Settings) -> NoWorker:
    """Why submit.lua queued nothing for want of a live worker: a queue served
    within a day but not within the grace period is ``WorkersGone`` (a retry
    may pass once its workers are back), any other ``NoWorker`` (a name no
    worker serves: mistyped, or never started)."""
    if result.served_until is None:
        return NoWorker(request.model, served)
    return WorkersGone(request.model, served, max(0.0, now - result.served_until),
                       settings.no_worker_grace_s)


def served_queues(names: list[bytes], live_counts: list[int], keys: Keys) -> list[str]:
    """Queue names from ``<ns>:served:<model>`` keys that have a live worker
    (a partition's: its queue's name)."""
    return sorted({queue_of_partition(keys.served_model(name.decode()))
                   for name, n in zip(names, live_counts) if n})


def cancel_call(job_id: str, record: list[bytes | None], keys: Keys,
                settings: Settings, now: float) -> ScriptCall[CancelVerdict]:
    """The cancel.lua call for a job whose record has ``CANCEL_FIELDS``
    (``record``, as HMGET gives them; model first, which is never None), at
    ``now`` (Redis's clock)."""
    model, priority, tenant, owner = (None if v is None else v.decode() for v in record)
    return client_scripts.cancel(
        # The job's partition (its id's queue part), whose keys it has.
        keys, job_id=job_id, model=job_model(job_id) or model or "",
        priority=priority or "normal", tenant=tenant, owner=owner or None,
        now=now,
        result_ttl_s=settings.result_ttl_s,
        end_event=end_event(JobStatus.CANCELLED, FinishReason.CANCELLED, None))


# What cancel reads of a record first: its stream's key goes to cancel.lua
# with the others (declared keys only).
CANCEL_FIELDS = ["model", "priority", "tenant", "owner"]


def cancel_verdict(verdict: CancelVerdict, job_id: str) -> CancelVerdict:
    """CANCELLED (it was queued: ended now), REQUESTED (it is running: its worker
    was told, the job may still end otherwise) or ENDED (nothing to cancel);
    ``JobNotFound`` for no such job."""
    if verdict is CancelVerdict.MISSING:
        raise JobNotFound(job_id)
    return verdict


def is_overdue(state: JobState, now: float) -> bool:
    """Queued past its deadline at ``now`` (Redis's clock): it can no longer
    start (a worker that reads it ends it expired), so a reader reports it as
    expired (``as_expired``)."""
    return (state.status is JobStatus.QUEUED and state.deadline_at is not None
            and state.deadline_at <= now)


def as_expired(state: JobState) -> JobState:
    """An overdue job as it reads once ended: ``expired``, finish reason
    ``deadline``, at its deadline. Derived, nothing is written: the record is
    ended by the worker that reads its entry, or by ``repair_fleet`` for a
    queue no worker serves."""
    return state.model_copy(update={
        "status": JobStatus.EXPIRED, "finish_reason": FinishReason.DEADLINE,
        "error": EXPIRED_ERROR, "finished_at": state.deadline_at})


def as_read(state: JobState, now: float) -> JobState:
    """The state a reader reports at ``now`` (Redis's clock): the record's, or
    an overdue job as expired."""
    return as_expired(state) if is_overdue(state, now) else state


def expires_at(state: JobState) -> float | None:
    """When a reader of this job should look again to see it expired (Redis's
    clock), or None."""
    return state.deadline_at if state.status is JobStatus.QUEUED else None


def parse_state(job_id: str, fields: dict[bytes, bytes]) -> JobState:
    if not fields:
        raise JobNotFound(job_id)
    return JobState.from_redis({k.decode(): v.decode() for k, v in fields.items()})


@dataclass
class EventCursor:
    """Merges the replay log and live messages into one gap-free, duplicate-free
    sequence of token events, ending at the job's end event."""

    next_index: int = 0
    ended: bool = False
    final: EndEvent | None = None  # the job's end, once seen (or read from its record)
    expires_at: float | None = None  # a queued job's deadline: look again then
    pending: list[TokenEvent] = field(default_factory=list)

    def log_after(self) -> str:
        """Exclusive XRANGE start for what this cursor has not yet seen."""
        return f"(0-{self.next_index}"

    def feed(self, payload: bytes | str) -> bool:
        """Take one event; return False when it leaves a gap (re-read the log)."""
        event = parse_event(payload)
        if isinstance(event, EndEvent):
            self.ended, self.final = True, event
            return True
        if event.end <= self.next_index:
            return True  # seen already, from the log or a redelivery
        if event.index > self.next_index:
            return False  # a message was lost in between: the log has it
        # An event that starts before what was seen: the log lost tokens a
        # consumer had already been sent, and a new attempt made them again
        # (coalesced otherwise): only its new tokens go on.
        self.pending.append(event.after(self.next_index))
        self.next_index = event.end
        return True

    def feed_log(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        for _id, fields in entries:
            self.feed(fields[b"e"])

    def feed_message(self, message: dict[str, Any] | None) -> bool:
        """Take a pub/sub message (None on a quiet interval); False asks for a re-read."""
        if message is None or not is_message(message):
            return message is not None
        return self.feed(message["data"])

    def take(self) -> list[TokenEvent]:
        out, self.pending = self.pending, []
        return out

    def end_from(self, state: JobState) -> None:
        """The record says the job ended (its end message may never come)."""
        self.ended = True
        if self.final is None:
            self.final = EndEvent(status=state.status, finish_reason=state.finish_reason,
                                  error=state.error)


def is_end(message: dict[str, Any]) -> bool:
    """Cheap test on the hot path of ``wait``: does this message end the job?"""
    return is_message(message) and is_end_payload(message["data"])


# What a channel's message is called: a classic channel's, a shard channel's.
_MESSAGES = ("message", "smessage")


def is_message(message: dict[str, Any]) -> bool:
    """Whether a pub/sub message carries an event. ``ChannelMoved`` for the
    unsubscribe of a shard channel that the reader did not ask for: its slot
    moved to another node (a reader unsubscribes only once it stops reading)."""
    kind = message.get("type")
    if kind == "sunsubscribe":
        raise ChannelMoved(f"{message.get('channel')!r} moved to another node")
    return kind in _MESSAGES


def is_end_payload(payload: bytes) -> bool:
    return b'"k":"end"' in payload


def time_slice(deadline: float | None, job_expires_at: float | None = None,
               now: float | None = None) -> float:
    """How long one wait for a message may block: until the next recheck, the
    caller's timeout (``deadline``, monotonic) or the moment a queued job's own
    deadline passes (``job_expires_at``, Redis's clock, as is ``now``),
    whichever comes first."""
    wait = RECHECK_S
    if deadline is not None:
        wait = max(0.0, min(wait, deadline - time.monotonic()))
    if job_expires_at is not None and now is not None:
        # Once past, no wait: the reader's next look reports the job expired
        # (is_overdue reads the same clock), so this never spins.
        wait = min(wait, max(0.0, job_expires_at - now + EXPIRE_SLACK_S))
    return wait


def check_deadline(deadline: float | None, job_id: str) -> None:
    if deadline is not None and time.monotonic() >= deadline:
        raise TimeoutError(f"job {job_id} did not end in time")
