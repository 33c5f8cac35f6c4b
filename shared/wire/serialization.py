"""JSON in and out of Redis: the only encoding the fleet puts on the wire.

Events on a job's token log and channel are small JSON objects with a kind
``k``: ``tok`` for a :class:`TokenEvent`, ``end`` for an :class:`EndEvent`.
They are built as plain dicts on the worker (the hot path), parsed into the
pydantic types on the client.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import orjson

from tokenfleet.shared.wire.schemas import EndEvent, FinishReason, JobStatus, TokenEvent

dumps = orjson.dumps


def loads(data: bytes | str) -> Any:
    return orjson.loads(data)


def token_event(index: int, token_ids: list[int], texts: list[str],
                logprobs: list[Any] | None = None, prompt: dict[str, Any] | None = None,
                prompt_tokens: int | None = None) -> bytes:
    """The event of tokens ``token_ids`` from ``index`` on, ``texts`` the text
    each one adds: one text, and where each token's part of it ends when
    there are several (see :class:`TokenEvent`); ``logprobs`` in their wire
    form (:class:`TokenLogprob`), one per token, when the job asked for them;
    on the first event, the prompt's length in tokens."""
    event: dict[str, Any] = {"k": "tok", "index": index, "token_ids": token_ids}
    if prompt_tokens is not None:
        event["prompt_tokens"] = prompt_tokens
    if len(texts) == 1:
        event["text"] = texts[0]
    else:
        offsets, at = [], 0
        for text in texts:
            at += len(text)
            offsets.append(at)
        event["text"] = "".join(texts)
        event["offsets"] = offsets
    if prompt is not None:  # the prompt's log probabilities (PromptEcho's wire form)
        event["prompt"] = prompt
    if logprobs is None and prompt is None:
        return orjson.dumps(event)
    if logprobs is not None:
        event["logprobs"] = logprobs
    # numpy float32 values as the shortest text that reads back as the same float32.
    return orjson.dumps(event, option=orjson.OPT_SERIALIZE_NUMPY)


@lru_cache(maxsize=256)  # most jobs end alike: one encoding serves them all
def end_event(status: JobStatus, finish_reason: FinishReason | None, error: str | None) -> bytes:
    return orjson.dumps(
        {
            "k": "end",
            "status": status.value,
            "finish_reason": finish_reason.value if finish_reason else None,
            "error": error,
        }
    )


def parse_event(data: bytes | str) -> TokenEvent | EndEvent:
    obj = orjson.loads(data)
    kind = obj.pop("k", None)
    if kind == "tok":
        return TokenEvent.model_validate(obj)
    if kind == "end":
        return EndEvent.model_validate(obj)
    raise ValueError(f"unknown event kind {kind!r}")
