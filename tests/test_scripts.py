"""The typed script bindings: a call names its script by the SHA1 Redis gives it,
loads it again when the server lost it (blocking and asyncio clients alike), and
its reply reads as the binding's dataclass or enum."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from tokenfleet.shared.wire.client_scripts import (
    Asked,
    SubmitVerdict,
    CancelVerdict,
    ExpireVerdict,
    cancel,
    expire,
    forget_queue,
    submit,
)
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.limits import client_limits
from tokenfleet.shared.redis.connect import connect_async, node_client
from tokenfleet.shared.wire.scripts import load, script
from tokenfleet.shared.wire.worker_scripts import (
    Bad,
    Emitted,
    Ended,
    Ending,
    RunningHere,
    LogEvent,
    Missing,
    Run,
    Stale,
    Take,
    emit,
    finish,
    log_entry_id,
    requeue,
    resume,
    start,
)
from tokenfleet.shared.wire.schemas import FinishReason, JobStatus

pytestmark = pytest.mark.timeout(60)

SCRIPTS = ("submit", "cancel", "start", "emit", "finish", "requeue", "resume", "expire",
           "forget_queue")


def _node(r: redis.Redis, keys: Keys) -> Any:
    """The client of the node the test's keys live on (one server: the client)."""
    return node_client(r, keys.queue("default"))


def test_each_script_is_named_by_the_sha1_redis_gives_its_source(r: redis.Redis,
                                                                   settings: Any) -> None:
    node = _node(r, Keys(settings.namespace))
    for name in SCRIPTS:
        one = script(name)
        assert node.script_load(one.source) == one.sha


def test_a_call_loads_its_script_again_when_the_server_lost_it(r: redis.Redis,
                                                               settings: Any) -> None:
    keys = Keys(settings.namespace)
    call = forget_queue(keys, model="default", live_since=time.time())  # nothing there
    node = _node(r, keys)
    node.script_flush()
    assert call.run(node) is True  # NOSCRIPT, loaded, run
    assert node.script_exists(call.script.sha) == [True]
    node.script_flush()
    load(node, [call.script, call.script])
    assert node.script_exists(call.script.sha) == [True]


async def test_the_asyncio_client_runs_the_same_calls(r: redis.Redis, settings: Any) -> None:
    keys = Keys(settings.namespace)
    _node(r, keys).script_flush()
    client = connect_async(settings.redis_url)
    try:
        verdict = await cancel(keys, job_id="default:nothing", model="default",
                               priority="normal", now=time.time(), result_ttl_s=60,
                               end_event=b"{}").run_async(client)
    finally:
        await client.aclose()
    assert verdict is CancelVerdict.MISSING


