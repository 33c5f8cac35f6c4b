"""The gpu-sim engine: a GPU's step, as the fleet sees it, with no GPU.

A GPU's decode step holds the engine thread outside Python with the GIL
released (the thread waits on CUDA) for a time that hardly depends on the
batch, then hands back one token per running sequence. This engine does the
same: each step sleeps ``gpu_sim_step_ms`` (``time.sleep`` releases the GIL)
and then emits, for every running sequence, the next token of a fixed English
text in the built-in tiny model's tokenizer (a byte-level BPE), so that
detokenization and everything else above the seam cost what they cost. It
never emits an end of sequence: every job runs to its ``max_new_tokens``. A
new sequence costs no prefill: its first token comes with the next step.

A GPU runs the steps queued on it back to back, whenever the host thread
wakes. With ``async_scheduling`` (the default, as vLLM's on a GPU since 0.14)
the engine launches each step before it takes the last one's tokens: the
device runs step N+1 while the engine thread applies step N's tokens, takes
requests and hands over, so that work costs the device nothing while it is
shorter than a step. The batch of step N+1 is fixed before step N's ends are
known, so a sequence that ends at step N also fills a slot of step N+1, whose
token is dropped (as vLLM drops it). Off, each step is launched and waited for
in turn, and the device idles while the engine thread works.

A device's step ends when the device says so, and the thread waiting on it
wakes then; a sleep ends up to the thread's timer slack later (50 µs by
default on Linux), which no GPU adds. The engine thread's slack is set to 1 ns
(Linux; elsewhere the sleep stays as it is), so the device step lasts what was
asked, give or take the OS waking the thread and the GIL taken back, which the
engine's timers show as the step's lateness.

It keeps where the engine thread's time went, step by step, by batch size
(``GpuSimStats``): the worker's heartbeat carries it in its ``stats`` field
under ``gpu_sim``, for ``tokenfleet bench --modes gpu-sim``.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import deque
from collections.abc import Sequence as Ids
from dataclasses import asdict, dataclass, field

from tokenfleet.shared.settings import Settings
from tokenfleet.workers import budget
from tokenfleet.workers.engine import BatchShape, Engine
from tokenfleet.workers.engines import BuiltEngine
from tokenfleet.workers.null_runner import null_tokenizer
from tokenfleet.workers.sequence import Made, Sequence
from tokenfleet.workers.stats import WorkerStats

MAX_MODEL_LEN = 1 << 16  # no cache to bound it: admission's limits are the only ones
TEXT = (
    "It was a bright cold day in April, and the clocks were striking thirteen. The river ran "
    "high after a week of rain, and the boats along the quay rocked against their ropes while "
    "the fishermen mended nets and argued about the weather, the price of bread, and whether "
    "the new bridge would ever be finished before winter came again to the valley. "
)
PR_SET_TIMERSLACK = 29  # prctl(2): the calling thread's timer slack, in nanoseconds


def precise_sleeps() -> None:
    """Let this thread's sleeps end when asked, not up to its timer slack
    later (Linux; a no-op where prctl is missing)."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


@dataclass
class StepTimes:
    """Where the engine thread's wall time went over the steps of one batch
    size. A step counts once the next one starts, and only if the engine had
    work left after it (the worker then steps again at once): its cycle is
    ``step_s + between_s`` and holds no idle wait."""

    steps: int = 0
    tokens: int = 0  # made for sequences still running (async: a slot of one just ended makes none)
    device_s: float = 0.0  # waiting for the simulated device (the sleep, the GIL taken back)
    step_s: float = 0.0  # in ``Engine.advance``, the device step included
    between_s: float = 0.0  # from a step's end to the next one's start: the hand-over
    idle_s: float = 0.0  # the device idle before this step, launched after the last had ended


@dataclass
class GpuSimStats(WorkerStats):
    """The worker's figures, and the gpu-sim engine's ``StepTimes`` by batch
    size (``as_dict()["gpu_sim"]``, keyed by the size as a string). Written by
    the engine thread; a reader on another thread gets a snapshot."""

    by_batch: dict[int, StepTimes] = field(default_factory=dict)
    async_scheduling: bool = False

    def add_step(self, batch: int, tokens: int, device_s: float, step_s: float,
                 between_s: float, idle_s: float) -> None:
        times = self.by_batch.setdefault(batch, StepTimes())
        times.steps += 1
        times.tokens += tokens
        times.device_s += device_s
        times.step_s += step_s
        times.between_s += between_s
        times.idle_s += idle_s

    def as_dict(self) -> dict[str, object]:
        figures = super().as_dict()
        # list() copies in one call: the engine thread may add a batch size meanwhile.
        figures["gpu_sim"] = {str(b): asdict(t) for b, t in list(self.by_batch.items())}
        figures["gpu_sim_async"] = self.async_scheduling
        return figures


@dataclass
class Launched:
    """A step on the device: the sequences it runs, when it ends, and whether
    it took in sequences new to the running batch."""

    seqs: list[Sequence]
    ends_at: float  # time.perf_counter()
    admitted: bool


