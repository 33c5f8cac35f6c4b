"""Admission tokenizes prompts exactly as the model's tokenizer does."""

from __future__ import annotations

from typing import Any

import pytest

from tokenfleet.workers.admission import _fast_encoder

TEXTS = ["The function returns", "", " leading space", "tabs\tand\nnewlines\r\n",
         "ünïcödé — “quotes” 漢字 🙂", "<|eos|> in the middle <|bos|>", "x" * 300, "1234567890"]


@pytest.mark.parametrize("text", TEXTS)
def test_the_fast_path_gives_the_tokenizers_ids(loaded_tiny: tuple[Any, Any], text: str) -> None:
    _, tok = loaded_tiny
    assert _fast_encoder(tok)(text) == tok(text)["input_ids"]


def test_a_tokenizer_set_to_truncate_keeps_the_slow_path(loaded_tiny: tuple[Any, Any]) -> None:
    _, tok = loaded_tiny
    backend = tok.backend_tokenizer
    backend.enable_truncation(max_length=4)
    try:
        assert _fast_encoder(tok).__name__ == "slow"
    finally:
        backend.no_truncation()
    assert _fast_encoder(tok).__name__ == "fast"
