"""A prompt's length in tokens of its queue's model, checked before it is enqueued.

The worker counts every prompt (it has the tokenizer) and fails a job over its
limit, but a job that can never run is better never enqueued: the caller hears
at once, and an HTTP client hears a 400 it does not retry. So where the model a
live worker of the queue serves is on this machine too (a built-in model, or a
directory here) and the ``tokenizers`` package is installed, the client counts
the prompt and hands the count to the submit script, which refuses it
(``PromptTooLong``) over the strictest of the workers' published limits (the
model's length) and this client's. Elsewhere the worker's own check stands.

A chat is counted by its messages' text alone: its template adds tokens around
them, so the count is a lower bound, and a chat refused here is surely too long.

An API key's tokens per minute need the other side: ``charged_prompt_tokens``
is at least the prompt's tokens (exact for a text prompt or token ids where
the tokenizer is here; else a bound from above), so no charge at admission is
under what the job will use.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from tokenfleet.shared.models import local_tokenizer_file
from tokenfleet.shared.wire.schemas import GenerationRequest
from tokenfleet.shared.settings import Settings

# Tokenizers make at most one token per byte of UTF-8 (byte-level BPE is the
# finest), plus the special tokens they add: a prompt shorter than the limit by
# this many bytes needs no count, and no look at who serves the queue.
SPECIAL_TOKENS_MARGIN = 16


# A chat template wraps each message in markers of its own (its role, start and
# end tokens): charged at this many tokens a message, on top of its text. (A
# template that adds a long text of its own, a default system prompt, is
# charged what it used once the job ends.)
CHAT_MARKERS_PER_MESSAGE = 16


def prompt_token_limit(settings: Settings) -> tuple[int, str]:
    """The most tokens a prompt may have, and where that limit comes from."""
    return settings.max_prompt_tokens, "TOKENFLEET_MAX_PROMPT_TOKENS"


def worth_counting(request: GenerationRequest, settings: Settings) -> bool:
    """Whether the prompt could be over the limit at all (else: no count needed)."""
    limit, _source = prompt_token_limit(settings)
    size = sum(len(text.encode()) for text in _texts(request))
    return size + SPECIAL_TOKENS_MARGIN > limit


def count_prompt_tokens(request: GenerationRequest, models: list[str]) -> int | None:
    """The prompt's tokens in the first of ``models`` (those the queue's live
    workers load) found on this machine; None where none is."""
    for model in models:
        tokenizer = _tokenizer(model)
        if tokenizer is None:
            continue
        if request.prompt is not None:
            return len(tokenizer.encode(request.prompt).ids)
        return sum(len(tokenizer.encode(text, add_special_tokens=False).ids)
                   for text in _texts(request))
    return None


def charged_prompt_tokens(request: GenerationRequest, models: list[str]) -> tuple[int, bool]:
    """At least the tokens the job's prompt will be, and whether exactly: token
    ids as they are; a text prompt counted by the tokenizer of the first of
    ``models`` found here; else every text the worker renders into the prompt
    (a chat's messages, its tools, a suffix) counted by that tokenizer or, with
    none here, one token a byte (no tokenizer makes more: byte-level BPE is the
    finest), plus the special tokens and a chat's markers. Tokenizes: call it
    off the event loop."""
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids), True
    if request.prompt is not None and request.suffix is None:
        counted = count_prompt_tokens(request, models)
        if counted is not None:
            return counted, True
    texts = _rendered_texts(request)
    tokenizer = next((t for t in map(_tokenizer, models) if t is not None), None)
    tokens = (sum(len(tokenizer.encode(text, add_special_tokens=False).ids) for text in texts)
              if tokenizer is not None else sum(len(text.encode()) for text in texts))
    return (tokens + SPECIAL_TOKENS_MARGIN
            + CHAT_MARKERS_PER_MESSAGE * len(request.messages or [])), False


def _rendered_texts(request: GenerationRequest) -> list[str]:
    """Every text of the request that can reach its prompt."""
    texts = [*_texts(request), request.suffix or ""]
    for message in request.messages or []:
        if message.tool_calls:
            texts.append(json.dumps([c.model_dump() for c in message.tool_calls]))
        texts.append(message.tool_call_id or "")
    if request.tools:
        texts.append(json.dumps(request.tools))
    return texts


def _texts(request: GenerationRequest) -> list[str]:
    if request.prompt is not None:
        return [request.prompt]
    return [m.content for m in request.messages or []]


def _tokenizer(model: str) -> Any | None:
    path = local_tokenizer_file(model)
    return None if path is None else _load(path)


@functools.lru_cache(maxsize=8)
def _load(path: Path) -> Any | None:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None  # the bare client: the worker checks
    return Tokenizer.from_file(str(path))
