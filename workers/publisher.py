"""The output side: one Redis round trip per engine step.

Token events of the step go to each job's log and channel in one script call;
each finished job's final state goes in one more script call in the same
pipeline. Both scripts check the attempt number, so a worker that lost a job
to a reclaim finds out here and drops it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from shared.keys import GROUP, Keys
from shared.schemas import FinishReason, JobStatus
from shared.scripts import Scripts
from shared.serialization import dumps, end_event, token_event
from shared.settings import Settings
from workers.scheduler import SeqOutput
from workers.sequence import Sequence


@dataclass
class Ending:
    """A job's final state, as stored in its record."""

    job_id: str
    queue: str
    entry_id: str
    attempt: int | None  # None: no ownership to check (the job never ran here)
    status: JobStatus
    finish_reason: FinishReason | None = None
    error: str | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int | None = None
    dead_letter: str | None = None  # reason, when the job also goes to the DLQ


class Publisher:
    def __init__(self, redis: Any, keys: Keys, settings: Settings, worker: str) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.worker = worker
        self.scripts = Scripts(redis)

    def publish(self, outputs: list[SeqOutput]) -> set[str]:
        """Write one step's events and endings; return the ids of fenced-off jobs."""
        tokens = [o for o in outputs if o.index is not None]
        endings = [self._ending(o) for o in outputs if o.finished]
        if not tokens and not endings:
            return set()
        pipe = self.redis.pipeline(transaction=False)
        if tokens:
            keys: list[str] = []
            args: list[Any] = [self.settings.result_ttl_s, repr(time.time())]
            for o in tokens:
                job_id = o.seq.job_id
                keys += [self.keys.job(job_id), self.keys.out(job_id), self.keys.events(job_id)]
                args += [o.seq.attempt, o.index, token_event(o.index, [o.token_id], o.text)]  # type: ignore[arg-type,list-item]
            self.scripts.emit(keys=keys, args=args, client=pipe)
        for ending in endings:
            self._finish(pipe, ending)
        results = pipe.execute()
        fenced = {tokens[i].seq.job_id for i in results[0]} if tokens else set()
        for ending, result in zip(endings, results[1 if tokens else 0:]):
            if result == 0:
                fenced.add(ending.job_id)
        return fenced

    def end(self, endings: Iterable[Ending]) -> None:
        """Store endings decided outside the engine (expired, rejected, cancelled)."""
        pipe = self.redis.pipeline(transaction=False)
        for ending in endings:
            self._finish(pipe, ending)
        pipe.execute()

    def hand_back(self, seqs: Iterable[Sequence]) -> int:
        """Put unfinished jobs back on their queue for another worker; returns how many."""
        pipe = self.redis.pipeline(transaction=False)
        seqs = [s for s in seqs if s.entry_json]
        for seq in seqs:
            model = seq.queue.split(":")[0]  # the level's queue name -> the model's
            self.scripts.requeue(keys=[self.keys.queue(seq.queue), self.keys.job(seq.job_id),
                                       self.keys.backlog(model)],
                                 args=[seq.entry_id, seq.attempt, seq.entry_json, GROUP],
                                 client=pipe)
        return sum(pipe.execute()) if seqs else 0

    def dead_letter(self, queue: str, entry_id: str, raw: Any, reason: str) -> None:
        """An entry no job can come from: keep it in the DLQ, take it off the queue."""
        stream = self.keys.queue(queue)
        record = {"reason": reason, "queue": queue, "entry_id": entry_id,
                  "worker": self.worker, "at": time.time(), "entry": _printable(raw)}
        pipe = self.redis.pipeline(transaction=True)
        pipe.xadd(self.keys.dlq, {"data": dumps(record)})
        pipe.xack(stream, GROUP, entry_id)
        pipe.xdel(stream, entry_id)
        pipe.execute()

    def _ending(self, o: SeqOutput) -> Ending:
        seq = o.seq
        assert seq.finish_reason is not None
        return Ending(
            job_id=seq.job_id, queue=seq.queue, entry_id=seq.entry_id, attempt=seq.attempt,
            status=seq.final_status, finish_reason=seq.finish_reason, error=seq.error,
            text=seq.text.text, token_ids=seq.generated, num_prompt_tokens=len(seq.prompt_ids),
            dead_letter=seq.error if seq.finish_reason == FinishReason.ERROR else None,
        )

    def _finish(self, pipe: Any, e: Ending) -> None:
        job_id = e.job_id
        fields: dict[str, Any] = {
            "status": e.status.value,
            "finish_reason": e.finish_reason.value if e.finish_reason else "",
            "error": e.error or "",
            "text": e.text,
            "token_ids": dumps(e.token_ids),
            "finished_at": repr(time.time()),
            "worker": self.worker,
        }
        if e.num_prompt_tokens is not None:
            fields["num_prompt_tokens"] = e.num_prompt_tokens
        dead: bytes | str = ""
        if e.dead_letter:
            dead = dumps({"reason": e.dead_letter, "job_id": job_id, "queue": e.queue,
                          "entry_id": e.entry_id, "worker": self.worker, "at": time.time(),
                          "error": e.error})
        self.scripts.finish(
            keys=[self.keys.job(job_id), self.keys.out(job_id), self.keys.events(job_id),
                  self.keys.queue(e.queue), self.keys.dlq],
            args=[
                "" if e.attempt is None else e.attempt, e.entry_id, self.settings.result_ttl_s,
                end_event(e.status, e.finish_reason, e.error), dead, GROUP,
                *[x for pair in fields.items() for x in pair],
            ],
            client=pipe,
        )


def _printable(raw: Any) -> Any:
    """Stream fields as JSON-safe text, whatever bytes a bad producer wrote."""
    if isinstance(raw, dict):
        return {_printable(k): _printable(v) for k, v in raw.items()}
    if isinstance(raw, bytes):
        return raw.decode("utf-8", errors="replace")
    return raw
