"""Per-sequence sampling over a batch of logits.

Every row keeps its own temperature, top-k, top-p, repetition penalty and seed.
Greedy rows take the argmax. Sampled rows use the exponential race (argmax of
p / E with E ~ Exp(1)), which draws one uniform vector per row per token: a
seeded job draws from its own generator, so its tokens do not depend on what
else is in the batch, and a resumed job can skip the draws it already made.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from tokenfleet.workers.sequence import Sequence


def seeded_generator(seq: Sequence, vocab: int, device: torch.device) -> torch.Generator:
    if seq.rng is None:
        assert seq.sampling.seed is not None
        gen = torch.Generator(device=device)
        gen.manual_seed(seq.sampling.seed)
        # A resumed job already drew one vector per restored token.
        for _ in range(len(seq.generated)):
            torch.rand(vocab, generator=gen, device=device)
        seq.rng = gen
    assert isinstance(seq.rng, torch.Generator)
    return seq.rng


def sample(logits: torch.Tensor, seqs: Seq[Sequence]) -> list[int]:
    """One token id per row of ``logits`` ([batch, vocab])."""
    logits = logits.float()
    params = [s.sampling for s in seqs]
    for row, (seq, p) in enumerate(zip(seqs, params)):
        if p.repetition_penalty != 1.0:
            _penalise(logits[row], seq.all_ids, p.repetition_penalty)
    greedy = [p.temperature == 0.0 for p in params]
    if all(greedy):
        return logits.argmax(dim=-1).tolist()  # type: ignore[no-any-return]

    device = logits.device
    temps = torch.tensor([p.temperature or 1.0 for p in params], device=device)
    scaled = logits / temps[:, None]
    if any(p.top_k for p in params) or any(p.top_p < 1.0 for p in params):
        scaled = _top_k_top_p(scaled, params)
    probs = torch.softmax(scaled, dim=-1)
    uniform = torch.empty_like(probs)
    unseeded = [i for i, p in enumerate(params) if p.seed is None]
    if unseeded:
        uniform[unseeded] = torch.rand(len(unseeded), probs.shape[1], device=device)
    for row, seq in enumerate(seqs):
        if seq.sampling.seed is not None:
            gen = seeded_generator(seq, probs.shape[1], device)
            uniform[row] = torch.rand(probs.shape[1], generator=gen, device=device)
    race = probs / -torch.log(uniform.clamp_min(1e-20))
    sampled = race.argmax(dim=-1)
    greedy_rows = torch.tensor(greedy, device=device)
    return torch.where(greedy_rows, logits.argmax(dim=-1), sampled).tolist()  # type: ignore[no-any-return]


def _penalise(row: torch.Tensor, history: list[int], penalty: float) -> None:
    # As transformers does: shrink the logit of every token already in the text.
    ids = torch.tensor(sorted(set(history)), device=row.device, dtype=torch.long)
    seen = row[ids]
    row[ids] = torch.where(seen < 0, seen * penalty, seen / penalty)


def _top_k_top_p(scaled: torch.Tensor, params: list) -> torch.Tensor:  # type: ignore[type-arg]
    vocab = scaled.shape[1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=scaled.device)[None, :]
    k = torch.tensor([p.top_k or vocab for p in params], device=scaled.device)[:, None]
    drop = ranks >= k
    top_p = torch.tensor([p.top_p for p in params], device=scaled.device)[:, None]
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    drop |= (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, sorted_logits)
