"""The output side coalesces a job's tokens: one log entry and one publish for the
tokens made within a window, the first token and the end at once, each token
logged and published once. A fake clock drives the window; steps are calls."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import FinishReason, SamplingParams
from tokenfleet.shared.wire.serialization import loads
from tokenfleet.shared.wire.worker_scripts import resume
from tokenfleet.workers.detokenizer import TextStream
from tokenfleet.workers.null_runner import null_tokenizer
from tokenfleet.workers.publisher import Publisher, Stored
from tokenfleet.workers.sequence import SeqOutput, Sequence

pytestmark = pytest.mark.timeout(60)

TOKENIZER = null_tokenizer()  # the tiny model's, without its weights
TOKEN = TOKENIZER.encode("x", add_special_tokens=False)[0]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def make(settings: Any, r: redis.Redis, clock: Clock) -> Iterator[Any]:
    """make(n_jobs, **settings) -> (publisher, sequences), their records running."""
    keys = Keys(settings.namespace)

    def make(n: int = 1, **overrides: Any) -> tuple[Publisher, list[Sequence]]:
        publisher = Publisher(redis.Redis.from_url(settings.redis_url), keys,
                              settings.model_copy(update=overrides), "w@test", clock=clock)
        seqs = [Sequence(f"{settings.namespace}-{i}", [1, 2], SamplingParams(),
                         TextStream(TOKENIZER), entry_id="") for i in range(n)]
        for seq in seqs:
            r.hset(keys.job(seq.job_id), mapping={"status": "running", "attempts": 1})
        return publisher, seqs

    yield make


def store(publisher: Publisher, outputs: list[SeqOutput]) -> Stored:
    """One step as the engine loop writes it: sent, then collected."""
    publisher.send(outputs)
    return publisher.collect()


def step(publisher: Publisher, seqs: list[Sequence], finish: bool = False) -> None:
    """One engine step: a token for each sequence (the last one, with ``finish``)."""
    outputs = []
    for seq in seqs:
        index = len(seq.generated)
        seq.generated.append(TOKEN)
        text = seq.text.push(TOKEN)
        if finish:
            text += seq.finish(FinishReason.LENGTH)
        outputs.append(SeqOutput(seq, index, TOKEN, text, finish))
    stored = store(publisher, outputs)
    assert not stored.fenced and not stored.untrusted


def steps(publisher: Publisher, seqs: list[Sequence], clock: Clock, n: int) -> None:
    """``n`` steps 1 ms apart."""
    for _ in range(n):
        step(publisher, seqs)
        clock.now += 0.001


def log(r: redis.Redis, settings: Any, seq: Sequence) -> list[tuple[str, Any]]:
    """The job's log: (entry id, event) in order."""
    return [(i.decode(), loads(f[b"e"])) for i, f in r.xrange(Keys(settings.namespace).out(seq.job_id))]


def test_a_jobs_first_token_goes_at_once_and_the_next_wait_for_the_window(
    make: Any, clock: Clock, r: redis.Redis, settings: Any
) -> None:
    publisher, [seq] = make(coalesce_ms=20, coalesce_tokens=32)
    steps(publisher, [seq], clock, 1)
    assert [i for i, _ in log(r, settings, seq)] == ["0-1"]  # the first token: at once
    steps(publisher, [seq], clock, 18)  # tokens 1-18, 1 ms apart: held
    assert len(log(r, settings, seq)) == 1
    # Token 19, 19 ms after token 0 went out: at the next step its consumer
    # would have waited 20 ms. Tokens 1-19 go now, as one event.
    step(publisher, [seq])
    entries = log(r, settings, seq)
    assert [i for i, _ in entries] == ["0-1", "0-20"]  # an event's id is where it ends
    assert entries[1][1]["index"] == 1 and entries[1][1]["token_ids"] == [TOKEN] * 19
    assert entries[1][1]["text"] == "x" * 19 and entries[1][1]["offsets"] == list(range(1, 20))


