"""A scripted runner: the engine's tests run on the CPU without a model."""

from __future__ import annotations

from collections.abc import Callable

from tokenfleet.workers.scheduler import StepBatch
from tokenfleet.workers.sequence import Sequence


class ScriptedRunner:
    """Emits ``next_token(seq)`` for every sequence that makes a token; records
    every batch it ran."""

    def __init__(self, next_token: Callable[[Sequence], int] | None = None,
                 fail_if: Callable[[StepBatch], bool] | None = None) -> None:
        self.next_token = next_token or (lambda seq: 65 + len(seq.generated) % 26)
        self.fail_if = fail_if
        self.batches: list[tuple[bool, list[str]]] = []
        self.resets = 0

    def run(self, batch: StepBatch) -> list[int]:
        self.batches.append((batch.is_prefill, [s.job_id for s in batch.seqs]))
        if self.fail_if is not None and self.fail_if(batch):
            raise RuntimeError("scripted failure")
        return [self.next_token(s) for s in batch.sampled]

    def reset(self) -> None:
        self.resets += 1
