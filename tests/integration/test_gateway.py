"""The HTTP gateway, served by a real uvicorn, in front of a real redis-server and worker."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis

from tokenfleet import FleetClient
from tokenfleet.openai.structured import AUTO_REFUSED
from tokenfleet.shared.wire import errors
from tokenfleet.shared.wire.keys import Keys, job_id_in, level_queue
from tokenfleet.shared.wire.schemas import JobStatus, QueueEntry
from tokenfleet.shared.settings import Settings

from gateway_server import gateway, pin_live_worker, port_of, sse_events  # noqa: F401  (a fixture)
from helpers import wait_until, written_keys

pytestmark = pytest.mark.timeout(120)

UNSERVED = "nobody-serves-this"  # a queue no worker of the test reads


def read_events(http: httpx.Client, job_id: str, **headers: str) -> list[dict[str, str]]:
    with http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(sse_events(response.iter_lines()))


def test_a_submitted_job_is_accepted_and_its_record_reads_succeeded(
    gateway: Any, start_worker: Any, client: FleetClient
) -> None:
    start_worker()
    http = gateway()
    response = http.post("/v1/jobs", json={"prompt": "Hello there",
                                           "sampling": {"max_new_tokens": 8, "temperature": 0}})
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    assert response.json() == {"id": job_id, "status": "queued"}
    assert response.headers["location"] == f"/v1/jobs/{job_id}"
    final = client.wait(job_id, timeout=60)
    state = http.get(response.headers["location"]).json()
    assert state["status"] == "succeeded" and state["id"] == job_id
    assert state["text"] == final.text and len(state["token_ids"]) == len(final.token_ids) > 0


def test_a_bad_body_is_422_naming_the_field_and_nothing_is_enqueued(
    gateway: Any, r: redis.Redis, settings: Any
) -> None:
    http = gateway()
    response = http.post("/v1/jobs", json={"prompt": "hi", "sampling": {"max_new_tokens": 0}})
    assert response.status_code == 422
    [err] = response.json()["detail"]
    assert err["loc"] == ["body", "sampling", "max_new_tokens"] and "1" in err["msg"]
    response = http.post("/v1/jobs", json={"prompt": "hi", "sampling": {"max_new_tokens": 10**6}})
    assert response.status_code == 422 and "limit of 1024" in response.text
    response = http.post("/v1/jobs", json={"prompt": "hi", "max_tokens": 5})
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "max_tokens"]
    response = http.post("/v1/jobs", content=b"{not json")
    assert response.status_code == 422 and response.json()["detail"][0]["type"] == "json_invalid"
    assert not written_keys(r, settings.namespace)


def test_a_body_over_the_payload_limit_is_413_with_or_without_a_length(
    gateway: Any, r: redis.Redis, settings: Any
) -> None:
    http = gateway(max_payload_bytes=1000, require_worker=False)  # no worker: queue ahead
    big = orjson.dumps({"prompt": "x" * 2000})
    response = http.post("/v1/jobs", content=big)
    assert response.status_code == 413 and "1000 bytes" in response.json()["detail"]
    chunked = http.post("/v1/jobs", content=iter([big[:600], big[600:]]))  # no Content-Length
    assert chunked.status_code == 413
    response = http.post("/v1/completions", content=big)
    assert response.status_code == 413 and "1000 bytes" in response.json()["error"]["message"]
    assert http.post("/v1/jobs", json={"prompt": "x" * 100}).status_code == 202


def test_a_full_queue_is_429_with_retry_after(gateway: Any) -> None:
    http = gateway(max_queue=1, require_worker=False)  # queues ahead of any worker
    body = {"prompt": "waits forever", "model": UNSERVED}
    assert http.post("/v1/jobs", json=body).status_code == 202
    response = http.post("/v1/jobs", json=body)
    assert response.status_code == 429
    assert int(response.headers["retry-after"]) > 0
    assert "is full" in response.json()["detail"] and "TOKENFLEET_MAX_QUEUE" in response.json()["detail"]
    completion = http.post("/v1/completions", json={"model": UNSERVED, "prompt": "hi"})
    assert completion.status_code == 429 and completion.headers["retry-after"]
    assert completion.json()["error"]["code"] == "rate_limit_exceeded"


def test_sse_events_concatenate_to_the_final_text_and_resume_after_last_event_id(
    gateway: Any, start_worker: Any
) -> None:
    start_worker()
    http = gateway()
    job_id = http.post("/v1/jobs", json={"prompt": "Streaming over HTTP",
                                         "sampling": {"max_new_tokens": 24, "temperature": 0}}
                       ).json()["id"]
    events = read_events(http, job_id)
    tokens, end = events[:-1], events[-1]
    assert end["event"] == "end" and "id" not in end
    final = orjson.loads(end["data"])
    assert final["status"] == "succeeded"
    assert all(e["event"] == "token" for e in tokens) and len(tokens) >= 3
    data = [orjson.loads(e["data"]) for e in tokens]
    # An event carries one token or several; its id is the index of its last one.
    assert [d["index"] for d in data] == [0, *(d["index"] + len(d["token_ids"]) for d in data[:-1])]
    assert [int(e["id"]) for e in tokens] == [d["index"] + len(d["token_ids"]) - 1 for d in data]
    assert "".join(d["text"] for d in data) == final["text"]
    assert [t for d in data for t in d["token_ids"]] == final["token_ids"]

    cut = len(tokens) // 2
    resumed = read_events(http, job_id, **{"Last-Event-ID": tokens[cut]["id"]})
    assert [e["id"] for e in resumed[:-1]] == [e["id"] for e in tokens[cut + 1:]]
    assert "".join(orjson.loads(e["data"])["text"] for e in resumed[:-1]) == \
        "".join(d["text"] for d in data[cut + 1:])
    assert resumed[-1]["event"] == "end"
    assert http.get("/v1/jobs/no-such-job/events").status_code == 404
    bad = http.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "abc"})
    assert bad.status_code == 400 and "Last-Event-ID" in bad.json()["detail"]


def test_delete_cancels_a_queued_job_and_unknown_ids_are_404(
    gateway: Any, client: FleetClient
) -> None:
    http = gateway(require_worker=False)  # jobs wait on a queue no worker serves
    job_id = http.post("/v1/jobs", json={"prompt": "never runs", "model": UNSERVED}).json()["id"]
    response = http.delete(f"/v1/jobs/{job_id}")
    assert response.status_code == 200 and response.json() == {"id": job_id, "cancelled": True}
    assert http.get(f"/v1/jobs/{job_id}").json()["status"] == "cancelled"
    events = read_events(http, job_id)
    assert [e["event"] for e in events] == ["end"]  # a cancelled job's stream ends at once
    assert http.delete(f"/v1/jobs/{job_id}").json() == {"id": job_id, "cancelled": False}
    for method in ("GET", "DELETE"):
        missing = http.request(method, "/v1/jobs/no-such-job")
        assert missing.status_code == 404 and "no-such-job" in missing.json()["detail"]


def completion_stream(http: httpx.Client, body: dict[str, Any]) -> list[str]:
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        return [e["data"] for e in sse_events(response.iter_lines())]


def test_completions_match_the_job_record_and_the_stream_matches_the_completion(
    gateway: Any, start_worker: Any, client: FleetClient
) -> None:
    start_worker()
    http = gateway()
    body = {"model": "default", "prompt": "The function returns", "max_tokens": 20,
            "temperature": 0}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    completion = response.json()
    assert completion["object"] == "text_completion" and completion["model"] == "default"
    assert completion["id"].startswith("cmpl-") and isinstance(completion["created"], int)
    state = client.status(completion["id"].removeprefix("cmpl-"))
    [choice] = completion["choices"]
    assert state.status is JobStatus.SUCCEEDED and choice["text"] == state.text
    assert choice["finish_reason"] == ("length" if state.finish_reason.value == "length"  # type: ignore[union-attr]
                                       else "stop")
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert completion["usage"] == {"prompt_tokens": state.num_prompt_tokens,
                                   "completion_tokens": len(state.token_ids),
                                   "total_tokens": state.num_prompt_tokens + len(state.token_ids)}  # type: ignore[operator]

    data = completion_stream(http, {**body, "stream_options": {"include_usage": True}})
    assert data[-1] == "[DONE]"
    chunks = [orjson.loads(d) for d in data[:-1]]
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks)
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert "".join(texts) == choice["text"]
    assert reasons[-1] == choice["finish_reason"] and set(reasons[:-1]) == {None}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == completion["usage"]


def test_an_openai_style_request_whose_extra_fields_ask_for_nothing_works(
    gateway: Any, start_worker: Any, client: FleetClient
) -> None:
    start_worker()
    http = gateway()
    body = {"model": "default", "prompt": ["Once upon a time"], "max_tokens": 6,
            "temperature": 0.0, "top_p": 1, "n": 1, "stop": "\n\n", "seed": 3, "stream": False,
            "echo": False, "logprobs": None, "best_of": 1, "user": "user-1234",
            "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "suffix": None}
    response = http.post("/v1/completions", json=body,
                         headers={"Authorization": "Bearer sk-ignored"})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert 1 <= response.json()["usage"]["completion_tokens"] <= 6
    state = client.status(response.json()["id"].removeprefix("cmpl-"))
    assert state.metadata == {"user": "user-1234"}  # honoured: kept with the job


def test_openai_fields_the_gateway_cannot_honour_are_400_naming_them(
    gateway: Any, r: redis.Redis, settings: Any
) -> None:
    http = gateway()
    refused = {"presence_penalty": 2.5, "frequency_penalty": -3, "suffix": 3,
               "logit_bias": {"50": -101}, "echo": 1, "logprobs": 6, "best_of": 2,
               "n": 0, "nonsense": 1, "stream_options": {"include_obfuscation": True}}
    for field, value in refused.items():
        response = http.post("/v1/completions", json={"prompt": "hi", field: value})
        assert response.status_code == 400, (field, response.text)
        err = response.json()["error"]
        assert err["param"] == field and field in err["message"], err
    chat = {"tools": [{"type": "function", "function": {"name": "f"}}], "top_logprobs": 21,
            "response_format": {"type": "xml"}, "presence_penalty": 2.5, "n": 17,
            "tool_choice": "auto", "store": True, "audio": {"voice": "x"}}
    for field, value in chat.items():
        response = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], field: value})
        assert response.status_code == 400, (field, response.text)
        err = response.json()["error"]
        assert err["param"] == field and field in err["message"], err
    messages = [([{"role": "tool", "content": "42", "tool_call_id": "c1"}], "messages[0].role"),
                ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                 "messages[0].content"),
                ([{"role": "user", "content": "hi", "name": 7}], "messages[0].name"),
                ([], None)]
    for value, param in messages:
        response = http.post("/v1/chat/completions", json={"messages": value})
        assert response.status_code == 400, (value, response.text)
        assert response.json()["error"]["param"] == param, response.json()
    assert not list(r.scan_iter(match=f"{settings.namespace}:job:*"))  # nothing was enqueued


def test_a_refusal_is_one_sentence_naming_the_field_without_echoing_its_value(
    gateway: Any, r: redis.Redis, settings: Any
) -> None:
    http = gateway()
    hi = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {}}}
             for i in range(50)]
    cases = [({"tools": tools}, AUTO_REFUSED),
             ({"response_format": {"type": "xml"}},
              "response_format type 'xml' is not supported: 'text', 'json_object' or "
              "'json_schema'")]
    for extra, sentence in cases:
        response = http.post("/v1/chat/completions", json={"messages": hi, **extra})
        assert response.status_code == 400, response.text
        assert response.headers["x-should-retry"] == "false"
        err = response.json()["error"]
        assert err["message"] == sentence and err["code"] == "unsupported_parameter", err
    assert not list(r.scan_iter(match=f"{settings.namespace}:job:*"))


def test_true_is_not_a_number_of_tokens_at_any_endpoint(
    gateway: Any, r: redis.Redis, settings: Any
) -> None:
    http = gateway(require_worker=False)  # would queue ahead: only validation refuses
    hi = [{"role": "user", "content": "hi"}]
    for path, body, param in (("/v1/completions", {"prompt": "hi", "max_tokens": True},
                               "max_tokens"),
                              ("/v1/chat/completions", {"messages": hi, "max_tokens": True},
                               "max_tokens"),
                              ("/v1/chat/completions", {"messages": hi, "temperature": False},
                               "temperature")):
        response = http.post(path, json=body)
        assert response.status_code == 400, (path, response.text)
        err = response.json()["error"]
        assert err["param"] == param and "not" in err["message"], err
    jobs = http.post("/v1/jobs", json={"prompt": "hi", "sampling": {"max_new_tokens": True}})
    assert jobs.status_code == 422
    assert jobs.json()["detail"][0]["loc"] == ["body", "sampling", "max_new_tokens"]
    assert not list(r.scan_iter(match=f"{settings.namespace}:job:*"))


def test_a_gateway_started_while_redis_is_down_answers_503_from_the_first_request(
    gateway: Any
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"redis://:secret@127.0.0.1:{s.getsockname()[1]}/0"  # nothing listens there
    http = gateway(redis_url=dead)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", chat),
                       ("/v1/jobs", {"prompt": "hi"})):
        response = http.post(path, json=body)
        assert response.status_code == 503, (path, response.text)  # a retry can fix it
        assert int(response.headers["retry-after"]) > 0
        assert "secret" not in response.text  # the URL is the operator's, not the caller's
        if path != "/v1/jobs":
            assert response.json()["error"]["type"] == "server_error"


def test_completion_errors_are_400_in_openai_shape_naming_the_param(gateway: Any) -> None:
    http = gateway()
    cases = [({"prompt": "hi", "n": 99}, "n"), ({"prompt": "hi", "max_tokens": 10**6}, "max_tokens"),
             ({"prompt": "hi", "temperature": -1}, "temperature"), ({"prompt": ["a", 1.5]}, "prompt"),
             ({"prompt": ""}, "prompt"), ({"model": "no/slashes", "prompt": "hi"}, "model"),
             ({"max_tokens": 3}, "prompt")]
    for body, param in cases:
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 400, (body, response.text)
        err = response.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
        assert err["message"] and not err["message"].startswith("Value error"), err


def test_a_client_that_leaves_a_completion_stream_cancels_its_job(
    gateway: Any, client: FleetClient, r: redis.Redis, settings: Any
) -> None:
    http = gateway(require_worker=False)  # jobs wait on a queue no worker serves
    with http.stream("POST", "/v1/completions",
                     json={"model": UNSERVED, "prompt": "nobody reads this", "stream": True}
                     ) as response:
        assert response.status_code == 200
        [job_key] = list(r.scan_iter(match=f"{settings.namespace}:job:*"))
    job_id = job_id_in(job_key.decode(), f"{settings.namespace}:job:")
    assert client.wait(job_id, timeout=30).status is JobStatus.CANCELLED


def test_a_client_that_gives_up_on_a_completion_cancels_its_job(
    gateway: Any, client: FleetClient, r: redis.Redis, settings: Any
) -> None:
    http = gateway(require_worker=False)  # jobs wait on a queue no worker serves
    with pytest.raises(httpx.ReadTimeout):  # the client's own timeout: it hangs up
        http.post("/v1/completions", json={"model": UNSERVED, "prompt": "nobody waits"},
                  timeout=httpx.Timeout(60, read=0.5))
    [job_key] = list(r.scan_iter(match=f"{settings.namespace}:job:*"))
    job_id = job_id_in(job_key.decode(), f"{settings.namespace}:job:")
    assert client.wait(job_id, timeout=30).status is JobStatus.CANCELLED


def test_live_without_redis_but_ready_only_with_it(gateway: Any) -> None:
    up = gateway()
    assert up.get("/healthz").json() == {"ok": True}
    assert up.get("/readyz").json() == {"ok": True}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{s.getsockname()[1]}/0"  # nothing listens there
    down = gateway(redis_url=dead)
    # A restart cures no Redis outage: the gateway stays live, and is not ready.
    assert down.get("/healthz").status_code == 200
    response = down.get("/readyz")
    assert response.status_code == 503 and response.json() == {
        "ok": False, "why": "Redis does not answer PING"}


def openai_client(http: httpx.Client) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port_of(http)}/v1", api_key="unused",
                         max_retries=0, timeout=60)


def test_the_openai_client_lists_models_completes_and_chats(
    gateway: Any, start_worker: Any, client: FleetClient, loaded_tiny: Any
) -> None:
    start_worker()
    oa = openai_client(gateway())
    wait_until(lambda: oa.models.list().data, timeout=10, what="the worker's first heartbeat")
    [model] = oa.models.list().data
    assert model.id == "default" and model.object == "model" and model.owned_by == "tokenfleet"
    assert oa.models.retrieve("default").id == "default"
    with pytest.raises(openai.NotFoundError) as missing:
        oa.models.retrieve(UNSERVED)
    assert missing.value.code == "model_not_found" and UNSERVED in missing.value.message

    ask = {"model": "default", "prompt": "The function returns", "max_tokens": 12,
           "temperature": 0}
    completion = oa.completions.create(**ask)
    [choice] = completion.choices
    assert choice.text == client.status(completion.id.removeprefix("cmpl-")).text
    streamed = list(oa.completions.create(**ask, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    assert streamed[-1].choices[0].finish_reason == choice.finish_reason

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Tell me about the sea."}]
    chat = {"model": "default", "messages": messages, "max_tokens": 12, "temperature": 0}
    reply = oa.chat.completions.create(**chat)  # type: ignore[call-overload]
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    message = reply.choices[0].message
    assert message.role == "assistant"
    assert message.content == client.status(reply.id.removeprefix("chatcmpl-")).text
    # The worker rendered the messages with the tokenizer's chat template.
    _model, tokenizer = loaded_tiny
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(rendered)
    chunks = list(oa.chat.completions.create(**chat, stream=True,  # type: ignore[call-overload]
                                             stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        reply.choices[0].finish_reason
    assert chunks[-1].usage == reply.usage

    with pytest.raises(openai.BadRequestError) as refused:
        oa.completions.create(model="default", prompt="hi", presence_penalty=2.5)
    assert refused.value.param == "presence_penalty"
    # Honoured as OpenAI defines them: a bias of 100 makes every token the one biased.
    biased = oa.completions.create(model="default", prompt="hi", max_tokens=4, temperature=0.9,
                                   seed=1, logit_bias={"40": 100}, presence_penalty=0.5,
                                   frequency_penalty=0.5)
    assert client.status(biased.id.removeprefix("cmpl-")).token_ids == [40] * 4
    with pytest.raises(openai.BadRequestError) as refused:
        oa.chat.completions.create(model="default", messages=messages, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {}}}])
    # tool_choice "auto" (the default): the tiny model's chat template takes no tools.
    assert refused.value.param == "tool_choice"
    assert "chat template without tools" in refused.value.message


LONG = "x y " * 7_000  # within the character limit, far past the 2,048 tokens allowed


def test_a_prompt_over_the_token_limit_is_400_context_length_exceeded_and_no_job(
    gateway: Any, start_worker: Any, r: redis.Redis, settings: Any
) -> None:
    start_worker()
    http = gateway()
    chat = {"messages": [{"role": "user", "content": LONG}]}
    for path, body, param in (("/v1/completions", {"prompt": LONG}, "prompt"),
                              ("/v1/chat/completions", chat, "messages")):
        response = http.post(path, json=body)
        assert response.status_code == 400, (path, response.text)
        err = response.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == param, err
        assert err["type"] == "invalid_request_error"
        assert "the model allows 1023 (model length 1024)" in err["message"], err
    jobs = http.post("/v1/jobs", json={"prompt": LONG})
    assert jobs.status_code == 400 and "model length 1024" in jobs.json()["detail"]
    keys = Keys(settings.namespace)
    assert not list(r.scan_iter(match=keys.job("*"))) and r.xlen(keys.dlq("default")) == 0


def test_a_prompt_only_the_worker_refuses_is_a_400_not_retried(
    gateway: Any, start_worker: Any, r: redis.Redis, settings: Any
) -> None:
    start_worker(max_prompt_tokens=3)  # stricter than the gateway: only the worker refuses
    http = gateway()
    response = http.post("/v1/completions", json={"prompt": "a prompt of many tokens"})
    assert response.status_code == 400, response.text  # the request's fault, not the fleet's
    assert response.headers["x-should-retry"] == "false"
    err = response.json()["error"]
    assert err["type"] == "invalid_request_error" and "refused by the worker" in err["message"]
    assert r.xlen(Keys(settings.namespace).dlq("default")) == 0


def test_the_openai_client_retries_no_refusal_of_ours_but_a_full_queue(
    gateway: Any, start_worker: Any, r: redis.Redis, settings: Any
) -> None:
    start_worker()
    http = gateway(max_payload_bytes=60_000)
    sent: list[str] = []
    counting = httpx.Client(event_hooks={"request": [lambda req: sent.append(req.url.path)]})
    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port_of(http)}/v1", api_key="unused",
                       max_retries=2, http_client=counting)  # retries as it does by default
    wait_until(lambda: oa.models.list().data, timeout=10, what="the worker's first heartbeat")
    hi: Any = [{"role": "user", "content": "hi"}]
    refusals = {
        "context_length_exceeded": lambda: oa.completions.create(model="default", prompt=LONG),
        "chat context_length_exceeded": lambda: oa.chat.completions.create(
            model="default", messages=[{"role": "user", "content": LONG}]),
        "unsupported_parameter": lambda: oa.chat.completions.create(
            model="default", messages=hi, tools=[{"type": "function", "function": {"name": "f"}}]),
        "invalid value": lambda: oa.completions.create(model="default", prompt="hi",
                                                       temperature=-1),
        "model_not_found": lambda: oa.completions.create(model=UNSERVED, prompt="hi"),
        "model_not_found (chat)": lambda: oa.chat.completions.create(model=UNSERVED,
                                                                     messages=hi),
        "request_too_large": lambda: oa.completions.create(model="default", prompt="x" * 70_000),
    }
    for name, call in refusals.items():
        before = len(sent)
        with pytest.raises(openai.APIStatusError) as refused:
            call()
        assert 400 <= refused.value.status_code < 500, (name, refused.value)
        assert len(sent) - before == 1, f"{name}: sent {len(sent) - before} times"
    assert not list(r.scan_iter(match=Keys(settings.namespace).job("*")))  # no job, ever

    # A full queue is what a retry can fix: the client waits Retry-After and tries again.
    full = gateway(max_queue=1, require_worker=False)
    assert full.post("/v1/jobs", json={"prompt": "waits", "model": UNSERVED}).status_code == 202
    oa_full = openai.OpenAI(base_url=f"http://127.0.0.1:{port_of(full)}/v1", api_key="unused",
                            max_retries=2, http_client=counting)
    before = len(sent)
    with pytest.raises(openai.RateLimitError):
        oa_full.completions.create(model=UNSERVED, prompt="hi")
    assert len(sent) - before == 3


def test_chat_for_a_model_without_a_chat_template_is_400_at_the_gateway(
    gateway: Any, settings: Any, loaded_tiny: Any, tiny_dir: Any, r: redis.Redis
) -> None:
    from transformers import AutoTokenizer

    from tokenfleet.workers.build import hf_engine
    from tokenfleet.workers.runner import HFRunner
    from tokenfleet.workers.service import Worker

    plain = AutoTokenizer.from_pretrained(tiny_dir)
    plain.chat_template = None  # a base model: prompts only
    runner = HFRunner(loaded_tiny[0], plain)
    plain_settings = settings.model_copy(update={"queue": "plain"})
    engine = hf_engine(plain_settings, runner, runner.eos_token_ids, runner.max_model_len)
    worker = Worker(plain_settings, engine, plain, name="plain@test")
    worker.start()
    try:
        http = gateway()
        oa = openai_client(http)
        wait_until(lambda: oa.models.list().data, timeout=10, what="the worker's heartbeat")
        assert oa.models.retrieve("plain").model_extra == {"root": settings.model, "workers": 1,
                                                            "chat": False}
        messages = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.BadRequestError) as refused:
            oa.chat.completions.create(model="plain", messages=messages)  # type: ignore[arg-type]
        assert refused.value.code == "chat_template_missing"
        assert "no chat template" in refused.value.message and "/v1/completions" in \
            refused.value.message
        response = http.post("/v1/jobs", json={"model": "plain", "messages": messages})
        assert response.status_code == 400 and "chat template" in response.json()["detail"]
        assert not list(r.scan_iter(match=f"{settings.namespace}:job:*"))  # nothing enqueued
        text = oa.completions.create(model="plain", prompt="Once", max_tokens=4).choices[0].text
        assert isinstance(text, str)  # the model serves prompts all the same
    finally:
        worker.stop(grace_s=0)


def test_an_idempotency_key_reused_for_another_request_is_409(gateway: Any,
                                                                start_worker: Any) -> None:
    if not hasattr(errors, "IdempotencyConflict"):
        pytest.skip("the client raises IdempotencyConflict once the validation work is in")
    start_worker()
    http = gateway()
    body = {"prompt": "once", "idempotency_key": "order-1", "sampling": {"max_new_tokens": 2}}
    first = http.post("/v1/jobs", json=body)
    assert first.status_code == 202
    again = http.post("/v1/jobs", json=body)
    assert again.status_code == 202 and again.json()["id"] == first.json()["id"]
    other = http.post("/v1/jobs", json={**body, "prompt": "twice"})
    assert other.status_code == 409 and "order-1" in other.json()["detail"]


def test_a_model_no_live_worker_serves_is_404_model_not_found_naming_the_served_ones(
    gateway: Any, start_worker: Any, r: redis.Redis, settings: Any
) -> None:
    if "require_worker" not in Settings.model_fields:
        pytest.skip("submit requires a live worker once the validation work is in")
    start_worker()
    http = gateway(require_worker=True)
    wait_until(lambda: http.get("/v1/models").json()["data"], timeout=10,
               what="the worker's first heartbeat")
    chat = [{"role": "user", "content": "hi"}]
    for path, body in (("/v1/jobs", {"prompt": "hi", "model": UNSERVED}),
                       ("/v1/completions", {"prompt": "hi", "model": UNSERVED}),
                       ("/v1/chat/completions", {"messages": chat, "model": UNSERVED})):
        response = http.post(path, json=body)
        assert response.status_code == 404, response.text  # a retry cannot help
        assert response.headers["x-should-retry"] == "false"
        found = response.json()
        message = found["detail"] if path == "/v1/jobs" else found["error"]["message"]
        assert UNSERVED in message and "'default'" in message  # what is served instead
        # Advice for whoever runs the fleet, not for an API caller.
        assert "require_worker" not in message and "tokenfleet worker" not in message
        if path != "/v1/jobs":
            assert found["error"]["code"] == "model_not_found"
            assert found["error"]["param"] == "model"
    assert not list(r.scan_iter(match=f"{settings.namespace}:job:*"))


def test_service_tier_runs_the_chat_at_its_level_and_the_answer_says_which(
    gateway: Any, start_worker: Any, r: redis.Redis, settings: Any
) -> None:
    # flex is the batch level, priority the high level: seen on the queue's
    # streams, where the jobs wait (the pinned worker never reads).
    pin_live_worker(r, settings.namespace, "waiting")
    start_worker()
    http = gateway()
    keys = Keys(settings.namespace)
    levels = ("high", "normal", "batch")
    hi = [{"role": "user", "content": "hi"}]

    def waiting() -> dict[str, int]:
        return {level: r.xlen(keys.queue(level_queue("waiting", level))) for level in levels}

    for tier, level in (("flex", "batch"), ("priority", "high"), ("default", "normal"),
                        ("auto", "normal"), (None, "normal")):
        tiered = {} if tier is None else {"service_tier": tier}
        before = waiting()  # other tests' jobs may wait there too
        with http.stream("POST", "/v1/chat/completions", json={
                "messages": hi, "model": "waiting", "stream": True,
                "prompt_cache_key": "user-42", "prompt_cache_retention": "in_memory",
                **tiered}) as streamed:
            assert streamed.status_code == 200
            queued = {name: count - before[name] for name, count in waiting().items()}
        assert queued == {name: int(name == level) for name in levels}, (tier, queued)
        # The client gone, its job is cancelled and leaves the queue.
        wait_until(lambda: waiting() == before, 10, "the cancelled job to leave its queue")
        # Served, the answer says the tier it ran at.
        answer = http.post("/v1/chat/completions", json={"messages": hi, "max_tokens": 2,
                                                          **tiered})
        assert answer.status_code == 200, answer.text
        assert answer.json()["service_tier"] == {"flex": "flex", "priority": "priority"}.get(
            tier or "", "default")
    for field, value in (("service_tier", "scale"), ("prompt_cache_retention", "24h"),
                         ("prompt_cache_options", {"mode": "explicit"}),
                         ("moderation", {"model": "x"}), ("prompt_cache_key", 7)):
        refused = http.post("/v1/chat/completions", json={"messages": hi, field: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, (
            field, refused.text)


def test_vllms_text_and_template_fields_are_honoured(
    gateway: Any, start_worker: Any, loaded_tiny: Any
) -> None:
    # What clients written for vLLM send in extra_body.
    _, tok = loaded_tiny
    start_worker()
    http = gateway()
    hi = [{"role": "user", "content": "hi"}]
    base = {"max_tokens": 6, "temperature": 0.0}
    plain = http.post("/v1/completions", json={"prompt": "Once upon a time", **base}).json()
    text = plain["choices"][0]["text"]
    stop = text[2:4]
    for include, expected in ((False, text[:2]), (True, text[:4])):
        cut = http.post("/v1/completions", json={"prompt": "Once upon a time", **base,
                                                 "stop": [stop],
                                                 "include_stop_str_in_output": include})
        assert cut.status_code == 200, cut.text
        assert cut.json()["choices"][0]["text"] == expected, (include, text, stop)
    # An end token, drawn for sure and not ending the job, written as text.
    eos = {"logit_bias": {str(tok.eos_token_id): 100}, "ignore_eos": True, **base}
    for skip, shown in ((True, ""), (False, tok.eos_token * 6)):
        marked = http.post("/v1/completions", json={"prompt": "x", **eos,
                                                    "skip_special_tokens": skip})
        assert marked.json()["choices"][0]["text"] == shown, marked.text
    for fields in ({"chat_template_kwargs": {"enable_thinking": False}},
                   {"add_generation_prompt": False},
                   {"messages": [*hi, {"role": "assistant", "content": "Hello"}],
                    "continue_final_message": True}):
        response = http.post("/v1/chat/completions", json={"messages": hi, **base, **fields})
        assert response.status_code == 200, (fields, response.text)
    for field, value in (("chat_template_kwargs", {"chat_template": "{{ 1 }}"}),
                         ("return_tokens_as_token_ids", 1),
                         ("include_stop_str_in_output", "yes")):
        refused = http.post("/v1/chat/completions", json={"messages": hi, field: value})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == field, refused.text


def test_return_tokens_as_token_ids_names_each_logprob_token_by_its_id(
    gateway: Any, start_worker: Any, client: FleetClient
) -> None:
    # vLLM's: tokens that decode alike (or to nothing) are told apart.
    start_worker()
    http = gateway()
    ask = {"max_tokens": 5, "temperature": 0.0, "return_tokens_as_token_ids": True}
    done = http.post("/v1/completions", json={"prompt": "Once upon a time", "logprobs": 2,
                                               "echo": True, **ask}).json()
    made = client.status(done["id"].removeprefix("cmpl-")).token_ids
    lp = done["choices"][0]["logprobs"]
    assert lp["tokens"][-len(made):] == [f"token_id:{t}" for t in made]
    assert all(t.startswith("token_id:") for t in lp["tokens"])  # the echoed prompt's too
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"][1:] for k in top)
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2,
        **ask}).json()
    made = client.status(chat["id"].removeprefix("chatcmpl-")).token_ids
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in made]
    assert all(t["token"].startswith("token_id:") for c in content for t in c["top_logprobs"])
    streamed = http.post("/v1/completions", json={"prompt": "Once upon a time", "logprobs": 1,
                                                   "stream": True, **ask})
    tokens = [token for line in streamed.text.splitlines() if line.startswith("data: {")
              for choice in orjson.loads(line[6:])["choices"]
              for token in (choice["logprobs"] or {}).get("tokens", [])]
    assert tokens and all(t.startswith("token_id:") for t in tokens)


def test_min_tokens_is_honoured_on_completions_and_chat(
    gateway: Any, start_worker: Any, loaded_tiny: Any
) -> None:
    # A bias of 100 on EOS ends a job at its first token, unless min_tokens holds it off.
    _, tok = loaded_tiny
    start_worker()
    http = gateway()
    bias = {"logit_bias": {str(tok.eos_token_id): 100}, "max_tokens": 12, "temperature": 0.0}
    asks = [("/v1/completions", {"prompt": "Once upon a time"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]
    for route, body in asks:
        made = {}
        for min_tokens in (None, 5):
            extra = {} if min_tokens is None else {"min_tokens": min_tokens}
            response = http.post(route, json={**body, **bias, **extra})
            assert response.status_code == 200, response.text
            made[min_tokens] = response.json()["usage"]["completion_tokens"]
        assert made[None] <= 1 and made[5] >= 5, (route, made)


def test_named_messages_are_answered_and_go_on_the_queue_with_their_names(
    gateway: Any, start_worker: Any, r: redis.Redis, settings: Any
) -> None:
    # What LangChain sends for HumanMessage(name=...) and AIMessage(name=...), and
    # multi-agent graphs for each agent's message.
    start_worker()
    http = gateway()
    named = [{"role": "system", "content": "be brief"},
             {"role": "user", "content": "hi", "name": "ann"},
             {"role": "assistant", "content": "hello", "name": "researcher"},
             {"role": "user", "content": "go on", "name": "ann"}]
    response = http.post("/v1/chat/completions", json={"messages": named, "max_tokens": 4})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    # On a queue whose (pinned) worker never reads, the entry stays to be read.
    pin_live_worker(r, settings.namespace, "waiting")
    with http.stream("POST", "/v1/chat/completions", json={
            "messages": named, "model": "waiting", "stream": True}) as streamed:
        assert streamed.status_code == 200
        (_, fields), = r.xrange(Keys(settings.namespace).queue("waiting"))
    entry = QueueEntry.model_validate_json(fields[b"data"])
    assert [m.name for m in entry.request.messages or []] == [None, "ann", "researcher", "ann"]


def test_ignore_eos_makes_every_choice_exactly_max_tokens_long(
    gateway: Any, start_worker: Any, loaded_tiny: Any
) -> None:
    # vllm bench serve --ignore-eos and guidellm fix the output length this way,
    # streamed: the usage and the chunks both count max_tokens.
    _, tok = loaded_tiny
    start_worker()
    http = gateway()
    ask = {"logit_bias": {str(tok.eos_token_id): 100}, "max_tokens": 9, "temperature": 0.0,
           "ignore_eos": True}
    asks = [("/v1/completions", {"prompt": "Once upon a time"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]
    for route, body in asks:
        response = http.post(route, json={**body, **ask, "n": 2})
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["usage"]["completion_tokens"] == 18, (route, answer["usage"])
        assert {c["finish_reason"] for c in answer["choices"]} == {"length"}
        streamed = http.post(route, json={**body, **ask, "stream": True,
                                          "stream_options": {"include_usage": True}})
        assert streamed.status_code == 200, streamed.text
        last = [line for line in streamed.text.splitlines() if line.startswith("data: {")][-1]
        assert orjson.loads(last[6:])["usage"]["completion_tokens"] == 9, route
    refused = http.post("/v1/completions", json={"prompt": "x", "ignore_eos": "yes"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "ignore_eos"


def test_continuous_usage_stats_puts_each_choices_usage_so_far_in_every_chunk(
    gateway: Any, start_worker: Any
) -> None:
    # vLLM's stream option, which guidellm sends: a client counts tokens as they come.
    start_worker()
    http = gateway()
    options = {"include_usage": True, "continuous_usage_stats": True}
    asks = [("/v1/completions", {"prompt": "Once upon a time"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]
    for route, body in asks:
        streamed = http.post(route, json={**body, "max_tokens": 8, "temperature": 0.0, "n": 2,
                                          "ignore_eos": True, "stream": True,
                                          "stream_options": options})
        assert streamed.status_code == 200, streamed.text
        chunks = [orjson.loads(line[6:]) for line in streamed.text.splitlines()
                  if line.startswith("data: {")]
        final = chunks[-1]["usage"]
        made: dict[int, list[int]] = {0: [], 1: []}
        for chunk in chunks[:-1]:
            if chunk["choices"] and ("text" in chunk["choices"][0]
                                     or chunk["choices"][0].get("delta", {}).get("content")
                                     or chunk["choices"][0]["finish_reason"]):
                assert chunk["usage"]["prompt_tokens"] == final["prompt_tokens"], (route, chunk)
                made[chunk["choices"][0]["index"]].append(chunk["usage"]["completion_tokens"])
        for counts in made.values():
            assert counts == sorted(counts) and counts[-1] == 8, (route, made)
        assert final["completion_tokens"] == 16
    refused = http.post("/v1/completions", json={"prompt": "x", "stream": True,
                                                 "stream_options": {"include_usage": 1}})
    assert refused.status_code == 400 and "stream_options" in refused.text