def test_a_job_goes_through_the_scripts_with_typed_verdicts(r: redis.Redis,
                                                            settings: Any) -> None:
    """submit, start, emit, finish, then a cancel and an expire that find it ended."""
    keys = Keys(settings.namespace)
    node, job_id = _node(r, keys), "default:abc"
    sub = submit(keys, job_id=job_id, model="default", priority="normal",
                 entry_json='{"job_id": "default:abc"}',
                 record={"id": job_id, "status": "queued", "attempts": 0}, weight=7,
                 limits=client_limits(settings), asked=Asked(new_tokens=4, payload_bytes=20),
                 idempotency_key="k", idempotency_ttl_s=60, fingerprint="f",
                 live_since=None)
    queued = sub.run(node)
    assert queued.admission is SubmitVerdict.QUEUED and queued.job_id == job_id
    again = sub.run(node)
    assert again.admission is SubmitVerdict.DUPLICATE and again.job_id == job_id
    entry_id = r.hget(keys.job(job_id), "entry").decode()
    take = start(keys, queue="default", level="default", worker="w", now=time.time(),
                 takes=[Take(job_id, entry_id, False), Take("default:none", "1-1", False)])
    assert take.run(node) == [Run(attempt=1, cancel=False, handbacks=0), Missing()]
    emitted = emit(keys, result_ttl_s=60, now=time.time(), events=[
        LogEvent(job_id, 1, 0, 2, b'{"k":"tok","index":0,"token_ids":[5,6],"text":"ab"}'),
        LogEvent(job_id, 2, 2, 1, b'{"k":"tok","index":2,"token_ids":[7],"text":"c"}'),
    ]).run(node)
    assert emitted.fenced == {job_id} and not emitted.gaps  # the second event's attempt is 2
    resumed = resume(keys, job_id=job_id, attempt=1, result_ttl_s=60).run(node)
    assert resumed.owned and len(resumed.events) == 1
    assert not resume(keys, job_id=job_id, attempt=2, result_ttl_s=60).run(node).owned
    finished = finish(keys, result_ttl_s=60, worker="w", now=time.time(), endings=[
        Ending(job_id, "default", entry_id, 1, JobStatus.SUCCEEDED, FinishReason.LENGTH,
               text="ab", token_ids=[5, 6], logged=2),
        Ending("default:other", "default", "", 3, JobStatus.SUCCEEDED),
    ]).run(node)
    assert finished.fenced == {"default:other"} and not finished.untrusted
    assert cancel(keys, job_id=job_id, model="default", priority="normal", now=time.time(),
                  result_ttl_s=60, end_event=b"{}").run(node) is CancelVerdict.ENDED
    assert expire(keys, job_id=job_id, model="default", priority="normal", now=time.time(),
                  result_ttl_s=60, end_event=b"{}", error="late").run(node) \
        is ExpireVerdict.UNCHANGED
    ended = start(keys, queue="default", level="default", worker="w", now=time.time(),
                  takes=[Take(job_id, entry_id, False)]).run(node)
    assert ended == [Ended(JobStatus.SUCCEEDED)]


def test_a_handed_back_job_refuses_its_old_attempts_writes_until_and_after_a_new_start(
        r: redis.Redis, settings: Any) -> None:
    """A preempted job is handed back while its worker may still send a step
    for it: nothing of that attempt reaches the log or the record."""
    keys = Keys(settings.namespace)
    node, job_id = _node(r, keys), "default:pre"
    submit(keys, job_id=job_id, model="default", priority="batch", entry_json="{}",
           record={"id": job_id, "status": "queued", "attempts": 0}, weight=7,
           limits=client_limits(settings), asked=Asked(new_tokens=4, payload_bytes=20),
           idempotency_key=None, idempotency_ttl_s=60, fingerprint="f",
           live_since=None).run(node)
    entry_id = r.hget(keys.job(job_id), "entry").decode()
    started = start(keys, queue="default", level="default:batch", worker="w", now=time.time(),
                    takes=[Take(job_id, entry_id, False)]).run(node)
    assert started == [Run(attempt=1, cancel=False, handbacks=0)]

    def token(index: int, attempt: int) -> LogEvent:
        return LogEvent(job_id, attempt, index, 1,
                        b'{"k":"tok","index":%d,"token_ids":[5],"text":"a"}' % index)

    assert not emit(keys, result_ttl_s=60, now=time.time(), events=[token(0, 1)]).run(node).fenced
    assert requeue(keys, queue="default:batch", job_id=job_id, entry_id=entry_id, attempt=1,
                   entry_json="{}", counts_as_attempt=False).run(node)
    late = emit(keys, result_ttl_s=60, now=time.time(), events=[token(1, 1)]).run(node)
    ending = Ending(job_id, "default:batch", entry_id, 1, JobStatus.SUCCEEDED,
                    FinishReason.LENGTH, text="aa", token_ids=[5, 5], logged=2)
    ended = finish(keys, result_ttl_s=60, worker="w", now=time.time(),
                   endings=[ending]).run(node)
    assert late.fenced == {job_id} and ended.fenced == {job_id}
    assert r.hget(keys.job(job_id), "status") == b"queued" and r.xlen(keys.out(job_id)) == 1
    entry_id = r.hget(keys.job(job_id), "entry").decode()
    again = start(keys, queue="default", level="default:batch", worker="w2", now=time.time(),
                  takes=[Take(job_id, entry_id, False)]).run(node)
    assert again == [Run(attempt=2, cancel=False, handbacks=1)]
    assert emit(keys, result_ttl_s=60, now=time.time(), events=[token(1, 1)]).run(node).fenced
    assert not emit(keys, result_ttl_s=60, now=time.time(), events=[token(1, 2)]).run(node).fenced


