"""n choices, prompts of token ids, echo and suffix: through the official
``openai`` client and the Python API, on the real tiny model and redis-server."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import redis

from tokenfleet import FleetClient, InvalidRequest, JobStatus
from tokenfleet.shared.wire.keys import job_id_in

from gateway_server import gateway, port_of  # noqa: F401  (a fixture)
from helpers import wait_until

pytestmark = pytest.mark.timeout(120)

PROMPT = "Once upon a time"


def openai_client(http: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port_of(http)}/v1", api_key="unused",
                         max_retries=0, timeout=60)


@pytest.mark.slow
def test_n_seeded_choices_each_equal_the_single_request_with_that_choice_index(
    gateway: Any, start_worker: Any, client: FleetClient
) -> None:
    start_worker()
    oa = openai_client(gateway())
    ask = {"temperature": 1.0, "seed": 7, "max_new_tokens": 8}
    states = [client.wait(client.submit(PROMPT, choice_index=i, **ask), timeout=60)
              for i in range(4)]
    singles = [state.text for state in states]
    assert singles[0] == client.wait(client.submit(PROMPT, **ask), timeout=60).text
    assert len(set(singles)) > 1  # the choices draw apart

    completion = oa.completions.create(model="default", prompt=PROMPT, n=4, seed=7,
                                       temperature=1.0, max_tokens=8)
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert [c.text for c in completion.choices] == singles
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == states[0].num_prompt_tokens  # counted once
    assert completion.usage.completion_tokens == sum(len(s.token_ids) for s in states)

    streamed = ["", "", "", ""]
    finished = set()
    for chunk in oa.completions.create(model="default", prompt=PROMPT, n=4, seed=7,
                                       temperature=1.0, max_tokens=8, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert streamed == singles and finished == {0, 1, 2, 3}

    job_ids = client.submit_choices(PROMPT, n=4, **ask)
    assert len(set(job_ids)) == 4
    assert [client.wait(j, timeout=60).text for j in job_ids] == singles

    messages = [{"role": "user", "content": "Tell me about the sea."}]
    ask_chat: Any = {"model": "default", "messages": messages, "n": 2, "seed": 5,
                     "temperature": 1.0, "max_tokens": 4}
    chat = oa.chat.completions.create(**ask_chat)
    texts = [c.message.content for c in chat.choices]
    assert [c.index for c in chat.choices] == [0, 1]
    deltas = ["", ""]
    for chunk in oa.chat.completions.create(**ask_chat, stream=True):
        for choice in chunk.choices:
            deltas[choice.index] += choice.delta.content or ""
    assert deltas == texts


@pytest.mark.slow
def test_a_prompt_of_token_ids_gives_the_text_of_the_same_prompt_as_a_string(
    gateway: Any, start_worker: Any, client: FleetClient, loaded_tiny: Any
) -> None:
    _, tok = loaded_tiny
    ids = tok(PROMPT)["input_ids"]
    start_worker()
    oa = openai_client(gateway())
    greedy = {"model": "default", "max_tokens": 6, "temperature": 0}
    text = oa.completions.create(prompt=PROMPT, **greedy).choices[0].text
    assert oa.completions.create(prompt=ids, **greedy).choices[0].text == text
    assert oa.completions.create(prompt=[ids], **greedy).choices[0].text == text
    by_ids = client.wait(client.submit(prompt_token_ids=ids, max_new_tokens=6,
                                       temperature=0.0), timeout=60)
    assert by_ids.text == text and by_ids.num_prompt_tokens == len(ids)
    echoed = oa.completions.create(prompt=PROMPT, echo=True, **greedy).choices[0].text
    assert echoed == PROMPT + text
    chunks = oa.completions.create(prompt=PROMPT, echo=True, stream=True, **greedy)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT + text


def test_a_token_id_outside_the_vocabulary_fails_its_job_and_the_worker_keeps_serving(
    gateway: Any, start_worker: Any, client: FleetClient, loaded_tiny: Any
) -> None:
    _, tok = loaded_tiny
    vocab = len(tok)
    start_worker()
    oa = openai_client(gateway())
    with pytest.raises(openai.BadRequestError) as refused:
        oa.completions.create(model="default", prompt=[5, vocab + 3], max_tokens=4)
    assert f"prompt token id {vocab + 3} is outside this model's vocabulary of {vocab}" in \
        refused.value.message
    failed = client.wait(client.submit(prompt_token_ids=[vocab], max_new_tokens=4), timeout=60)
    assert failed.status is JobStatus.FAILED and f"token id {vocab} " in (failed.error or "")
    no_fim = client.wait(client.submit(PROMPT, suffix="The end.", max_new_tokens=4), timeout=60)
    assert no_fim.status is JobStatus.FAILED
    assert "this model has no fill-in-the-middle tokens" in (no_fim.error or "")
    ok = oa.completions.create(model="default", prompt=[5, vocab - 1], max_tokens=4)
    assert ok.choices[0].finish_reason in ("stop", "length")


# Each field this change touches, with a request that sets it and what comes
# back: honoured (200) or refused (400 naming the field, and why).
FIELDS = [
    ("n", {"n": 2}, 200, None),
    ("n", {"n": 0}, 400, "at least 1"),
    ("n", {"n": 17}, 400, "TOKENFLEET_MAX_N"),
    ("n", {"n": 1.5}, 400, "integer"),
    ("best_of", {"best_of": 2, "n": 2}, 200, None),
    ("best_of", {"best_of": 3, "n": 2}, 400, "not ranked by likelihood"),
    ("best_of", {"best_of": 1, "n": 2}, 400, "at least n"),
    ("echo", {"echo": True}, 200, None),
    ("echo", {"echo": 1}, 400, "boolean"),
    ("echo", {"echo": True, "prompt": [1, 2]}, 200, None),
    ("echo", {"echo": True, "prompt": [1, 2], "stream": True}, 200, None),
    ("suffix", {"suffix": "The end."}, 400, "model 'default' has no fill-in-the-middle"),
    ("suffix", {"suffix": "The end.", "prompt": [1, 2]}, 400, "token ids"),
    ("suffix", {"suffix": ""}, 200, None),
    ("prompt", {"prompt": [1, 2]}, 200, None),
    ("prompt", {"prompt": [[1, 2]]}, 200, None),
    ("prompt", {"prompt": [1, 2.0]}, 400, "item 1 is 2.0"),
    ("prompt", {"prompt": [1, True]}, 400, "item 1 is true"),
    ("prompt", {"prompt": [1, -2]}, 400, "item 1 is -2"),
    ("prompt", {"prompt": [1, 2**70]}, 400, f"item 1 is {2**70}"),
    ("prompt", {"prompt": [[1], [2]]}, 200, None),
    ("prompt", {"prompt": ["a", "b"]}, 200, None),
    ("prompt", {"prompt": ["a", [2]]}, 400, "all text or all token ids"),
    ("prompt", {"prompt": [[1], [2, 0.5]]}, 400, "item 1 of prompt 1 is 0.5"),
    ("prompt", {"prompt": ["a", ""]}, 400, "empty"),
    ("prompt", {"prompt": ["a"] * 257}, 400, "above the limit of 256"),
    ("prompt", {"prompt": []}, 400, "empty"),
    ("logprobs", {"logprobs": 1, "n": 2}, 200, None),
    ("logprobs", {"logprobs": 6}, 400, "less than or equal to 5"),
    ("echo", {"echo": True, "logprobs": 1}, 200, None),
    ("echo", {"echo": True, "logprobs": 1, "stream": True}, 200, None),
    ("prompt_logprobs", {"prompt_logprobs": 2}, 200, None),
    ("prompt_logprobs", {"prompt_logprobs": 21}, 400, "less than or equal to 20"),
]


@pytest.mark.slow
def test_each_field_is_honoured_or_refused_by_name_with_its_reason(
    gateway: Any, start_worker: Any, r: redis.Redis, settings: Any
) -> None:
    start_worker()
    http = gateway()
    for field, extra, status, reason in FIELDS:
        body = {"model": "default", "prompt": "hi", "max_tokens": 2, **extra}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == status, (extra, response.text)
        if status == 200:
            continue
        err = response.json()["error"]
        assert err["param"] == field and reason in err["message"], (extra, err)
    chat = http.post("/v1/chat/completions", json={
        "model": "default", "messages": [{"role": "user", "content": "hi"}], "n": 99})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "n"


def test_submit_choices_refuses_more_than_the_limit_and_queues_nothing(
    client: FleetClient, r: redis.Redis, settings: Any
) -> None:
    with pytest.raises(InvalidRequest, match="TOKENFLEET_MAX_N"):
        client.submit_choices(PROMPT, n=settings.max_n + 1, require_worker=False)
    with pytest.raises(InvalidRequest, match="choice_index"):
        client.submit_choices(PROMPT, n=2, choice_index=1, require_worker=False)
    assert not list(r.scan_iter(match=f"{settings.namespace}:job:*"))


def test_a_refused_choice_cancels_the_choices_queued_before_it(
    client: FleetClient, r: redis.Redis, settings: Any
) -> None:
    from tokenfleet import QueueFull

    small = FleetClient(settings=settings.model_copy(update={"max_queue": 2}))
    with small, pytest.raises(QueueFull):
        small.submit_choices(PROMPT, n=3, require_worker=False, model="nobody-serves-this")
    keys = list(r.scan_iter(match=f"{settings.namespace}:job:*"))
    assert len(keys) == 2
    wait_until(lambda: all(r.hget(k, "status") == b"cancelled" for k in keys), timeout=10,
               what="the queued choices to be cancelled")


def test_a_choice_that_ends_otherwise_ends_the_stream_with_its_error_and_cancels_the_others(
    gateway: Any, client: FleetClient, r: redis.Redis, settings: Any
) -> None:
    http = gateway(require_worker=False)  # the choices wait on a queue no worker serves
    body = {"model": "nobody-serves-this", "prompt": PROMPT, "n": 2, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        job_ids = sorted(job_id_in(k.decode(), f"{settings.namespace}:job:")
                         for k in r.scan_iter(match=f"{settings.namespace}:job:*"))
        assert len(job_ids) == 2
        assert client.cancel(job_ids[0])
        events = [line.removeprefix("data: ") for line in response.iter_lines()
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "ended cancelled" in events[-2], events
    assert [client.wait(j, timeout=30).status for j in job_ids] == [JobStatus.CANCELLED] * 2


def test_a_list_of_prompts_answers_each_prompts_choices_in_order_as_the_single_requests(
    gateway: Any, start_worker: Any
) -> None:
    # lm-eval's --batch_size and LangChain's batch() send several prompts in one request.
    start_worker()
    oai = openai_client(gateway())
    prompts = ["Once upon a time", "The capital of", "In the beginning"]
    ask = {"model": "default", "max_tokens": 5, "temperature": 0.0}
    singles = [oai.completions.create(prompt=p, **ask) for p in prompts]
    both = oai.completions.create(prompt=prompts, n=2, echo=True, **ask)
    assert [c.index for c in both.choices] == list(range(6))
    for p, single in enumerate(singles):
        for i in range(2):  # prompt-major, then n
            assert both.choices[p * 2 + i].text == prompts[p] + single.choices[0].text
    assert both.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert both.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)

    ids = oai.completions.create(prompt=[[1, 2, 3], [4, 5]], logprobs=1, echo=True, **ask)
    assert [len(c.logprobs.tokens) for c in ids.choices] == [3 + 5, 2 + 5]

    streamed = oai.completions.create(prompt=prompts, echo=True, stream=True,
                                      stream_options={"include_usage": True}, **ask)
    texts = ["", "", ""]
    usage = None
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts == [p + s.choices[0].text for p, s in zip(prompts, singles)]
    assert usage is not None and usage.prompt_tokens == both.usage.prompt_tokens
