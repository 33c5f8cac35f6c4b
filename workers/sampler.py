"""Sampling for a whole batch in tensor ops, one wait for the device per step.

Every row keeps its own temperature, top-k, top-p, min-p, penalties, logit bias
and seed: they go to the device as small tensors, the tokens come back in one
copy (the step's only host sync; every other decision is made from the
parameters, on the host). Greedy rows take the exact argmax of their adjusted
logits. A request's adjustments apply in vLLM's order: logit bias, then
transformers' repetition penalty, then OpenAI's presence and frequency penalties,
then a structured output's grammar mask; temperature; min-p; top-k; top-p.
Each costs only the rows that ask for it.

Sampled rows draw by inversion: one uniform number u per row picks the token at
which the row's cumulative probability passes u. A seeded job's u is a hash of
its seed (for choice i of an n-choice request, ``SamplingParams.draw_seed``)
and the index of the token being drawn, so its tokens depend neither on
the other rows of the batch nor on any generator state: a job resumed elsewhere,
or prefilled again after a failed step, draws the same tokens without replaying
anything.

Log probabilities (``tokenfleet.workers.logprobs``) are taken from the raw
logits, before any adjustment, for the rows that ask, and come back in the
same copy as the tokens.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Collection
from collections.abc import Sequence as Seq
from itertools import chain

import torch

from tokenfleet.shared.wire.schemas import SamplingParams
from tokenfleet.workers.logprobs import StepLogprobs, asking
from tokenfleet.workers.sequence import Sequence


def sample(logits: torch.Tensor, seqs: Seq[Sequence],
           eos_token_ids: Collection[int] = ()) -> list[int]:
    """One token id per row of ``logits`` ([batch, vocab]); the rows whose job
    asked for log probabilities get them in ``Sequence.made_logprobs``. A row
    below its ``min_tokens`` cannot draw any of ``eos_token_ids``."""
    rows = asking(seqs)
    if not rows:
        return sample_ids(logits, seqs, eos_token_ids).tolist()  # type: ignore[no-any-return]
    # From the logits as the model gave them.
    logprobs = StepLogprobs(logits, seqs, rows, _to_device(torch.tensor(rows), logits.device))
    return logprobs.attach(sample_ids(logits, seqs, eos_token_ids), seqs)


def sample_ids(logits: torch.Tensor, seqs: Seq[Sequence],
               eos_token_ids: Collection[int] = ()) -> torch.Tensor:
    """The tokens of ``sample`` as a tensor on the logits' device (no host sync)."""
    logits = adjusted(logits.float(), seqs, eos_token_ids)
    params = [s.sampling for s in seqs]
    drawn = [row for row, p in enumerate(params) if p.temperature != 0.0]
    if not drawn:
        return logits.argmax(dim=-1)
    if len(drawn) == len(params):
        return _draw(logits, seqs)
    # Greedy and sampled rows together: only the rows that sample pay for it.
    index = _to_device(torch.tensor(drawn), logits.device)
    picked = _draw(logits.index_select(0, index), [seqs[row] for row in drawn])
    return logits.argmax(dim=-1).index_copy(0, index, picked)


def adjusted(logits: torch.Tensor, seqs: Seq[Sequence],
             eos_token_ids: Collection[int] = ()) -> torch.Tensor:
    """``logits`` as each row's request changes them before temperature."""
    params = [s.sampling for s in seqs]
    if any(p.logit_bias for p in params):
        logits = _biased(logits, seqs)
    if any(p.repetition_penalty != 1.0 for p in params):
        logits = _penalise(logits, seqs)
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        logits = _penalise_counts(logits, seqs)
    if eos_token_ids and any(len(s.generated) < s.sampling.min_tokens for s in seqs):
        logits = _no_end_yet(logits, seqs, eos_token_ids)
    if any(s.grammar is not None for s in seqs):
        logits = _grammar_masked(logits, seqs)
    return logits


def _no_end_yet(logits: torch.Tensor, seqs: Seq[Sequence],
                eos_token_ids: Collection[int]) -> torch.Tensor:
    """vLLM's ``min_tokens``: a row that has made fewer tokens than it asks for
    cannot end yet, so its end tokens are masked (after any bias, as vLLM does:
    no bias brings one back early)."""
    ends = sorted(eos_token_ids)
    rows = [row for row, s in enumerate(seqs) if len(s.generated) < s.sampling.min_tokens]
    row_of = [row for row in rows for _ in ends]
    token = ends * len(rows)
    host = (torch.tensor(row_of, dtype=torch.long), torch.tensor(token, dtype=torch.long))
    index = tuple(_to_device(t, logits.device) for t in host)
    return logits.index_put(index, torch.tensor(float("-inf"), device=logits.device))


