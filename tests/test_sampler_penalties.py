"""OpenAI's presence and frequency penalties, logit bias and min-p in the batched
sampler, against a plain one-row-at-a-time reference of their formulas, on random
logits and random histories."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import given, settings as hsettings, strategies as st

from tokenfleet.shared.wire.schemas import SamplingParams
from tokenfleet.workers.detokenizer import TextStream
from tokenfleet.workers.sampler import adjusted, sample
from tokenfleet.workers.sequence import Sequence

VOCAB = 40


def reference(logits: list[float], prompt: list[int], generated: list[int],
              p: SamplingParams) -> list[float]:
    """OpenAI's formula (mu[j] - c[j] * frequency - [c[j] > 0] * presence), after
    the logit bias and transformers' repetition penalty, as vLLM orders them."""
    out = list(logits)
    for token, bias in p.logit_bias.items():
        out[token] += bias
    if p.repetition_penalty != 1.0:
        for token in set(prompt + generated):
            out[token] = (out[token] * p.repetition_penalty if out[token] < 0
                          else out[token] / p.repetition_penalty)
    for token, count in Counter(generated).items():
        out[token] -= count * p.frequency_penalty + p.presence_penalty
    return out


penalty = st.one_of(st.just(0.0), st.floats(-2.0, 2.0))
params = st.builds(
    SamplingParams,
    temperature=st.just(0.0),
    presence_penalty=penalty,
    frequency_penalty=penalty,
    repetition_penalty=st.one_of(st.just(1.0), st.floats(0.5, 2.0)),
    logit_bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100.0, 100.0),
                               max_size=6),
)
row = st.tuples(params, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
                st.lists(st.integers(0, VOCAB - 1), max_size=30))


def seq(i: int, p: SamplingParams, prompt: list[int], generated: list[int]) -> Sequence:
    s = Sequence(f"s{i}", prompt, p, TextStream(None))
    s.generated = list(generated)
    return s


@pytest.mark.slow
@hsettings(max_examples=300, deadline=None)
@given(rows=st.lists(row, min_size=1, max_size=6), seed=st.integers(0, 2**31))
def test_penalties_and_bias_equal_the_reference_row_by_row(rows: list[Any], seed: int) -> None:
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed)) * 5
    seqs = [seq(i, p, prompt, generated) for i, (p, prompt, generated) in enumerate(rows)]
    got = adjusted(logits.clone(), seqs)
    for i, (p, prompt, generated) in enumerate(rows):
        want = torch.tensor(reference(logits[i].tolist(), prompt, generated, p))
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-4)
    # Greedy rows take the argmax of what the reference makes of their logits.
    greedy = sample(logits.clone(), seqs)
    for i, (p, prompt, generated) in enumerate(rows):
        want = reference(logits[i].tolist(), prompt, generated, p)
        assert want[greedy[i]] == pytest.approx(max(want), abs=1e-4)


def test_a_row_without_adjustments_is_left_as_it_was_beside_one_with_them() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(7))
    seqs = [seq(0, SamplingParams(), [1], [3, 3, 4]),
            seq(1, SamplingParams(frequency_penalty=1.5, logit_bias={5: 100.0}), [1], [3, 3, 4])]
    got = adjusted(logits.clone(), seqs)
    assert torch.equal(got[0], logits[0])
    assert got[1][3] == pytest.approx(float(logits[1][3]) - 3.0)
    assert got[1][5] == pytest.approx(float(logits[1][5]) + 100.0)


def test_a_bias_of_100_forces_a_token_and_minus_100_bans_it() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    forced = SamplingParams(temperature=1.0, seed=1, logit_bias={17: 100.0})
    banned_all_but = {t: -100.0 for t in range(VOCAB) if t != 9}
    banned = SamplingParams(temperature=1.0, seed=1, logit_bias=banned_all_but)
    seqs = [seq(0, forced, [1], []), seq(1, banned, [1], [])]
    for n in range(20):
        for s in seqs:
            s.generated = [0] * n  # another draw each time (the seeded u moves on)
        assert sample(logits.clone(), seqs) == [17, 9]


@hsettings(max_examples=200, deadline=None)
@given(min_p=st.floats(0.01, 1.0), seed=st.integers(0, 2**31), temperature=st.floats(0.2, 2.0))
def test_min_p_never_draws_a_token_less_likely_than_min_p_times_the_likeliest(
    min_p: float, seed: int, temperature: float
) -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    probs = torch.softmax(logits[0] / temperature, dim=-1)
    allowed = probs >= probs.max() * min_p
    p = SamplingParams(temperature=temperature, min_p=min_p, seed=seed)
    s = seq(0, p, [1], [])
    for n in range(8):
        s.generated = [0] * n
        token = sample(logits.clone(), [s])[0]
        assert allowed[token], (token, float(probs[token]), float(probs.max()))


def test_out_of_range_values_are_refused_naming_the_field_and_the_limit() -> None:
    from pydantic import ValidationError

    for fields, message in [({"presence_penalty": 2.5}, "presence_penalty"),
                            ({"frequency_penalty": -3}, "frequency_penalty"),
                            ({"min_p": 1.5}, "min_p"),
                            ({"logit_bias": {3: 101}}, "outside -100 to 100"),
                            ({"logit_bias": {-1: 1}}, "negative"),
                            ({"logit_bias": {i: 1 for i in range(301)}}, "at most 300")]:
        with pytest.raises(ValidationError, match=message):
            SamplingParams(**fields)