class GpuSimEngine(Engine):
    """Runs up to ``max_batch`` sequences (the rest wait for a slot); each step
    takes ``step_s`` seconds with the GIL released and makes one token per
    running sequence, cycling through ``token_ids`` from where its output is."""

    stats: GpuSimStats

    def __init__(self, token_ids: Ids[int], eos_token_id: int, max_batch: int,
                 step_s: float, async_scheduling: bool = False) -> None:
        super().__init__({eos_token_id}, MAX_MODEL_LEN)
        if eos_token_id in token_ids or not token_ids:
            raise ValueError("the gpu-sim text must be some tokens, none of them the end of "
                             "sequence")
        self.stats = GpuSimStats(async_scheduling=async_scheduling)
        self.token_ids = list(token_ids)
        self.max_batch = max_batch
        self.step_s = step_s
        self.async_scheduling = async_scheduling
        self._running: dict[str, Sequence] = {}
        self._waiting: deque[Sequence] = deque()
        self._free_at = 0.0  # when the device ends the last step launched on it
        self._in_flight: Launched | None = None  # async: launched, its tokens not taken yet
        self._device_s = 0.0  # the last step's wait for the device
        self._idle_s = 0.0  # the device's idle time before the last step launched
        # The last step's batch size, tokens, device, step and idle seconds and
        # end, until the next step starts and closes its cycle.
        self._open: tuple[int, int, float, float, float, float] | None = None
        self._thread: int | None = None  # the thread whose sleeps were made precise

    @property
    def num_running(self) -> int:
        return len(self._running)

    def advance(self) -> list[Made]:
        started = time.perf_counter()
        last, self._open = self._open, None
        if last is not None:
            batch, tokens, device_s, step_s, idle_s, ended = last
            self.stats.add_step(batch, tokens, device_s, step_s, started - ended, idle_s)
        outputs = super().advance()
        ended = time.perf_counter()
        # Without work left the worker idles before the next step: that wait
        # is no part of this step's cycle, so the step is not counted.
        if self.has_work and self.last_batch.size:
            tokens = sum(m.token_id is not None for m in outputs)
            # After an idle wait, the device's idle time before this step is that wait's.
            idle_s = self._idle_s if last is not None else 0.0
            self._open = (self.last_batch.size, tokens, self._device_s, ended - started,
                          idle_s, ended)
        return outputs

    def _add(self, seq: Sequence) -> None:
        self._waiting.append(seq)

    def _run(self) -> list[tuple[Sequence, int]]:
        admitted = False
        while self._waiting and len(self._running) < self.max_batch:
            seq = self._waiting.popleft()
            self._running[seq.job_id] = seq
            admitted = True
        launched = self._launch(admitted) if self._running else None
        if self.async_scheduling:  # this step runs while the last one's tokens are taken
            done, self._in_flight = self._in_flight, launched
        else:
            done = launched
        self._device_s = 0.0
        if done is None:
            self.last_batch = BatchShape(0, False)
            return []
        self._device_s = self._wait(done.ends_at)
        ids, n = self.token_ids, len(self.token_ids)
        # From where each output is, so a resumed job goes on with the text;
        # none for a sequence that ended (or was dropped) since its step was launched.
        made = [(seq, ids[len(seq.generated) % n]) for seq in done.seqs
                if self._running.get(seq.job_id) is seq]
        self.last_batch = BatchShape(len(done.seqs), done.admitted)
        return made

    def _launch(self, admitted: bool) -> Launched:
        """Queue a step of the running batch on the device: it starts once the
        device has ended the step before, or now if that one has ended."""
        now = time.perf_counter()
        self._idle_s = max(0.0, now - self._free_at) if self._free_at else 0.0
        self._free_at = max(now, self._free_at) + self.step_s
        return Launched(list(self._running.values()), self._free_at, admitted)

    def _wait(self, ends_at: float) -> float:
        """Wait, the GIL released, for the device to end a step; the seconds waited."""
        if self._thread != threading.get_ident():  # the engine thread: once
            self._thread = threading.get_ident()
            precise_sleeps()
        started = time.perf_counter()
        if ends_at > started:
            time.sleep(ends_at - started)  # the GIL is free meanwhile, as while CUDA runs a step
        return time.perf_counter() - started

    def _release(self, seq: Sequence) -> None:
        if self._running.pop(seq.job_id, None) is None:
            self._waiting.remove(seq)


def build_gpu_sim(settings: Settings) -> BuiltEngine:
    """The factory the ``gpu-sim`` entry point names: no model, the tiny
    model's tokenizer, ``max_batch`` as set ("auto": the no-model default)."""
    tokenizer = null_tokenizer()
    settings = budget.apply(settings, budget.resolve(settings, None, MAX_MODEL_LEN))
    max_batch, _ = budget.resolved(settings)
    engine = GpuSimEngine(tokenizer.encode(TEXT, add_special_tokens=False),
                          int(tokenizer.eos_token_id), max_batch,
                          settings.gpu_sim_step_ms / 1000, settings.async_scheduling)
    return BuiltEngine(engine, tokenizer, settings)
