"""The real model path: continuous batching through the HF runner gives exactly
what plain `transformers` `generate()` gives, one prompt at a time."""

from __future__ import annotations

from typing import Any

import torch

from tokenfleet.shared.wire.schemas import SamplingParams
from tokenfleet.workers.detokenizer import TextStream
from tokenfleet.workers.hf_engine import HFEngine
from tokenfleet.workers.runner import HFRunner
from tokenfleet.workers.sampler import sample
from tokenfleet.workers.scheduler import Scheduler
from tokenfleet.workers.sequence import Sequence
from tokenfleet.workers.output_processor import step

PROMPTS = ["The function returns", "A", "In Python, a list is a mutable sequence of",
           "Errors should never pass silently.", "x = 1", "Once upon a time"]


def reference(model: Any, tok: Any, prompt: str, n: int) -> list[int]:
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=n, pad_token_id=tok.pad_token_id)
    return out[0, ids.shape[1]:].tolist()  # type: ignore[no-any-return]


def test_batched_greedy_equals_generate_one_by_one(loaded_tiny: tuple[Any, Any]) -> None:
    model, tok = loaded_tiny
    runner = HFRunner(model, tok)
    sched = Scheduler(max_batch=4, eos_token_ids=runner.eos_token_ids,
                      max_model_len=runner.max_model_len)
    engine = HFEngine(sched, runner)
    seqs = []
    for i, prompt in enumerate(PROMPTS * 2):
        n = 5 + 7 * (i % 5)
        s = Sequence(f"j{i}", tok(prompt)["input_ids"],
                     SamplingParams(max_new_tokens=n, temperature=0.0), TextStream(tok))
        seqs.append(s)
        engine.add(s)
        if i % 3 == 2:
            step(engine)  # later jobs join a batch already decoding
    while engine.has_work:
        step(engine)
    assert engine.stats.peak_batch == 4
    for i, s in enumerate(seqs):
        expected = reference(model, tok, PROMPTS[i % len(PROMPTS)], s.sampling.max_new_tokens)
        assert s.generated == expected, f"job {i}"
        assert s.text.text == tok.decode(expected, skip_special_tokens=True)


def seqs_with(params: list[SamplingParams]) -> list[Sequence]:
    return [Sequence(f"s{i}", [1, 2, 3], p, TextStream(None)) for i, p in enumerate(params)]


def test_greedy_rows_take_the_argmax_whatever_else_is_in_the_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0)]
    out = sample(logits.clone(), seqs_with(params))
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())


def test_a_seeded_job_samples_the_same_tokens_in_any_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 50).repeat(4, 1)

    def draws(batch_params: list[SamplingParams]) -> list[int]:
        seqs = seqs_with(batch_params)
        for _ in range(20):  # as the scheduler does: each token joins its sequence
            for seq, token in zip(seqs, sample(logits[: len(seqs)].clone(), seqs)):
                seq.generated.append(token)
        return seqs[0].generated

    seeded = SamplingParams(temperature=1.5, seed=42)
    alone = draws([seeded])
    crowded = draws([seeded, SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, seed=1)])
    assert alone == crowded
    assert len(set(alone)) > 3  # it really samples


def test_a_resumed_seeded_job_draws_what_the_undisturbed_one_would() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    seeded = SamplingParams(temperature=1.0, seed=7)
    whole = seqs_with([seeded])[0]
    for _ in range(12):
        whole.generated.append(sample(logits.clone(), [whole])[0])
    resumed = seqs_with([seeded])[0]
    resumed.generated = whole.generated[:5]  # another worker restored five tokens
    for _ in range(7):
        resumed.generated.append(sample(logits.clone(), [resumed])[0])
    assert resumed.generated == whole.generated


def test_sampled_tokens_follow_the_distribution_seeded_or_not() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0]])).repeat(2, 1)
    counts = torch.zeros(2, 5)
    for i in range(4000):
        rows = seqs_with([SamplingParams(temperature=1.0),
                          SamplingParams(temperature=1.0, seed=i)])
        for row, token in enumerate(sample(logits.clone(), rows)):
            counts[row, token] += 1
    assert counts[:, 4].sum() == 0  # a token of probability 0 is never drawn
    assert torch.allclose(counts / 4000, logits.exp(), atol=0.03)


def test_top_k_1_is_greedy_and_top_p_keeps_the_head_of_the_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 100)
    top1 = sample(logits.clone(), seqs_with([SamplingParams(top_k=1)] * 2))
    assert top1 == logits.argmax(dim=-1).tolist()
    probs = torch.softmax(logits[0], dim=-1)
    order = probs.argsort(descending=True)
    head = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    picks = {sample(logits[:1].clone(), seqs_with([SamplingParams(top_p=0.5)]))[0]
             for _ in range(200)}
    assert picks <= head


def test_repetition_penalty_lowers_tokens_already_in_the_text() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 2] = 2.0  # token 2 is in the prompt [1, 2, 3]
    logits[0, 5] = 1.5
    out = sample(logits, seqs_with([SamplingParams(temperature=0.0, repetition_penalty=2.0)]))
    assert out == [5]
