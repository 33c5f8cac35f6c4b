"""Structured output's cost on the built-in engine: tokens/s of a batch whose
every job follows a JSON schema against the same batch unconstrained, and the
time to first token of unconstrained jobs that arrive with a schema still
being compiled. The engine alone (no Redis): the mask is the engine's cost.

    python -m tokenfleet.workers.bench.structured [--model tiny] [--batch 64]
        [--tokens 64] [--rounds 3] [--clock wall|cpu]

Rounds take turns (plain, schema, plain, ...), so a machine's drift falls on both.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from tokenfleet.shared import models
from tokenfleet.shared.schemas import SamplingParams
from tokenfleet.shared.structured import StructuredOutput
from tokenfleet.workers.build import grammars
from tokenfleet.workers.detokenizer import TextStream
from tokenfleet.workers.hf_engine import HFEngine
from tokenfleet.workers.runner import HFRunner
from tokenfleet.workers.scheduler import Scheduler
from tokenfleet.workers.sequence import Sequence

# A schema whose text runs to the length limit (a long string), so both runs
# make the same number of tokens and tokens/s compares like with like.
LONG = StructuredOutput(kind="json_schema", name="note", json_schema={
    "type": "object", "properties": {"title": {"type": "string"},
                                     "done": {"type": "boolean"}},
    "required": ["title", "done"], "additionalProperties": False})


# What tokens/s divides by: "wall", or "cpu" (this process's CPU time) on a
# machine that others share, where wall time measures their load as much as ours.
CLOCK = "wall"


def big_schema(salt: int) -> StructuredOutput:
    """A schema new to the cache (``salt``) that takes a while to compile."""
    fields = {f"field_{salt}_{i}": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "[a-z]{1,8}"}, "b": {"type": "integer"},
        "c": {"enum": [f"v{j}" for j in range(20)]}}} for i in range(60)}
    return StructuredOutput(kind="json_schema", name="big", json_schema={
        "type": "object", "properties": fields, "required": list(fields)})


def engine_for(model: Any, tokenizer: Any, batch: int) -> HFEngine:
    runner = HFRunner(model, tokenizer)
    engine = HFEngine(Scheduler(batch, runner.eos_token_ids, runner.max_model_len), runner)
    engine.grammars = grammars(tokenizer, runner.vocab_size, runner.eos_token_ids)
    return engine


def jobs(tokenizer: Any, n: int, tokens: int, spec: StructuredOutput | None,
         tag: str) -> list[Sequence]:
    prompt = tokenizer("Write a note about the sea:")["input_ids"]
    return [Sequence(f"{tag}{i}", prompt, SamplingParams(max_new_tokens=tokens, temperature=1.0,
                                                         seed=i),
                     TextStream(tokenizer), structured=spec) for i in range(n)]


def run(engine: HFEngine, seqs: list[Sequence]) -> tuple[float, dict[str, float]]:
    """Seconds to run ``seqs`` to their ends (``CLOCK``), and each one's time to
    first token (wall clock)."""
    started, cpu = time.perf_counter(), time.process_time()
    for seq in seqs:
        engine.add(seq)
    first: dict[str, float] = {}
    while engine.has_work:
        for out in engine.step():
            first.setdefault(out.seq.job_id, time.perf_counter() - started)
    if CLOCK == "cpu":
        return time.process_time() - cpu, first
    return time.perf_counter() - started, first


def throughput(engine: HFEngine, tokenizer: Any, batch: int, tokens: int,
               rounds: int) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {"plain": [], "schema": []}
    run(engine, jobs(tokenizer, batch, tokens, LONG, "warm"))  # compiles LONG once
    for r in range(rounds):
        for name, spec in (("plain", None), ("schema", LONG)):
            seqs = jobs(tokenizer, batch, tokens, spec, f"{name}{r}-")
            seconds, _ = run(engine, seqs)
            rates[name].append(sum(len(s.generated) for s in seqs) / seconds)
    return rates


def ttft(engine: HFEngine, tokenizer: Any, batch: int, rounds: int) -> dict[str, list[float]]:
    """Median time to first token of ``batch - 1`` unconstrained jobs, alone and
    with one job whose schema is new (compiled while they run)."""
    out: dict[str, list[float]] = {"alone": [], "with a schema compiling": []}
    for r in range(rounds):
        _, first = run(engine, jobs(tokenizer, batch - 1, 4, None, f"alone{r}-"))
        out["alone"].append(statistics.median(first.values()))
        plain = jobs(tokenizer, batch - 1, 4, None, f"mixed{r}-")
        _, first = run(engine, [*jobs(tokenizer, 1, 4, big_schema(r), f"big{r}-"), *plain])
        out["with a schema compiling"].append(
            statistics.median(first[s.job_id] for s in plain))
    return out


def compile_seconds(engine: HFEngine, salt: int) -> float:
    assert engine.grammars is not None
    started = time.perf_counter()
    engine.grammars.compile(big_schema(salt)).result()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="divide tokens by wall time or by this process's CPU time")
    args = parser.parse_args(argv)
    global CLOCK
    CLOCK = args.clock
    model, tokenizer = models.load(args.model)
    engine = engine_for(model, tokenizer, args.batch)
    rates = throughput(engine, tokenizer, args.batch, args.tokens, args.rounds)
    plain, schema = statistics.median(rates["plain"]), statistics.median(rates["schema"])
    print(f"batch {args.batch}, {args.tokens} tokens a job, {args.rounds} rounds each, "
          f"model {args.model}, tokens/s by {args.clock} time")
    print(f"tokens/s unconstrained: {plain:9.1f}  (rounds: "
          f"{', '.join(f'{x:.1f}' for x in rates['plain'])})")
    print(f"tokens/s JSON schema:   {schema:9.1f}  (rounds: "
          f"{', '.join(f'{x:.1f}' for x in rates['schema'])})")
    print(f"ratio schema/unconstrained: {schema / plain:.3f}")
    print(f"compile of the big schema, alone: {compile_seconds(engine, 10_000) * 1000:.1f} ms")
    for name, values in ttft(engine, tokenizer, args.batch, args.rounds).items():
        print(f"TTFT of unconstrained jobs, {name}: median "
              f"{statistics.median(values) * 1000:.1f} ms "
              f"(rounds: {', '.join(f'{v * 1000:.1f}' for v in values)})")
    assert engine.grammars is not None
    engine.grammars.close()


if __name__ == "__main__":
    main()
