"""Log probabilities of the tokens a step samples, for the rows that ask.

Which distribution: the model's own, ``log_softmax`` of the raw logits, before
logit bias, penalties, temperature or truncation change them; vLLM reports
the same by default (its ``logprobs_mode`` is ``raw_logprobs``), so both
engines agree, and a greedy token's value is what ``transformers`` computes
for it. They come from the logits the step's sampler gets: no second forward
pass. Only the rows whose job asked (``SamplingParams.logprobs`` set) pay for
them: one ``log_softmax`` and one batched ``topk`` over those rows, and they go
to the host in the same copy as the step's token ids (the step's one wait for
the device).

Values stay float32-exact all the way: the log writes each as the shortest
decimal that reads back as the same float32 (orjson's float32 output), which
keeps the JSON small without rounding (a fixed number of decimals would turn a
log probability of -3e-8 into 0).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokenfleet.workers.detokenizer import rust_tokenizer

if TYPE_CHECKING:
    from tokenfleet.workers.sequence import Sequence

# The lowest log probability written: OpenAI's (and vLLM's) stand-in for -inf.
FLOOR = np.float32(-9999.0)


@dataclass(frozen=True, slots=True)
class Logprobs:
    """One sampled token's log probability and its position's likeliest tokens
    (ids and log probabilities, likeliest first), as numbers: the token
    strings are the output side's (``wire``)."""

    logprob: np.float32
    top_ids: list[int]
    top_logprobs: np.ndarray  # float32, one per id

    def wire(self, token_id: int, tokenizer: Any) -> list[Any]:
        """As the token log holds it (``TokenLogprob``'s wire form):
        ``[token, logprob, [[id, token, logprob], ...]]``; -inf (a token the
        model rules out) as OpenAI writes it, -9999.0: JSON has no infinity."""
        top = [[i, token_text(tokenizer, i), lp]
               for i, lp in zip(self.top_ids, np.maximum(self.top_logprobs, FLOOR))]
        return [token_text(tokenizer, token_id), np.maximum(self.logprob, FLOOR), top]


def wire(seq: Sequence, token_ids: list[int], made: list[Logprobs | None]) -> list[Any] | None:
    """The log probabilities of ``seq``'s tokens ``token_ids`` as one event of
    its log holds them; None when the job did not ask (or, which an engine
    that reports them never does, a token came without them)."""
    if seq.sampling.logprobs is None:
        return None
    values = [lp for lp in made if lp is not None]
    if len(values) != len(token_ids):
        return None
    tokenizer = seq.text.tokenizer
    return [lp.wire(token_id, tokenizer) for token_id, lp in zip(token_ids, values)]


def asking(seqs: Seq[Sequence]) -> list[int]:
    """The rows whose job asked for log probabilities."""
    return [row for row, s in enumerate(seqs) if s.sampling.logprobs is not None]


class StepLogprobs:
    """The log probabilities of ``rows`` of one step's raw ``logits``
    [batch, vocab] (``index``: the rows on the logits' device), taken before
    the sampler adjusts anything; ``attach`` adds the sampled tokens' own and
    hands everything to the host with the ids."""

    def __init__(self, logits: torch.Tensor, seqs: Seq[Sequence], rows: list[int],
                 index: torch.Tensor) -> None:
        self.rows = rows
        self.index = index
        self.table = torch.log_softmax(logits.index_select(0, self.index).float(), dim=-1)
        # One top-k for every row, as wide as the widest ask; each row keeps its own count.
        self.width = max(seqs[row].sampling.logprobs or 0 for row in rows)
        self.top: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.width:
            top = self.table.topk(self.width, dim=-1)
            self.top = (top.values, top.indices)

    def attach(self, token_ids: torch.Tensor, seqs: Seq[Sequence]) -> list[int]:
        """The step's token ids on the host; each asking row's log
        probabilities go to its sequence (``Sequence.made_logprobs``) under
        the index of the token being made. One copy for all: token ids and
        float32 values are exact in float64."""
        count, asked = len(token_ids), len(self.rows)
        chosen = self.table.gather(1, token_ids.index_select(0, self.index)[:, None])
        parts = [token_ids.double(), chosen.flatten().double()]
        if self.top is not None:
            parts += [self.top[0].flatten().double(), self.top[1].flatten().double()]
        host = torch.cat(parts).cpu().numpy()
        ids = host[:count].astype(np.int64)
        top_end = count + asked + asked * self.width  # ids | chosen, top values | top ids
        values = host[count:top_end].astype(np.float32)  # exact: they were float32
        top_values = values[asked:].reshape(asked, self.width)
        top_ids = host[top_end:].astype(np.int64).reshape(asked, self.width)
        for j, row in enumerate(self.rows):
            seq = seqs[row]
            wanted = seq.sampling.logprobs or 0
            seq.made_logprobs[len(seq.generated)] = Logprobs(
                values[j], top_ids[j, :wanted].tolist(), top_values[j, :wanted])
        return ids.tolist()  # type: ignore[no-any-return]


# token id -> its text alone, per tokenizer: a vocabulary's strings are few and
# the same ones come back at every step.
_texts: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()


def token_text(tokenizer: Any, token_id: int) -> str:
    """The token decoded alone, special tokens included (an end of sequence
    reads as its name), as OpenAI's and vLLM's logprobs name tokens."""
    try:
        cache = _texts[tokenizer]
    except KeyError:
        cache = _texts[tokenizer] = {}
    except TypeError:  # not weakly referable: no cache
        cache = {}
    text = cache.get(token_id)
    if text is None:
        backend = rust_tokenizer(tokenizer) or tokenizer
        text = cache[token_id] = backend.decode([token_id], skip_special_tokens=False)
    return text
