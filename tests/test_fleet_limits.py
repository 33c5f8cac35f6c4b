"""The fleet owns its limits: what the queue's workers allow holds every submit,
whatever the submitting client's settings say; a client's own settings can
only be stricter; with no live worker they hold alone. A refusal names the
real limit and what sets it."""

from __future__ import annotations

import re
from typing import Any

import pytest
import redis

from tokenfleet import FleetClient
from tokenfleet.shared.wire.errors import LimitExceeded, PromptTooLong, QueueFull
from tokenfleet.shared.wire.keys import Keys, level_queue
from tokenfleet.shared.wire.schemas import JobStatus

from gateway_server import gateway  # noqa: F401  (a fixture)
from helpers import wait_until

pytestmark = pytest.mark.timeout(120)

MODEL_SAYS = "the model allows 1023 (model length 1024)"  # the built-in tiny model


def client_with(settings: Any, **limits: Any) -> FleetClient:
    """A client whose own settings allow what ``limits`` say (more, or less)."""
    return FleetClient(settings=settings.model_copy(update=limits))


def queued(r: redis.Redis, settings: Any) -> int:
    return r.xlen(Keys(settings.namespace).queue(level_queue("default", "normal")))


def a_prompt_of(tokenizer: Any, tokens: int) -> tuple[str, int]:
    """A prompt of about ``tokens`` tokens, and its count by the model's tokenizer."""
    prompt = "x y " * (tokens // 2)
    return prompt, len(tokenizer(prompt)["input_ids"])


def test_a_workers_max_queue_holds_a_client_that_allows_more(
        settings: Any, start_worker: Any, r: redis.Redis) -> None:
    worker = start_worker(max_queue=2)
    worker.paused.set()  # nothing runs: the jobs stay queued
    for client in (client_with(settings, max_queue=100_000), client_with(settings)):
        with client:
            while queued(r, settings) < 2:
                client.submit("Hello", max_new_tokens=4)
            with pytest.raises(QueueFull) as refused:
                client.submit("Hello", max_new_tokens=4)
    assert refused.value.limit == 2
    assert "limit 2, TOKENFLEET_MAX_QUEUE of the queue's workers" in str(refused.value)
    assert queued(r, settings) == 2


def test_a_workers_max_new_tokens_limit_holds_a_client_that_allows_more(
        settings: Any, start_worker: Any, r: redis.Redis) -> None:
    start_worker(max_new_tokens_limit=16)
    for client in (client_with(settings, max_new_tokens_limit=4096), client_with(settings)):
        with client, pytest.raises(LimitExceeded) as refused:
            client.submit("Hello", max_new_tokens=100)
        assert str(refused.value) == ("max_new_tokens is 100; the queue allows 16 "
                                      "(TOKENFLEET_MAX_NEW_TOKENS_LIMIT of the queue's workers)")
    assert queued(r, settings) == 0
    with client_with(settings) as client:  # within it: runs as ever
        assert client.wait(client.submit("Hello", max_new_tokens=16, temperature=0),
                           timeout=60).status is JobStatus.SUCCEEDED


def test_a_prompt_over_the_models_length_is_refused_at_submit_naming_the_model(
        settings: Any, start_worker: Any, loaded_tiny: tuple[Any, Any], r: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    start_worker()  # TOKENFLEET_MAX_PROMPT_TOKENS 2048 everywhere; the model takes 1023
    prompt, count = a_prompt_of(loaded_tiny[1], 1503)
    assert 1023 < count < 2048
    with client_with(settings) as client:
        with pytest.raises(LimitExceeded) as refused:
            client.submit(prompt, prompt_tokens=count, max_new_tokens=4)
        assert str(refused.value) == f"prompt has {count} tokens; {MODEL_SAYS}"
        assert refused.value.name == "prompt_tokens" and refused.value.limit == 1023
        # The model is on this machine: the client counts the prompt itself.
        with pytest.raises(PromptTooLong, match=re.escape(MODEL_SAYS)):
            client.submit(prompt, max_new_tokens=4)
        assert queued(r, settings) == 0
        # A client without the tokenizer counts nothing: the worker always
        # does, and fails the job with the same sentence.
        monkeypatch.setattr("tokenfleet.client.sync.count_prompt_tokens", lambda *_: None)
        state = client.wait(client.submit(prompt, max_new_tokens=4), timeout=60)
    assert state.status is JobStatus.FAILED
    assert f"prompt has {count} tokens; {MODEL_SAYS}" in (state.error or "")


def test_a_clients_stricter_settings_still_hold(
        settings: Any, start_worker: Any, r: redis.Redis) -> None:
    worker = start_worker()
    worker.paused.set()
    with client_with(settings, max_queue=1, max_prompt_tokens=5) as client:
        with pytest.raises(LimitExceeded) as refused:
            client.submit("a prompt", prompt_tokens=9, max_new_tokens=4)
        assert str(refused.value) == ("prompt has 9 tokens; this client allows 5 "
                                      "(TOKENFLEET_MAX_PROMPT_TOKENS of this client)")
        client.submit("a prompt", prompt_tokens=5, max_new_tokens=4)
        with pytest.raises(QueueFull, match="limit 1, TOKENFLEET_MAX_QUEUE of this client"):
            client.submit("Hello", max_new_tokens=4)
    assert queued(r, settings) == 1


def test_with_no_live_worker_the_clients_settings_hold(
        settings: Any, start_worker: Any, r: redis.Redis) -> None:
    worker = start_worker(max_new_tokens_limit=16)
    worker.stop(grace_s=0)  # it leaves, its limits with it
    with client_with(settings, max_queue=1) as client:
        client.submit("Hello", max_new_tokens=100, require_worker=False)
        with pytest.raises(QueueFull, match="TOKENFLEET_MAX_QUEUE of this client"):
            client.submit("Hello", max_new_tokens=4, require_worker=False)
    assert queued(r, settings) == 1


def test_a_dead_workers_limits_are_forgotten_by_a_live_one(
        settings: Any, start_worker: Any, r: redis.Redis) -> None:
    keys = Keys(settings.namespace)
    # A worker that died with the strictest limit: its field is left, it is not live.
    r.hset(keys.limits("default"), "dead@test", '{"new_tokens": {"value": 1, "by": "the queue", '
                                                '"why": "TOKENFLEET_MAX_NEW_TOKENS_LIMIT"}}')
    start_worker()
    wait_until(lambda: not r.hexists(keys.limits("default"), "dead@test"), timeout=30,
               what="a live worker's heartbeat to forget the dead one's limits")
    with client_with(settings) as client:
        client.submit("Hello", max_new_tokens=8)


def test_the_gateway_refuses_a_request_over_the_workers_limit_as_invalid(
        gateway: Any, start_worker: Any, r: redis.Redis, settings: Any) -> None:
    start_worker(max_new_tokens_limit=16)
    http = gateway(max_new_tokens_limit=4096)  # the gateway's own setting allows it
    response = http.post("/v1/jobs", json={"prompt": "Hello", "sampling": {"max_new_tokens": 100}})
    assert response.status_code == 400, response.text  # not retried by an HTTP client
    assert "max_new_tokens is 100; the queue allows 16" in response.text
    assert queued(r, settings) == 0
