"""A runner with no model: every step emits one fixed token per sequence at once.

It measures what the fleet itself costs (the queue, the record writes, the token
log and pub/sub, the scheduler and detokenizer) with nothing else in the step.
A worker runs it with ``TOKENFLEET_MODEL=null``; it uses the built-in tiny
model's tokenizer, so prompts are admitted and tokens decoded as usual.
"""

from __future__ import annotations

from typing import Any

from tokenfleet.workers.scheduler import StepBatch

NULL_MODEL = "null"
TOKEN_TEXT = "x"  # what every step emits: one character, never an end of sequence


class NullRunner:
    chunked_prefill = False  # no prefill at all: whole, as the scheduler's default
    rows_at_longest = False  # no cache

    def __init__(self, tokenizer: Any, max_model_len: int = 1 << 16) -> None:
        self.tokenizer = tokenizer
        self.token_id: int = tokenizer.encode(TOKEN_TEXT, add_special_tokens=False)[0]
        self.max_model_len = max_model_len
        self.vocab_size = len(tokenizer)
        eos = tokenizer.eos_token_id
        self.eos_token_ids: set[int] = set() if eos is None else {int(eos)}
        self.steps = 0

    def run(self, batch: StepBatch) -> list[int]:
        self.steps += 1
        return [self.token_id] * len(batch.sampled)

    def reset(self) -> None:
        pass


def null_tokenizer() -> Any:
    """The built-in tiny model's tokenizer, without loading any weights."""
    from transformers import AutoTokenizer

    from tokenfleet.shared.models import resolve

    return AutoTokenizer.from_pretrained(resolve("tiny"), local_files_only=True)