def test_an_event_holds_at_most_coalesce_tokens(
    make: Any, clock: Clock, r: redis.Redis, settings: Any
) -> None:
    publisher, [seq] = make(coalesce_ms=1000, coalesce_tokens=4)
    steps(publisher, [seq], clock, 9)
    assert [i for i, _ in log(r, settings, seq)] == ["0-1", "0-5", "0-9"]


def test_events_of_a_job_are_at_most_the_window_apart_unless_a_step_outlasts_the_last(
    make: Any, clock: Clock, r: redis.Redis, settings: Any
) -> None:
    publisher, seqs = make(3, coalesce_ms=20, coalesce_tokens=64)
    times: list[float] = []  # when each step ran
    sent_at: list[int] = []  # the step each event of the first job went out at
    for step_ms in [1, 3, 7, 8, 8, 8, 12, 5, 5, 2, 9, 9, 9, 25, 1, 1, 30, 4, 4, 4, 4, 4] * 3:
        times.append(clock.now)
        step(publisher, seqs)
        events = len(log(r, settings, seqs[0]))
        sent_at += [len(times) - 1] * (events - len(sent_at))
        clock.now += step_ms / 1000
    assert len(sent_at) < len(times) / 2  # coalesced: fewer events than tokens
    # An event goes at the last step before the window would pass, judged by
    # the step before: only a step longer than that one overshoots, by no more
    # than it outlasted it.
    for a, b in zip(sent_at, sent_at[1:]):
        gap = times[b] - times[a]
        longer = (times[b] - times[b - 1]) - (times[b - 1] - times[b - 2])
        assert gap <= 0.020 + 1e-9 or (longer > 0 and gap <= 0.020 + longer + 1e-9), (a, b)


def test_an_ending_job_sends_what_it_holds_then_its_end(
    make: Any, clock: Clock, r: redis.Redis, settings: Any
) -> None:
    publisher, [seq] = make(coalesce_ms=20, coalesce_tokens=16)
    steps(publisher, [seq], clock, 3)
    step(publisher, [seq], finish=True)
    entries = log(r, settings, seq)
    assert [i for i, _ in entries] == ["0-1", "0-4", "1-0"]
    assert [t for _, e in entries[:-1] for t in e["token_ids"]] == seq.generated
    record = r.hgetall(Keys(settings.namespace).job(seq.job_id))
    assert record[b"status"] == b"succeeded" and loads(record[b"token_ids"]) == seq.generated


def test_a_step_sent_again_logs_and_publishes_each_token_once(
    make: Any, clock: Clock, r: redis.Redis, settings: Any
) -> None:
    publisher, seqs = make(4, coalesce_ms=20, coalesce_tokens=3)
    pubsub = r.pubsub()
    pubsub.psubscribe(Keys(settings.namespace).events("*"))
    assert pubsub.get_message(timeout=5)["type"] == "psubscribe"
    for n in range(7):
        outputs = []
        for seq in seqs:
            outputs.append(SeqOutput(seq, len(seq.generated), TOKEN, "x", False))
            seq.generated.append(TOKEN)
        publisher.send(outputs)
        if n % 2:
            # The reply is lost (a dropped connection): the whole step goes again.
            publisher._drop_connection()
        assert not publisher.collect().untrusted
        clock.now += 0.001
    published = []
    while (message := pubsub.get_message(timeout=0.5)) is not None:  # until a quiet 0.5 s
        published.append(message)
    pubsub.close()
    tokens = [(m["channel"], k) for m in published for e in [loads(m["data"])]
              for k in range(e["index"], e["index"] + len(e["token_ids"]))]
    assert len(tokens) == len(set(tokens)) == 4 * 7  # token 6 of each: its event is full
    for seq in seqs:
        entries = log(r, settings, seq)
        assert [i for i, _ in entries] == ["0-1", "0-4", "0-7"]


def test_coalescing_off_sends_every_token_as_an_event_of_its_own(
    make: Any, clock: Clock, r: redis.Redis, settings: Any
) -> None:
    publisher, [seq] = make(coalesce_ms=0)
    steps(publisher, [seq], clock, 5)
    entries = log(r, settings, seq)
    assert [i for i, _ in entries] == ["0-1", "0-2", "0-3", "0-4", "0-5"]
    assert all("offsets" not in e for _, e in entries)


