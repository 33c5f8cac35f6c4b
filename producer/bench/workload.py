"""The jobs every mode runs, and how the timings of a run become its figures.

Every mode gets the same jobs: the same prompts, the same lengths, the same
arrival times (all at once, or one every ``1/rate`` seconds), greedy decoding,
so each mode generates the same tokens.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

WORDS = ("the module returns a list of values when the function is called with "
         "an argument that names each field of the record in order").split()

# Every mode's figures have these fields (the JSON's contract, checked by the tests).
FIELDS = ("jobs", "tokens", "elapsed_s", "tokens_per_s", "jobs_per_s", "ttft_p50_ms",
          "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "mean_batch", "max_batch", "occupancy")


@dataclass(frozen=True)
class Job:
    prompt: str
    max_new_tokens: int
    arrival_s: float  # after the start of the run; 0 for all at once


def arrive(job: Job, t0: float) -> None:
    """Sleep until ``job``'s arrival, ``t0`` (``time.perf_counter``) being the
    run's start: the schedule an open-loop load keeps, not a wait for an event."""
    if job.arrival_s:
        time.sleep(max(0.0, t0 + job.arrival_s - time.perf_counter()))


WORKLOADS = ("uniform", "mixed", "shared-prefix")
# The mixed workload's lengths: log-normal, as chat traffic's are (most
# requests short, a long tail of long ones). Prompts have a median of 16 words
# (about 100 tokens of a byte-level tokenizer), cut at 96 so the longest still
# fits a 1,024-token context with its output; outputs a median of a quarter of
# --max-new-tokens, cut at all of it.
MIXED_PROMPT_WORDS = (16, 96)  # median, longest
MIXED_SIGMA = 1.0  # of the log of a length: the p99 is about 10x the median
# The shared-prefix workload: a chat app's traffic, each request one of a few
# system prompts followed by a short user turn of its own. In words of WORDS,
# about a token each for the built-in models' tokenizers: system prompts of
# about 512 tokens, user turns of about 32.
SYSTEM_PROMPTS = 16
SYSTEM_WORDS = 480
USER_WORDS = (24, 36)  # shortest, longest


def make_jobs(n: int, max_new_tokens: int, rate: float | None = None,
              seed: int = 0, workload: str = "uniform") -> list[Job]:
    """``n`` jobs, the same for a given seed, so every mode runs the same ones.

    ``uniform``: prompts of 2-12 words and between half and all of
    ``max_new_tokens`` tokens each, so that jobs leave the batch at different
    steps and new ones join it (what continuous batching is for).
    ``mixed``: long-tailed prompt and output lengths (``MIXED_*``).
    ``shared-prefix``: one of ``SYSTEM_PROMPTS`` system prompts each, then a
    user turn of its own, and ``max_new_tokens`` tokens each (``shared_prefix``)."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    if workload == "shared-prefix":
        return shared_prefix(n, max_new_tokens, rate, seed)
    rng = random.Random(seed)
    low = max(1, math.ceil(max_new_tokens / 2))

    def long_tailed(median: float, longest: int) -> int:
        return max(1, min(longest, round(rng.lognormvariate(math.log(median), MIXED_SIGMA))))

    mixed = workload == "mixed"
    jobs = []
    for i in range(n):
        words = long_tailed(*MIXED_PROMPT_WORDS) if mixed else rng.randint(2, 12)
        prompt = " ".join(rng.choices(WORDS, k=words))
        new_tokens = (long_tailed(max_new_tokens / 4, max_new_tokens) if mixed
                      else rng.randint(low, max_new_tokens))
        jobs.append(Job(prompt, new_tokens, i / rate if rate else 0.0))
    return jobs


def shared_prefix(n: int, max_new_tokens: int, rate: float | None = None, seed: int = 0,
                  prefixes: int = SYSTEM_PROMPTS, system_seed: int | None = None,
                  hot: float = 0.0) -> list[Job]:
    """``n`` jobs, each a system prompt (one of ``prefixes``, chosen at random)
    and a user turn of its own; another ``seed`` gives other user turns and,
    unless ``system_seed`` names them, other system prompts. ``hot``: the share
    of the jobs that have the first system prompt (one hot prefix)."""
    system_rng = random.Random(seed if system_seed is None else system_seed)
    systems = [" ".join(system_rng.choices(WORDS, k=SYSTEM_WORDS)) for _ in range(prefixes)]
    rng = random.Random(seed)

    def turn() -> str:
        return " ".join(rng.choices(WORDS, k=rng.randint(*USER_WORDS)))

    def system() -> str:
        return systems[0] if rng.random() < hot else rng.choice(systems)

    return [Job(f"{system()}\nuser: {turn()}", max_new_tokens, i / rate if rate else 0.0)
            for i in range(n)]


def conversations(n: int, turns: int, max_new_tokens: int, seed: int = 0) -> list[list[Job]]:
    """``n`` conversations of ``turns`` turns, as turn after turn of jobs: each
    opens with a context of its own (a system prompt's length), and each turn's
    prompt is the one before, an answer (written here, so that the prompts are
    known ahead) and a new user turn: an agent's growing conversation, whose
    next turn starts with everything its last one computed."""
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(rng.choices(WORDS, k=k))

    prompts = [words(SYSTEM_WORDS) for _ in range(n)]
    out = []
    for turn in range(turns):
        if turn:
            prompts = [f"{p}\nassistant: {words(rng.randint(*USER_WORDS))}" for p in prompts]
        prompts = [f"{p}\nuser: {words(rng.randint(*USER_WORDS))}" for p in prompts]
        out.append([Job(p, max_new_tokens, 0.0) for p in prompts])
    return out


def describe(jobs: list[Job]) -> dict[str, Any]:
    """The lengths of a workload's jobs, for the report."""
    words = [float(len(j.prompt.split())) for j in jobs]
    new_tokens = [float(j.max_new_tokens) for j in jobs]
    return {name: {"p50": percentile(values, 50), "p99": percentile(values, 99),
                   "max": max(values, default=None)}
            for name, values in (("prompt_words", words), ("max_new_tokens", new_tokens))}


@dataclass
class Trace:
    """What one run saw, per job: when it was submitted, when each token came."""

    submitted: list[float]
    tokens: list[list[float]]
    ended: list[float | None]
    streamed: bool = True  # False: all tokens came at once, with the result
    # Tokens per job where they are not one per timed event: not streamed, or
    # streamed in chunks that may carry several (an OpenAI stream's, counted by its usage).
    num_tokens: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, n: int, streamed: bool = True) -> Trace:
        return cls([0.0] * n, [[] for _ in range(n)], [None] * n, streamed, [0] * n)

    @property
    def done(self) -> int:
        return sum(1 for t in self.ended if t is not None)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (``q`` in 0-100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)


