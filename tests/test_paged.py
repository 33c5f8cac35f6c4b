"""The paged KV cache and chunked prefill: the same tokens as `generate()`,
decodes that keep going while a long prompt is prefilled, and recovery from a
failed forward pass in the middle of a prompt."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tokenfleet.shared.compat.hf_transformers import attn_implementation
from tokenfleet.shared.wire.schemas import JobStatus, SamplingParams
from tokenfleet.workers.detokenizer import TextStream
from tokenfleet.workers.hf_engine import HFEngine
from tokenfleet.workers.paged_runner import PagedRunner
from tokenfleet.workers.scheduler import StepBatch, Scheduler
from tokenfleet.workers.sequence import Sequence
from tokenfleet.workers.output_processor import step

from scripted import ScriptedRunner
from test_runner import PROMPTS, reference
from test_scheduler import EOS, run_all, seq


@pytest.fixture(autouse=True)
def attention_as_loaded(loaded_tiny: tuple[Any, Any]) -> Iterator[None]:
    """A paged runner sets its model's attention to its own, and the tiny model is
    every test's: set it back, so a later test's runner finds the model as loaded."""
    model = loaded_tiny[0]
    name = attn_implementation(model)
    yield
    if name is not None and attn_implementation(model) != name:
        model.set_attn_implementation(name)


def paged_engine(loaded: tuple[Any, Any], runner: PagedRunner | None = None,
                 max_step_tokens: int = 7) -> tuple[HFEngine, PagedRunner]:
    model, tok = loaded
    runner = runner or PagedRunner(model, tok, block_size=4)
    sched = Scheduler(max_batch=4, eos_token_ids=runner.eos_token_ids,
                      max_model_len=runner.max_model_len, max_step_tokens=max_step_tokens)
    return HFEngine(sched, runner), runner


def add_prompts(engine: HFEngine, tok: Any) -> list[Sequence]:
    seqs = []
    for i, prompt in enumerate(PROMPTS * 2):
        s = Sequence(f"j{i}", tok(prompt)["input_ids"],
                     SamplingParams(max_new_tokens=5 + 7 * (i % 5), temperature=0.0),
                     TextStream(tok))
        seqs.append(s)
        engine.add(s)
        if i % 3 == 2:
            step(engine)  # later jobs join a batch already decoding
    return seqs


def assert_generate_tokens(loaded: tuple[Any, Any], seqs: list[Sequence]) -> None:
    model, tok = loaded
    for i, s in enumerate(seqs):
        expected = reference(model, tok, PROMPTS[i % len(PROMPTS)], s.sampling.max_new_tokens)
        assert s.generated == expected, f"job {i}"


def test_chunked_prefill_over_paged_blocks_gives_what_generate_gives(
        loaded_tiny: tuple[Any, Any]) -> None:
    # 7 tokens a step and blocks of 4: prompts span steps and blocks.
    engine, _ = paged_engine(loaded_tiny)
    seqs = add_prompts(engine, loaded_tiny[1])
    while engine.has_work:
        step(engine)
    assert engine.stats.peak_batch == 4
    assert_generate_tokens(loaded_tiny, seqs)


def test_the_freed_blocks_serve_the_next_jobs(loaded_tiny: tuple[Any, Any]) -> None:
    engine, runner = paged_engine(loaded_tiny, max_step_tokens=64)
    for wave in range(3):
        add_prompts(engine, loaded_tiny[1])
        while engine.has_work:
            step(engine)
        if wave == 0:
            blocks = runner.cache.num_blocks
    assert runner.cache.num_blocks == blocks
    # The blocks of jobs that ended go back at the next step.
    engine.add(seq("next", n=2))
    step(engine)
    assert list(runner.cache.tables) == ["next"]


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_keep_decoding() -> None:
    sched = Scheduler(max_batch=8, eos_token_ids=[EOS], max_model_len=512, max_step_tokens=8)
    runner = ScriptedRunner()
    engine = HFEngine(sched, runner)
    engine.add(seq("a", n=10))
    step(engine)  # a's prompt
    engine.add(seq("long", n=2, prompt_len=20))
    made: list[list[str]] = []
    for _ in range(4):
        made.append([o.seq.job_id for o in step(engine) if o.token_id is not None])
    # Each step: a's decode and 7 of long's 20 prompt tokens; long's first
    # token comes with its last chunk, a's with every step.
    assert made == [["a"], ["a"], ["a", "long"], ["a", "long"]]
    assert [ids for _, ids in runner.batches[1:4]] == [["a", "long"]] * 3


class FailOnce(PagedRunner):
    """Fails the first forward pass that holds a prefill chunk after ``after`` steps."""

    def __init__(self, loaded: tuple[Any, Any], after: int) -> None:
        super().__init__(*loaded, block_size=4)
        self.after, self.steps, self.failed = after, 0, 0

    def run(self, batch: StepBatch) -> list[int]:
        self.steps += 1
        if not self.failed and self.steps > self.after and any(n > 1 for n in batch.num_new):
            self.failed += 1
            super().run(batch)  # the cache is half-written when it fails
            raise RuntimeError("forward failed")
        return super().run(batch)


def test_a_failed_step_mid_prompt_is_recovered_with_the_same_tokens(
        loaded_tiny: tuple[Any, Any]) -> None:
    runner = FailOnce(loaded_tiny, after=3)
    engine, _ = paged_engine(loaded_tiny, runner)
    seqs = add_prompts(engine, loaded_tiny[1])
    while engine.has_work:
        step(engine)
    assert runner.failed == 1 and engine.stats.failed_steps == 1
    assert all(s.final_status is JobStatus.SUCCEEDED for s in seqs)
    assert_generate_tokens(loaded_tiny, seqs)


def test_scripted_engine_runs_every_job_to_its_length_with_chunking() -> None:
    sched = Scheduler(max_batch=3, eos_token_ids=[EOS], max_model_len=512, max_step_tokens=5)
    engine = HFEngine(sched, ScriptedRunner())
    for i in range(7):
        engine.add(seq(f"j{i}", n=3 + i, prompt_len=2 + 3 * i))
    out = run_all(engine)
    assert {j: len(o) for j, o in out.items()} == {f"j{i}": 3 + i for i in range(7)}


def test_a_model_with_windowed_or_capped_attention_gets_the_rectangular_cache(
        loaded_tiny: tuple[Any, Any]) -> None:
    from tokenfleet.shared.settings import Settings
    from tokenfleet.workers.build import model_runner
    from tokenfleet.workers.paged_runner import PagedRunner
    from tokenfleet.workers.runner import HFRunner

    model, tok = loaded_tiny
    # Not packed for oneDNN: the model is the session's, which other tests
    # compare with generate() on its own nn.Linear layers.
    paged = Settings(kv_cache="paged", cpu_packed_linear=False)
    assert isinstance(model_runner(paged, model, tok), PagedRunner)
    model.config.sliding_window = 16
    try:
        assert isinstance(model_runner(paged, model, tok), HFRunner)
    finally:
        model.config.sliding_window = None


def test_a_job_dropped_and_taken_again_under_its_id_gets_fresh_blocks(
        loaded_tiny: tuple[Any, Any]) -> None:
    # The job is handed back (drop) and taken again by this worker between two
    # steps: the blocks its first run left under its id must not be reused, or
    # its block table is longer than its length says and the step fails.
    engine, _ = paged_engine(loaded_tiny, max_step_tokens=64)
    model, tok = loaded_tiny

    def job(job_id: str, prompt: str, n: int) -> Sequence:
        return Sequence(job_id, tok(prompt)["input_ids"],
                        SamplingParams(max_new_tokens=n, temperature=0.0), TextStream(tok))

    engine.add(job("again", PROMPTS[2], 30))
    for _ in range(25):
        step(engine)
    other = job("other", PROMPTS[3], 30)
    engine.add(other)
    step(engine)
    engine.drop("again")
    again = job("again", PROMPTS[4], 20)
    engine.add(again)
    while engine.has_work:
        step(engine)
    assert engine.stats.failed_steps == 0
    assert again.generated == reference(model, tok, PROMPTS[4], 20)
    assert other.generated == reference(model, tok, PROMPTS[3], 30)
