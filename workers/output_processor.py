"""The worker's output side in one place: the only loop over an engine step's
token ids above the engine.

``OutputProcessor.process`` turns a step's ``Made`` (token ids and the ends
the engine decided) into ``SeqOutput``s: text (incremental detokenising,
``Sequence.take``), stop strings, log probabilities, the worker's figures,
and the release of the jobs a stop string ended (the engine may have run them
on a step or two: ``Engine.forget`` stops them at its next step). What it
returns is what the writer (``Publisher.send``) stores. No I/O here.

Thread: the caller's. In a worker, the output thread owns the processor, and
with it ``WorkerStats.record_outputs`` and ``Metrics.step_done``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from tokenfleet.shared.wire.schemas import FinishReason
from tokenfleet.workers.sequence import Made, Sequence, SeqOutput
from tokenfleet.workers.stats import WorkerStats

if TYPE_CHECKING:
    from tokenfleet.workers.engine import Engine


def take_outputs(made: Iterable[Made]) -> list[SeqOutput]:
    """A step's text and ends from its token ids, in order. Tokens of a job
    whose end was decided already (a stop string found a step late) make no
    output."""
    return [out for m in made if (out := m.seq.take(m)) is not None]


class OutputProcessor:
    """A step's token ids in, what to store out.

    ``release``: how a job ended above the engine leaves it (``Engine.forget``);
    ``stats``: the figures the outputs count in; ``on_outputs``: called with
    each step's outputs (the worker's metrics); ``on_step``: a hook, called
    last, that tests can wait on.
    """

    def __init__(self, release: Callable[[Sequence], None], stats: WorkerStats,
                 on_outputs: Callable[[list[SeqOutput]], None] | None = None,
                 on_step: Callable[[list[SeqOutput]], None] | None = None) -> None:
        self.release = release
        self.stats = stats
        self.on_outputs = on_outputs
        self.on_step = on_step

    def process(self, made: Iterable[Made]) -> list[SeqOutput]:
        outputs = take_outputs(made)
        release = self.release
        for o in outputs:
            if o.seq.finish_reason is FinishReason.STOP:
                release(o.seq)  # the engine may have run it on: stop it
        self.stats.record_outputs(outputs)
        if self.on_outputs is not None:
            self.on_outputs(outputs)
        if self.on_step is not None:
            self.on_step(outputs)
        return outputs


def step(engine: Engine) -> list[SeqOutput]:
    """One step of ``engine`` with its output made at once, for a caller with no
    output thread (the benchmark's direct mode, tests): the engine's ``advance``
    and this one output loop, as the worker's threads run them. Raises
    ``DeviceFailure`` when the device is beyond use."""
    return OutputProcessor(engine.forget, engine.stats).process(engine.advance())
