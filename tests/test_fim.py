"""Insert mode (``suffix``): honoured for a tokenizer that declares
fill-in-the-middle tokens, refused with the reason for one that does not."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tokenfleet.shared.wire.schemas import GenerationRequest
from tokenfleet.shared.settings import Settings
from tokenfleet.workers.admission import Admission, Rejected
from tokenfleet.workers.fim import FORMATS, fim_format


def with_tokens(tokenizer: Any, *tokens: str) -> Any:
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": list(tokens)})
    return tok


def test_a_suffix_puts_the_models_sentinels_around_prompt_and_suffix(loaded_tiny: Any) -> None:
    _, tiny = loaded_tiny
    for fmt in FORMATS:
        tok = with_tokens(tiny, fmt.prefix, fmt.suffix, fmt.middle)
        assert fim_format(tok) == fmt
        ids = Admission(tok, Settings(), 1024).prompt_ids(
            GenerationRequest(prompt="def f(x):\n    ", suffix="\n    return y"))
        sentinels = [tok.convert_tokens_to_ids(t) for t in (fmt.prefix, fmt.suffix, fmt.middle)]
        assert [i for i in ids if i in sentinels] == sentinels  # each once, in order
        assert ids[-1] == sentinels[2]  # the model writes the middle next
        assert tok.decode(ids, skip_special_tokens=True) == "def f(x):\n    \n    return y"


def test_a_model_without_fill_in_the_middle_tokens_refuses_a_suffix_saying_why(
    loaded_tiny: Any
) -> None:
    _, tiny = loaded_tiny
    assert fim_format(tiny) is None
    assert fim_format(with_tokens(tiny, "<fim_prefix>", "<fim_suffix>")) is None  # not all three
    admission = Admission(tiny, Settings(), 1024)
    with pytest.raises(Rejected, match="this model has no fill-in-the-middle tokens"):
        admission.prompt_ids(GenerationRequest(prompt="a", suffix="b"))
    with pytest.raises(ValueError, match="suffix needs a prompt as text"):
        GenerationRequest(prompt_token_ids=[1], suffix="b")
