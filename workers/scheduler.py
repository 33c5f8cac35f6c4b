"""Iteration-level scheduling: which sequences run in the next forward pass.

The scheduler owns every state change of a sequence and does no I/O. Each step
is either a prefill of newly admitted sequences (they join the running batch)
or one decode step for every running sequence; finished sequences leave at once,
so their slots are free for the next prefill.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tokenfleet.shared.schemas import FinishReason
from tokenfleet.workers.sequence import Sequence, SeqStatus


@dataclass
class Batch:
    seqs: list[Sequence]
    is_prefill: bool
    # For a prefill: the running sequences whose cache rows stay, in order.
    keep: list[Sequence] = field(default_factory=list)


@dataclass
class SeqOutput:
    """What one step did to one sequence."""

    seq: Sequence
    index: int | None  # position of the new token; None when no token was made
    token_id: int | None
    text: str
    finished: bool


class Scheduler:
    def __init__(
        self,
        max_batch: int,
        eos_token_ids: Iterable[int],
        max_model_len: int,
        max_prefill_tokens: int = 8192,
        max_failures: int = 3,
        max_batch_tokens: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_batch = max_batch
        self.max_failures = max_failures
        # Bound on the KV cache: the tokens every running job may reach (its
        # prompt plus max_new_tokens), added up.
        self.max_batch_tokens = max_batch_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.max_prefill_tokens = max_prefill_tokens
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ended: list[SeqOutput] = []  # ended between steps (cancel, deadline)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._ended)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, job_id: str, reason: FinishReason, error: str | None = None) -> bool:
        """End a sequence between steps (cancel, deadline); its output comes with
        the next ``postprocess``. False if no such sequence is here."""
        for seq in [*self.waiting, *self.running]:
            if seq.job_id == job_id and not seq.is_finished:
                text = seq.finish(reason, error)
                self._ended.append(SeqOutput(seq, None, None, text, finished=True))
                self._drop_finished()
                return True
        return False

    def drop(self, job_id: str) -> None:
        """Forget a sequence without an output: another attempt owns its job now."""
        self.waiting = deque(s for s in self.waiting if s.job_id != job_id)
        self.running = [s for s in self.running if s.job_id != job_id]

    def schedule(self) -> Batch | None:
        self._expire_deadlines()
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

    def postprocess(self, batch: Batch | None, token_ids: list[int]) -> list[SeqOutput]:
        outputs, self._ended = self._ended, []
        if batch is None:
            return outputs
        for seq, token_id in zip(batch.seqs, token_ids, strict=True):
            index = len(seq.generated)
            seq.generated.append(token_id)
            text = seq.text.push(token_id)
            reason = self._finish_reason(seq, token_id)
            if reason is not None:
                text += seq.finish(reason)
            outputs.append(SeqOutput(seq, index, token_id, text, reason is not None))
            seq.isolate = False
        if batch.is_prefill:
            self.running.extend(batch.seqs)
        self._drop_finished()
        return outputs

    def recover(self, batch: Batch, error: str) -> None:
        """The forward pass of ``batch`` raised and the runner's cache is gone.

        Every running sequence goes back to the front of the queue to be
        prefilled again with what it has generated. A sequence that failed alone
        counts a failure and ends with the error after ``max_failures``; those
        of a larger failed batch are retried one by one, so one bad sequence
        never fails the others.
        """
        for seq in batch.seqs:
            if len(batch.seqs) == 1:
                seq.failures += 1
                if seq.failures >= self.max_failures:
                    text = seq.finish(FinishReason.ERROR, error)
                    self._ended.append(SeqOutput(seq, None, None, text, finished=True))
                    continue
            seq.isolate = True
        requeue = [s for s in [*batch.keep, *batch.seqs, *self.running] if not s.is_finished]
        self.running = []
        for seq in reversed(list(dict.fromkeys(requeue))):
            seq.status = SeqStatus.WAITING
            self.waiting.appendleft(seq)

    def _reserve(self, seq: Sequence) -> int:
        return min(len(seq.prompt_ids) + seq.sampling.max_new_tokens, self.max_model_len)

    def _finish_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        if token_id in self.eos_token_ids:
            return FinishReason.EOS
        if seq.text.stopped:
            return FinishReason.STOP
        if len(seq.generated) >= seq.sampling.max_new_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _expire_deadlines(self) -> None:
        now = self.clock()
        for seq in [*self.waiting, *self.running]:
            if seq.deadline_at is not None and seq.deadline_at <= now:
                self.abort(seq.job_id, FinishReason.DEADLINE, "deadline passed")

    def _drop_finished(self) -> None:
        if any(s.is_finished for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if not s.is_finished)
        self.running = [s for s in self.running if not s.is_finished]
