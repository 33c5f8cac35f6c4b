"""transformers: what the built-in engine needs beyond its documented API.

Every name here holds on each release ``pyproject.toml`` admits (from the
``transformers`` floor to the newest); ``tests/test_compat_transformers.py``
checks each one against the installed release.

- ``attn_implementation``: which attention a loaded model runs. transformers
  has no public getter; the config's ``_attn_implementation`` is what
  ``from_pretrained`` and ``set_attn_implementation`` write on every release.
- ``use_attention``: register an attention function under a name and switch a
  model to it (public: ``AttentionInterface``, ``AttentionMaskInterface``,
  ``set_attn_implementation``).
- ``cache_keyword``: the forward's keyword for a KV cache, ``past_key_values``
  or (newer releases) ``cache``.
- ``CacheLayer`` and ``LayerCache``: a cache made of one's own layers.
  ``get_mask_sizes`` takes the query's length on newer releases and its
  ``cache_position`` tensor on older ones; ``CacheLayer`` takes either.
- ``rust_decoder``: the ``tokenizers.Tokenizer`` whose ``decode`` is exactly a
  tokenizer's, found by the private ``_decode`` a fast tokenizer runs.
- ``save_tokenizer``: a fast tokenizer saved so that every release loads it
  (5.x names its class ``TokenizersBackend``, which 4.x does not know).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

# The attention every other forward of a model runs: transformers' own SDPA.
sdpa_attention: Callable[..., tuple[torch.Tensor, Any]] = sdpa_attention_forward

# The fast tokenizers' ``_decode`` that is the Rust tokenizer's ``decode`` and
# nothing more (with clean-up of spaces off): PreTrainedTokenizerFast's before
# 5.0, TokenizersBackend's since.
_PLAIN_DECODES = ("TokenizersBackend._decode", "PreTrainedTokenizerFast._decode")


def attn_implementation(model: Any) -> str | None:
    """The name of the attention ``model`` runs ("sdpa", "eager", a registered
    one), or None when its config does not say."""
    name = getattr(model.config, "_attn_implementation", None)
    return name if isinstance(name, str) else None


def use_attention(model: Any, name: str,
                  attention: Callable[..., tuple[torch.Tensor, Any]]) -> None:
    """Make ``model``'s attention layers call ``attention`` (an
    ``AttentionInterface`` function), with SDPA's masks.

    The registry is transformers' own and process-wide: ``name`` then means
    ``attention`` for every model in this process. Registering the same pair
    again is harmless.
    """
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    if attn_implementation(model) != name:
        model.set_attn_implementation(name)


def cache_keyword(model: Any) -> str:
    """The keyword ``model.forward`` takes its KV cache by."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class CacheLayer(DynamicLayer):  # type: ignore[misc]
    """A ``DynamicLayer`` whose attention masks cover ``get_seq_length()`` cached
    columns plus the query's, on every release. A subclass that keeps its keys
    and values its own way overrides ``get_seq_length`` and ``update``, not
    ``get_mask_sizes``."""

    def get_mask_sizes(self, query: int | torch.Tensor, *args: Any) -> tuple[int, int]:
        """(columns the mask covers, offset of the first): ``query`` is the query's
        length, or (older releases) its ``cache_position`` tensor."""
        length = query if isinstance(query, int) else int(query.shape[0])
        return int(self.get_seq_length()) + length, 0


class LayerCache(DynamicCache):  # type: ignore[misc]
    """A ``DynamicCache`` over layers given up front (it does not add its own)."""

    def __init__(self, layers: list[CacheLayer]) -> None:
        # DynamicCache's own constructor makes its layers (from a config, or one
        # per layer as they come); Cache's takes them as given on every release.
        Cache.__init__(self, layers=layers)


def rust_decoder(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` when its ``decode`` gives
    exactly ``tokenizer.decode``'s text (a fast tokenizer that cleans up no
    spaces); else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decode = getattr(type(tokenizer), "_decode", None)
    if (backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False)
            or getattr(decode, "__qualname__", "") not in _PLAIN_DECODES):
        return None
    return backend


def save_tokenizer(tokenizer: Any, out: Path) -> None:
    """``tokenizer.save_pretrained(out)``, with a fast tokenizer's class saved
    under the name every release resolves and its inputs named (4.x fast
    tokenizers otherwise add ``token_type_ids``, which ``generate()`` rejects)."""
    tokenizer.save_pretrained(out)
    path = Path(out) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config.setdefault("model_input_names", list(tokenizer.model_input_names))
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
