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
    num_computed: int = 0  # tokens in the runner's KV cache (a chunked prefill's progress)

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

    def take(self, token_id: int, eos_token_ids: frozenset[int], max_model_len: int) -> SeqOutput:
        """Append a token an engine made: its text (held back while a stop
        string may still match) and, when it is the last, the sequence's end.
        Every engine's tokens go through here, so stop strings, end of
        sequence and the length limits mean the same on each."""
        index = len(self.generated)
        self.generated.append(token_id)
        text = self.text.push(token_id)
        reason = self._finish_reason(token_id, eos_token_ids, max_model_len)
        if reason is not None:
            text += self.finish(reason)
        return SeqOutput(self, index, token_id, text, reason is not None)

    def _finish_reason(self, token_id: int, eos_token_ids: frozenset[int],
                       max_model_len: int) -> FinishReason | None:
        if token_id in eos_token_ids:
            return FinishReason.EOS
        if self.text.stopped:
            return FinishReason.STOP
        if len(self.generated) >= self.sampling.max_new_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None


@dataclass(slots=True)
class SeqOutput:
    """What one step did to one sequence."""

    seq: Sequence
    index: int | None  # position of the new token; None when no token was made
    token_id: int | None
    text: str
    finished: bool
