"""The prompt echoed with its log probabilities: OpenAI's ``echo`` with
``logprobs`` on completions, and an ``echo`` of a prompt of token ids.

The worker computes them from the prefill's logits and writes them, with the
prompt's text (it has the tokenizer; a prompt of token ids has no text here),
on the job's first event (``TokenEvent.prompt``). In completions' shape the
prompt's tokens come first, the first with no log probability (None, as
OpenAI writes it), then the generated ones, ``text_offset`` counting on
through both.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tokenfleet.openai.logprobs import CompletionLogprobs
from tokenfleet.shared.wire.schemas import PromptEcho, TokenEvent


def prompt_of(events: Sequence[TokenEvent]) -> PromptEcho | None:
    """The prompt the job's first event carries, if it carries one."""
    for event in events:
        if event.index == 0:
            return event.prompt
    return None


def echo_logprobs(prompt: PromptEcho) -> dict[str, Any]:
    """Completions' ``logprobs`` for the prompt's tokens; ``text_offset`` from 0."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                 "text_offset": []}
    for token, offset in zip(prompt.tokens, prompt.offsets):
        out["tokens"].append(token.token)
        out["token_logprobs"].append(token.logprob)
        if token.logprob is None or token.top is None:
            out["top_logprobs"].append(None)
        else:
            top = {t.token: t.logprob for t in token.top}
            top.setdefault(token.token, token.logprob)  # as for generated tokens: always there
            out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
    return out


def joined(prompt: dict[str, Any], generated: dict[str, Any], echoed: str) -> dict[str, Any]:
    """The prompt's logprobs followed by the generated tokens', these offset
    by the echoed text's length (their own ``text_offset`` counts from 0)."""
    return {"tokens": prompt["tokens"] + generated["tokens"],
            "token_logprobs": prompt["token_logprobs"] + generated["token_logprobs"],
            "top_logprobs": prompt["top_logprobs"] + generated["top_logprobs"],
            "text_offset": prompt["text_offset"] + [o + len(echoed)
                                                    for o in generated["text_offset"]]}


def vllm_prompt_logprobs(prompt: PromptEcho) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else
    ``{token_id: {logprob, rank, decoded_token}}`` for the token and the
    likeliest ones there (rank 1 the likeliest; the prompt token's own rank is
    its place among them, or one past them where it is not one)."""
    out: list[dict[str, Any] | None] = []
    for token_id, token in zip(prompt.token_ids, prompt.tokens):
        if token.logprob is None:
            out.append(None)
            continue
        top = token.top or []
        ranked = {str(t.token_id): {"logprob": t.logprob, "rank": rank,
                                    "decoded_token": t.token}
                  for rank, t in enumerate(top, start=1)}
        ranked.setdefault(str(token_id), {"logprob": token.logprob, "rank": len(top) + 1,
                                          "decoded_token": token.token})
        out.append(ranked)
    return out


def from_worker(ask: Any) -> bool:
    """Whether a streamed echo waits for the worker's first event: a prompt of
    token ids (the worker writes its text), or the prompt's log probabilities.
    A text prompt alone is echoed at once, from the request."""
    return bool(ask.echo) and (not isinstance(ask.prompt, str) or ask.logprobs is not None)


def echo_text(ask: Any, event: TokenEvent) -> str:
    """The echoed prompt a stream's chunk of ``event`` opens with: on the job's
    first event only, the request's text, or the worker's for token ids."""
    if event.index != 0 or event.prompt is None:
        return ""
    return ask.prompt if isinstance(ask.prompt, str) else event.prompt.text


class EchoedLogprobs(CompletionLogprobs):
    """Completions' streamed ``logprobs`` with the prompt's first: the first
    event's chunk holds the prompt's tokens, then its own; ``text_offset``
    counts on through the echoed text."""

    def __init__(self, ask: Any) -> None:
        super().__init__()
        self.ask = ask

    def __call__(self, events: Iterable[TokenEvent]) -> dict[str, Any]:
        events = list(events)
        first = next((e for e in events if e.index == 0 and e.prompt is not None), None)
        if first is None or first.prompt is None:
            return super().__call__(events)
        # The generated tokens' offsets count on from the echoed text.
        self.offset += len(echo_text(self.ask, first))
        return joined(echo_logprobs(first.prompt), super().__call__(events), "")


def prompt_wanted(ask: Any) -> int | None:
    """How many likeliest tokens per prompt position a completion request needs
    from its worker (``SamplingParams.prompt_logprobs``), None if it needs no
    prompt: vLLM's ``prompt_logprobs``, ``echo`` with ``logprobs``, and an
    ``echo`` of token ids (the prompt's text comes with the values)."""
    asked = [ask.prompt_logprobs] if ask.prompt_logprobs is not None else []
    if ask.echo and ask.logprobs is not None:
        asked.append(ask.logprobs)
    elif ask.echo and not isinstance(ask.prompt, str):
        asked.append(0)
    return max(asked) if asked else None


def echoed(ask: Any, choice: dict[str, Any], events: Sequence[TokenEvent],
           shape: type[CompletionLogprobs] = CompletionLogprobs) -> None:
    """``choice`` (an answer that is not streamed) completed from its job's
    events: the generated tokens' ``logprobs``, after the prompt's where it is
    echoed; the prompt's text where it is echoed from token ids; vLLM's
    ``prompt_logprobs`` where asked."""
    prompt = prompt_of(events)
    if ask.echo and prompt is None and prompt_wanted(ask) is not None:
        raise ValueError("the job's token log holds no prompt: its worker did not write it")
    text = ask.prompt if isinstance(ask.prompt, str) else (prompt.text if prompt else "")
    if ask.echo and not isinstance(ask.prompt, str):
        choice["text"] = text + choice["text"]
    if ask.logprobs is not None:
        generated = shape()(events)
        if ask.echo and prompt is not None:
            generated = joined(echo_logprobs(prompt), generated, text)
        choice["logprobs"] = generated
    if ask.prompt_logprobs is not None and prompt is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt)
