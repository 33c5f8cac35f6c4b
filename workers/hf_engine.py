"""The built-in engine (``--engine hf``): the scheduler and a runner over a
Hugging Face model.

It serves any ``transformers`` causal LM with no extra install; its factory,
which loads the model and picks the runner, is ``tokenfleet.workers.build``'s
``build_hf``. A failed forward pass is retried (the batch re-prefilled, its
suspects one by one) until it is clearly the device's fault (``DeviceFailure``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait
from typing import TYPE_CHECKING, Protocol

from tokenfleet.shared.wire.schemas import REFUSED_BY_WORKER, FinishReason
from tokenfleet.workers.engine import BatchShape, DeviceFailure, Engine, is_fatal_device_error
from tokenfleet.workers.scheduler import StepBatch, Scheduler
from tokenfleet.workers.sequence import Sequence

if TYPE_CHECKING:
    from tokenfleet.workers.grammar import Grammars

log = logging.getLogger(__name__)

# How long an idle engine thread waits for a grammar being compiled before it
# looks at its inbox again (a new job must not wait long behind a compile).
COMPILE_POLL_S = 0.002


class Runner(Protocol):
    """Knows tensors, not jobs: one new token for every sequence of a batch
    that makes one (``batch.sampled``: a sequence part-way through a chunked
    prefill makes none)."""

    def run(self, batch: StepBatch) -> list[int]: ...

    def reset(self) -> None: ...


class ModelRunner(Runner, Protocol):
    """A runner over a model: its limits, and what its KV cache can do, which
    the engine's scheduler and batch size are set up for."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def eos_token_ids(self) -> set[int]: ...

    @property
    def vocab_size(self) -> int:
        """How many token ids the model has."""
        ...

    @property
    def chunked_prefill(self) -> bool:
        """Whether a prompt may be prefilled in chunks, in the same forward
        pass as other sequences' decodes (a step then carries at most
        ``max_step_tokens``); else each prefill runs whole, in a step of its own."""
        ...

    @property
    def rows_at_longest(self) -> bool:
        """Whether every sequence's cache takes the memory of the longest
        sequence's: the batch the memory holds is then counted at the longest."""
        ...


class HFEngine(Engine):
    """Owned by the engine thread, but for ``add`` and ``abort`` (see ``Engine``)."""

    reports_logprobs = True  # the runners sample with tokenfleet.workers.sampler

    def __init__(self, scheduler: Scheduler, runner: Runner, max_failed_steps: int = 5,
                 clock: Callable[[], float] = time.time, vocab_size: int | None = None) -> None:
        super().__init__(scheduler.eos_token_ids, scheduler.max_model_len, clock, vocab_size)
        self.scheduler = scheduler
        self.runner = runner
        # Must exceed a poison job's own run of failures (one in its batch, then
        # max_failures alone), so one bad job never stops a worker.
        self.max_failed_steps = max_failed_steps
        self.failed_in_a_row = 0
        # Structured output: set by the factory where xgrammar is installed.
        self.grammars: Grammars | None = None
        # Held sequences whose grammar is still compiling: not yet the scheduler's.
        self._compiling: list[Sequence] = []
        self._compiling_failed: list[tuple[Sequence, str]] = []

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    def refusal(self, seq: Sequence) -> str | None:
        why = super().refusal(seq)
        if why is not None:
            return why
        if seq.structured is not None and self.grammars is None:
            return (f"this worker cannot constrain output to a {seq.structured.label}: "
                    "structured output needs xgrammar "
                    "(pip install \"tokenfleet[structured]\" on the worker's host)")
        return None

    def _add(self, seq: Sequence) -> None:
        if seq.structured is not None and self.grammars is not None:
            from tokenfleet.workers.grammar import SeqGrammar

            # Compiled on the grammars' own thread: the sequence waits out of
            # the scheduler's sight, and the others run meanwhile.
            seq.grammar = SeqGrammar(self.grammars.compile(seq.structured), seq.structured.label)
            self._compiling.append(seq)
            self._start_compiled()
            return
        self.scheduler.add(seq)

    def _start_compiled(self) -> None:
        """Hand the scheduler each sequence whose grammar is compiled, its
        matcher fed the tokens it has; end those whose grammar failed."""
        waiting: list[Sequence] = []
        for seq in self._compiling:
            assert seq.grammar is not None
            if not seq.grammar.ready:
                waiting.append(seq)
                continue
            problem = seq.grammar.start(seq.generated)
            if problem is None:
                self.scheduler.add(seq)
            else:
                self._compiling_failed.append((seq, problem))
        self._compiling = waiting

    def _release(self, seq: Sequence) -> None:
        self._compiling = [s for s in self._compiling if s is not seq]
        self.scheduler.drop(seq.job_id)

    def _run(self) -> list[tuple[Sequence, int]]:
        if self._compiling:
            self._start_compiled()
        for seq, problem in self._compiling_failed:
            self.end(seq, FinishReason.ERROR, REFUSED_BY_WORKER + problem)
        self._compiling_failed = []
        batch = self.scheduler.schedule()
        self.last_batch = BatchShape(0, False)
        if batch is None:
            if self._compiling:  # nothing else to run: wait for a compile, briefly
                wait([s.grammar.compiled for s in self._compiling if s.grammar is not None],
                     timeout=COMPILE_POLL_S, return_when=FIRST_COMPLETED)
            return []
        try:
            token_ids = self.runner.run(batch)
        except Exception as exc:
            self._failed(batch, exc)
            return []
        self.failed_in_a_row = 0
        made = list(zip(batch.sampled, token_ids, strict=True))
        self.scheduler.ran(batch)
        # The prompt tokens the runner computed, and what its prefix cache found
        # (the runner counts, the stats report).
        self.stats.prefill_tokens = getattr(self.runner, "prefill_tokens", 0)
        self.stats.prefix_query_tokens = getattr(self.runner, "prefix_query_tokens", 0)
        self.stats.prefix_hit_tokens = getattr(self.runner, "prefix_hit_tokens", 0)
        self.last_batch = BatchShape(len(batch.keep) + len(batch.seqs), batch.admits)
        return made

    def _failed(self, batch: StepBatch, exc: Exception) -> None:
        self.failed_in_a_row += 1
        self.stats.failed_steps += 1
        error = f"{type(exc).__name__}: {exc}"
        # Before the scheduler counts it against any job: a broken device
        # is not the jobs' fault.
        if is_fatal_device_error(exc):
            raise DeviceFailure(f"fatal device error: {error}", batch.seqs) from exc
        if self.failed_in_a_row >= self.max_failed_steps:
            raise DeviceFailure(f"{self.failed_in_a_row} steps failed in a row, "
                                f"the last with {error}", batch.seqs) from exc
        log.exception("forward pass of %d sequence(s) failed", len(batch.seqs))
        # The cache may be half-updated: drop it, the scheduler re-prefills.
        self.runner.reset()
        for seq in self.scheduler.recover(batch):
            self.end(seq, FinishReason.ERROR, error)
