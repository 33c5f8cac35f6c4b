"""Iteration-level scheduling for the built-in engine: which sequences run in
the next forward pass.

No I/O. Each step is either a prefill of newly admitted sequences (they join
the running batch) or one decode step for every running sequence; a sequence
that ends leaves at once (the engine drops it), so its slot is free for the
next prefill.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from tokenfleet.workers.sequence import Sequence, SeqStatus


@dataclass
class Batch:
    seqs: list[Sequence]
    is_prefill: bool
    # For a prefill: the running sequences whose cache rows stay, in order.
    keep: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        max_batch: int,
        eos_token_ids: Iterable[int],
        max_model_len: int,
        max_prefill_tokens: int = 8192,
        max_failures: int = 3,
        max_batch_tokens: int | None = None,
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
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def drop(self, job_id: str) -> None:
        """Forget a sequence without an output: another attempt owns its job now."""
        self.waiting = deque(s for s in self.waiting if s.job_id != job_id)
        self.running = [s for s in self.running if s.job_id != job_id]

    def schedule(self) -> Batch | None:
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
                if (self.max_batch_tokens is not None and (admitted or self.running)
                        and reserved + self._reserve(seq) > self.max_batch_tokens):
                    break  # it waits for running jobs to end and free their share
                reserved += self._reserve(seq)
                tokens += seq.num_tokens
                admitted.append(self.waiting.popleft())
            for seq in admitted:
                seq.status = SeqStatus.RUNNING
            if admitted:
                return Batch(admitted, is_prefill=True, keep=list(self.running))
        if self.running:
            return Batch(list(self.running), is_prefill=False)
        return None

    def ran(self, batch: Batch) -> None:
        """``batch`` ran: its prefilled sequences join the running batch."""
        for seq in batch.seqs:
            seq.isolate = False
        if batch.is_prefill:
            self.running.extend(batch.seqs)

    def recover(self, batch: Batch) -> list[Sequence]:
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
            self.waiting.appendleft(seq)
        return failed

    def _reserve(self, seq: Sequence) -> int:
        return min(len(seq.prompt_ids) + seq.sampling.max_new_tokens, self.max_model_len)
