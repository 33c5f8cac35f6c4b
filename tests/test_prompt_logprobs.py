"""Prompt log probabilities: from the prefill's logits, equal to transformers'
own log_softmax at each prompt position; the first token has none."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from tokenfleet.shared.wire.schemas import SamplingParams
from tokenfleet.workers.detokenizer import TextStream
from tokenfleet.workers.hf_engine import HFEngine
from tokenfleet.workers.paged_runner import PagedRunner
from tokenfleet.workers.runner import HFRunner
from tokenfleet.workers.scheduler import Scheduler
from tokenfleet.workers.sequence import Sequence
from tokenfleet.workers.output_processor import step

PROMPTS = ["Once upon a time there was", "A", "x = 1 + 2 * y"]


def reference(model: Any, prompt_ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax at positions 0..n-2 (each predicting the next prompt token)."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def run(runner: Any, tok: Any, asks: list[int | None], step_tokens: int | None) -> list[Sequence]:
    engine = HFEngine(Scheduler(max_batch=4, eos_token_ids=runner.eos_token_ids,
                                max_model_len=runner.max_model_len,
                                max_step_tokens=step_tokens), runner)
    seqs = [Sequence(f"j{i}", tok(p)["input_ids"],
                     SamplingParams(max_new_tokens=3, temperature=0.0, prompt_logprobs=ask),
                     TextStream(tok)) for i, (p, ask) in enumerate(zip(PROMPTS, asks))]
    for s in seqs:
        engine.add(s)
    while engine.has_work:
        step(engine)
    return seqs


@pytest.mark.parametrize("runner_class,count,step_tokens", [
    (HFRunner, 3, None), (HFRunner, 1, None), (PagedRunner, 3, None), (PagedRunner, 3, 4)],
    ids=["packed", "alone", "paged", "paged-chunked"])
def test_prompt_logprobs_equal_transformers_log_softmax(
    loaded_tiny: tuple[Any, Any], runner_class: Any, count: int, step_tokens: int | None
) -> None:
    model, tok = loaded_tiny
    asks = [3, None, 0][:count]
    seqs = run(runner_class(model, tok), tok, asks, step_tokens)
    plain = run(runner_class(model, tok), tok, [None] * count, step_tokens)
    for seq, ask, without in zip(seqs, asks, plain):
        # What the job generates does not change for asking.
        assert seq.generated == without.generated and len(seq.generated) == 3
        if ask is None:
            assert seq.prompt_logprobs is None
            continue
        got = seq.prompt_logprobs
        assert got is not None and len(got) == len(seq.prompt_ids)
        assert got[0] is None  # nothing comes before the first token
        expected = reference(model, seq.prompt_ids)
        for position, (token_id, lp) in enumerate(zip(seq.prompt_ids[1:], got[1:])):
            assert lp is not None
            assert abs(float(lp.logprob) - float(expected[position, token_id])) < 1e-4
            top = expected[position].topk(ask)
            assert lp.top_ids == top.indices.tolist()
            np.testing.assert_allclose(lp.top_logprobs, top.values.numpy(), atol=1e-4)
