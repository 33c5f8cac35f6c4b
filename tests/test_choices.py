"""How one request becomes n choices, and how a choice's seed is defined."""

from __future__ import annotations

import pytest
import torch

from tokenfleet.client.choices import check_n, choice_requests
from tokenfleet.shared.wire.errors import InvalidRequest
from tokenfleet.shared.wire.schemas import GenerationRequest, SamplingParams, choice_seed
from tokenfleet.shared.settings import Settings
from tokenfleet.workers.detokenizer import TextStream
from tokenfleet.workers.sampler import sample
from tokenfleet.workers.sequence import Sequence


def test_choice_zero_keeps_the_seed_and_the_others_draw_their_own() -> None:
    assert choice_seed(7, 0) == 7
    seeds = {choice_seed(7, i) for i in range(1, 16)} | {choice_seed(8, 1)}
    assert len(seeds) == 16 and 7 not in seeds and 8 not in seeds
    assert all(0 <= s < 2**63 for s in seeds)
    assert SamplingParams(seed=7, choice_index=3).draw_seed == choice_seed(7, 3)
    assert SamplingParams(choice_index=3).draw_seed is None


def test_a_choice_samples_as_the_single_request_with_its_seed_and_index() -> None:
    logits = torch.randn(1, 256, generator=torch.Generator().manual_seed(0))

    def drawn(**sampling: int) -> list[int]:
        params = SamplingParams(temperature=1.0, **sampling)
        seq = Sequence("j", [1], params, TextStream(None))  # type: ignore[arg-type]
        out = []
        for _ in range(12):
            out.append(sample(logits, [seq])[0])
            seq.generated.append(out[-1])
        return out

    assert drawn(seed=5, choice_index=0) == drawn(seed=5)
    assert drawn(seed=5, choice_index=2) == drawn(seed=5, choice_index=2)
    assert drawn(seed=5, choice_index=2) != drawn(seed=5)


def test_a_fan_out_numbers_its_choices_and_gives_each_its_own_idempotency_key() -> None:
    request = GenerationRequest(prompt="hi", idempotency_key="k",
                                sampling=SamplingParams(seed=1, max_new_tokens=3))
    choices = choice_requests(request, 3)
    assert [c.sampling.choice_index for c in choices] == [0, 1, 2]
    assert [c.idempotency_key for c in choices] == ["k", "k#1", "k#2"]
    assert all(c.sampling.seed == 1 and c.prompt == "hi" for c in choices)
    with pytest.raises(InvalidRequest, match="idempotency_key"):
        choice_requests(request.model_copy(update={"idempotency_key": "k" * 127}), 3)


def test_n_is_a_count_from_one_to_the_setting() -> None:
    settings = Settings(max_n=4)
    assert check_n(4, settings) == 4
    for bad, words in ((0, "at least 1"), (5, "at most 4 per request (TOKENFLEET_MAX_N)"),
                       (True, "integer"), (2.0, "integer")):
        with pytest.raises(InvalidRequest, match=r"'n'") as refused:
            check_n(bad, settings)
        assert words in str(refused.value)


def test_a_prompt_of_token_ids_is_one_input_of_strict_non_negative_integers() -> None:
    assert GenerationRequest(prompt_token_ids=[0, 5]).prompt_token_ids == [0, 5]
    for bad in ([], [1.0], [True], [-1], [2**31]):
        with pytest.raises(ValueError):
            GenerationRequest.model_validate({"prompt_token_ids": bad})
    with pytest.raises(ValueError, match="exactly one of prompt, messages or prompt_token_ids"):
        GenerationRequest(prompt="hi", prompt_token_ids=[1])