def test_a_fenced_job_holds_nothing_more(
    make: Any, clock: Clock, r: redis.Redis, settings: Any
) -> None:
    publisher, [seq] = make(coalesce_ms=20, coalesce_tokens=16)
    step(publisher, [seq])
    # Reclaimed elsewhere: attempt 2 taken (start.lua) and resumed (resume.lua).
    keys = Keys(settings.namespace)
    r.hset(keys.job(seq.job_id), "attempts", 2)
    assert resume(keys, job_id=seq.job_id, attempt=2, result_ttl_s=60).run(r).owned
    clock.now += 0.001
    outputs = [SeqOutput(seq, 1, TOKEN, "x", False)]
    assert not store(publisher, outputs).fenced  # held: Redis is not asked yet
    clock.now += 0.030
    outputs = [SeqOutput(seq, 2, TOKEN, "x", False)]
    assert store(publisher, outputs).fenced == {seq.job_id}
    assert not publisher.held and len(log(r, settings, seq)) == 1


def test_a_log_that_lost_tokens_is_caught_at_the_jobs_next_event_after_a_lost_connection(
    make: Any, clock: Clock, r: redis.Redis, settings: Any
) -> None:
    publisher, [seq, other] = make(2, coalesce_ms=0)
    steps(publisher, [seq, other], clock, 3)
    # What a failover does: the newest token of one log lost, every connection cut.
    pipe = r.pipeline(transaction=True)
    pipe.xdel(Keys(settings.namespace).out(seq.job_id), "0-3")
    pipe.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    pipe.execute()
    index = len(seq.generated)
    stored = store(publisher, [SeqOutput(s, index, TOKEN, "x", False) for s in (seq, other)])
    # Its event is not logged after the hole; the other job's log was whole: it goes on.
    assert stored.untrusted == {seq.job_id} and not stored.fenced
    assert [i for i, _ in log(r, settings, seq)] == ["0-1", "0-2"]
    assert [i for i, _ in log(r, settings, other)] == ["0-1", "0-2", "0-3", "0-4"]
def test_a_handed_back_job_is_refused_quietly_held_tokens_and_all(
    make: Any, clock: Clock, r: redis.Redis, settings: Any
) -> None:
    """Preemption hands a job back while it has tokens held here: those reach
    Redis a step later as an unchecked event (its attempt's band is still the
    log's newest: logged, and the next attempt resumes after them) and nothing
    is reported as a fenced job (the worker has nothing to drop, and may run
    the job again meanwhile)."""
    publisher, [seq, other] = make(2, coalesce_ms=20, coalesce_tokens=16)
    step(publisher, [seq, other])
    clock.now += 0.001
    step(publisher, [seq, other])  # held: the window is not over
    seq.handed_back = True
    r.hset(Keys(settings.namespace).job(seq.job_id), "status", "queued")  # requeue.lua
    clock.now += 0.030
    stored = store(publisher, [SeqOutput(other, 2, TOKEN, "x", False)])
    assert not stored.fenced and not stored.untrusted
    assert seq.job_id not in publisher.held and len(log(r, settings, seq)) == 2
    assert len(log(r, settings, other)) == 2


def test_a_job_handed_back_while_its_step_is_on_the_wire_is_no_fence_either(
    make: Any, r: redis.Redis, settings: Any
) -> None:
    """The engine thread hands a job back between the step's send and its
    collect, and Redis runs the hand-back first: the refusal is expected."""
    publisher, [seq] = make()
    r.hset(Keys(settings.namespace).job(seq.job_id), "status", "queued")  # requeue.lua, first
    publisher.send([SeqOutput(seq, 0, TOKEN, "x", False)])
    seq.handed_back = True  # flagged before the hand-back was sent
    stored = publisher.collect()
    assert not stored.fenced and not stored.untrusted and not log(r, settings, seq)
