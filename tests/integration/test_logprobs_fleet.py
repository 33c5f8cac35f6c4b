"""Log probabilities through the whole fleet: the official ``openai`` client on
completions and chat, live and replayed SSE streams, and a resumed job. One
worker on the tiny model and one gateway serve the module."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from tokenfleet import FleetClient, TokenEvent
from tokenfleet.gateway import server_config
from tokenfleet.shared.schemas import JobStatus
from tokenfleet.shared.settings import Settings
from tokenfleet.workers.runner import HFRunner

from gateway_server import _Server, sse_events
from helpers import wait_until

pytestmark = pytest.mark.timeout(120)

PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "Tell me a story"}]


class SlowRunner(HFRunner):
    """The real model at a big model's pace: a job outlives a few reads."""

    def run(self, batch: Any) -> list[int]:
        time.sleep(0.05)  # simulated compute time, not synchronisation
        return super().run(batch)


class Served:
    def __init__(self, settings: Settings, loaded_tiny: tuple[Any, Any]) -> None:
        self.settings, self.loaded_tiny = settings, loaded_tiny
        self.fleet = FleetClient(settings=settings)
        self.http = httpx.Client()
        self.openai: openai.OpenAI

    def worker(self, queue: str = "default", runner: type[HFRunner] = HFRunner) -> Any:
        """A worker on the tiny model serving ``queue``, from its first heartbeat on."""
        from tokenfleet.workers.build import hf_engine
        from tokenfleet.workers.service import Worker

        settings = self.settings.model_copy(update={"queue": queue})
        model_runner = runner(*self.loaded_tiny)
        worker = Worker(settings, hf_engine(settings, model_runner, model_runner.eos_token_ids,
                                            model_runner.max_model_len),
                        self.loaded_tiny[1], name=f"{queue}@test")
        worker.start()
        wait_until(lambda: worker.redis.zscore(worker.keys.queue_workers(queue),
                                               worker.name) is not None,
                   timeout=30, what=f"the {queue} worker's first heartbeat")
        return worker


@pytest.fixture(scope="module")
def served(redis_url: str, loaded_tiny: tuple[Any, Any]) -> Iterator[Served]:
    """A worker on the tiny model and a gateway, on a namespace of the module's own."""
    settings = Settings(queue="default", redis_url=redis_url, namespace=f"t{uuid.uuid4().hex[:10]}",
                        block_ms=20, heartbeat_s=0.5, max_batch=8, max_batch_tokens=65_536,
                        prefetch=4)
    out = Served(settings, loaded_tiny)
    worker = out.worker()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = _Server(server_config(settings, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert server.ready.wait(20), "the gateway did not start"
    out.http = httpx.Client(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=60)
    out.openai = openai.OpenAI(base_url=f"{out.http.base_url}/v1", api_key="unused",
                               max_retries=0, timeout=60)
    yield out
    out.fleet.close()
    out.openai.close()
    out.http.close()
    server.should_exit = True
    thread.join(20)
    worker.stop(grace_s=0)


def reference(loaded_tiny: tuple[Any, Any], prompt_ids: list[int], token_ids: list[int]
              ) -> torch.Tensor:
    """transformers' log_softmax at each generated position: [tokens, vocab]."""
    model, _ = loaded_tiny
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt_ids) - 1:-1]


