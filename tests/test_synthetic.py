"""The synthetic models: a realistic Llama shape with fixed-seed random weights,
built here, the same bytes each time, loaded like any Hugging Face model."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tokenfleet.shared import models, synthetic


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_llama_86m_builds_the_same_weights_twice(tmp_path: Path) -> None:
    first = synthetic.write("llama-86m", tmp_path / "a")
    second = synthetic.write("llama-86m", tmp_path / "b")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert _sha(first / name) == _sha(second / name), name


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_llama_86m_loads_by_name_with_its_shape(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert "llama-86m" in models.BUILTIN
    model, tokenizer = models.load("llama-86m")
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.vocab_size) == (768, 12, 12, 1024)
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert 85e6 < model.num_parameters() < 87e6
    assert len(tokenizer) == cfg.vocab_size
    assert models.local_tokenizer_file("llama-86m") == tmp_path / "tokenfleet" / "llama-86m" / \
        "tokenizer.json"


def test_llama_1b_has_the_shape_of_llama_3_2_1b() -> None:
    cfg = synthetic.config("llama-1b")
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
            cfg.num_attention_heads, cfg.num_key_value_heads) == (2048, 8192, 16, 32, 8)
    assert cfg.dtype in ("bfloat16", __import__("torch").bfloat16)
    assert 0.95e9 < synthetic.num_parameters("llama-1b") < 1.0e9


def test_an_unknown_synthetic_name_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="llama-86m"):
        synthetic.config("llama-7b")