def test_start_verdicts_read_as_their_dataclasses() -> None:
    decode = start(Keys("ns"), queue="q", level="q", worker="w", now=0.0, takes=[]).decode
    reply = [[b"run", 3, b"1", b"2"], [b"stale"], [b"held"], [b"missing"],
             [b"bad", b"job record's weight is \xff", b"1"], [b"cancelled"]]
    assert decode(reply) == [Run(3, True, 2), Stale(), RunningHere(), Missing(),
                             Bad("job record's weight is \ufffd", True),
                             Ended(JobStatus.CANCELLED)]


def _event(index: int, size: int) -> bytes:
    ids = ",".join(["5"] * size)
    return f'{{"k":"tok","index":{index},"token_ids":[{ids}],"text":"x"}}'.encode()


def test_the_log_entry_id_fences_an_older_attempt_once_the_new_one_resumed(
    r: redis.Redis, settings: Any
) -> None:
    keys = Keys(settings.namespace)
    node = _node(r, keys)
    job_id, lost, fresh = (f"default:{n}" for n in ("job", "lost", "fresh"))
    for one in (job_id, lost):
        r.hset(keys.job(one), mapping={"status": "running", "attempts": 1})

    def write(one: str, attempt: int, index: int, size: int, checked: bool = False) -> Any:
        return emit(keys, result_ttl_s=60, now=time.time(), events=[
            LogEvent(one, attempt, index, size, _event(index, size), checked=checked)]).run(node)

    assert write(job_id, 1, 0, 1, checked=True) == write(job_id, 1, 1, 2) == Emitted()
    assert write(job_id, 1, 1, 2) == Emitted()  # a retry finds its entry: nothing twice
    # Reclaimed: attempt 2 resumes from the 3 tokens logged. Attempt 1, unchecked
    # (no read of the record), is refused by the id alone.
    r.hset(keys.job(job_id), "attempts", 2)
    assert len(resume(keys, job_id=job_id, attempt=2, result_ttl_s=60).run(node).events) == 2
    assert write(job_id, 1, 3, 1) == Emitted(fenced=frozenset({job_id}))
    assert write(job_id, 2, 3, 4) == Emitted()
    assert [i for i, _ in r.xrange(keys.out(job_id))] == [
        b"0-1", b"0-3", log_entry_id(2, 7).encode()] == [b"0-1", b"0-3", b"0-10000000007"]
    # A log that is gone is not made again by an unchecked event: a gap.
    assert write(lost, 1, 3, 1) == Emitted(gaps=frozenset({lost})) and not r.exists(keys.out(lost))
    # A job resumed before anything was logged: an empty log in the new band,
    # so attempt 1 cannot make it, even with its first (checked) event.
    r.hset(keys.job(fresh), mapping={"status": "running", "attempts": 3})
    assert resume(keys, job_id=fresh, attempt=3, result_ttl_s=60).run(node).events == ()
    assert r.xlen(keys.out(fresh)) == 0 and 0 < r.ttl(keys.out(fresh)) <= 60
    assert write(fresh, 1, 0, 1, checked=True) == Emitted(fenced=frozenset({fresh}))
    # Even were the record read before the resume: the id is refused, nothing logged.
    r.hset(keys.job(fresh), "attempts", 1)
    assert write(fresh, 1, 0, 1, checked=True) == Emitted(gaps=frozenset({fresh}))
    assert r.xlen(keys.out(fresh)) == 0
