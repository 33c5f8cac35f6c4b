"""Log probabilities in OpenAI's shapes, from a job's token events.

Completions: ``{tokens, token_logprobs, top_logprobs, text_offset}``, with
``logprobs`` (0 to 5) likeliest tokens per position as ``{token: logprob}``, and
the sampled token among them where it is not one (up to ``logprobs`` + 1, as
OpenAI's);
chat: ``{content: [{token, logprob, bytes, top_logprobs: [...]}], refusal}``
with ``top_logprobs`` (0 to 20) of them. Values are the model's own
distribution (before temperature, penalties and bias), as vLLM reports them by
default. A token's ``bytes`` are its decoded text's UTF-8 (as vLLM gives them),
and ``text_offset`` is where the token's share of the completion's text starts
(a token held back inside a UTF-8 sequence shares the offset of the next one).

The events come from the job's token log, which carries each token's values,
so a stream resumed or replayed from the log has the same ones as the live one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tokenfleet.shared.wire.schemas import TokenEvent, TokenLogprob

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound for completions


class CompletionLogprobs:
    """Completions' shape for a job's events, in order; ``text_offset`` counts
    on from the text of the events formatted before (a stream's chunks)."""

    def __init__(self) -> None:
        self.offset = 0

    def __call__(self, events: Iterable[TokenEvent]) -> dict[str, Any]:
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                     "text_offset": []}
        for event in events:
            for text, lp in zip(event.token_texts(), _values(event)):
                out["tokens"].append(lp.token)
                out["token_logprobs"].append(lp.logprob)
                top = {t.token: t.logprob for t in lp.top}
                top.setdefault(lp.token, lp.logprob)  # OpenAI: the sampled one, always
                out["top_logprobs"].append(top)
                out["text_offset"].append(self.offset)
                self.offset += len(text)
        return out


def over_budget(n: int, tokens: int, per_token: int, settings: Any, param: str) -> str | None:
    """Why an answer that is not streamed, of ``n`` choices of up to ``tokens``
    tokens with ``per_token`` values each, may not be built (it is built whole
    in memory: n x tokens x per_token values), or None if it may."""
    values = n * tokens * per_token
    limit = settings.max_logprob_values
    if values <= limit:
        return None
    return (f"invalid {param!r}: {n} choices x {tokens} tokens x {per_token} log probabilities "
            f"is {values:,} values, above this gateway's limit of {limit:,} for an answer that "
            "is not streamed (TOKENFLEET_MAX_LOGPROB_VALUES); lower n, the token limit or "
            f"{param}, or stream the answer")


def chat_logprobs(events: Iterable[TokenEvent]) -> dict[str, Any]:
    """Chat's shape for a job's events, in order."""
    content = [{**_entry(lp.token, lp.logprob),
                "top_logprobs": [_entry(t.token, t.logprob) for t in lp.top]}
               for event in events for lp in _values(event)]
    return {"content": content, "refusal": None}


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def _values(event: TokenEvent) -> list[TokenLogprob]:
    if event.logprobs is None or len(event.logprobs) != len(event.token_ids):
        # The job asked for them and its worker's engine refuses jobs it cannot
        # report them for: a log without them is not this fleet's writing.
        raise ValueError(f"the token log of tokens {event.index} to {event.end - 1} holds no "
                         "log probabilities")
    return event.logprobs

