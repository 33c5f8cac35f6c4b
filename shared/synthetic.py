"""Fixed-seed random Llamas: a model of a given shape, built here, nothing downloaded.

What a forward pass costs depends on a model's shape, not its weights, so a
benchmark can run a realistic shape without a download. Each model is a plain
``LlamaForCausalLM`` directory (``config.json``, ``model.safetensors``,
``tokenizer.json``) that ``from_pretrained`` and vLLM load like any other, and
the same name builds the same bytes on any machine with the same torch and
transformers. All share the ``tiny`` model's 1,024-token byte-level BPE tokenizer.

- ``tiny-random`` and ``tiny-wide``: the tiny shape (and 4x wider), for tests
  that only need a real forward pass, and for benchmarks;
- ``llama-86m``: 12 layers of width 768, 86M parameters, a CPU benchmark's model;
- ``llama-1b``: the shape of Llama 3.2 1B (its vocabulary aside), 0.97B
  parameters, for GPUs; stored in bfloat16.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SEED = 1234

_TINY = {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 1024}
SHAPES: dict[str, dict[str, int]] = {
    "tiny-random": _TINY,
    "tiny-wide": {**_TINY, "hidden_size": 4 * 64, "intermediate_size": 4 * 176},
    "llama-86m": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
                  "num_attention_heads": 12, "num_key_value_heads": 12,
                  "max_position_embeddings": 2048},
    "llama-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                 "num_attention_heads": 32, "num_key_value_heads": 8,
                 "max_position_embeddings": 2048},
}
DTYPES = {"llama-1b": "bfloat16"}  # the others are stored in float32


def config(name: str, tokenizer: Any = None) -> Any:
    """The ``LlamaConfig`` of model ``name`` (its tokenizer fixes the vocabulary
    and the special tokens; by default the tiny model's)."""
    from transformers import LlamaConfig

    if name not in SHAPES:
        raise ValueError(f"unknown synthetic model {name!r}; known: {', '.join(SHAPES)}")
    tokenizer = tokenizer if tokenizer is not None else _tokenizer()
    return LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        dtype=DTYPES.get(name, "float32"),
        **SHAPES[name],
    )


def num_parameters(name: str) -> int:
    """Parameters of model ``name``, counted on the meta device (no weights made)."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config(name))
    return int(model.num_parameters())


def write(name: str, out: Path) -> Path:
    """Build model ``name`` at the fixed seed and save it to directory ``out``."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from tokenfleet.shared.compat import hf_transformers

    hf_logging.disable_progress_bar()
    tokenizer = _tokenizer()
    cfg = config(name, tokenizer)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(cfg)
    # Random weights give flat logits; scaling the embeddings spreads them so that
    # greedy decoding is not decided by rounding noise.
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)
    model.to(getattr(torch, DTYPES.get(name, "float32")))
    model.generation_config = GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    hf_transformers.save_tokenizer(tokenizer, out)
    (out / "tokenfleet.json").write_text(json.dumps({"synthetic": name, "seed": SEED}))
    return out


def _tokenizer() -> Any:
    from tokenfleet.shared import tiny

    return tiny.tokenizer()
