"""Continuous batching, on the CPU with a scripted runner."""

from __future__ import annotations

from tokenfleet.shared.wire.schemas import FinishReason, JobStatus, SamplingParams
from tokenfleet.shared.tiny import byte_level_tokenizer
from tokenfleet.workers.detokenizer import TextStream
from tokenfleet.workers.hf_engine import HFEngine
from tokenfleet.workers.scheduler import Scheduler
from tokenfleet.workers.sequence import Sequence
from tokenfleet.workers.output_processor import step

from scripted import ScriptedRunner

TOK = byte_level_tokenizer()
EOS = TOK.eos_token_id


def seq(job_id: str, n: int = 4, prompt_len: int = 3, **sampling) -> Sequence:  # type: ignore[no-untyped-def]
    return Sequence(job_id, list(range(10, 10 + prompt_len)),
                    SamplingParams(max_new_tokens=n, temperature=0.0, **sampling),
                    TextStream(TOK, sampling.get("stop")))


def run_all(engine: HFEngine) -> dict[str, list]:  # type: ignore[type-arg]
    outputs: dict[str, list] = {}  # type: ignore[type-arg]
    while engine.has_work:
        for o in step(engine):
            outputs.setdefault(o.seq.job_id, []).append(o)
    return outputs


def test_new_jobs_join_the_running_batch_between_decode_steps() -> None:
    sched = Scheduler(max_batch=8, eos_token_ids=[EOS], max_model_len=512)
    runner = ScriptedRunner()
    engine = HFEngine(sched, runner)
    engine.add(seq("a", n=6))
    step(engine)  # prefill a
    step(engine)  # decode a
    engine.add(seq("b", n=3))
    step(engine)  # prefill b while a waits one step
    step(engine)  # decode a and b together
    assert runner.batches[:4] == [(True, ["a"]), (False, ["a"]), (True, ["b"]), (False, ["a", "b"])]


def test_finished_jobs_leave_at_once_and_free_their_slot() -> None:
    sched = Scheduler(max_batch=2, eos_token_ids=[EOS], max_model_len=512)
    runner = ScriptedRunner()
    engine = HFEngine(sched, runner)
    for job_id, n in (("short", 2), ("long", 5), ("next", 2)):
        engine.add(seq(job_id, n=n))
    out = run_all(engine)
    assert [len(out[j]) for j in ("short", "long", "next")] == [2, 5, 2]
    # "next" starts right after "short" ends, not after "long".
    prefills = [ids for is_prefill, ids in runner.batches if is_prefill]
    assert prefills == [["short", "long"], ["next"]]
    assert max(len(ids) for _, ids in runner.batches) <= 2


def test_each_job_keeps_its_own_stop_conditions() -> None:
    ids = TOK("ab!cd", add_special_tokens=False)["input_ids"]
    tokens = {"eos": [65, EOS], "stop": ids, "len": ids + ids}
    sched = Scheduler(max_batch=8, eos_token_ids=[EOS], max_model_len=512)
    engine = HFEngine(sched, ScriptedRunner(lambda s: tokens[s.job_id][len(s.generated)]))
    seqs = {"eos": seq("eos", n=10), "stop": seq("stop", n=10, stop=["!"]), "len": seq("len", n=3)}
    for s in seqs.values():
        engine.add(s)
    out = run_all(engine)
    assert seqs["eos"].finish_reason is FinishReason.EOS and seqs["eos"].generated == [65, EOS]
    assert seqs["stop"].finish_reason is FinishReason.STOP and seqs["stop"].text.text == "ab"
    assert len(seqs["stop"].generated) == 3
    assert seqs["len"].finish_reason is FinishReason.LENGTH and len(seqs["len"].generated) == 3
    assert all(o[-1].finished for o in out.values())
    assert "".join(o.text for o in out["stop"]) == "ab"


def test_the_model_length_caps_a_job() -> None:
    sched = Scheduler(max_batch=4, eos_token_ids=[EOS], max_model_len=6)
    s = seq("a", n=100, prompt_len=3)
    engine = HFEngine(sched, ScriptedRunner())
    engine.add(s)
    run_all(engine)
    assert s.finish_reason is FinishReason.LENGTH and s.num_tokens == 6


