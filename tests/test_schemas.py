"""Bad input is refused at submit, before anything reaches Redis, with a clear message."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tokenfleet.shared.wire.schemas import GenerationRequest, JobState, JobStatus, SamplingParams
from tokenfleet.shared.settings import Settings


def test_a_minimal_request_gets_sane_defaults() -> None:
    req = GenerationRequest(prompt="Hi")
    assert req.model == "default" and req.priority == "normal"
    assert req.sampling.max_new_tokens == 64 and req.sampling.temperature == 1.0


def test_max_new_tokens_above_the_limit_names_the_limit() -> None:
    with pytest.raises(ValidationError, match="above this fleet's limit of 1024"):
        SamplingParams(max_new_tokens=5000)


def test_limits_follow_the_settings_given_as_context() -> None:
    tight = Settings(max_prompt_chars=10)
    with pytest.raises(ValidationError, match="prompt is 11 characters.*limit of 10"):
        GenerationRequest.model_validate({"prompt": "x" * 11}, context={"settings": tight})


@pytest.mark.parametrize(
    "data, message",
    [
        ({}, "exactly one of prompt, messages or prompt_token_ids"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one"),
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": "a", "model": "no spaces allowed"}, "queue name"),
        ({"prompt": "a", "model": "default\n"}, "queue name"),  # '$' matched before '\n'
        ({"prompt": "a", "metadata": {"tags": {"x"}}}, "metadata\\['tags'\\] is of type set"),
        ({"prompt": "a", "metadata": {"b": b"x"}}, "is of type bytes"),
        ({"prompt": "a", "metadata": {"f": float("inf")}}, "not a finite number"),
        ({"prompt": "a", "sampling": {"temperature": -1}}, "greater than or equal to 0"),
        ({"prompt": "a", "sampling": {"top_p": 0}}, "greater than 0"),
        ({"prompt": "a", "sampling": {"stop": [""]}}, "1 to 128 characters"),
        ({"prompt": "a", "sampling": {"stop": ["x"] * 9}}, "at most 8"),
        ({"prompt": "a", "priority": "urgent"}, "high"),
        ({"prompt": "a", "unknown": 1}, "Extra inputs"),
        ({"prompt": "a", "metadata": {"blob": "x" * 5000}}, "metadata is"),
    ],
)
def test_invalid_requests_say_what_is_wrong(data: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        GenerationRequest.model_validate(data)


def test_job_state_parses_a_redis_hash() -> None:
    state = JobState.from_redis({"id": "j", "status": "succeeded", "token_ids": "[1,2]",
                                 "attempts": "1", "created_at": "1.5", "error": "",
                                 "metadata": '{"a": 1}'})
    assert state.status is JobStatus.SUCCEEDED and state.token_ids == [1, 2]
    assert state.error is None and state.metadata == {"a": 1} and state.created_at == 1.5


def test_terminal_statuses() -> None:
    assert not JobStatus.QUEUED.is_terminal and not JobStatus.RUNNING.is_terminal
    assert all(s.is_terminal for s in (JobStatus.SUCCEEDED, JobStatus.FAILED,
                                       JobStatus.CANCELLED, JobStatus.EXPIRED))


def test_the_fingerprint_names_the_request_not_its_key_or_dict_order() -> None:
    a = GenerationRequest(prompt="Hi", metadata={"x": 1, "y": 2}, idempotency_key="k1")
    same = GenerationRequest(prompt="Hi", metadata={"y": 2, "x": 1}, idempotency_key="k2")
    assert a.fingerprint() == same.fingerprint()
    for other in ({"prompt": "Ho"}, {"model": "m"}, {"sampling": {"max_new_tokens": 5}},
                  {"metadata": {"x": 1}}, {"priority": "low"}, {"deadline_s": 3.0}):
        changed = GenerationRequest.model_validate({**a.model_dump(), **other})
        assert changed.fingerprint() != a.fingerprint(), other


def test_metadata_nested_too_deep_is_refused_without_a_recursion_error() -> None:
    deep: dict = {}
    inner = deep
    for _ in range(10_000):
        inner["k"] = {}
        inner = inner["k"]
    with pytest.raises(ValidationError, match="nests more than 32 levels"):
        GenerationRequest(prompt="a", metadata=deep)
