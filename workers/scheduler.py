"""Iteration-level scheduling for the built-in engine: which sequences run in
the next forward pass, and how many of their tokens.

No I/O. Two policies, by what the runner can run:

- whole prefills (``max_step_tokens=None``, the rectangular cache): each step
  is either a prefill of newly admitted sequences (they join the running
  batch) or one decode step for every running sequence;
- chunked prefill (``max_step_tokens=N``, the paged cache): each step carries
  one token of every decoding sequence and, in what is left of the N tokens,
  chunks of prompts still being prefilled (oldest first, then new ones), so a
  long prompt never stalls the decodes for more than a chunk's time.

A sequence that ends leaves at once (the engine drops it), so its slot is free
for the next admission. With chunked prefill, a sequence admitted starts from
the tokens its runner's prefix cache already holds (``cached``), so the
step's budget goes to the tokens it computes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tokenfleet.workers.sequence import Sequence, SeqStatus


@dataclass
class StepBatch:
    """One forward pass: ``seqs`` feed ``num_new[i]`` tokens each, from their
    ``num_computed``; ``sampled`` are those that make a token (their last
    token is in the pass), in order."""

    seqs: list[Sequence]
    is_prefill: bool
    # The running sequences whose cache stays but that are not in this pass.
    keep: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    sampled: list[Sequence] = field(default_factory=list)
    admits: bool = False  # whether it admitted new sequences

    def __post_init__(self) -> None:
        if not self.num_new:  # whole prefills or one decode step: every sequence to its end
            self.num_new = [s.num_tokens - s.num_computed for s in self.seqs]
        self.sampled = [s for s, n in zip(self.seqs, self.num_new)
                        if s.num_computed + n == s.num_tokens]
        self.admits = self.admits or self.is_prefill


class Scheduler:
    def __init__(
        self,
        max_batch: int,
        eos_token_ids: Iterable[int],
        max_model_len: int,
        max_prefill_tokens: int = 8192,
        max_failures: int = 3,
        max_batch_tokens: int | None = None,
        max_step_tokens: int | None = None,
        cached: Callable[[Sequence], int] | None = None,
    ) -> None:
        self.max_batch = max_batch
        self.max_failures = max_failures
        # Bound on the KV cache: the tokens every running job may reach (its
        # prompt plus max_new_tokens), added up.
        self.max_batch_tokens = max_batch_tokens
        # The limits of the sequences: the engine ends them by these.
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.max_prefill_tokens = max_prefill_tokens
        # Chunked prefill: the tokens one forward pass carries, decodes included.
        self.max_step_tokens = max_step_tokens
        # The tokens a sequence admitted now finds computed (the runner's
        # ``cached_prefix``, which hands them to its table); None: none.
        self.cached = cached
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def drop(self, job_id: str) -> None:
        """Forget a sequence without an output: another attempt owns its job now."""
        self.waiting = deque(s for s in self.waiting if s.job_id != job_id)
        self.running = [s for s in self.running if s.job_id != job_id]

    def schedule(self) -> StepBatch | None:
        if self.max_step_tokens is not None:
            return self._schedule_chunked(self.max_step_tokens)
        if self.waiting and len(self.running) < self.max_batch:
            admitted: list[Sequence] = []
            tokens = 0
            reserved = sum(self._reserve(s) for s in self.running)
            while self.waiting and len(self.running) + len(admitted) < self.max_batch:
                seq = self.waiting[0]
                if admitted and (seq.isolate or admitted[0].isolate):
                    break  # a suspect of a failed batch runs alone
                if admitted and tokens + seq.num_tokens > self.max_prefill_tokens:
                    break
                if not self._fits(seq, reserved, bool(admitted or self.running)):
                    break
                reserved += self._reserve(seq)
                tokens += seq.num_tokens
                admitted.append(self.waiting.popleft())
            for seq in admitted:
                seq.status = SeqStatus.RUNNING
            if admitted:
                return StepBatch(admitted, is_prefill=True, keep=list(self.running))
        if self.running:
            return StepBatch(list(self.running), is_prefill=False)
        return None

    def _schedule_chunked(self, budget: int) -> StepBatch | None:
        # A suspect of a failed batch runs alone, to its first token.
        suspect = next((s for s in self.running if s.isolate), None)
        if suspect is None and self.waiting and self.waiting[0].isolate and (
                len(self.running) < self.max_batch):
            suspect = self._admit()
        if suspect is not None:
            n = min(suspect.num_tokens - suspect.num_computed, budget)
            return StepBatch([suspect], is_prefill=False, num_new=[n], admits=True,
                         keep=[s for s in self.running if s is not suspect])
        seqs: list[Sequence] = []
        num_new: list[int] = []
        # Decodes first (one token each), then prefills in the order they came.
        for seq in sorted(self.running, key=lambda s: s.num_tokens - s.num_computed > 1):
            n = min(seq.num_tokens - seq.num_computed, budget)
            if n > 0:
                seqs.append(seq)
                num_new.append(n)
                budget -= n
        admits = False
        reserved = sum(self._reserve(s) for s in self.running)
        while (budget > 0 and self.waiting and len(self.running) < self.max_batch
               and not self.waiting[0].isolate
               and self._fits(self.waiting[0], reserved, bool(self.running))):
            seq = self._admit()
            reserved += self._reserve(seq)
            n = min(seq.num_tokens - seq.num_computed, budget)
            seqs.append(seq)
            num_new.append(n)
            budget -= n
            admits = True
        if not seqs:
            return None
        chosen = set(map(id, seqs))
        return StepBatch(seqs, is_prefill=False, num_new=num_new, admits=admits,
                     keep=[s for s in self.running if id(s) not in chosen])

    def _admit(self) -> Sequence:
        seq = self.waiting.popleft()
        seq.status = SeqStatus.RUNNING
        seq.num_computed = self.cached(seq) if self.cached is not None else 0
        self.running.append(seq)
        return seq

    def _fits(self, seq: Sequence, reserved: int, others: bool) -> bool:
        """Whether ``seq`` fits the KV bound beside the ``reserved`` tokens of
        the others; it waits for running jobs to end and free their share.
        Alone, it always runs."""
        return (self.max_batch_tokens is None or not others
                or reserved + self._reserve(seq) <= self.max_batch_tokens)

    def ran(self, batch: StepBatch) -> None:
        """``batch`` ran: its tokens are in the cache, its prefilled sequences
        join the running batch."""
        for seq, n in zip(batch.seqs, batch.num_new):
            seq.num_computed += n
        for seq in batch.sampled:
            seq.isolate = False
        if batch.is_prefill:
            self.running.extend(batch.seqs)

    def recover(self, batch: StepBatch) -> list[Sequence]:
        """The forward pass of ``batch`` raised and the runner's cache is gone.

        Every running sequence goes back to the front of the queue to be
        prefilled again with what it has generated. A sequence that failed alone
        counts a failure; those of a larger failed batch are retried one by one,
        so one bad sequence never fails the others. Returns the sequences that
        failed ``max_failures`` times: the engine ends them with the error.
        """
        failed: list[Sequence] = []
        for seq in batch.seqs:
            if len(batch.seqs) == 1:
                seq.failures += 1
                if seq.failures >= self.max_failures:
                    failed.append(seq)
                    continue
            seq.isolate = True
        requeue = [s for s in [*batch.keep, *batch.seqs, *self.running]
                   if not s.is_finished and s not in failed]
        self.running = []
        for seq in reversed(list(dict.fromkeys(requeue))):
            seq.status = SeqStatus.WAITING
            seq.num_computed = 0
            self.waiting.appendleft(seq)
        return failed

    def _reserve(self, seq: Sequence) -> int:
        return min(len(seq.prompt_ids) + seq.sampling.max_new_tokens, self.max_model_len)