def test_abort_ends_a_running_job_within_one_step_and_keeps_its_text() -> None:
    sched = Scheduler(max_batch=4, eos_token_ids=[EOS], max_model_len=512)
    runner = ScriptedRunner()
    engine = HFEngine(sched, runner)
    a, b = seq("a", n=50), seq("b", n=5)
    engine.add(a)
    engine.add(b)
    step(engine)
    step(engine)
    engine.abort("a", FinishReason.CANCELLED)
    outputs = step(engine)
    ended = [o for o in outputs if o.seq is a]
    assert len(ended) == 1 and ended[0].finished and ended[0].token_id is None
    assert a.final_status is JobStatus.CANCELLED and len(a.generated) == 2
    assert runner.batches[-1] == (False, ["b"])


def test_a_deadline_expires_waiting_and_running_jobs() -> None:
    now = [100.0]
    sched = Scheduler(max_batch=1, eos_token_ids=[EOS], max_model_len=512)
    engine = HFEngine(sched, ScriptedRunner(), clock=lambda: now[0])
    running, queued = seq("r", n=50), seq("q", n=5)
    running.deadline_at = queued.deadline_at = 101.0
    engine.add(running)
    engine.add(queued)
    step(engine)
    now[0] = 102.0
    step(engine)
    assert running.final_status is JobStatus.EXPIRED and running.finish_reason is FinishReason.DEADLINE
    assert queued.final_status is JobStatus.EXPIRED and queued.generated == []
    assert not engine.has_work


def test_only_jobs_past_their_deadline_expire_and_a_job_that_ended_first_keeps_its_end() -> None:
    now = [100.0]
    sched = Scheduler(max_batch=4, eos_token_ids=[EOS], max_model_len=512)
    engine = HFEngine(sched, ScriptedRunner(), clock=lambda: now[0])
    short, timed, free = seq("short", n=2), seq("timed", n=50), seq("free", n=50)
    short.deadline_at, timed.deadline_at = 101.0, 103.0
    outputs: list = []  # type: ignore[type-arg]
    for s in (short, timed, free):
        engine.add(s)
    for _ in range(3):
        outputs += step(engine)
    now[0] = 102.0  # past the deadline of a job that has ended: nothing more for it
    outputs += step(engine)
    now[0] = 104.0
    outputs += step(engine)
    ends = {o.seq.job_id: o.seq.finish_reason for o in outputs if o.finished}
    assert ends == {"short": FinishReason.LENGTH, "timed": FinishReason.DEADLINE}
    assert len(short.generated) == 2 and engine.has_work and not free.has_ended
    assert len(free.generated) == 5  # one token a step, none lost to the others' ends


def test_a_job_ends_by_length_at_max_new_tokens_or_where_the_model_length_leaves_no_room() -> None:
    sched = Scheduler(max_batch=4, eos_token_ids=[EOS], max_model_len=10)
    engine = HFEngine(sched, ScriptedRunner())
    long = seq("long", n=20, prompt_len=3)  # the model's 10 tokens leave room for 7
    resumed = seq("resumed", n=4, prompt_len=3)
    resumed.restore([65, 66])  # an earlier attempt logged 2 of its 4 tokens
    for s in (long, resumed):
        engine.add(s)
    run_all(engine)
    assert len(long.generated) == 7 and long.finish_reason is FinishReason.LENGTH
    assert resumed.generated[:2] == [65, 66] and len(resumed.generated) == 4
    assert resumed.finish_reason is FinishReason.LENGTH


def test_a_poison_sequence_fails_alone_and_the_rest_of_its_batch_succeeds() -> None:
    sched = Scheduler(max_batch=8, eos_token_ids=[EOS], max_model_len=512, max_failures=3)
    runner = ScriptedRunner(fail_if=lambda b: any(s.job_id == "poison" for s in b.seqs))
    engine = HFEngine(sched, runner)
    seqs = [seq(f"ok{i}", n=4) for i in range(5)] + [seq("poison", n=4)]
    for s in seqs:
        engine.add(s)
    run_all(engine)
    poison = seqs[-1]
    assert poison.final_status is JobStatus.FAILED and "scripted failure" in (poison.error or "")
    assert poison.failures == 3
    assert all(s.final_status is JobStatus.SUCCEEDED and len(s.generated) == 4 for s in seqs[:-1])


def test_the_batch_token_budget_holds_jobs_back_until_others_end() -> None:
    sched = Scheduler(max_batch=8, eos_token_ids=[EOS], max_model_len=512, max_batch_tokens=20)
    runner = ScriptedRunner()
    engine = HFEngine(sched, runner)
    for job_id in ("a", "b", "c"):
        engine.add(seq(job_id, n=7, prompt_len=3))  # each may reach 10 tokens
    run_all(engine)
    prefills = [ids for is_prefill, ids in runner.batches if is_prefill]
    assert prefills == [["a", "b"], ["c"]]  # c waited: 30 tokens do not fit in 20
