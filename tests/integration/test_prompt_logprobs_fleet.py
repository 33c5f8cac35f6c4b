"""Prompt log probabilities through the gateway: ``echo`` with ``logprobs`` (what
lm-eval's ``local-completions`` sends for a loglikelihood) and vLLM's
``prompt_logprobs``, on text and token-id prompts, equal to transformers' own
log_softmax of the prompt's logits."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch
from gateway_server import gateway, port_of  # noqa: F401  (a fixture)

pytestmark = pytest.mark.timeout(120)

PROMPT = "Once upon a time there was"


def reference(model: Any, ids: list[int]) -> list[float]:
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    table = torch.log_softmax(logits, dim=-1)
    return [float(table[i, ids[i + 1]]) for i in range(len(ids) - 1)]


@pytest.mark.slow
def test_echo_with_logprobs_gives_the_prompts_log_probabilities_text_or_token_ids(
    gateway: Any, start_worker: Any, loaded_tiny: Any
) -> None:
    model, tok = loaded_tiny
    ids = tok(PROMPT)["input_ids"]
    expected = reference(model, ids)
    start_worker()
    url = f"http://127.0.0.1:{port_of(gateway())}/v1/completions"
    greedy = {"model": "default", "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    answers = [httpx.post(url, json={**greedy, "prompt": prompt}, timeout=60)
               for prompt in (PROMPT, ids)]
    for answer in answers:
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1  # the prompt's, then the generated one
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for got, want in zip(lp["token_logprobs"][1:len(ids)], expected):
            assert abs(got - want) < 1e-4
        assert all(len(top) >= 1 for top in lp["top_logprobs"][1:])
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
        # lm-eval's parse: the continuation's tokens are those after the context's.
        assert choice["text"].startswith(PROMPT)
    # The token-id prompt's echo is its text, as the worker decoded it.
    assert answers[0].json()["choices"][0]["text"] == answers[1].json()["choices"][0]["text"]

    vllm = httpx.post(url, json={"model": "default", "max_tokens": 1, "temperature": 0,
                                 "prompt": ids, "prompt_logprobs": 2}, timeout=60)
    assert vllm.status_code == 200, vllm.text
    by_position = vllm.json()["choices"][0]["prompt_logprobs"]
    assert len(by_position) == len(ids) and by_position[0] is None
    for token_id, ranked, want in zip(ids[1:], by_position[1:], expected):
        assert abs(ranked[str(token_id)]["logprob"] - want) < 1e-4
        assert sorted(v["rank"] for v in ranked.values())[:2] == [1, 2]


@pytest.mark.slow
def test_a_streamed_echo_opens_with_the_prompt_and_its_logprobs_as_the_answer_does(
    gateway: Any, start_worker: Any, loaded_tiny: Any
) -> None:
    # The prompt comes with the job's first event (the worker has the tokenizer
    # and the prompt's logits): its chunks add up to the answer not streamed.
    _, tok = loaded_tiny
    ids = tok(PROMPT)["input_ids"]
    start_worker()
    url = f"http://127.0.0.1:{port_of(gateway())}/v1/completions"
    greedy = {"model": "default", "max_tokens": 4, "temperature": 0, "echo": True}
    for prompt, logprobs in ((ids, None), (PROMPT, 1), (ids, 2)):
        ask = {**greedy, "prompt": prompt,
               **({} if logprobs is None else {"logprobs": logprobs})}
        whole = httpx.post(url, json=ask, timeout=60)
        assert whole.status_code == 200, whole.text
        want = whole.json()["choices"][0]
        text, got = "", {"tokens": [], "token_logprobs": [], "text_offset": []}
        with httpx.stream("POST", url, json={**ask, "stream": True}, timeout=60) as streamed:
            assert streamed.status_code == 200, streamed.read()
            for line in streamed.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in httpx.Response(200, content=line[6:]).json()["choices"]:
                    text += choice["text"]
                    for name, values in (choice["logprobs"] or {}).items():
                        got.setdefault(name, []).extend(values)
        assert text == want["text"], (prompt, logprobs)
        if logprobs is not None:
            for name in ("tokens", "token_logprobs", "text_offset"):
                assert got[name] == want["logprobs"][name], (prompt, logprobs, name)
