"""The slot cache against a plain model of it: rows as lists of columns."""

from __future__ import annotations

import random
from typing import Any

import torch

from tokenfleet.shared.wire.schemas import SamplingParams
from tests.test_runner import reference
from tokenfleet.workers.detokenizer import TextStream
from tokenfleet.workers.hf_engine import HFEngine
from tokenfleet.workers.kv_cache import SlotLayer
from tokenfleet.workers.runner import HFRunner
from tokenfleet.workers.scheduler import Scheduler
from tokenfleet.workers.sequence import Sequence
from tokenfleet.workers.output_processor import step

HEADS, DIM = 2, 3


def states(rows: int, columns: int) -> torch.Tensor:
    return torch.randn(rows, HEADS, columns, DIM)


def test_slot_layer_matches_a_left_padded_batch_through_random_operations() -> None:
    rng = random.Random(7)
    torch.manual_seed(7)
    layer = SlotLayer()
    model: list[torch.Tensor] = []  # each row [HEADS, width, DIM], left-padded with zeros
    width = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.3 or not model:  # rows join, right-aligned (the cache may widen)
            count, theirs = rng.randint(1, 4), rng.randint(1, 90)
            new = states(count, theirs)
            target = max(width, theirs)
            layer.append(new, new + 1, target)
            model = [torch.nn.functional.pad(r, (0, 0, target - width, 0)) for r in model]
            model += [torch.nn.functional.pad(r, (0, 0, target - theirs, 0)) for r in new]
            width = target
        elif op < 0.5:  # some rows leave: the last rows fill their places
            leave = set(rng.sample(range(len(model)), rng.randint(1, len(model))))
            rows = len(model) - len(leave)
            holes = [i for i in range(rows) if i in leave]
            movers = [i for i in range(rows, len(model)) if i not in leave]
            layer.move_rows(torch.tensor(movers, dtype=torch.long),
                            torch.tensor(holes, dtype=torch.long), rows)
            for hole, mover in zip(holes, movers):
                model[hole] = model[mover]
            model = model[:rows]
        elif op < 0.6 and width:  # padding columns dropped on the left
            drop = rng.randint(0, width)
            layer.drop_left(drop)
            model = [r[:, drop:] for r in model]
            width -= drop
        else:  # a decode step: one column for every row
            new = states(len(model), 1)
            keys, values = layer.update(new, new + 1)
            model = [torch.cat([r, n], dim=1) for r, n in zip(model, new)]
            width += 1
            assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)
        live = layer.keys
        assert live is not None and layer.get_seq_length() == width
        expected = torch.stack(model) if model else torch.zeros(0, HEADS, width, DIM)
        assert live.shape == expected.shape
        # Padding may hold stale (finite) values; only the model's nonzero part must match.
        nonzero = expected != 0
        assert torch.equal(live[nonzero], expected[nonzero])
        assert torch.isfinite(live).all()


def test_greedy_equals_generate_through_joins_leaves_long_prompts_and_growth(
        loaded_tiny: tuple[Any, Any]) -> None:
    """Jobs of very different lengths join and leave a small batch: rows move,
    the cache widens for a long prompt and grows past its first buffers."""
    model, tok = loaded_tiny
    runner = HFRunner(model, tok)
    sched = Scheduler(max_batch=3, eos_token_ids=set(), max_model_len=runner.max_model_len)
    engine = HFEngine(sched, runner)
    rng = random.Random(3)
    words = "the list of values in a record is returned when the function runs".split()
    jobs = []
    for i in range(12):
        prompt = " ".join(rng.choices(words, k=rng.choice([1, 3, 40])))
        n = rng.choice([1, 2, 9, 70])
        seq = Sequence(f"j{i}", tok(prompt)["input_ids"],
                       SamplingParams(max_new_tokens=n, temperature=0.0), TextStream(tok))
        jobs.append((prompt, seq))
        engine.add(seq)
        if i % 2:
            step(engine)
    while engine.has_work:
        step(engine)
    for prompt, seq in jobs:
        assert seq.generated == reference(model, tok, prompt, seq.sampling.max_new_tokens), \
            seq.job_id