def test_completions_logprobs_equal_transformers_and_stream_as_they_answer(
    served: Served, loaded_tiny: tuple[Any, Any]
) -> None:
    _, tok = loaded_tiny
    ask = {"model": "default", "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0,
           "logprobs": 3}
    answer = served.openai.completions.create(**ask)
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    state = served.fleet.status(answer.id.removeprefix("cmpl-"))
    expected = reference(loaded_tiny, tok(PROMPT)["input_ids"], state.token_ids)
    assert len(logprobs.token_logprobs) == len(state.token_ids) == 6
    for position, (token_id, value) in enumerate(zip(state.token_ids, logprobs.token_logprobs)):
        assert abs(value - float(expected[position, token_id])) < 1e-4
        top = expected[position].topk(3)
        assert list(logprobs.top_logprobs[position].values()) == pytest.approx(  # type: ignore[index]
            top.values.tolist(), abs=1e-4)
    assert logprobs.tokens == [tok.decode([t]) for t in state.token_ids]
    offsets = logprobs.text_offset or []
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(state.text)

    streamed: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in served.openai.completions.create(**ask, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for name, values in streamed.items():
                values.extend(getattr(chunk.choices[0].logprobs, name))
    assert streamed == {"tokens": logprobs.tokens, "token_logprobs": logprobs.token_logprobs,
                        "text_offset": offsets}


def test_chat_logprobs_parse_in_the_openai_client_with_top_logprobs(served: Served) -> None:
    ask: dict[str, Any] = {"model": "default", "messages": CHAT, "max_tokens": 5,
                           "temperature": 0.0, "logprobs": True, "top_logprobs": 2}
    answer = served.openai.chat.completions.create(**ask)
    content = answer.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == answer.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == entry.top_logprobs[0].logprob  # greedy: the likeliest
        assert entry.bytes == list(entry.token.encode())
    assert "".join(e.token for e in content) == answer.choices[0].message.content
    streamed = [entry for chunk in served.openai.chat.completions.create(**ask, stream=True)
                if chunk.choices and chunk.choices[0].logprobs is not None
                for entry in chunk.choices[0].logprobs.content or []]
    assert streamed == content
    plain = served.openai.chat.completions.create(model="default", messages=CHAT, max_tokens=2)
    assert plain.choices[0].logprobs is None  # nothing asked, nothing sent


def test_a_replayed_sse_stream_carries_the_live_streams_logprobs(served: Served) -> None:
    # Queued where no worker reads yet: the first read is open before any token exists.
    job_id = served.fleet.submit(PROMPT, model="later", max_new_tokens=8, temperature=0.0,
                                 logprobs=2, require_worker=False)
    opened = threading.Event()

    def read(**headers: str) -> list[Any]:
        with served.http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as events:
            opened.set()
            return [lp for e in sse_events(events.iter_lines()) if e.get("event") == "token"
                    for lp in TokenEvent.model_validate_json(e["data"]).logprobs or []]

    live: list[Any] = []
    reader = threading.Thread(target=lambda: live.extend(read()))
    reader.start()
    assert opened.wait(30)
    worker = served.worker("later")
    try:
        reader.join(60)
        assert not reader.is_alive(), "the live stream did not end"
    finally:
        worker.stop(grace_s=0)
    assert len(live) == 8 and all(len(lp.top) == 2 for lp in live)
    assert read() == live  # replayed from the token log, from token 0
    assert read(**{"Last-Event-ID": "0"}) == live[1:]


def test_a_resumed_job_keeps_the_logprobs_of_its_tokens_before(
    served: Served, loaded_tiny: tuple[Any, Any]
) -> None:
    _, tok = loaded_tiny
    job_id = served.fleet.submit(PROMPT, model="resumed", max_new_tokens=12, temperature=0.0,
                                 logprobs=1, require_worker=False)
    first = served.worker("resumed", SlowRunner)
    seen = 0
    for event in served.fleet.stream(job_id, timeout=60):
        seen += len(event.token_ids)
        if seen >= 3:
            break
    first.stop(grace_s=0)  # hands the job back: the next attempt resumes from its log
    second = served.worker("resumed")
    try:
        state = served.fleet.wait(job_id, timeout=60)
    finally:
        second.stop(grace_s=0)
    assert state.status is JobStatus.SUCCEEDED and state.attempts == 2
    logged = [lp for e in served.fleet.stream(job_id, timeout=30) for lp in e.logprobs or []]
    expected = reference(loaded_tiny, tok(PROMPT)["input_ids"], state.token_ids)
    assert len(logged) == len(state.token_ids) == 12
    for position, (token_id, lp) in enumerate(zip(state.token_ids, logged)):
        assert abs(lp.logprob - float(expected[position, token_id])) < 1e-4


def test_limits_are_400s_naming_the_field_and_the_limit(served: Served) -> None:
    cases = [("/v1/completions", {"prompt": "hi", "logprobs": 6}, "logprobs", "5"),
             ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs", "integer"),
             ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
              "top_logprobs", "20"),
             ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, None,
              "top_logprobs needs logprobs"),
             ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs", "boolean")]
    for path, body, param, words in cases:
        response = served.http.post(path, json=body)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == param and words in error["message"], (body, error)
    with pytest.raises(Exception, match="logprobs"):
        served.fleet.submit(PROMPT, logprobs=21)
