"""The ``tiny`` model: trained here and shipped in ``shared/tiny_model`` (see
``tests/tools/train_tiny.py``), and its byte-level tokenizer, which the random
models of ``tokenfleet.shared.synthetic`` share.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SHIPPED = Path(__file__).parent / "tiny_model"


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


def tokenizer() -> Any:
    """The shipped model's tokenizer (1,024 tokens); in a checkout without it, the
    bare byte-level one."""
    if (SHIPPED / "config.json").exists():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(SHIPPED)
    return byte_level_tokenizer()
