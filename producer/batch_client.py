"""Batches from Python: ``client.submit_batch(requests)``, ``client.batch(id)``,
``client.batch_results(id)``, ``client.cancel_batch(id)``.

The requests are streamed into the file store as the batch's input file (the
client never holds them all), then the batch is recorded; a batch driver runs
it: every gateway runs one, and ``tokenfleet batch drive`` runs one without a
gateway. Requests are dicts as a batch file's lines hold them (``custom_id``
and ``body``; ``method`` and ``url`` may be left out) or ``GenerationRequest``s
(their custom_id is ``request-<n>``, n counting from 0), each field kept
(``openai_body``; one a body cannot carry is refused, naming it).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any, Literal

import orjson

from tokenfleet.batch_records import (
    Batch,
    cancel_batch,
    create_batch,
    get_batch,
)
from tokenfleet.files import create_file, max_line_bytes, store_name
from tokenfleet.protocol import check_webhook_destination
from tokenfleet.shared.errors import InvalidRequest
from tokenfleet.shared.file_store import FileStore, open_store, read_lines
from tokenfleet.shared.schemas import GenerationRequest
from tokenfleet.shared.structured import StructuredOutput

Request = dict[str, Any] | GenerationRequest
Order = Literal["input", "finished"]
UPLOAD_CHUNK = 1 << 16
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# SamplingParams' fields by their OpenAI names.
SAMPLING = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
            "top_k": "top_k", "seed": "seed", "stop": "stop", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty"}


def endpoint_of(request: Request) -> str:
    """The endpoint a request goes to: its url, else chat for messages."""
    if isinstance(request, GenerationRequest):
        return CHAT if request.messages is not None else COMPLETIONS
    if "url" in request:
        return str(request["url"])
    return CHAT if "messages" in (request.get("body") or {}) else COMPLETIONS


def openai_body(request: GenerationRequest) -> dict[str, Any]:
    """A ``GenerationRequest`` as the OpenAI request its endpoint takes: every
    field the endpoint maps back to the same request. ``InvalidRequest`` names
    a field the endpoint's body cannot carry, rather than leave it out; the
    batch sets ``priority``, ``tenant``, ``idempotency_key`` and the deadline
    (its window) of each line itself."""
    chat = request.messages is not None
    body: dict[str, Any] = {"model": request.model}
    if chat:
        body["messages"] = [m if isinstance(m, dict) else m.model_dump(exclude_none=True)
                            for m in request.messages or ()]
    elif request.prompt_token_ids is not None:
        body["prompt"] = list(request.prompt_token_ids)
    else:
        body["prompt"] = request.prompt
    if request.suffix is not None:
        body["suffix"] = request.suffix
    sampling = request.sampling.model_dump(exclude_defaults=True)
    sampling["max_new_tokens"] = request.sampling.max_new_tokens
    for name, value in sampling.items():
        if name in SAMPLING and value is not None:
            body[SAMPLING[name]] = value
    if request.sampling.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in request.sampling.logit_bias.items()}
    logprobs = request.sampling.logprobs
    if logprobs is not None:
        body.update({"logprobs": True, "top_logprobs": logprobs} if chat
                    else {"logprobs": logprobs})
    body.update(_metadata(request.metadata, chat))
    if request.webhook_url is not None:
        body["webhook_url"] = request.webhook_url
    if request.structured_output is not None:
        body.update(_structured(request.structured_output))
    if request.tools is not None:  # a request with tools is a chat
        body["tools"] = request.tools
    return body


def _metadata(metadata: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The request's metadata as the endpoint's fields: ``user`` on both; the
    rest in a chat's ``metadata`` (OpenAI's, strings only)."""
    user = metadata.get("user")
    rest = {k: v for k, v in metadata.items() if k != "user"}
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("metadata: 'user' must be a string (OpenAI's user)")
    if rest and not (chat and all(isinstance(v, str) for v in rest.values())):
        where = "a chat carries metadata of strings only" if chat else (
            "a completion carries only metadata['user'] (OpenAI's user)")
        raise InvalidRequest(f"metadata: {where}; got {', '.join(sorted(rest))[:200]}")
    out: dict[str, Any] = {} if user is None else {"user": user}
    return {**out, "metadata": rest} if rest else out


def _structured(spec: StructuredOutput) -> dict[str, Any]:
    """A spec as the field the endpoints read it from: OpenAI's
    ``response_format`` for JSON (a schema keeps its name), vLLM's
    ``structured_outputs`` for the rest."""
    if spec.kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if spec.kind == "json_schema":
        named = {} if spec.name is None else {"name": spec.name}
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {**named, "schema": spec.json_schema}}}
    return {"structured_outputs": {spec.kind: getattr(spec, spec.kind)}}


