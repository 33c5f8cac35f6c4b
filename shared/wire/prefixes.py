"""A request's prefix keys: what placement by prefix matches jobs on.

A worker's prefix cache holds the KV of prompts it ran lately; a job whose prompt
starts the same way runs cheaper there. The gateway has not tokenized the prompt
(the worker does), so the keys name text, not blocks: each key is a hash of one
leading part of the request, and its length (in characters) is what a match on
it is worth (``submit.lua`` scores matched length against the prompt's).

- A chat's keys name its leading messages: the tools and the first message (the
  system prompt), then each longer run of turns before the last message. An
  agent's growing conversation matches the worker that ran its earlier turns.
- A prompt's keys name its first 128, 256, 512, ... characters (each power of
  two shorter than the prompt, from ``TOKENFLEET_AFFINITY_MIN_CHARS``): two
  prompts sharing 600 characters share the keys of 128 to 512.
- ``prompt_cache_key`` (OpenAI's field) is a key of its own, worth the whole
  prompt: the caller says which requests share a prefix.

Keys are the model's: the same text on two queues names two prefixes.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import orjson
from tokenfleet.shared.wire.schemas import GenerationRequest

# The most keys one request carries.
MOST = 12


class PrefixKey(NamedTuple):
    length: int  # characters of the request the key covers
    key: str


def prefix_keys(request: GenerationRequest, shortest: int = 128) -> list[PrefixKey]:
    """The keys of ``request``, shortest first, each of at least ``shortest``
    characters (``TOKENFLEET_AFFINITY_MIN_CHARS``: a prompt this short costs
    little to compute again); none for a prompt of token ids."""
    keys: list[PrefixKey] = []
    if request.messages:
        keys = _chat_keys(request, shortest)
    elif request.prompt and request.suffix is None:
        keys = _prompt_keys(request.model, request.prompt, shortest)
    if request.prompt_cache_key is not None:
        keys.append(PrefixKey(request_length(request), _key(request.model, "cache-key",
                                                   request.prompt_cache_key)))
    return keys[-MOST:]


def request_length(request: GenerationRequest) -> int:
    """The request's length in characters, as its keys' lengths count them."""
    if request.messages:
        return len(orjson.dumps(request.tools or []).decode()) + sum(len(m.content)
                                                            for m in request.messages)
    return max(1, len(request.prompt or ""))


def _prompt_keys(model: str, prompt: str, shortest: int) -> list[PrefixKey]:
    keys = []
    length = shortest
    while length < len(prompt):
        keys.append(PrefixKey(length, _key(model, "prompt", prompt[:length])))
        length *= 2
    return keys


def _chat_keys(request: GenerationRequest, shortest: int) -> list[PrefixKey]:
    messages = request.messages or []
    head = orjson.dumps(request.tools or []).decode()  # request_length counts it so
    keys, length, parts = [], len(head), [head]
    # Every message but the last: that one is what is new in this request.
    for message in messages[:-1]:
        text = message.model_dump_json(exclude_defaults=True)
        parts.append(text)
        length += len(message.content)
        if length >= shortest:
            keys.append(PrefixKey(length, _key(request.model, "chat", "\n".join(parts))))
    return keys


def _key(model: str, kind: str, text: str) -> str:
    digest = hashlib.blake2b(f"{model}\n{kind}\n{text}".encode(), digest_size=10)
    return digest.hexdigest()
