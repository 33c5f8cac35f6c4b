"""Automatic prefix caching in the paged KV cache: a prompt that starts as an
earlier one computes only the rest, the n choices of one prompt share it,
parked blocks give way to new ones, and greedy output is the same token for
token as without the cache."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from tokenfleet.shared.compat.hf_transformers import attn_implementation
from tokenfleet.shared.wire.schemas import SamplingParams
from tokenfleet.workers.detokenizer import TextStream
from tokenfleet.workers.hf_engine import HFEngine
from tokenfleet.workers.metrics import StatsCounters
from tokenfleet.workers.output_processor import step
from tokenfleet.workers.paged_cache import PagedKVCache
from tokenfleet.workers.paged_runner import PagedRunner
from tokenfleet.workers.prefix_cache import chain
from tokenfleet.workers.scheduler import Scheduler
from tokenfleet.workers.sequence import Sequence

from test_runner import reference

BLOCK = 4
SYSTEM = ("You are a careful assistant. Answer in one short sentence, plainly, and say "
          "when you do not know. The user asks about programming languages.")
QUESTIONS = ["What is a list?", "What is a tuple?", "Why use a set?", "What does map do?",
             "What is a closure?", "How do I sort?", "What is a dict?", "What is recursion?"]


@pytest.fixture(autouse=True)
def attention_as_loaded(loaded_tiny: tuple[Any, Any]) -> Iterator[None]:
    """A paged runner sets the shared tiny model's attention to its own: set it back."""
    model = loaded_tiny[0]
    name = attn_implementation(model)
    yield
    if name is not None and attn_implementation(model) != name:
        model.set_attn_implementation(name)


def engine_of(loaded: tuple[Any, Any], prefix_cache: bool = True,
              max_step_tokens: int = 64) -> tuple[HFEngine, PagedRunner]:
    model, tok = loaded
    runner = PagedRunner(model, tok, block_size=BLOCK, prefix_cache=prefix_cache)
    sched = Scheduler(max_batch=8, eos_token_ids=runner.eos_token_ids,
                      max_model_len=runner.max_model_len, max_step_tokens=max_step_tokens,
                      cached=runner.cached_prefix)
    return HFEngine(sched, runner), runner


def job(tok: Any, job_id: str, prompt: str, n: int = 12, **sampling: Any) -> Sequence:
    return Sequence(job_id, tok(prompt)["input_ids"],
                    SamplingParams(max_new_tokens=n, temperature=0.0, **sampling),
                    TextStream(tok))


def run(engine: HFEngine, seqs: list[Sequence]) -> None:
    for s in seqs:
        engine.add(s)
    while engine.has_work:
        step(engine)


def test_a_prompt_that_starts_as_an_earlier_one_computes_only_the_rest(
        loaded_tiny: tuple[Any, Any]) -> None:
    model, tok = loaded_tiny
    engine, runner = engine_of(loaded_tiny)
    first = job(tok, "a", f"{SYSTEM} {QUESTIONS[0]}")
    run(engine, [first])
    assert runner.prefix_hit_tokens == 0
    second = job(tok, "b", f"{SYSTEM} {QUESTIONS[1]}")
    run(engine, [second])
    common = next(i for i, (x, y) in enumerate(zip(first.prompt_ids, second.prompt_ids))
                  if x != y)
    assert runner.prefix_hit_tokens == common // BLOCK * BLOCK > 0
    assert engine.stats.prefix_hit_tokens == runner.prefix_hit_tokens
    assert engine.stats.prefix_query_tokens == len(first.prompt_ids) + len(second.prompt_ids)
    assert second.generated == reference(model, tok, f"{SYSTEM} {QUESTIONS[1]}", 12)


