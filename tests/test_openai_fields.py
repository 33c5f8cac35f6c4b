"""Every request field of OpenAI's completions and chat APIs (as the installed
``openai`` package types them) and of vLLM's OpenAI server is honoured, shown by
a test named here, or refused with a 400 that names it; none is silently
ignored. The table in docs/openai-fields.md is written from this one
(``python tests/test_openai_fields.py`` writes it again).
"""

from __future__ import annotations

import ast
import asyncio
import sys
import typing
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import orjson
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from tokenfleet.openai.chat import ChatRequest, chat_request
from tokenfleet.openai.completions import CompletionRequest, completions
from tokenfleet.openai.errors import OpenAIError
from tokenfleet.openai.translate import chat_job, completion_job
from tokenfleet.shared.settings import Settings

from source_trees import tree

TESTS = Path(__file__).parent
DOCS = TESTS.parent / "docs" / "openai-fields.md"

# vLLM 0.32's request fields (vllm.entrypoints.openai.*.protocol), beside OpenAI's;
# test_the_vllm_field_lists_are_vllms_own checks them against the installed vLLM.
VLLM_COMPLETIONS = frozenset({
    "add_special_tokens", "allowed_token_ids", "bad_words", "cache_salt", "ec_transfer_params",
    "ignore_eos", "include_stop_str_in_output", "kv_transfer_params", "length_penalty",
    "logprob_token_ids", "min_p", "min_tokens", "mm_payload", "priority", "prompt_embeds",
    "prompt_logprobs", "repetition_detection", "repetition_penalty", "request_id",
    "response_format", "return_mm_kwargs", "return_token_ids", "return_token_offsets",
    "return_tokens_as_token_ids", "routed_experts_prompt_start", "session_id",
    "skip_special_tokens", "spaces_between_special_tokens", "stop_token_ids", "stream_interval",
    "structured_outputs", "thinking_token_budget", "top_k", "truncate_prompt_tokens",
    "truncation_side", "use_beam_search", "vllm_xargs", "watermarking"})
VLLM_CHAT = (VLLM_COMPLETIONS - {"prompt_embeds", "response_format"}) | {
    "add_generation_prompt", "chat_template", "chat_template_kwargs", "continue_final_message",
    "documents", "echo", "include_reasoning", "media_io_kwargs", "mm_processor_kwargs",
    "return_prompt_text"}

GATEWAY = "tests/integration/test_gateway.py::"
CHOICES = "tests/integration/test_choices_and_token_prompts.py::"
LOGPROBS = "tests/integration/test_logprobs_fleet.py::"
STRUCTURED = "tests/integration/test_structured_output.py::"
PROMPT_LP = "tests/integration/test_prompt_logprobs_fleet.py::"
SAMPLING = "tests/integration/test_sampling_fields.py::"
PENALTIES = "tests/test_sampler_penalties.py::"
HERE = "tests/test_openai_fields.py::test_each_honoured_field_reaches_the_job_it_makes"
VLLM_TEXT = GATEWAY + "test_vllms_text_and_template_fields_are_honoured"
PLACED = ("tests/integration/test_affinity.py::"
          "test_both_routes_carry_prompt_cache_key_to_the_job_and_its_prefix_keys")
