"""One job's life inside a worker: its tokens, its text, its end."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tokenfleet.shared.schemas import FinishReason, JobStatus, SamplingParams
from tokenfleet.workers.detokenizer import TextStream


class SeqStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


# How a finish reason maps to the job's final status.
FINAL_STATUS = {
    FinishReason.CANCELLED: JobStatus.CANCELLED,
    FinishReason.DEADLINE: JobStatus.EXPIRED,
    FinishReason.ERROR: JobStatus.FAILED,
}


@dataclass(eq=False)
class Sequence:
    job_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    text: TextStream
    attempt: int = 1
    entry_id: str = ""
    entry_json: str = ""  # the stream entry as read, to hand the job back on a drain
    queue: str = "default"
    deadline_at: float | None = None
    generated: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    arrived_at: float = field(default_factory=time.monotonic)
    created_at: float | None = None  # when it was submitted (wall clock, for latency metrics)
    last_token_at: float | None = None  # monotonic time of its last token (metrics)
    failures: int = 0  # forward passes that raised with this sequence in them
    isolate: bool = False  # run alone until it passes a step (after a failed batch)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.generated

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    @property
    def final_status(self) -> JobStatus:
        assert self.finish_reason is not None
        return FINAL_STATUS.get(self.finish_reason, JobStatus.SUCCEEDED)

    def restore(self, token_ids: list[int]) -> None:
        """Resume after a reclaim or a hand-back: take the tokens earlier
        attempts logged (the log's contiguous prefix, see resume.lua).
        Replaying them through the detokenizer releases the same text, so the
        next delta continues exactly where the stream stopped."""
        for token_id in token_ids:
            self.generated.append(token_id)
            self.text.push(token_id)

    def finish(self, reason: FinishReason, error: str | None = None) -> str:
        """End the sequence; returns the text still held back."""
        self.status = SeqStatus.FINISHED
        self.finish_reason = reason
        self.error = error
        return self.text.finish()