def test_the_n_choices_of_one_prompt_admitted_together_share_its_blocks(
        loaded_tiny: tuple[Any, Any]) -> None:
    model, tok = loaded_tiny
    engine, runner = engine_of(loaded_tiny, max_step_tokens=256)
    prompt = f"{SYSTEM} {QUESTIONS[2]}"
    choices = [job(tok, f"c{i}", prompt) for i in range(3)]
    run(engine, choices)
    length = len(choices[0].prompt_ids)
    # The first computes the prompt; the two others find its full blocks,
    # written in the same forward pass, and compute the last block's rest.
    assert runner.prefix_hit_tokens == 2 * ((length - 1) // BLOCK * BLOCK)
    expected = reference(model, tok, prompt, 12)
    assert [c.generated for c in choices] == [expected] * 3


def test_greedy_output_with_the_prefix_cache_is_the_output_without_it(
        loaded_tiny: tuple[Any, Any]) -> None:
    # The shared-prefix load in small: turns of one system prompt, arriving a few
    # at a time (later ones find the blocks cached, some share them in flight).
    _, tok = loaded_tiny
    outputs = {}
    for cached in (True, False):
        engine, runner = engine_of(loaded_tiny, prefix_cache=cached, max_step_tokens=48)
        seqs = [job(tok, f"j{i}", f"{SYSTEM} {QUESTIONS[i % len(QUESTIONS)]}", n=6 + i % 5)
                for i in range(24)]
        for i, s in enumerate(seqs):
            engine.add(s)
            if i % 4 == 3:
                step(engine)
        while engine.has_work:
            step(engine)
        outputs[cached] = [s.generated for s in seqs]
        hits = runner.prefix_hit_tokens
        if cached:
            assert hits > 0.7 * sum(len(s.prompt_ids) for s in seqs)
        else:
            assert hits == 0
    assert outputs[True] == outputs[False]


def test_a_job_handed_back_and_taken_again_finds_its_own_tokens_cached(
        loaded_tiny: tuple[Any, Any]) -> None:
    model, tok = loaded_tiny
    engine, runner = engine_of(loaded_tiny)
    prompt = f"{SYSTEM} {QUESTIONS[3]}"
    first = job(tok, "again", prompt, n=20)
    engine.add(first)
    for _ in range(12):
        step(engine)
    made = list(first.generated)
    engine.drop("again")  # preempted: its blocks are parked, not lost
    step(engine)
    resumed = Sequence("again", first.prompt_ids, first.sampling, TextStream(tok),
                       generated=list(made))
    run(engine, [resumed])
    assert runner.prefix_hit_tokens == (len(first.prompt_ids) + len(made) - 1) // BLOCK * BLOCK
    assert resumed.generated == reference(model, tok, prompt, 20)


def test_a_job_that_wants_its_prompts_logprobs_computes_the_whole_prompt(
        loaded_tiny: tuple[Any, Any]) -> None:
    _, tok = loaded_tiny
    engine, runner = engine_of(loaded_tiny)
    run(engine, [job(tok, "a", f"{SYSTEM} {QUESTIONS[4]}")])
    echoed = job(tok, "b", f"{SYSTEM} {QUESTIONS[4]}", prompt_logprobs=0)
    run(engine, [echoed])
    assert runner.prefix_hit_tokens == 0
    assert echoed.prompt_logprobs is not None
    assert len(echoed.prompt_logprobs) == len(echoed.prompt_ids)


def test_parked_blocks_are_reused_once_free_ones_run_out_and_their_names_forgotten() -> None:
    cache = PagedKVCache(num_layers=1, block_size=BLOCK, initial_blocks=4)
    like = torch.zeros(1, 2)
    ids = list(range(100, 108))
    table = cache.reserve("a", 8, like)
    for (name, _), block in zip(chain(ids, BLOCK, 2), table):
        cache.prefixes.name(name, block)
    cache.reserve("b", 8, like)  # the two other blocks
    cache.release("a")
    assert set(cache.prefixes.parked) == set(table) and not cache.free
    # A third sequence shares a's first block: it is no longer parked.
    first_name = chain(ids, BLOCK, 1)[0][0]
    cache.share("c", [cache.prefixes.find(first_name)])  # type: ignore[list-item]
    assert list(cache.prefixes.parked) == [table[1]]
    # Needing a block with none free takes the parked one and forgets its name.
    taken = cache.reserve("d", 4, like)
    assert taken == [table[1]] and cache.prefixes.find(chain(ids, BLOCK, 2)[1][0]) is None
    assert cache.num_blocks == 4  # nothing grew
    cache.release("c")
    assert cache.holders == {b: 1 for t in (cache.tables["b"], taken) for b in t}


def test_the_prefix_cache_counters_are_exported(loaded_tiny: tuple[Any, Any]) -> None:
    _, tok = loaded_tiny
    engine, _ = engine_of(loaded_tiny)
    run(engine, [job(tok, "a", f"{SYSTEM} {QUESTIONS[5]}"),
                 job(tok, "b", f"{SYSTEM} {QUESTIONS[6]}")])
    step(engine)
    registry = CollectorRegistry()
    registry.register(StatsCounters("default", engine.stats))
    text = generate_latest(registry).decode()
    hits = engine.stats.prefix_hit_tokens
    assert hits > 0
    assert f'tokenfleet_prefix_cache_hit_tokens_total{{queue="default"}} {float(hits)}' in text
    assert (f'tokenfleet_prefix_cache_queries_total{{queue="default"}} '
            f'{float(engine.stats.prefix_query_tokens)}') in text