CACHE = GATEWAY + "test_service_tier_runs_the_chat_at_its_level_and_the_answer_says_which"
# Honoured on both routes: the field, and the test that shows it.
SHARED = {
    "model": GATEWAY + "test_a_model_no_live_worker_serves_is_404_model_not_found_naming_the_served_ones",
    "temperature": "tests/test_runner.py::test_sampled_tokens_follow_the_distribution_seeded_or_not",
    "top_p": "tests/test_runner.py::test_top_k_1_is_greedy_and_top_p_keeps_the_head_of_the_distribution",
    "top_k": "tests/test_runner.py::test_top_k_1_is_greedy_and_top_p_keeps_the_head_of_the_distribution",
    "min_p": PENALTIES + "test_min_p_never_draws_a_token_less_likely_than_min_p_times_the_likeliest",
    "repetition_penalty": "tests/test_runner.py::test_repetition_penalty_lowers_tokens_already_in_the_text",
    "presence_penalty": PENALTIES + "test_penalties_and_bias_equal_the_reference_row_by_row",
    "frequency_penalty": SAMPLING + "test_a_frequency_penalty_stops_greedy_repetition",
    "logit_bias": SAMPLING + "test_logit_bias_steers_every_token_and_an_id_outside_the_vocabulary_fails_alone",
    "seed": CHOICES + "test_n_seeded_choices_each_equal_the_single_request_with_that_choice_index",
    "n": CHOICES + "test_n_seeded_choices_each_equal_the_single_request_with_that_choice_index",
    "stop": "tests/test_output_thread.py::test_200_jobs_with_stop_strings_end_as_the_whole_text_says_through_a_worker",
    "stream": GATEWAY + "test_completions_match_the_job_record_and_the_stream_matches_the_completion",
    "stream_options": GATEWAY + "test_continuous_usage_stats_puts_each_choices_usage_so_far_in_every_chunk",
    "user": HERE,
    "max_tokens": GATEWAY + "test_ignore_eos_makes_every_choice_exactly_max_tokens_long",
    "response_format": STRUCTURED + "test_the_openai_client_gets_json_valid_against_its_schema_50_of_50",
    "structured_outputs": STRUCTURED + "test_json_mode_and_vllms_structured_outputs_constrain_the_text",
    "min_tokens": GATEWAY + "test_min_tokens_is_honoured_on_completions_and_chat",
    "ignore_eos": GATEWAY + "test_ignore_eos_makes_every_choice_exactly_max_tokens_long",
    "include_stop_str_in_output": VLLM_TEXT,
    "skip_special_tokens": VLLM_TEXT,
    "return_tokens_as_token_ids": GATEWAY + "test_return_tokens_as_token_ids_names_each_logprob_token_by_its_id",
    "webhook_url": (
        "tests/integration/test_webhooks.py::"
        "test_the_gateway_delivers_the_end_of_a_completion_that_named_a_webhook_url"),
}
HONOURED: dict[str, dict[str, str]] = {
    "completions": {
        **SHARED,
        "prompt": CHOICES + "test_a_list_of_prompts_answers_each_prompts_choices_in_order_as_the_single_requests",
        "echo": PROMPT_LP + "test_echo_with_logprobs_gives_the_prompts_log_probabilities_text_or_token_ids",
        "logprobs": LOGPROBS + "test_completions_logprobs_equal_transformers_and_stream_as_they_answer",
        "prompt_logprobs": PROMPT_LP + "test_echo_with_logprobs_gives_the_prompts_log_probabilities_text_or_token_ids",
        "best_of": CHOICES + "test_each_field_is_honoured_or_refused_by_name_with_its_reason",
        "suffix": "tests/test_fim.py::test_a_suffix_puts_the_models_sentinels_around_prompt_and_suffix",
        "prompt_cache_key": PLACED,
    },
    "chat": {
        **SHARED,
        "messages": GATEWAY + "test_the_openai_client_lists_models_completes_and_chats",
        "max_completion_tokens": HERE,
        "metadata": HERE,
        "safety_identifier": HERE,
        "logprobs": LOGPROBS + "test_chat_logprobs_parse_in_the_openai_client_with_top_logprobs",
        "top_logprobs": LOGPROBS + "test_chat_logprobs_parse_in_the_openai_client_with_top_logprobs",
        "tools": STRUCTURED + "test_tool_choice_required_returns_tool_calls_whose_arguments_fit_the_schema",
        "tool_choice": "tests/integration/test_auto_tools.py::test_the_models_own_call_comes_back_as_tool_calls",
        "service_tier": CACHE,
        "prompt_cache_key": PLACED,
        "chat_template_kwargs": VLLM_TEXT,
        "add_generation_prompt": VLLM_TEXT,
        "continue_final_message": VLLM_TEXT,
    },
}
# A value that asks for something, where the field's own type is needed to say so.
SOMETHING: dict[str, Any] = {"parallel_tool_calls": "sometimes", "modalities": ["audio"],
                             "store": True, "service_tier": "scale",
                             "prompt_cache_retention": "24h", "include_reasoning": False,
                             "spaces_between_special_tokens": False, "priority": 5,
                             "add_special_tokens": "maybe", "echo": True}
BASE = {"completions": {"prompt": "hi"}, "chat": {"messages": [{"role": "user", "content": "hi"}]}}


def openai_fields(route: str) -> frozenset[str]:
    params = (completion_create_params if route == "completions" else chat_create_params)
    return frozenset(typing.get_type_hints(params.CompletionCreateParamsBase)) | {"stream"}


def vllm_fields(route: str) -> frozenset[str]:
    return VLLM_COMPLETIONS if route == "completions" else VLLM_CHAT


def every_field(route: str) -> list[str]:
    """OpenAI's fields, vLLM's and the gateway's own (``webhook_url``, the old ``guided_*``)."""
    model = CompletionRequest if route == "completions" else ChatRequest
    return sorted(openai_fields(route) | vllm_fields(route) | set(model.model_fields))


def answer(route: str, body: dict[str, Any]) -> OpenAIError | None:
    """The gateway's refusal of ``body`` as its route checks it, None if it is taken."""
    client = SimpleNamespace(settings=Settings())
    check = completions if route == "completions" else chat_request
    raw = orjson.dumps({**BASE[route], **body})
    # Who serves the model is the last check, and not this test's: nobody says.
    with mock.patch(f"tokenfleet.openai.{'chat' if route == 'chat' else 'completions'}.served",
                    mock.AsyncMock(return_value=None)):
        made = asyncio.run(check(client, raw))  # type: ignore[arg-type]
    return made if isinstance(made, OpenAIError) else None