def _grammar_masked(logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
    """Only what each constrained row's grammar allows next (last: no bias
    brings a forbidden token back)."""
    from tokenfleet.workers import grammar  # xgrammar: only when a row asks

    rows = [row for row, s in enumerate(seqs) if s.grammar is not None]
    return grammar.mask(logits, rows, [g for s in seqs if (g := s.grammar) is not None])


def seeded_uniform(seed: int, index: int) -> float:
    """The u in [0, 1) a job seeded ``seed`` draws its token ``index`` with."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / 2**53


def _draw(logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
    """Sample one token per row; every row samples (temperature > 0)."""
    rows, vocab = logits.shape
    device = logits.device
    params = [s.sampling for s in seqs]
    host = torch.tensor(
        [[p.temperature, p.top_k or vocab, p.top_p,
          -1.0 if p.draw_seed is None else seeded_uniform(p.draw_seed, len(s.generated))]
         for s, p in zip(seqs, params)], dtype=torch.float64)
    table = _to_device(host, device)
    temperature, top_k, top_p, seeded_u = table.unbind(dim=1)
    scaled = logits / temperature[:, None].float()
    scaled = _min_p(scaled, params)
    scaled = _top_k_top_p(scaled, top_k, top_p, params)
    # In float32 a token's share of the running sum is off by about 1e-7 of the
    # sum at most: far below any probability that matters to a draw.
    cdf = torch.softmax(scaled, dim=-1).cumsum(dim=-1)
    # Unseeded rows draw from torch's generator, in one call for all of them.
    u = torch.where(seeded_u >= 0, seeded_u, torch.rand(rows, dtype=torch.float64, device=device))
    total = cdf[:, -1:]
    # Scale u to the row's own total (float sums stop a hair off 1) and keep it
    # below that total, so the search never runs past the last token; a token of
    # zero probability adds nothing to the sum and so is never the first to pass u.
    below = torch.nextafter(total, torch.zeros_like(total))
    target = torch.minimum((u[:, None] * total).float(), below)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max(vocab - 1)


def _penalise(logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
    """As transformers does: shrink the logit of every token already in the text
    (prompt and output) of a row whose repetition penalty is not 1. Gathers and
    scatters the seen tokens only, so it costs the length of the texts, not the
    vocabulary (a token seen twice is written twice, with the same value)."""
    rows = [row for row, s in enumerate(seqs) if s.sampling.repetition_penalty != 1.0]
    ids = [seqs[row].all_ids for row in rows]
    lengths = torch.tensor([len(i) for i in ids])
    host = (torch.repeat_interleave(torch.tensor(rows), lengths),
            torch.tensor(list(chain.from_iterable(ids)), dtype=torch.long),
            torch.repeat_interleave(torch.tensor([seqs[row].sampling.repetition_penalty
                                                  for row in rows]), lengths))
    row_of, token, factor = (_to_device(t, logits.device) for t in host)
    seen = logits[row_of, token]
    shrunk = torch.where(seen < 0, seen * factor, seen / factor)
    return logits.index_put((row_of, token), shrunk)


def _biased(logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
    """Add each row's ``logit_bias`` (its ids were checked against the
    vocabulary when the job was admitted)."""
    row_of, token, bias = [], [], []
    for row, s in enumerate(seqs):
        for token_id, amount in s.sampling.logit_bias.items():
            row_of.append(row)
            token.append(token_id)
            bias.append(amount)
    return _add_at(logits, row_of, token, bias)


def _penalise_counts(logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
    """OpenAI's penalties: a token generated c times so far loses
    ``c * frequency_penalty + presence_penalty`` from its logit (the prompt does
    not count, as in OpenAI's and vLLM's servers)."""
    row_of, token, amount = [], [], []
    for row, s in enumerate(seqs):
        presence, frequency = s.sampling.presence_penalty, s.sampling.frequency_penalty
        if not (presence or frequency):
            continue
        for token_id, count in Counter(s.generated).items():
            row_of.append(row)
            token.append(token_id)
            amount.append(-(count * frequency + presence))
    return _add_at(logits, row_of, token, amount)


def _add_at(logits: torch.Tensor, rows: list[int], tokens: list[int],
            amounts: list[float]) -> torch.Tensor:
    if not rows:
        return logits
    host = (torch.tensor(rows, dtype=torch.long), torch.tensor(tokens, dtype=torch.long),
            torch.tensor(amounts, dtype=logits.dtype))
    row_of, token, amount = (_to_device(t, logits.device) for t in host)
    return logits.index_put((row_of, token), amount, accumulate=True)


def _min_p(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) each token less likely than ``min_p`` times the row's
    likeliest (after temperature, as vLLM does); only rows with a min-p."""
    bounded = [row for row, p in enumerate(params) if p.min_p > 0.0]
    if not bounded:
        return scaled
    index = _to_device(torch.tensor(bounded), scaled.device)
    floor = _to_device(torch.tensor([params[row].min_p for row in bounded]), scaled.device)
    rows = scaled.index_select(0, index)
    probs = torch.softmax(rows, dim=-1)
    cut = probs < probs.amax(dim=-1, keepdim=True) * floor[:, None].to(probs.dtype)
    return scaled.index_copy(0, index, rows.masked_fill(cut, float("-inf")))


def _top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) what each row's top-k, then its top-p, leave out, in
    transformers' order. Only the rows with a bound take part, and they rank
    only as many candidates as their largest top-k: a full sort of the
    vocabulary (what a row with top-p and no top-k needs) costs a hundred times
    a top-k of 50 on the CPU."""
    vocab = scaled.shape[1]
    bounded = [row for row, p in enumerate(params) if p.top_k or p.top_p < 1.0]
    if not bounded:
        return scaled
    index = _to_device(torch.tensor(bounded), scaled.device)
    top_k, top_p = top_k.index_select(0, index)[:, None], top_p.index_select(0, index)[:, None]
    most = max(min(params[row].top_k or vocab, vocab) for row in bounded)
    values, order = scaled.index_select(0, index).topk(most, dim=-1)
    ranks = torch.arange(most, device=scaled.device)[None, :]
    values = values.masked_fill(ranks >= top_k, float("-inf"))
    probs = torch.softmax(values, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always
    # stays); a row at top_p = 1 keeps all, whatever the float sums say.
    before = probs.cumsum(dim=-1) - probs
    values = values.masked_fill((before >= top_p) & (top_p < 1.0), float("-inf"))
    kept = torch.full_like(scaled[: len(bounded)], float("-inf")).scatter_(1, order, values)
    return scaled.index_copy(0, index, kept)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device: a plain copy
    to a GPU first waits for the work queued before it (the forward pass)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)

