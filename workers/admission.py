"""Turning a queue entry into a sequence the engine can run: tokenize and check.

Requests were validated by the producer, but the worker checks again what only
it can know (the prompt's length in this model's tokens, the chat template,
what its engine accepts) and what it must not trust (a producer with other
limits, a hand-written entry, the token ids of a resumed job's log).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenfleet.shared.wire.errors import NO_FIM, LimitExceeded
from tokenfleet.shared.wire.limits import worker_limits
from tokenfleet.shared.wire.schemas import GenerationRequest, QueueEntry
from tokenfleet.shared.settings import Settings
from tokenfleet.workers.detokenizer import TextStream
from tokenfleet.workers.fim import fim_format
from tokenfleet.workers.tool_template import takes_tools, tool_format
from tokenfleet.workers.sequence import Sequence


class Rejected(Exception):
    """The request cannot run on this worker; the message says why."""


class CorruptLog(Exception):
    """A resumed job's token log holds what no model made: not the request's
    fault, so an operator hears of it too (a dead letter)."""


class Admission:
    def __init__(self, tokenizer: Any, settings: Settings, max_model_len: int, *,
                 vocab_size: int | None = None,
                 refusal: Callable[[Sequence], str | None] | None = None) -> None:
        """``vocab_size``: the engine's (``Engine.vocab_size``), else the
        tokenizer's; ``refusal``: the engine's ``Engine.refusal``."""
        self.tokenizer = tokenizer
        self.settings = settings
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size if vocab_size is not None else len(tokenizer)
        self.refusal = refusal
        self.limits = worker_limits(settings, max_model_len)
        self._encode = _fast_encoder(tokenizer)
        self.fim = fim_format(tokenizer)
        self.tool_format = tool_format(tokenizer)

    @property
    def has_chat_template(self) -> bool:
        """Whether this model takes ``messages`` (the heartbeat says so, for the gateway)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        if request.messages is not None:
            if not self.has_chat_template:
                raise Rejected("this model has no chat template: send a prompt, not messages")
            ids = self.render_chat(request)
        elif request.prompt_token_ids is not None:
            # Given as ids, they skip the tokenizer: checked here, before any
            # engine sees one (an id past the embedding crashes the whole step).
            beyond = [t for t in request.prompt_token_ids if t >= self.vocab_size]
            if beyond:
                raise Rejected(f"prompt token id {beyond[0]} is outside this model's vocabulary "
                               f"of {self.vocab_size} (ids 0 to {self.vocab_size - 1})")
            ids = request.prompt_token_ids
        elif request.suffix is not None:
            if self.fim is None:
                raise Rejected("this model " + NO_FIM)
            ids = self._encode(self.fim.prompt(request.prompt or "", request.suffix))
        else:
            ids = self._encode(request.prompt)
        ids = list(ids)
        # Counted here always: a client without the tokenizer could not.
        limit = self.limits.prompt_tokens
        if len(ids) > limit.value:
            raise Rejected(str(LimitExceeded("prompt_tokens", len(ids), limit.value,
                                             limit.by, limit.why)))
        return ids

    def render_chat(self, request: GenerationRequest) -> list[int]:
        """The token ids of ``request.messages`` through the chat template, its
        tools and tool history included (for a template that takes them)."""
        messages = request.messages or []
        if (request.tools or any(m.is_tool_history for m in messages)) and not takes_tools(
                self.tool_format):
            raise Rejected("this model's chat template takes no tools: send tool results and "
                           "calls as user and assistant text, or serve a model whose template "
                           "renders tools")
        # Unset tool fields left out: a template tests whether they are defined.
        dumped = [m.model_dump(exclude_none=True) for m in messages]
        return list(self.tokenizer.apply_chat_template(
            dumped, tools=request.tools, add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message, tokenize=True,
            return_dict=False, **(request.chat_template_kwargs or {})))

    def sequence(self, entry: QueueEntry, entry_id: str, attempt: int) -> Sequence:
        request = entry.request
        # Re-check the producer's limits against this worker's settings.
        request = GenerationRequest.model_validate(
            request.model_dump(), context={"settings": self.settings}
        )
        beyond = [t for t in request.sampling.logit_bias if t >= self.vocab_size]
        if beyond:
            raise Rejected(f"logit_bias names token {beyond[0]}, outside this model's vocabulary "
                           f"of {self.vocab_size} (ids 0 to {self.vocab_size - 1})")
        return Sequence(
            job_id=entry.job_id,
            prompt_ids=self.prompt_ids(request),
            sampling=request.sampling,
            text=TextStream(self.tokenizer, request.sampling.stop,
                            include_stop=request.sampling.include_stop_str_in_output,
                            skip_special_tokens=request.sampling.skip_special_tokens),
            attempt=attempt,
            entry_id=entry_id,
            queue=request.model,
            deadline_at=entry.deadline_at,
            created_at=entry.created_at,
            structured=request.structured_output,
        )


    def resume(self, seq: Sequence, token_ids: list[Any]) -> None:
        """Give ``seq`` the tokens an earlier attempt logged, then ask the
        engine whether it runs the request. The log is read back from Redis,
        so its ids are checked before the detokenizer or any engine sees one:
        an id outside the vocabulary would make the model index past its
        embedding (a crash of the whole step, every job in it lost)."""
        for token_id in token_ids:
            if type(token_id) is not int or not 0 <= token_id < self.vocab_size:
                raise CorruptLog(f"token log holds id {token_id!r} outside the vocabulary of "
                               f"{self.vocab_size} (ids 0 to {self.vocab_size - 1})")
        seq.restore(token_ids)
        why = self.refusal(seq) if self.refusal is not None else None
        if why is not None:
            raise Rejected(why)


def _fast_encoder(tokenizer: Any) -> Any:
    """``tokenizer(text)["input_ids"]`` without transformers' Python around the
    Rust tokenizer (half the feeder's time per job), where it gives the same ids."""

    def slow(text: str) -> list[int]:
        return list(tokenizer(text)["input_ids"])

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation or backend.padding or getattr(
            tokenizer, "split_special_tokens", False) != backend.encode_special_tokens:
        return slow

    def fast(text: str) -> list[int]:
        return backend.encode(text).ids  # type: ignore[no-any-return]

    probe = "Hello, wörld! <|eos|> 123\n\tend"
    return fast if fast(probe) == slow(probe) else slow
