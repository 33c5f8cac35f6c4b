"""Structured output's cost on the built-in engine: tokens/s of a full batch
whose every job follows a JSON schema against the same batch unconstrained
(the decode steps that ran at least 90% of it), and the
time to first token of unconstrained jobs that arrive with a schema still
being compiled. The engine alone (no Redis): the mask is the engine's cost.

    python -m tokenfleet.bench.structured [--model tiny] [--batch 64]
        [--tokens 24] [--rounds 3]

Rounds take turns (plain, schema, plain, ...), so a machine's drift falls on both.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from tokenfleet.shared import models
from tokenfleet.shared.wire.schemas import SamplingParams
from tokenfleet.shared.wire.structured import StructuredOutput
from tokenfleet.workers.build import grammars
from tokenfleet.workers.detokenizer import TextStream
from tokenfleet.workers.hf_engine import HFEngine
from tokenfleet.workers.runner import HFRunner
from tokenfleet.workers.scheduler import Scheduler
from tokenfleet.workers.sequence import Sequence
from tokenfleet.workers.output_processor import step

# A schema whose text is mostly one long string: a job writes it until the
# model closes the quote or the length limit comes.
LONG = StructuredOutput(kind="json_schema", name="note", json_schema={
    "type": "object", "properties": {"title": {"type": "string"},
                                     "done": {"type": "boolean"}},
    "required": ["title", "done"], "additionalProperties": False})


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
    # No early end of sequence (an unconstrained job would leave the batch);
    # a constrained one still ends once its grammar leaves nothing else.
    never = {int(tokenizer.eos_token_id): -100.0}
    return [Sequence(f"{tag}{i}", prompt, SamplingParams(max_new_tokens=tokens, temperature=1.0,
                                                         seed=i, logit_bias=never),
                     TextStream(tokenizer), structured=spec) for i in range(n)]


def run(engine: HFEngine, seqs: list[Sequence]) -> tuple[float, float, dict[str, float]]:
    """Run ``seqs`` to their ends. Returns tokens/s of the decode steps that ran
    at least nine in ten of the jobs, by the wall clock and by this process's
    CPU time (on a shared machine the wall clock measures the others' load as
    much as ours), and each job's time to first token (wall clock). Jobs that
    follow a schema end when their JSON closes, so their batch thins out
    earlier: only steps of a like size compare."""
    started = time.perf_counter()
    for seq in seqs:
        engine.add(seq)
    first: dict[str, float] = {}
    made = wall = cpu = 0.0
    while engine.has_work:
        step_wall, step_cpu = time.perf_counter(), time.process_time()
        outputs = step(engine)
        if engine.last_batch.size >= 0.9 * len(seqs) and not engine.last_batch.admitted:
            made += engine.last_batch.size
            wall += time.perf_counter() - step_wall
            cpu += time.process_time() - step_cpu
        for out in outputs:
            first.setdefault(out.seq.job_id, time.perf_counter() - started)
    return made / wall if wall else 0.0, made / cpu if cpu else 0.0, first


def throughput(engine: HFEngine, tokenizer: Any, batch: int, tokens: int,
               rounds: int) -> dict[str, list[float]]:
    """Tokens/s of each round's (nearly) full decode steps, by wall clock and
    by CPU time, plain and schema."""
    rates: dict[str, list[float]] = {}
    run(engine, jobs(tokenizer, batch, tokens, LONG, "warm"))  # compiles LONG once
    for r in range(rounds):
        for name, spec in (("plain", None), ("schema", LONG)):
            wall, cpu, _ = run(engine, jobs(tokenizer, batch, tokens, spec, f"{name}{r}-"))
            rates.setdefault(f"{name} wall", []).append(wall)
            rates.setdefault(f"{name} cpu", []).append(cpu)
    return rates


def ttft(engine: HFEngine, tokenizer: Any, batch: int, rounds: int) -> dict[str, list[float]]:
    """Median time to first token of ``batch - 1`` unconstrained jobs, alone and
    with one job whose schema is new (compiled while they run)."""
    out: dict[str, list[float]] = {"alone": [], "with a schema compiling": []}
    for r in range(rounds):
        *_, first = run(engine, jobs(tokenizer, batch - 1, 4, None, f"alone{r}-"))
        out["alone"].append(statistics.median(first.values()))
        plain = jobs(tokenizer, batch - 1, 4, None, f"mixed{r}-")
        *_, first = run(engine, [*jobs(tokenizer, 1, 4, big_schema(r), f"big{r}-"), *plain])
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
    # Short: a constrained job may close its JSON, leaving the batch, from then on.
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    model, tokenizer = models.load(args.model)
    engine = engine_for(model, tokenizer, args.batch)
    rates = throughput(engine, tokenizer, args.batch, args.tokens, args.rounds)
    print(f"batch {args.batch}, {args.tokens} tokens a job, {args.rounds} rounds each, "
          f"model {args.model}")
    for clock in ("wall", "cpu"):
        for label, name in (("unconstrained", "plain"), ("JSON schema", "schema")):
            values = rates[f"{name} {clock}"]
            print(f"tokens/s by {clock} time, {label}: {statistics.median(values):.1f} "
                  f"(rounds: {', '.join(f'{x:.1f}' for x in values)})")
        ratio = statistics.median(rates[f"schema {clock}"]) / statistics.median(
            rates[f"plain {clock}"])
        print(f"ratio by {clock} time, schema/unconstrained: {ratio:.3f}")
    print(f"compile of the big schema, alone: {compile_seconds(engine, 10_000) * 1000:.1f} ms")
    for name, values in ttft(engine, tokenizer, args.batch, args.rounds).items():
        print(f"TTFT of unconstrained jobs, {name}: median "
              f"{statistics.median(values) * 1000:.1f} ms "
              f"(rounds: {', '.join(f'{v * 1000:.1f}' for v in values)})")
    assert engine.grammars is not None
    engine.grammars.close()


if __name__ == "__main__":
    main()
