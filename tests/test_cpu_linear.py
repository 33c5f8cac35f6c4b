"""Linear layers packed for oneDNN and prompts packed in one row: the same
model, the same greedy text as plain `transformers` `generate()` (after a failed
step too), and layers left alone where packing cannot apply."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from tokenfleet.shared.wire.schemas import JobStatus
from tokenfleet.workers import cpu_linear
from tokenfleet.workers.cpu_linear import PackedLinear
from tokenfleet.workers.hf_engine import HFEngine
from tokenfleet.workers.runner import HFRunner
from tokenfleet.workers.scheduler import StepBatch, Scheduler
from tokenfleet.workers.sequence import Sequence
from tokenfleet.workers.output_processor import step

from test_paged import add_prompts, assert_generate_tokens
from test_runner import PROMPTS

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="this torch has no oneDNN")



@pytest.fixture
def packed_tiny(loaded_tiny: tuple[Any, Any]) -> tuple[Any, Any, Any]:
    """(the tiny model as loaded, a packed copy of it, its tokenizer)."""
    model, tok = loaded_tiny
    packed = copy.deepcopy(model)
    linears = sum(type(m) is nn.Linear for m in packed.modules())
    assert cpu_linear.pack(packed) == linears > 0
    return model, packed, tok


def test_every_linear_is_packed_and_computes_the_same(packed_tiny: tuple[Any, Any, Any]) -> None:
    model, packed, tok = packed_tiny
    assert not any(type(m) is nn.Linear for m in packed.modules())
    assert isinstance(packed.lm_head, PackedLinear)
    # The tied embedding keeps its weight.
    assert packed.model.embed_tokens.weight.shape == model.model.embed_tokens.weight.shape
    ids = tok(PROMPTS, return_tensors="pt", padding=True)
    with torch.inference_mode():
        want = model(**ids).logits
        got = packed(**ids).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert cpu_linear.pack(packed) == 0  # packed already: nothing left to pack


def run_prompts(runner: HFRunner, tok: Any) -> tuple[HFEngine, list[Sequence]]:
    """test_paged's prompts through ``runner``, batches of 4, later jobs joining."""
    engine = HFEngine(Scheduler(max_batch=4, eos_token_ids=runner.eos_token_ids,
                                max_model_len=runner.max_model_len), runner)
    seqs = add_prompts(engine, tok)
    while engine.has_work:
        step(engine)
    return engine, seqs


def test_batched_greedy_on_packed_layers_equals_generate(packed_tiny: tuple[Any, Any, Any]) -> None:
    model, packed, tok = packed_tiny
    _, seqs = run_prompts(HFRunner(packed, tok), tok)
    assert_generate_tokens((model, tok), seqs)  # generate() on the unpacked model


class FailsOnce(HFRunner):
    """Its 6th step (decoding, with later jobs joined) fails once, as a device error would."""

    steps = 0

    def run(self, batch: StepBatch) -> list[int]:
        self.steps += 1
        if self.steps == 6:
            raise RuntimeError("forward failed")
        return super().run(batch)


def test_a_failed_step_is_recovered_by_packed_prefills_of_what_was_generated(
        packed_tiny: tuple[Any, Any, Any]) -> None:
    # After a failed step every held job is prefilled again with its prompt and
    # the tokens it made so far: packed prompts of many lengths in one pass.
    model, packed, tok = packed_tiny
    engine, seqs = run_prompts(FailsOnce(packed, tok), tok)
    assert engine.stats.failed_steps == 1
    assert all(s.final_status is JobStatus.SUCCEEDED for s in seqs)
    assert_generate_tokens((model, tok), seqs)


def test_a_model_with_windowed_attention_gets_padded_prefills(
        loaded_tiny: tuple[Any, Any]) -> None:
    # A block-diagonal mask of our own would attend past a sliding window: such
    # a model's prompts are left-padded and the model makes its own masks.
    model, tok = loaded_tiny
    assert HFRunner(model, tok)._packs
    model.config.sliding_window = 6
    try:
        assert not HFRunner(model, tok)._packs
    finally:
        model.config.sliding_window = None
    padded = HFRunner(model, tok)
    padded._packs = False
    _, seqs = run_prompts(padded, tok)
    assert_generate_tokens(loaded_tiny, seqs)


def test_a_float16_model_is_left_as_it_is() -> None:
    model = nn.Sequential(nn.Linear(8, 8)).half()
    assert cpu_linear.available(model) == "torch.float16 weights"
    assert cpu_linear.pack(model) == 0
    assert type(model[0]) is nn.Linear


def test_bias_and_any_row_count() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 24)
    packed = PackedLinear(linear)
    for shape in [(1, 48), (5, 48), (3, 7, 48), (300, 48)]:
        x = torch.randn(shape)
        with torch.inference_mode():
            assert torch.allclose(packed(x), linear(x), atol=1e-5)
