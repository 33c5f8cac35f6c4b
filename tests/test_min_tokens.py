"""``min_tokens`` and ``ignore_eos`` on the built-in engine: no end (EOS) before
that many tokens, or none at all, even where the request's own logit bias makes
EOS the likeliest token."""

from __future__ import annotations

from typing import Any

import pytest

from tokenfleet.shared.wire.schemas import FinishReason, SamplingParams
from tokenfleet.workers.output_processor import step


def generate(loaded_tiny: Any, **sampling: Any) -> tuple[list[int], FinishReason | None, Any]:
    from tokenfleet.workers.detokenizer import TextStream
    from tokenfleet.workers.hf_engine import HFEngine
    from tokenfleet.workers.runner import HFRunner
    from tokenfleet.workers.scheduler import Scheduler
    from tokenfleet.workers.sequence import Sequence

    model, tok = loaded_tiny
    runner = HFRunner(model, tok)
    engine = HFEngine(Scheduler(max_batch=4, eos_token_ids=runner.eos_token_ids,
                                max_model_len=runner.max_model_len), runner)
    eos = min(runner.eos_token_ids)
    seq = Sequence("j", tok("The list of values")["input_ids"],
                   SamplingParams(max_new_tokens=12, logit_bias={eos: 100.0}, **sampling),
                   TextStream(tok))
    engine.add(seq)
    while engine.has_work:
        step(engine)
    return seq.generated, seq.finish_reason, runner.eos_token_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_holds_off_an_eos_the_bias_makes_certain(
        loaded_tiny: Any, temperature: float) -> None:
    # Without min_tokens the biased EOS ends the job at its first token.
    early, reason, _ = generate(loaded_tiny, temperature=temperature, seed=3)
    assert (len(early), reason) == (1, FinishReason.EOS)
    made, reason, eos = generate(loaded_tiny, temperature=temperature, seed=3, min_tokens=5)
    assert len(made) == 6 and reason == FinishReason.EOS
    assert not set(made[:5]) & set(eos)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ignore_eos_makes_exactly_max_new_tokens_through_a_certain_eos(
        loaded_tiny: Any, temperature: float) -> None:
    # What benchmarks send to fix the output length: the biased EOS is drawn
    # again and again, and none of them ends the job before its length.
    made, reason, eos = generate(loaded_tiny, temperature=temperature, seed=3, ignore_eos=True)
    assert len(made) == 12 and reason == FinishReason.LENGTH
    assert set(made) & set(eos)


def test_ignore_eos_takes_only_a_boolean() -> None:
    with pytest.raises(ValueError):
        SamplingParams(ignore_eos="yes")


def test_min_tokens_is_refused_below_zero() -> None:
    with pytest.raises(ValueError):
        SamplingParams(min_tokens=-1)