def line_of(index: int, request: Request, endpoint: str) -> bytes:
    if isinstance(request, GenerationRequest):
        line: dict[str, Any] = {"custom_id": f"request-{index}", "body": openai_body(request)}
    else:
        line = dict(request)
    line.setdefault("method", "POST")
    line.setdefault("url", endpoint)
    return orjson.dumps(line) + b"\n"


async def submit_batch(client: Any, requests: Iterable[Request] | AsyncIterable[Request], *,
                       endpoint: str | None = None, completion_window: str = "24h",
                       metadata: dict[str, str] | None = None, tenant: str | None = None,
                       store: FileStore | None = None) -> Batch:
    """Stream ``requests`` into the store as a batch's input, then create the batch."""
    if metadata and isinstance(metadata.get("webhook_url"), str):
        check_webhook_destination(metadata["webhook_url"], client.settings,
                                  "metadata.webhook_url")
    store = store or open_store(client.settings.files_url)
    source = _aiter(requests)
    first = await anext(source, None)
    if first is None:
        raise InvalidRequest("a batch needs at least one request")
    endpoint = endpoint or endpoint_of(first)

    async def chunks() -> AsyncIterator[bytes]:
        # Lines go to the store's thread in chunks, not one by one: each hand-over
        # is a round trip between the threads.
        assert first is not None and endpoint is not None
        chunk = bytearray(line_of(0, first, endpoint))
        index = 1
        async for request in source:
            chunk += line_of(index, request, endpoint)
            index += 1
            if len(chunk) >= UPLOAD_CHUNK:
                yield bytes(chunk)
                chunk.clear()
        if chunk:
            yield bytes(chunk)

    file = await create_file(client.redis, client.keys, store, chunks(),
                             filename="batch_input.jsonl", purpose="batch", tenant=tenant,
                             max_files=client.settings.files_max_per_tenant,
                             max_line=max_line_bytes(client.settings.max_payload_bytes))
    return await create_batch(client.redis, client.keys, input_file_id=file.id,
                              endpoint=endpoint, completion_window=completion_window,
                              metadata=metadata, tenant=tenant,
                              max_open=client.settings.batch_max_open)


async def _aiter(requests: Iterable[Request] | AsyncIterable[Request]
                 ) -> AsyncIterator[Request]:
    if isinstance(requests, AsyncIterable):
        async for request in requests:
            yield request
    else:
        for request in requests:
            yield request


async def batch(client: Any, batch_id: str, tenant: str | None = None) -> Batch:
    found = await get_batch(client.redis, client.keys, batch_id, tenant)
    if found is None:
        raise KeyError(f"no batch {batch_id!r}")
    return found


async def cancel(client: Any, batch_id: str, tenant: str | None = None) -> Batch:
    found = await cancel_batch(client.redis, client.keys, batch_id, tenant)
    if found is None:
        raise KeyError(f"no batch {batch_id!r}")
    return found


def results(store: FileStore, found: Batch, order: Order = "finished"
            ) -> Iterator[dict[str, Any]]:
    """The batch's result lines (its output file's, then its error file's), in
    the order they finished, streamed; or, with ``order="input"``, in its
    input's order: the result files hold no line number, so their lines are
    held in memory (as their bytes) to be sorted. Blocking."""
    files = [f for f in (found.output_file_id, found.error_file_id) if f]
    lines = (line for f in files for line in read_lines(store, store_name(f)) if line.strip())
    if order == "finished":
        yield from (orjson.loads(line) for line in lines)
        return
    # By custom_id, in the files' order: a duplicate custom_id (or none) names
    # more than one line, each given to the next input line that names it.
    by_id: dict[str | None, deque[bytes]] = {}
    for line in lines:
        by_id.setdefault(custom_id_of(line), deque()).append(line)
    for raw in read_lines(store, store_name(found.input_file_id)):
        if raw.strip():
            waiting = by_id.get(custom_id_of(raw))
            if waiting:
                yield orjson.loads(waiting.popleft())
    for rest in by_id.values():  # lines whose custom_id the input does not give
        yield from (orjson.loads(line) for line in rest)


def custom_id_of(raw: bytes) -> str | None:
    """A line's custom_id; None for a line that is not JSON or names none."""
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    custom_id = line.get("custom_id") if isinstance(line, dict) else None
    return custom_id if isinstance(custom_id, str) and custom_id else None


async def aresults(client: Any, batch_id: str, order: Order = "finished",
                   tenant: str | None = None) -> AsyncIterator[dict[str, Any]]:
    found = await batch(client, batch_id, tenant)
    lines = results(open_store(client.settings.files_url), found, order)
    while chunk := await asyncio.to_thread(_take, lines, 256):
        for line in chunk:
            yield line


def _take(lines: Iterator[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    out = []
    for line in lines:
        out.append(line)
        if len(out) >= n:
            break
    return out
