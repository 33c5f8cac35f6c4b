"""vLLM's ``return_tokens_as_token_ids``: log probabilities that name each token
``token_id:<id>`` rather than by its decoded text, so a client can tell apart
tokens that decode alike (and read tokens that decode to nothing).

Applied to a job's events before they are shaped: every shape (completions',
chat's, the echoed prompt's) then writes the ids as it writes text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from tokenfleet.shared.wire.schemas import PromptEcho, TokenEvent, TopLogprob


def token_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def by_id(event: TokenEvent) -> TokenEvent:
    """``event`` with its tokens, and its echoed prompt's, named by id."""
    logprobs = None if event.logprobs is None else [
        lp.model_copy(update={"token": token_name(token_id), "top": _tops(lp.top)})
        for token_id, lp in zip(event.token_ids, event.logprobs, strict=True)]
    return event.model_copy(update={"logprobs": logprobs, "prompt": _prompt(event.prompt)})


def shaped_by_id(shape: Callable[[list[TokenEvent]], Any]) -> Callable[[list[TokenEvent]], Any]:
    """``shape`` of events whose tokens are named by id."""
    return lambda events: shape([by_id(e) for e in events])


def events_by_id(events: Iterable[TokenEvent]) -> list[TokenEvent]:
    return [by_id(e) for e in events]


def _tops(top: list[TopLogprob] | None) -> list[TopLogprob] | None:
    if top is None:
        return None
    return [t.model_copy(update={"token": token_name(t.token_id)}) for t in top]


def _prompt(prompt: PromptEcho | None) -> PromptEcho | None:
    if prompt is None:
        return None
    tokens = [t.model_copy(update={"token": token_name(token_id), "top": _tops(t.top)})
              for token_id, t in zip(prompt.token_ids, prompt.tokens, strict=True)]
    return prompt.model_copy(update={"tokens": tokens})
