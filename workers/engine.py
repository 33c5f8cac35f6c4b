"""The engine seam: what a worker asks of any engine, and what every engine
gets for free above it.

An engine owns its sequences from ``add`` to their end: it schedules them,
runs the model and hands back its tokens. Above the seam, once
for every engine (``Engine``'s own methods): requests from other threads
applied at a step boundary, cancels that come before their job, deadlines, and
ends by token id (end of sequence, length limits). Turning tokens into text
(``Sequence.take``: incremental detokenization, stop strings) is the output
side's (``tokenfleet.workers.output_processor``): a worker does it on its
output thread from what ``advance`` hands over, so the engine goes back to its next step at once. Below it, only
what differs: the abstract members of ``Engine``, each documented there. An
engine is found by name through the ``tokenfleet.engines`` entry points
(``tokenfleet.workers.engines``). No I/O here.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable
from typing import NamedTuple

from tokenfleet.shared.wire.schemas import FinishReason
from tokenfleet.workers.sequence import Made, Sequence, SeqStatus
from tokenfleet.workers.stats import WorkerStats

log = logging.getLogger(__name__)

# Errors after which the device is no use until the process restarts: a CUDA
# error (an illegal memory access, a device-side assert) poisons the CUDA
# context for good, so every later forward pass fails too.
FATAL_DEVICE_ERRORS = (
    "illegal memory access", "cuda error", "device-side assert", "cublas_status",
    "cudnn_status", "cusparse_status", "nccl error", "unspecified launch failure",
    "misaligned address", "illegal instruction", "uncorrectable ecc",
)
# Not fatal: out of memory ("CUDA out of memory", "CUDA error: out of memory",
# CUBLAS_STATUS_ALLOC_FAILED) frees up with the batch's cache; the batch is
# retried smaller, as for any other failed step.
NOT_FATAL = ("out of memory", "alloc_failed")
# How long a cancel of a job this engine has not seen yet is kept for it.
EARLY_ABORT_S = 60.0


def is_fatal_device_error(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}".lower()
    if type(exc).__name__ == "OutOfMemoryError" or any(m in text for m in NOT_FATAL):
        return False
    return any(m in text for m in FATAL_DEVICE_ERRORS)


class DeviceFailure(RuntimeError):
    """The device can no longer run the model: a fatal device error, or
    ``max_failed_steps`` steps failed in a row. The worker must stop and leave
    its jobs to others, instead of spending their attempts here.

    ``suspects`` are the sequences of the step that failed (their job may have
    caused it); the worker hands them back with every other held sequence.

    ``by_jobs``: the device works (no fatal device error, and it had run good
    steps), so the step most likely failed on what one of its jobs held, yet the
    engine cannot go on after a failed step (vLLM's cannot). The worker still
    restarts, but a supervisor does not count it against the device.
    """

    def __init__(self, reason: str, suspects: Iterable[Sequence], by_jobs: bool = False) -> None:
        super().__init__(reason)
        self.suspects = list(suspects)
        self.by_jobs = by_jobs


class BatchShape(NamedTuple):
    """What one step's forward pass held."""

    size: int  # sequences in it; 0 when the step ran none
    admitted: bool  # whether it took in sequences new to the running batch


class Engine(ABC):
    """The seam between a worker and the model: an engine takes sequences and
    hands back their tokens, one step at a time.

    The worker calls the public methods; an engine implements the abstract
    members below ("What an engine implements") and calls ``super().__init__``.

    Threads: ``add`` and ``abort`` are called from any thread (the feeder's,
    the cancel listener's) and take effect at the next step; ``unfinished``
    may be called from any thread; everything else, the abstract members
    included, belongs to the engine thread. ``num_running``, ``num_held`` and
    ``stats`` are also read, as a snapshot, by the heartbeat.

    Attributes every engine has:

    - ``eos_token_ids``: the tokens that end a sequence (``FinishReason.EOS``);
    - ``max_model_len``: the longest sequence, prompt and output, it serves;
    - ``vocab_size``: how many token ids its model has (ids are ``0`` to
      ``vocab_size - 1``); None when the engine does not say, and the
      tokenizer's size bounds the ids instead;
    - ``clock``: the clock deadlines are compared with (in a worker, Redis's: ``FleetClock``);
    - ``stats``: the worker's figures; an engine that fails a step and goes on
      counts it in ``stats.failed_steps``;
    - ``last_batch``: what the last step's forward pass held (``BatchShape``),
      set by the engine's ``_run`` at every step;
    - ``reports_logprobs``: whether it computes the log probabilities a job
      asks for (``SamplingParams.logprobs``): it puts each token's in
      ``Sequence.made_logprobs`` under the token's index before ``_run``
      returns it. An engine without them refuses such jobs.
    """

    reports_logprobs = False

    def __init__(self, eos_token_ids: Iterable[int], max_model_len: int,
                 clock: Callable[[], float] = time.time, vocab_size: int | None = None) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.clock = clock  # deadlines are absolute times on the clock that set them
        self.stats = WorkerStats()
        self.last_batch = BatchShape(0, False)
        # deque append/popleft are atomic: the hand-over between threads.
        self._inbox: deque[Sequence] = deque()
        self._aborts: deque[tuple[str, FinishReason, str | None]] = deque()
        self._held: dict[str, Sequence] = {}  # added and not ended or dropped
        # The held sequences that have a deadline (most have none): the only
        # ones each step checks.
        self._deadlines: dict[str, Sequence] = {}
        self._ended: list[Made] = []  # ended between steps: out with the next step
        # Jobs to forget at the next step (dropped, or ended by a stop string
        # the output side found): appended from other threads.
        self._forgets: deque[Sequence] = deque()
        # Cancels that came before their job (the feeder was between reading the
        # entry and handing it over): applied when it arrives.
        self._early: dict[str, tuple[float, FinishReason, str | None]] = {}

    # -- any thread -----------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Take a job's sequence: the engine runs it from the next step on."""
        self._inbox.append(seq)

    def abort(self, job_id: str, reason: FinishReason = FinishReason.CANCELLED,
              error: str | None = None) -> None:
        """End a job at the next step (cancel); its output comes with that step.
        A job not here yet is ended when it arrives; one on another worker is
        forgotten after a while."""
        self._aborts.append((job_id, reason, error))

    def refusal(self, seq: Sequence) -> str | None:
        """Why this engine would refuse ``seq``, or None when it runs it: asked
        before the job is handed over (``add``), so that a request the engine
        cannot run fails at once with a reason that names the field and the
        limit, instead of holding a slot. Called from any thread (the feeder's):
        it may read only what is fixed once the engine is built. By default an
        engine takes every request the fleet's own validation lets through,
        but for log probabilities it does not report."""
        if seq.sampling.logprobs is not None and not self.reports_logprobs:
            return (f"logprobs: the {type(self).__name__} engine does not report log "
                    "probabilities; leave logprobs unset")
        if seq.sampling.prompt_logprobs is not None and not self.reports_logprobs:
            return (f"prompt_logprobs: the {type(self).__name__} engine does not report log "
                    "probabilities; leave prompt_logprobs (and echo with logprobs) unset")
        return None

    # -- the engine thread ------------------------------------------------------

    @property
    def has_work(self) -> bool:
        """Whether a step has anything to do: the worker idles while not."""
        return bool(self._inbox or self._aborts or self._held or self._ended or self._forgets)

    @property
    def num_held(self) -> int:
        """Sequences taken and not ended: the worker's credits count them."""
        return len(self._inbox) + len(self._held)

    @property
    def num_waiting(self) -> int:
        """Sequences held and not yet running."""
        return self.num_held - self.num_running

    def taken(self) -> list[Sequence]:
        """The sequences taken from the inbox and not ended: those a step may
        have run. Safe to call from another thread (a snapshot)."""
        return list(self._held.values())

    def unfinished(self) -> list[Sequence]:
        """Every sequence not ended: to hand back, or to keep claimed.
        Safe to call from another thread (a snapshot)."""
        return [*list(self._inbox), *list(self._held.values())]

    def advance(self) -> list[Made]:
        """One step in token ids: requests in, the model's tokens and the
        ends the engine decides (``Made``); their text is the caller's
        (``OutputProcessor``), who ``forget``s the jobs a stop string ended.
        Raises ``DeviceFailure`` when the device is beyond use."""
        started = time.perf_counter()
        self._take_requests()
        made = self._apply(self._run())
        self.stats.record_step(time.perf_counter() - started, *self.last_batch)
        return made

    def forget(self, seq: Sequence) -> None:
        """Stop running a sequence at the next step, with no output (its end
        was decided above the engine: a stop string). Any thread."""
        self._forgets.append(seq)

    def drop(self, job_id: str) -> None:
        """Forget a job without an output: another attempt owns it now. Any
        thread: a job still in the inbox goes now, a running one at the next
        step (the sequences are the ones here now, never a later attempt's)."""
        # In place, never a new deque: the feeder thread may be appending to it.
        # list() and remove() are single calls, atomic under the GIL.
        for waiting in [s for s in list(self._inbox) if s.job_id == job_id]:
            try:
                self._inbox.remove(waiting)
            except ValueError:  # the engine took it meanwhile
                self._forgets.append(waiting)
        held = self._held.get(job_id)
        if held is not None:
            self._forgets.append(held)

    def end(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """End a held sequence between steps; its output comes with the next."""
        if seq.is_finished or self._held.pop(seq.job_id, None) is None:
            return
        seq.status = SeqStatus.FINISHED
        self._ended.append(Made(seq, None, None, reason, error))
        self._release(seq)

    def _forget(self, keep: bool) -> None:
        """Release the sequences ``forget``/``drop`` named that are held;
        ``keep`` the others for the next call (one taken from the inbox meanwhile)."""
        kept: list[Sequence] = []
        while self._forgets:
            seq = self._forgets.popleft()
            if self._held.get(seq.job_id) is seq:
                del self._held[seq.job_id]
                seq.status = SeqStatus.FINISHED
                self._release(seq)
            elif keep:
                kept.append(seq)
        self._forgets.extend(kept)

    def _take_requests(self) -> None:
        # A dropped job goes before its id can be taken by a new attempt in the inbox.
        self._forget(keep=True)
        while self._inbox:
            seq = self._inbox.popleft()
            self._held[seq.job_id] = seq
            seq.take_room(self.max_model_len)
            if seq.deadline_at is not None:
                self._deadlines[seq.job_id] = seq
            try:
                self._add(seq)
            except DeviceFailure:
                raise
            except Exception as exc:
                # The engine refused this request (vLLM raises at add_request
                # for what its own validation rejects): the job fails alone, at
                # once, and its slot is free; the other requests go in.
                log.warning("engine refused job %s: %s: %s", seq.job_id, type(exc).__name__, exc)
                self.end(seq, FinishReason.ERROR, f"the engine refused the request: {exc}")
                continue
            early = self._early.pop(seq.job_id, None)
            if early is not None:
                self.end(seq, early[1], early[2])
        self._forget(keep=False)
        while self._aborts:
            job_id, reason, error = self._aborts.popleft()
            held = self._held.get(job_id)
            if held is not None:
                self.end(held, reason, error)
            else:
                self._early[job_id] = (time.monotonic(), reason, error)
        if len(self._early) > 1000:  # cancels of jobs that run on other workers
            horizon = time.monotonic() - EARLY_ABORT_S
            self._early = {j: a for j, a in self._early.items() if a[0] > horizon}
        if self._deadlines:
            now = self.clock()
            for job_id, seq in list(self._deadlines.items()):
                if self._held.get(job_id) is not seq:
                    del self._deadlines[job_id]  # ended or dropped
                elif seq.deadline_at is not None and seq.deadline_at <= now:
                    del self._deadlines[job_id]
                    self.end(seq, FinishReason.DEADLINE, "deadline passed")

    def _apply(self, made: list[tuple[Sequence, int]]) -> list[Made]:
        # The one loop over a step's tokens on the engine thread: names bound
        # once, and a sequence's end decided by ``append`` without text.
        out, self._ended = self._ended, []
        held, eos, release = self._held, self.eos_token_ids, self._release
        for seq, token_id in made:
            if held.get(seq.job_id) is not seq:
                continue  # ended or dropped (a cancel, a stop) since the engine took it
            step = seq.append(token_id, eos)
            out.append(step)
            if step.end is not None:
                del held[seq.job_id]
                release(seq)
        return out

    # -- what an engine implements ----------------------------------------------

    @property
    @abstractmethod
    def num_running(self) -> int:
        """Sequences in the running batch (the next forward pass's), at most
        the engine's batch size; the rest of ``num_held`` waits for a slot."""

    @abstractmethod
    def _add(self, seq: Sequence) -> None:
        """Take a new sequence, to run from the next ``_run`` on.

        Its ``generated`` may hold a resumed job's tokens: continue after them,
        within the rest of ``seq.sampling.max_new_tokens`` and ``max_model_len``.
        Called once per sequence, on the engine thread, before any ``_run``
        that may see it. An engine that cannot serve it ends it here with
        ``self.end(seq, reason, error)`` (``_release`` follows), or raises: the
        job then fails with the exception's message (``_release`` follows
        too, for a sequence this call may have taken only in part), and the
        other sequences are not affected."""

    @abstractmethod
    def _run(self) -> list[tuple[Sequence, int]]:
        """Run one step of the model and set ``self.last_batch``.

        Returns each new token with its sequence, a sequence's tokens in the
        order it made them; ``Engine`` turns them into text and ends, so a
        sequence that ends by its tokens (end of sequence, stop string, length)
        needs nothing more here, and tokens of a sequence ended meanwhile are
        ignored. A step may make no token (an empty batch, a prefill chunk).

        A failed step the engine recovers from may end the sequences it blames
        with ``self.end(seq, FinishReason.ERROR, error)`` and counts
        ``self.stats.failed_steps``. Raises ``DeviceFailure`` when the device
        can run no more steps: the worker then hands every held job back and
        exits."""

    @abstractmethod
    def _release(self, seq: Sequence) -> None:
        """Forget a sequence that ended (by its tokens, ``end``, or a step's
        failure) or was dropped: free its slot and cache.

        Called at most once for each sequence given to ``_add``, on the engine
        thread; its tokens are ignored from then on. It must not call ``end``."""
