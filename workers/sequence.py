"""One job's life inside a worker: its tokens, its text, its end."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenfleet.shared.wire.schemas import FinishReason, JobStatus, SamplingParams
from tokenfleet.shared.wire.structured import StructuredOutput
from tokenfleet.workers.detokenizer import TextStream
from tokenfleet.workers.logprobs import Logprobs

if TYPE_CHECKING:  # xgrammar is the built-in engine's alone
    from tokenfleet.workers.grammar import SeqGrammar


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
    # Log probabilities an engine computed for tokens it is about to hand over,
    # by the token's index; ``append`` takes each with its token. By index, not
    # in a queue: a step that fails after sampling leaves nothing that a later
    # token could pick up (the retry computes the same index again).
    made_logprobs: dict[int, Logprobs] = field(default_factory=dict)
    # The prompt's log probabilities (``workers.prompt_logprobs``), once its
    # prefill computed them, for a job that asked (``SamplingParams.prompt_logprobs``).
    prompt_logprobs: list[Logprobs | None] | None = None
    # The most tokens it generates (resumed ones included) before it ends by
    # length: set by ``take_room`` when an engine takes it.
    max_generated: int = 0
    structured: StructuredOutput | None = None  # what its text must be, if anything
    # Handed back to its queue while it ran (preemption): the writes still on
    # their way for it are refused, as expected (the job is no longer this attempt's).
    handed_back: bool = False
    grammar: SeqGrammar | None = None  # the built-in engine's matcher for ``structured``

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.generated

    @property
    def is_finished(self) -> bool:
        """Whether the engine is done with it (the engine thread's view; the
        job's end is ``has_ended``)."""
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

    # -- the engine's side: token ids only ---------------------------------------

    def take_room(self, max_model_len: int) -> None:
        """Fix ``max_generated`` for an engine of ``max_model_len``: its
        ``max_new_tokens``, or what that length leaves after its prompt. The
        engine calls it once, when it takes the sequence."""
        self.max_generated = min(self.sampling.max_new_tokens, max_model_len - len(self.prompt_ids))

    def append(self, token_id: int, eos_token_ids: frozenset[int]) -> Made:
        """Append a token an engine made, and end the sequence when its id
        says so (end of sequence, a complete grammar, or ``max_generated``
        tokens generated). No text: that is the output side's (``take``), which
        may run on another thread a step or two later. Runs once per token on
        the engine thread, so it does as little as it can."""
        generated = self.generated
        index = len(generated)
        generated.append(token_id)
        # Most sequences ask for no log probabilities: no dict lookup for them.
        logprobs = self.made_logprobs.pop(index, None) if self.made_logprobs else None
        end: FinishReason | None = None
        error: str | None = None
        grammar = self.grammar
        if grammar is not None and not grammar.accept(token_id):
            # The step's mask allowed only what the grammar does: not the job's fault.
            end, error = FinishReason.ERROR, f"token {token_id} breaks the {grammar.label}"
        elif token_id in eos_token_ids and not self.sampling.ignore_eos:
            end = FinishReason.EOS
        elif grammar is not None and grammar.terminated:
            end = FinishReason.STOP  # the grammar is complete: nothing may follow
        elif index + 1 >= self.max_generated:
            end = FinishReason.LENGTH
        if end is not None:
            self.status = SeqStatus.FINISHED
        return Made(self, index, token_id, end, error, logprobs=logprobs)

    # -- the output side: text and the job's end -----------------------------------

    @property
    def has_ended(self) -> bool:
        """Whether the job's end is decided (its text is final). The engine may
        still run it for a step: a stop string is found after the engine moved on."""
        return self.finish_reason is not None

    def finish(self, reason: FinishReason, error: str | None = None) -> str:
        """End the job; returns the text still held back."""
        self.finish_reason = reason
        self.error = error
        return self.text.finish()

    def take(self, made: Made) -> SeqOutput | None:
        """The text and end of what an engine step did to this sequence; None
        once the job has ended (tokens the engine made past a stop string
        before it learnt of it). Every engine's tokens go through here, so stop
        strings, end of sequence and the length limits mean the same on each:
        a stop string ends the text where it starts, and its reason wins over
        a length limit reached by the same token, as an end of sequence wins
        over it."""
        if self.has_ended:
            return None
        if made.token_id is None:  # ended between steps (a cancel, a deadline, an error)
            assert made.end is not None
            return SeqOutput(self, None, None, self.finish(made.end, made.error), finished=True)
        text = self.text.push(made.token_id)
        reason = made.end
        if self.text.stopped and reason is not FinishReason.EOS:
            reason = FinishReason.STOP
        if reason is not None:
            text += self.finish(reason, made.error)
        return SeqOutput(self, made.index, made.token_id, text, reason is not None,
                         made.logprobs)


@dataclass(slots=True)
class Made:
    """What one engine step did to one sequence, in token ids: a new token
    and, when the engine ended it (by the token's id, or between steps with
    no token), the reason. The engine thread makes it; the output side turns
    it into a ``SeqOutput`` (``Sequence.take``)."""

    seq: Sequence
    index: int | None  # position of the new token; None when no token was made
    token_id: int | None
    end: FinishReason | None = None
    error: str | None = None
    logprobs: Logprobs | None = None  # when the job asked for them


@dataclass(slots=True)
class SeqOutput:
    """What one step did to one sequence."""

    seq: Sequence
    index: int | None  # position of the new token; None when no token was made
    token_id: int | None
    text: str
    finished: bool
    logprobs: Logprobs | None = None  # when the job asked for them
