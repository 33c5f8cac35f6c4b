"""Log probabilities of a prompt's own tokens (vLLM's ``prompt_logprobs``,
OpenAI's ``echo`` with ``logprobs``), from the prefill's logits: no second
forward pass.

The logits at position i predict token i + 1, so a prompt of n tokens has n - 1
values; the first token has none (None, as OpenAI and vLLM write it). Only the
sequences that ask keep logits for every prompt position (the prefill keeps
the last position's alone for the others, ``logits_to_keep``); the values are
the raw distribution's, as the generated tokens' (``tokenfleet.workers.logprobs``).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tokenfleet.workers.detokenizer import rust_tokenizer
from tokenfleet.workers.logprobs import FLOOR, Logprobs, token_text

if TYPE_CHECKING:
    from tokenfleet.workers.sequence import Sequence


def asks(seq: Sequence) -> bool:
    """Whether this prefill computes ``seq``'s prompt log probabilities: it
    asked, and has not had them yet (a resumed job's came with its first run)."""
    return seq.sampling.prompt_logprobs is not None and seq.prompt_logprobs is None


def compute(logits: torch.Tensor, prompt_ids: list[int], wanted: int) -> list[Logprobs | None]:
    """``logits`` [len(prompt_ids), vocab] at the prompt's positions: each
    token's log probability after the ones before it, and the ``wanted``
    likeliest tokens there; None for the first token. One copy to the host."""
    if len(prompt_ids) < 2:
        return [None] * len(prompt_ids)
    return [None, *of_targets(logits[:len(prompt_ids) - 1], prompt_ids[1:], wanted)]


def of_targets(logits: torch.Tensor, targets: list[int], wanted: int) -> list[Logprobs]:
    """For each row of ``logits`` [len(targets), vocab], the log probability of
    its target (the token that follows) and the ``wanted`` likeliest tokens."""
    rows = len(targets)
    if not rows:
        return []
    # log_softmax(x)[t] = x[t] - logsumexp(x): no [rows, vocab] table written,
    # and the likeliest tokens are the largest logits (``max`` for one: faster
    # than ``topk``). Every position of a long prompt pays this, so it counts.
    logits = logits.float()
    norm = logits.logsumexp(dim=-1)
    chosen = logits.gather(1, torch.tensor(targets, device=logits.device)[:, None]).flatten()
    parts = [(chosen - norm).double()]
    if wanted == 1:
        best, at = logits.max(dim=-1)
        parts += [(best - norm).double(), at.double()]
    elif wanted:
        top = logits.topk(wanted, dim=-1)
        parts += [(top.values - norm[:, None]).flatten().double(), top.indices.flatten().double()]
    host = torch.cat(parts).cpu().numpy()
    values = host[:rows].astype(np.float32)  # exact: they were float32
    top_values = host[rows:rows + rows * wanted].astype(np.float32).reshape(rows, wanted)
    top_ids = host[rows + rows * wanted:].astype(np.int64).reshape(rows, wanted)
    return [Logprobs(values[i], top_ids[i].tolist(), top_values[i]) for i in range(rows)]


class ChunkKeep:
    """A chunked prefill's share (the paged runner): a step feeds prompt
    positions [start, end) of a sequence that asks; the positions before the
    prompt's last predict prompt tokens, so their logits are kept too (after
    the sampled rows' in ``logits_to_keep``), and their values wait, by
    position, until the chunk that ends the prompt completes the list."""

    def __init__(self) -> None:
        self.partial: dict[str, dict[int, Logprobs]] = {}
        self.step: list[tuple[Sequence, int, int]] = []  # (seq, first position, end)

    def plan(self, seq: Sequence, start: int, end: int, packed_first: int) -> list[int]:
        """The packed indices to keep for this chunk of ``seq`` (packed from ``packed_first``)."""
        if not asks(seq):
            return []
        if start == 0:
            self.partial[seq.job_id] = {}
        stop = min(end, len(seq.prompt_ids) - 1)
        if stop <= start:
            if stop == len(seq.prompt_ids) - 1 or len(seq.prompt_ids) < 2:
                self.step.append((seq, start, start))
            return []
        self.step.append((seq, start, stop))
        return list(range(packed_first, packed_first + stop - start))

    def take(self, logits: torch.Tensor) -> None:
        """``logits``: the kept rows of this step's plan, in order (one pass for all)."""
        wanted = max(seq.sampling.prompt_logprobs or 0 for seq, _, _ in self.step)
        every = of_targets(logits, [t for seq, start, stop in self.step
                                    for t in seq.prompt_ids[start + 1:stop + 1]], wanted)
        row = 0
        for seq, start, stop in self.step:
            keep = seq.sampling.prompt_logprobs or 0
            made = every[row:row + stop - start]
            if keep != wanted:
                made = [Logprobs(lp.logprob, lp.top_ids[:keep], lp.top_logprobs[:keep])
                        for lp in made]
            row += stop - start
            held = self.partial.setdefault(seq.job_id, {})
            held.update({start + 1 + k: lp for k, lp in enumerate(made)})
            if stop >= len(seq.prompt_ids) - 1:
                del self.partial[seq.job_id]
                first: list[Logprobs | None] = [None]  # the first token has none
                seq.prompt_logprobs = first + [held.get(p) for p in range(1, len(seq.prompt_ids))]
        self.step = []


class PackedKeep:
    """Which positions of a packed prefill (prompts end to end, ``lengths``
    tokens each) keep their logits: every prompt position of a sequence that
    asks, the last position of the others. ``index`` goes to the model as
    ``logits_to_keep``; ``take`` stores the askers' values and gives the last
    position's logits of every sequence, [len(seqs), vocab], for the sampler."""

    def __init__(self, seqs: Seq[Sequence], lengths: list[int]) -> None:
        self.spans: list[tuple[int, int]] = []  # per seq: its kept rows in the logits
        keep: list[int] = []
        start = 0
        for seq, length in zip(seqs, lengths):
            first = len(keep)
            keep.extend(range(start, start + length) if asks(seq) else [start + length - 1])
            self.spans.append((first, len(keep)))
            start += length
        self.keep = keep
        self.any = any(asks(s) for s in seqs)

    def take(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
        askers = [(seq, first, end) for seq, (first, end) in zip(seqs, self.spans) if asks(seq)]
        # One pass for every asker: the rows before each prompt's last, as wide as the widest ask.
        # (A resumed job's prefill runs on past its prompt: its prompt's rows only.)
        rows = torch.tensor([r for seq, first, _ in askers
                             for r in range(first, first + len(seq.prompt_ids) - 1)],
                            dtype=torch.long, device=logits.device)
        wanted = max(seq.sampling.prompt_logprobs or 0 for seq, _, _ in askers)
        made = of_targets(logits.index_select(0, rows),
                          [t for seq, _, _ in askers for t in seq.prompt_ids[1:]], wanted)
        at = 0
        for seq, _, _ in askers:
            count, keep = len(seq.prompt_ids) - 1, seq.sampling.prompt_logprobs or 0
            mine = made[at:at + max(count, 0)]
            at += max(count, 0)
            seq.prompt_logprobs = [None, *(mine if keep == wanted else [
                Logprobs(lp.logprob, lp.top_ids[:keep], lp.top_logprobs[:keep]) for lp in mine])]
        last = torch.tensor([end - 1 for _, end in self.spans], device=logits.device)
        return logits.index_select(0, last)


def wire(seq: Sequence) -> dict[str, Any] | None:
    """``seq``'s prompt as its first event carries it (``PromptEcho``'s wire
    form): the prompt's text, decoded (special tokens kept, as echoed), and
    ``[token, logprob, [[id, token, logprob], ...]]`` per prompt token, the
    first ``[token, null, null]``; None when the job did not ask, or its
    values are not there (an engine that reports them always has them)."""
    made = seq.prompt_logprobs
    if seq.sampling.prompt_logprobs is None or made is None:
        return None
    tokenizer = seq.text.tokenizer
    tokens: list[list[Any]] = []
    for token_id, lp in zip(seq.prompt_ids, made):
        text = token_text(tokenizer, token_id)
        if lp is None:
            tokens.append([text, None, None])
            continue
        top = [[i, token_text(tokenizer, i), v]
               for i, v in zip(lp.top_ids, np.maximum(lp.top_logprobs, FLOOR))]
        tokens.append([text, np.maximum(lp.logprob, FLOOR), top])
    if tokenizer is None:
        return {"text": "", "token_ids": seq.prompt_ids, "tokens": tokens,
                "offsets": [0] * len(tokens)}
    # Where each token starts in the prompt's text: the length of the text of
    # the tokens before it (decoded together: a token's share depends on its
    # neighbours). Special tokens (a BOS) are no part of the echoed text.
    backend = rust_tokenizer(tokenizer) or tokenizer
    ids = seq.prompt_ids
    offsets = [len(backend.decode(ids[:i], skip_special_tokens=True)) for i in range(len(ids))]
    return {"text": backend.decode(ids, skip_special_tokens=True), "token_ids": ids,
            "tokens": tokens, "offsets": offsets}