def summarize(trace: Trace, *, max_batch: int, mean_batch: float | None,
              occupancy: float | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One mode's figures: throughput over the whole run (first submit to last
    end), time to first token and inter-token latency over every job."""
    ends = [t for t in trace.ended if t is not None]
    start = min(trace.submitted) if trace.submitted else 0.0
    elapsed = (max(ends) - start) if ends else 0.0
    if trace.streamed:
        num_tokens = sum(trace.num_tokens) or sum(len(t) for t in trace.tokens)
        ttft = [t[0] - s for s, t in zip(trace.submitted, trace.tokens) if t]
        itl = [b - a for t in trace.tokens for a, b in zip(t, t[1:])]
    else:  # the whole text arrives with the result: its first token is its last
        num_tokens = sum(trace.num_tokens)
        ttft = [e - s for s, e in zip(trace.submitted, trace.ended) if e is not None]
        itl = []
    figures: dict[str, Any] = {
        "jobs": len(ends),
        "tokens": num_tokens,
        "elapsed_s": round(elapsed, 4),
        "tokens_per_s": round(num_tokens / elapsed, 1) if elapsed else 0.0,
        "jobs_per_s": round(len(ends) / elapsed, 2) if elapsed else 0.0,
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "itl_p50_ms": _ms(percentile(itl, 50)),
        "itl_p99_ms": _ms(percentile(itl, 99)),
        "mean_batch": None if mean_batch is None else round(mean_batch, 2),
        "max_batch": max_batch,
        "occupancy": None if occupancy is None else round(occupancy, 3),
    }
    figures.update(extra or {})
    return figures


def occupancy_from_stats(before: dict[str, Any], after: dict[str, Any], jobs: int,
                         max_batch: int) -> tuple[float | None, float | None]:
    """(mean sequences per decode step, that over the batch's capacity) from two
    readings of a worker's stats. A prefill makes one token per admitted job, so
    the decode steps made ``tokens - jobs`` tokens in ``steps - prefill_steps``."""
    steps = after["steps"] - before["steps"] - (after["prefill_steps"] - before["prefill_steps"])
    tokens = after["tokens"] - before["tokens"] - jobs
    if steps <= 0:
        return None, None
    mean = tokens / steps
    return mean, mean / max_batch


def step_counts(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Forward passes of a run: all of them, the prefills among them, and the
    engine's time in them (against the run's time: what the rest costs)."""
    return {"steps": after["steps"] - before["steps"],
            "prefill_steps": after["prefill_steps"] - before["prefill_steps"],
            "engine_busy_s": round(after.get("busy_s", 0.0) - before.get("busy_s", 0.0), 4)}
