"""Each shim over transformers holds on the installed release (CI runs this file
on the lowest release ``pyproject.toml`` allows and on the newest)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedTokenizerFast

from tokenfleet.shared.compat import hf_transformers
from tokenfleet.shared import tiny
from tokenfleet.shared.tiny import byte_level_tokenizer


@pytest.fixture(scope="module")
def model(tiny_dir: Any) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32,
                                                attn_implementation="sdpa").eval()


def test_attn_implementation_names_what_the_model_was_loaded_with(tiny_dir: Any) -> None:
    for name in ("sdpa", "eager"):
        loaded = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation=name)
        assert hf_transformers.attn_implementation(loaded) == name


def test_cache_keyword_is_a_parameter_of_the_forward(model: Any) -> None:
    keyword = hf_transformers.cache_keyword(model)
    assert keyword in inspect.signature(model.forward).parameters
    ids = torch.tensor([[1, 40, 41, 42]])
    cache = DynamicCache()
    model(input_ids=ids, use_cache=True, **{keyword: cache})
    assert cache.get_seq_length() == 4  # the forward filled the cache it was given


def test_use_attention_routes_the_models_attention_through_the_function(
        tiny_dir: Any) -> None:
    routed = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
    calls: list[int] = []

    def counting(module: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        calls.append(module.layer_idx)
        return hf_transformers.sdpa_attention(module, *args, **kwargs)

    ids = torch.tensor([[1, 40, 41, 42, 43]])
    with torch.inference_mode():
        before = routed(input_ids=ids).logits
        hf_transformers.use_attention(routed, "test_counting", counting)
        hf_transformers.use_attention(routed, "test_counting", counting)  # again: harmless
        after = routed(input_ids=ids).logits
    assert hf_transformers.attn_implementation(routed) == "test_counting"
    assert sorted(set(calls)) == list(range(routed.config.num_hidden_layers))
    torch.testing.assert_close(after, before)


def test_a_cache_of_cache_layers_gives_what_a_dynamic_cache_gives(model: Any) -> None:
    """Prefill then decode: the masks built from the layers' sizes are right on
    this release, whichever argument it passes to ``get_mask_sizes``."""
    keyword = hf_transformers.cache_keyword(model)
    layers = model.config.num_hidden_layers
    prompt = torch.tensor([[1, 50, 51, 52, 53, 54]])
    ours = hf_transformers.LayerCache([hf_transformers.CacheLayer() for _ in range(layers)])
    theirs = DynamicCache()
    with torch.inference_mode():
        for cache in (ours, theirs):
            model(input_ids=prompt, use_cache=True, **{keyword: cache})
        for token in (60, 61, 62):
            step = torch.tensor([[token]])
            got = model(input_ids=step, use_cache=True, **{keyword: ours}).logits
            want = model(input_ids=step, use_cache=True, **{keyword: theirs}).logits
            torch.testing.assert_close(got, want)
    assert ours.get_seq_length() == theirs.get_seq_length() == 9


def test_get_mask_sizes_takes_a_length_or_a_cache_position() -> None:
    layer = hf_transformers.CacheLayer()
    layer.update(torch.zeros(1, 2, 5, 3), torch.zeros(1, 2, 5, 3))
    assert layer.get_mask_sizes(3) == (8, 0)
    assert layer.get_mask_sizes(torch.arange(5, 8)) == (8, 0)


def test_rust_decoder_decodes_as_the_fast_tokenizer_does() -> None:
    tok = byte_level_tokenizer()
    rust = hf_transformers.rust_decoder(tok)
    assert rust is not None
    ids = tok("naïve café → 🙂", add_special_tokens=False)["input_ids"]
    assert rust.decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True)


def test_rust_decoder_is_none_where_decode_does_more_than_the_rust_tokenizer() -> None:
    cleaning = PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer().backend_tokenizer,
                                       clean_up_tokenization_spaces=True)
    assert hf_transformers.rust_decoder(cleaning) is None

    class OwnDecode(PreTrainedTokenizerFast):  # type: ignore[misc]
        def _decode(self, *args: Any, **kwargs: Any) -> str:
            return "changed"

    own = OwnDecode(tokenizer_object=byte_level_tokenizer().backend_tokenizer)
    assert hf_transformers.rust_decoder(own) is None
    assert hf_transformers.rust_decoder(object()) is None


def test_a_saved_tokenizer_loads_with_only_its_model_inputs(tmp_path: Any) -> None:
    tok = tiny.tokenizer()  # what the synthetic models save
    hf_transformers.save_tokenizer(tok, tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert sorted(loaded("hello")) == ["attention_mask", "input_ids"]
    assert loaded("hello")["input_ids"] == tok("hello")["input_ids"]
