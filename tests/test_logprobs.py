"""Log probabilities: computed in the sampler's step from the raw logits, carried
exactly through the token log's JSON, refused by an engine that has none."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tokenfleet.shared.wire.schemas import SamplingParams, TokenEvent
from tokenfleet.shared.wire.serialization import parse_event, token_event
from tokenfleet.workers.detokenizer import TextStream
from tokenfleet.workers.hf_engine import HFEngine
from tokenfleet.workers.logprobs import Logprobs
from tokenfleet.workers.paged_runner import PagedRunner
from tokenfleet.workers.runner import HFRunner
from tokenfleet.workers.sampler import sample
from tokenfleet.workers.scheduler import Scheduler
from tokenfleet.workers.sequence import Sequence
from tokenfleet.workers.output_processor import step

from scripted import ScriptedRunner

PROMPTS = ["Once upon a time", "A", "x = 1"]
TOP = 3


def reference(model: Any, seq: Sequence) -> torch.Tensor:
    """transformers' own log_softmax at each position that made a token of ``seq``."""
    with torch.inference_mode():
        logits = model(torch.tensor([seq.all_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(seq.prompt_ids) - 1:-1]


@pytest.mark.parametrize("runner_class", [HFRunner, PagedRunner])
def test_greedy_logprobs_equal_log_softmax_of_transformers_logits(
    loaded_tiny: tuple[Any, Any], runner_class: Any
) -> None:
    model, tok = loaded_tiny
    runner = runner_class(model, tok)
    engine = HFEngine(Scheduler(max_batch=4, eos_token_ids=runner.eos_token_ids,
                                max_model_len=runner.max_model_len), runner)
    # The middle job asks for nothing: its rows cost nothing and carry nothing.
    asks = [TOP, None, 0]
    seqs = [Sequence(f"j{i}", tok(p)["input_ids"],
                     SamplingParams(max_new_tokens=6, temperature=0.0, logprobs=ask),
                     TextStream(tok)) for i, (p, ask) in enumerate(zip(PROMPTS, asks))]
    for s in seqs:
        engine.add(s)
    made: dict[str, list[Logprobs | None]] = {s.job_id: [] for s in seqs}
    while engine.has_work:
        for out in step(engine):
            if out.token_id is not None:
                made[out.seq.job_id].append(out.logprobs)
    for seq, ask in zip(seqs, asks):
        got = made[seq.job_id]
        assert len(got) == len(seq.generated) == 6
        if ask is None:
            assert got == [None] * 6
            continue
        expected = reference(model, seq)
        for position, (token_id, lp) in enumerate(zip(seq.generated, got)):
            assert lp is not None
            assert abs(float(lp.logprob) - float(expected[position, token_id])) < 1e-4
            top = expected[position].topk(ask)
            assert lp.top_ids == top.indices.tolist()
            np.testing.assert_allclose(lp.top_logprobs, top.values.numpy(), atol=1e-4)
            if ask:  # greedy: the token is the likeliest
                assert lp.top_ids[0] == token_id


def test_logprobs_are_the_raw_distribution_whatever_the_request_does_to_sampling() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 40)
    params = [SamplingParams(temperature=0.7, top_k=5, logit_bias={3: 100.0}, seed=1, logprobs=2),
              SamplingParams(temperature=0.0, presence_penalty=1.5, logprobs=2)]
    seqs = [Sequence(f"s{i}", [1, 2, 3], p, TextStream(None)) for i, p in enumerate(params)]
    seqs[1].generated = [7, 7]
    tokens = sample(logits.clone(), seqs)
    assert tokens[0] == 3  # the bias decided the draw ...
    raw = torch.log_softmax(logits, dim=-1)
    for row, seq in enumerate(seqs):
        lp = seq.made_logprobs[len(seq.generated)]
        # ... and the values are the model's, before bias, penalties and temperature.
        assert float(lp.logprob) == pytest.approx(float(raw[row, tokens[row]]), abs=1e-6)
        assert lp.top_ids == raw[row].topk(2).indices.tolist()


def test_the_logs_json_keeps_every_float32_exactly_and_cuts_with_the_event() -> None:
    tiny = np.float32(-3.0517578e-08)  # round(x, 6) would make it 0: a probability of 1
    values = np.array([-0.1234567, -7.654321e-5, -np.inf], dtype=np.float32)
    lps = [Logprobs(tiny, [5, 6, 9], values), Logprobs(values[0], [], values[:0])]

    class Tok:
        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            return f"<{ids[0]}>"

    wire = [lp.wire(token_id, Tok()) for token_id, lp in zip([5, 8], lps)]
    event = parse_event(token_event(10, [5, 8], ["a", "bc"], wire))
    assert isinstance(event, TokenEvent) and event.logprobs is not None
    first, second = event.logprobs
    assert np.float32(first.logprob) == tiny and first.token == "<5>"
    assert [np.float32(t.logprob) for t in first.top[:2]] == list(values[:2])
    assert first.top[2].logprob == -9999.0  # JSON has no -inf: OpenAI's stand-in
    assert [t.token_id for t in first.top] == [5, 6, 9] and second.top == []
    rest = event.after(11)
    assert rest.text == "bc" and rest.logprobs == [second]
    assert event.token_texts() == ["a", "bc"]


def test_an_engine_without_logprobs_refuses_a_job_that_asks_for_them() -> None:
    class Plain(HFEngine):
        reports_logprobs = False

    runner = ScriptedRunner()
    engine = Plain(Scheduler(max_batch=2, eos_token_ids=set(), max_model_len=64), runner)
    asks = Sequence("j", [1], SamplingParams(logprobs=0), TextStream(None))
    why = engine.refusal(asks)
    assert why is not None and why.startswith("logprobs:") and "Plain" in why
    assert engine.refusal(Sequence("k", [1], SamplingParams(), TextStream(None))) is None