@cache
def refusal(route: str, name: str) -> dict[str, Any] | None:
    """The error a request setting ``name`` to something gets, None if it is taken."""
    refused = answer(route, {name: SOMETHING.get(name, {"asks": "for something"})})
    return None if refused is None else dict(refused.body["error"])


def test_every_field_is_honoured_or_refused_by_name_and_none_is_ignored() -> None:
    for route in HONOURED:
        for name in every_field(route):
            if name in HONOURED[route]:
                continue
            error = refusal(route, name)
            assert error is not None, f"{route}: {name} is neither honoured nor refused"
            assert error["param"] == name, (route, name, error)
            assert name in error["message"], (route, name, error)


@pytest.mark.parametrize("route", sorted(HONOURED))
def test_each_honoured_field_names_a_test_that_exists(route: str) -> None:
    for name, test in HONOURED[route].items():
        path, _, function = test.partition("::")
        defined = {node.name for node in ast.walk(tree(TESTS.parent / path))
                   if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
        assert function in defined, f"{route}: {name}'s test {test} does not exist"
        assert name in every_field(route), f"{route}: {name} is no request field"


def test_each_honoured_field_reaches_the_job_it_makes() -> None:
    settings = Settings()
    sampling = {"temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1,
                "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.25,
                "logit_bias": {"5": 3}, "seed": 11, "stop": ["x"], "min_tokens": 2,
                "ignore_eos": True, "include_stop_str_in_output": True,
                "skip_special_tokens": False}
    expected = {**sampling, "logit_bias": {5: 3.0}, "max_new_tokens": 9}
    completion = CompletionRequest.model_validate({"prompt": "hi", "max_tokens": 9,
                                                   "user": "u1", **sampling})
    job = completion_job(completion, settings)
    assert job.sampling.model_dump(include=set(expected)) == expected
    assert job.metadata == {"user": "u1"}
    chat = ChatRequest.model_validate({
        **BASE["chat"], "max_completion_tokens": 9, "max_tokens": 99, "user": "u1",
        "safety_identifier": "s1", "metadata": {"team": "a"}, **sampling})
    job = chat_job(chat, settings)
    assert job.sampling.model_dump(include=set(expected)) == expected  # max_completion_tokens wins
    assert job.metadata == {"team": "a", "user": "u1", "safety_identifier": "s1"}


def test_fields_that_ask_for_nothing_are_taken() -> None:
    # A client that sends every default (vLLM's own clients do) gets its answer.
    for route, defaults in (("completions", {"add_special_tokens": True, "use_beam_search": False,
                                             "spaces_between_special_tokens": True,
                                             "priority": 0, "return_token_ids": False}),
                            ("chat", {"add_special_tokens": False, "echo": False,
                                      "include_reasoning": True, "store": False,
                                      "parallel_tool_calls": True})):
        assert answer(route, defaults) is None, route


def test_the_vllm_field_lists_are_vllms_own() -> None:
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest as VllmCompletion

    for route, model in (("completions", VllmCompletion), ("chat", ChatCompletionRequest)):
        assert set(model.model_fields) - openai_fields(route) == vllm_fields(route), route


def table() -> str:
    """docs/openai-fields.md: the table of every field, from the checks above."""
    lines = [
        "# OpenAI and vLLM request fields",
        "",
        "Every field of OpenAI's completions and chat requests, and of vLLM's OpenAI server, is",
        "honoured or refused with a 400 that names it (`param`) and says why; none is silently",
        "ignored. A refused field set to the value that asks for nothing (vLLM's default, `null`)",
        "is taken. This page is written from the test that checks it",
        "(`python tests/test_openai_fields.py` writes it again).",
        "",
    ]
    for route, path in (("completions", "/v1/completions"), ("chat", "/v1/chat/completions")):
        lines += [f"## `POST {path}`", "", "| field | OpenAI | vLLM | tokenfleet |",
                  "| --- | --- | --- | --- |"]
        for name in every_field(route):
            ours = "honoured" if name in HONOURED[route] else (
                "refused: " + str((refusal(route, name) or {}).get("message", "")))
            mark = {True: "yes", False: ""}
            lines.append(f"| `{name}` | {mark[name in openai_fields(route)]} | "
                         f"{mark[name in vllm_fields(route)]} | {ours.replace('|', '/')} |")
        lines.append("")
    return "\n".join(lines)


def test_the_docs_table_is_written_from_this_one() -> None:
    assert DOCS.read_text() == table(), "run python tests/test_openai_fields.py"


if __name__ == "__main__":
    DOCS.write_text(table())
    sys.exit(0)
