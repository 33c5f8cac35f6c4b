"""A validation error reads the same wherever a user meets it (the CLI, a dead
letter's reason, the OpenAI-compatible gateway): one line naming the field, what
was wrong and the limit, never the input itself."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from tokenfleet.shared.wire.errors import invalid_field, invalid_input
from tokenfleet.shared.wire.schemas import GenerationRequest, QueueEntry


def refusal(data: Any) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        GenerationRequest.model_validate(data)
    return info.value


def test_a_bad_field_is_named_with_what_was_wrong_and_the_limit() -> None:
    exc = refusal({"prompt": "hi", "sampling": {"max_new_tokens": 0}})
    assert invalid_field(exc) == "sampling.max_new_tokens"
    assert invalid_input(exc) == ("invalid 'sampling.max_new_tokens': "
                                  "Input should be greater than or equal to 1")


def test_a_validator_s_own_sentence_is_kept_without_pydantic_s_prefix() -> None:
    line = invalid_input(refusal({"prompt": "hi", "sampling": {"max_new_tokens": 100_000}}))
    assert line.startswith("invalid 'sampling.max_new_tokens': max_new_tokens is 100000")
    assert "limit of 1024" in line and "Value error" not in line


def test_list_positions_read_as_indexes_and_caller_names_replace_locations() -> None:
    exc = refusal({"messages": [{"role": "nobody", "content": "hi"}]})
    assert invalid_field(exc) == "messages[0].role"
    assert invalid_field(exc, {("messages", "0", "role"): "role"}) == "role"
    assert invalid_field(exc, {}) is None  # a location the caller has no name for


def test_a_mappings_key_is_named_by_its_mapping_and_never_echoed() -> None:
    key = "not-a-token-id" * 20
    exc = refusal({"prompt": "hi", "sampling": {"logit_bias": {key: 1.0}}})
    assert invalid_field(exc) == "sampling.logit_bias"
    line = invalid_input(exc)
    assert line.startswith("invalid 'sampling.logit_bias': a key: ") and key not in line
    long_id = "9" * 100  # a key that parses, whose value is wrong: named, cut short
    field = invalid_field(refusal({"prompt": "hi", "sampling": {"logit_bias": {long_id: "x"}}}))
    assert field is not None and field.startswith("sampling.logit_bias[") and long_id not in field


def test_more_errors_are_counted_not_listed_and_the_input_is_left_out() -> None:
    secret = "a prompt that must not be echoed"
    exc = refusal({"prompt": secret, "sampling": {"temperature": -1, "top_p": 7}})
    line = invalid_input(exc)
    assert line.endswith(" (and 1 more error)") and "\n" not in line
    assert secret not in line


def test_broken_json_and_unknown_fields_say_so() -> None:
    with pytest.raises(ValidationError) as broken:
        QueueEntry.model_validate_json(b"{not json")
    assert invalid_input(broken.value).startswith("not valid JSON (")
    extra = refusal({"prompt": "hi", "n": 2})
    assert invalid_input(extra) == "unrecognized request argument 'n'"
