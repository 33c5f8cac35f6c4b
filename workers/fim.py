"""Fill-in-the-middle (OpenAI's ``suffix``, insert mode) for models trained for it.

A model can write the text between a prefix and a suffix only if it was
trained with sentinel tokens that mark the two parts; its tokenizer then
declares them in its vocabulary. The common open-model conventions are below,
each in its prefix-suffix-middle order (the model writes after the last
sentinel). A tokenizer that declares none of them has no insert mode, and a
request with a suffix is refused, naming the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FimFormat:
    prefix: str  # before the text that comes first
    suffix: str  # before the text that comes after the insertion
    middle: str  # after both: the model writes the middle from here

    def prompt(self, before: str, after: str) -> str:
        """The prompt that asks for the text between ``before`` and ``after``."""
        return f"{self.prefix}{before}{self.suffix}{after}{self.middle}"


# StarCoder and SantaCoder; Qwen2.5-Coder; DeepSeek-Coder.
FORMATS = (
    FimFormat("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    FimFormat("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    FimFormat("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
)


def fim_format(tokenizer: Any) -> FimFormat | None:
    """The first convention whose three sentinels are added tokens of
    ``tokenizer`` (so that encoding :meth:`FimFormat.prompt` as text makes each
    one token, as the model was trained on), or None: no insert mode."""
    vocab = tokenizer.get_added_vocab()
    for fmt in FORMATS:
        if all(token in vocab for token in (fmt.prefix, fmt.suffix, fmt.middle)):
            return fmt
    return None
