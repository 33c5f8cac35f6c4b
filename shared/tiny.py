"""Small models the project makes itself, offline and deterministically.

``tiny`` is the trained model shipped in ``shared/tiny_model`` (see
``tokenfleet.shared.train_tiny``). The ``tiny-random`` and ``tiny-wide`` variants share its
tokenizer but have fixed-seed random weights: the first for tests that only
need a real forward pass, the second (4x wider) for benchmarks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SHIPPED = Path(__file__).parent / "tiny_model"
SEED = 1234
BASE = {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4}
VARIANTS = {"tiny-random": 1, "tiny-wide": 4}


def byte_level_tokenizer() -> Any:
    """A byte-level BPE tokenizer with no merges: 256 byte tokens and 3 specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|bos|>", "<|eos|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(specials + sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", vocab["<|bos|>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )


def write_random(out: Path, width: int = 1) -> Path:
    """Write a fixed-seed random Llama model (``width`` times the base width) to ``out``."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer: Any = (AutoTokenizer.from_pretrained(SHIPPED) if (SHIPPED / "config.json").exists()
                      else byte_level_tokenizer())
    shape = dict(BASE)
    shape["hidden_size"] *= width
    shape["intermediate_size"] *= width
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        **shape,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    # Random weights give flat logits; scaling the embeddings spreads them so that
    # greedy decoding is not decided by rounding noise.
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "tokenfleet.json").write_text(json.dumps({"variant": "random", "width": width}))
    return out
