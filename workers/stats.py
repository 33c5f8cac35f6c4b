"""A worker's own figures: what the heartbeat, ``inspect``, ``/metrics`` and
the tests read. Two threads write them, each its own fields: the engine thread
the step's (``record_step``, ``failed_steps``, ``preempted``), the output
thread the outputs' (``record_outputs`` through the output processor,
``store_retries``); other threads only read (``as_dict`` copies)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tokenfleet.shared.wire.keys import level_tenant
from tokenfleet.workers.sequence import SeqOutput

# The window of the rate a worker reports (its heartbeat, ``tokenfleet status``).
RATE_WINDOW_S = 10.0
RECENT_STEPS = 256  # the steps kept for it


@dataclass
class WorkerStats:
    steps: int = 0
    prefill_steps: int = 0
    tokens: int = 0
    jobs: dict[str, int] = field(default_factory=dict)  # final status -> count
    # tenant -> tokens of its jobs that ended here (counted at the end: once a job)
    tenant_tokens: dict[str, int] = field(default_factory=dict)
    peak_batch: int = 0  # most sequences that ever decoded in one step
    last_batch: int = 0
    busy_s: float = 0.0  # time in engine steps (forward passes and their bookkeeping)
    last_step_s: float = 0.0
    failed_steps: int = 0  # engine steps that raised (in the forward pass or around it)
    store_retries: int = 0  # times Redis refused a step's writes and they were sent again
    preempted: int = 0  # batch-level jobs handed back for live jobs (workers/preemption.py)
    # Prompt tokens the model computed (a prefix cache's hits left out); prompt
    # tokens of the jobs admitted with a prefix cache, and of those the tokens
    # found in it (not computed again): the runner's counts.
    prefill_tokens: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    started_at: float = field(default_factory=time.time)
    _recent: deque[tuple[float, int]] = field(
        default_factory=lambda: deque(maxlen=RECENT_STEPS))

    def record(self, outputs: list[SeqOutput], seconds: float = 0.0, batch: int = 0,
               prefill: bool = False) -> None:
        """One engine step and its outputs."""
        self.record_step(seconds, batch, prefill)
        self.record_outputs(outputs)

    def record_step(self, seconds: float = 0.0, batch: int = 0, prefill: bool = False) -> None:
        """One engine step (the engine thread): ``batch`` sequences ran in it
        (0: none ran), ``prefill`` when it admitted new ones."""
        self.steps += 1
        self.busy_s += seconds
        self.last_step_s = seconds
        if batch:
            self.prefill_steps += prefill
            self.last_batch = batch
            self.peak_batch = max(self.peak_batch, batch)

    def record_outputs(self, outputs: list[SeqOutput]) -> None:
        """One step's outputs (the output side): its tokens and the jobs it ended."""
        made = 0
        for o in outputs:
            if o.token_id is not None:
                made += 1
            if o.finished:
                status = o.seq.final_status.value
                self.jobs[status] = self.jobs.get(status, 0) + 1
                tenant = level_tenant(o.seq.queue)  # the stream it came from names it
                self.tenant_tokens[tenant] = self.tenant_tokens.get(tenant, 0) + len(o.seq.generated)
        self.tokens += made
        self._recent.append((time.monotonic(), made))

    def tokens_per_s(self, window_s: float = RATE_WINDOW_S) -> float:
        """Tokens made over the last ``window_s`` seconds, a second: 0 once the
        worker made none for that long, not the pace of its last burst."""
        now = time.monotonic()
        # list() copies in one call: the engine thread appends while another reads.
        steps = list(self._recent)
        made = sum(n for t, n in steps if now - t <= window_s)
        # The last RECENT_STEPS steps are kept: at many steps a second they cover
        # less than the window, and the rate is over what they cover.
        covered = now - steps[0][0] if len(steps) == RECENT_STEPS else window_s
        return made / max(min(window_s, covered), 1e-3)

    def as_dict(self) -> dict[str, object]:
        return {
            "steps": self.steps,
            "prefill_steps": self.prefill_steps,
            "tokens": self.tokens,
            "jobs": dict(self.jobs),
            "peak_batch": self.peak_batch,
            "last_batch": self.last_batch,
            "busy_s": round(self.busy_s, 6),
            "failed_steps": self.failed_steps,
            "store_retries": self.store_retries,
            "preempted": self.preempted,
            "prefill_tokens": self.prefill_tokens,
            "prefix_query_tokens": self.prefix_query_tokens,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "tokens_per_s": round(self.tokens_per_s(), 2),
            "rate_window_s": RATE_WINDOW_S,  # what tokenfleet status labels the rate with
            "started_at": self.started_at,
        }
