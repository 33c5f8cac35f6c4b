"""One worker process's moving parts, wired together and run on threads.

- the engine loop (this is where the model runs): admit, step, publish;
- the feeder: reads the stream with credits and hands sequences to the engine;
- the heartbeat: the worker's stats hash, and the idle-time renewal of the
  entries it is still generating (so a long job is never reclaimed from a live
  worker);
- the cancel listener: cancels of running jobs, applied between steps.

Torch releases the GIL in its kernels, so Redis I/O overlaps the forward pass.
Celery (``tokenfleet.workers.bootstep``) and the embedded demo both run this class.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from typing import Any

from redis.exceptions import ConnectionError, TimeoutError

from tokenfleet.shared.keys import GROUP, PRIORITIES, Keys
from tokenfleet.shared.redis_conn import connect
from tokenfleet.shared.schemas import FinishReason
from tokenfleet.shared.serialization import dumps
from tokenfleet.shared.settings import Settings
from tokenfleet.workers.admission import Admission
from tokenfleet.workers.engine import Engine, Runner
from tokenfleet.workers.feeder import Feeder
from tokenfleet.workers.metrics import Metrics
from tokenfleet.workers.publisher import Publisher
from tokenfleet.workers.scheduler import Scheduler, SeqOutput
from tokenfleet.workers.sequence import Sequence

log = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        settings: Settings,
        runner: Runner,
        tokenizer: Any,
        *,
        name: str,
        eos_token_ids: set[int],
        max_model_len: int,
        model_name: str | None = None,
        redis: Any = None,
    ) -> None:
        self.settings = settings
        self.name = name
        self.queue = settings.queue
        self.model_name = model_name or settings.model
        self.keys = Keys(settings.namespace)
        self.redis = redis or connect(settings.redis_url)
        self.scheduler = Scheduler(settings.max_batch, eos_token_ids, max_model_len,
                                   max_failures=settings.max_attempts,
                                   max_batch_tokens=settings.max_batch_tokens)
        self.engine = Engine(self.scheduler, runner)
        self.publisher = Publisher(self.redis, self.keys, settings, name)
        self._held: set[str] = set()  # ids of the jobs this worker runs now
        self.feeder = Feeder(
            self.redis, self.keys, settings, name, self.queue,
            Admission(tokenizer, settings, max_model_len), self.publisher,
            sink=self._receive, credits=self.credits, holds=self._held.__contains__,
        )
        self.metrics = Metrics(self.queue)
        self._inbox: deque[Sequence] = deque()
        self._aborts: deque[tuple[str, FinishReason]] = deque()
        # Cancels that came before their job reached the engine (the feeder was
        # between taking the entry and handing it over): applied on arrival.
        self._early_cancels: dict[str, float] = {}
        self._sent: list[SeqOutput] = []  # the step whose writes Redis is storing
        self._wake = threading.Event()
        self._idle = threading.Event()  # set by the engine loop when it has nothing to do
        self._stop_intake = threading.Event()
        self._stop_engine = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- life cycle -------------------------------------------------------------

    def start(self) -> None:
        self.feeder.ensure_group()
        if self.settings.metrics_port:
            self.metrics.serve(self.settings.metrics_port)
        for target, name in (
            (self._engine_loop, "engine"),
            (lambda: self.feeder.run(self._stop_intake), "feeder"),
            (self._heartbeat_loop, "heartbeat"),
            (self._cancel_loop, "cancels"),
        ):
            thread = threading.Thread(target=target, name=f"tokenfleet-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("worker %s serving queue %r (max batch %d, prefetch %d)",
                 self.name, self.queue, self.settings.max_batch, self.settings.prefetch)

    def stop(self, grace_s: float | None = None) -> None:
        """Warm shutdown: stop reading, finish what runs within the grace period,
        hand the rest back to the queue (another worker resumes it from its
        streamed tokens), and lose nothing."""
        grace = self.settings.drain_grace_s if grace_s is None else grace_s
        self._stop_intake.set()
        feeder = next((t for t in self._threads if t.name.endswith("feeder")), None)
        if feeder is not None:
            feeder.join(timeout=grace + 5)  # it hands over what it read, then stops
        deadline = time.monotonic() + grace
        while self.busy and time.monotonic() < deadline:
            self._idle.clear()
            self._wake.set()
            self._idle.wait(min(0.5, max(0.0, deadline - time.monotonic())))
        self._stop_engine.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout=10)
        left = [*self._inbox, *self.scheduler.waiting, *self.scheduler.running]
        try:
            if left:
                handed = self.publisher.hand_back(left)
                log.info("handed %d unfinished job(s) back to the queue", handed)
            self.redis.delete(self.keys.worker(self.name))
            self.redis.zrem(self.keys.queue_workers(self.queue), self.name)
        except (ConnectionError, TimeoutError) as exc:
            # Redis is away: the entries stay pending and are reclaimed later.
            log.warning("could not hand jobs back (%s); they will be reclaimed", exc)

    @property
    def busy(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work

    def credits(self) -> int:
        held = self.scheduler.num_running + self.scheduler.num_waiting + len(self._inbox)
        return self.settings.max_batch + self.settings.prefetch - held

    def cancel(self, job_id: str) -> None:
        self._aborts.append((job_id, FinishReason.CANCELLED))
        self._wake.set()

    # -- the engine loop ------------------------------------------------------

    def _receive(self, seqs: list[Sequence]) -> None:
        self._held.update(s.job_id for s in seqs)
        for seq in seqs:
            self.metrics.started(seq.created_at)
        self._inbox.extend(seqs)
        self._wake.set()

    def _admit(self) -> None:
        while self._inbox:
            seq = self._inbox.popleft()
            self.scheduler.add(seq)
            if self._early_cancels.pop(seq.job_id, None) is not None:
                self.scheduler.abort(seq.job_id, FinishReason.CANCELLED)
        while self._aborts:
            job_id, reason = self._aborts.popleft()
            if not self.scheduler.abort(job_id, reason):
                self._early_cancels[job_id] = time.monotonic()
        if len(self._early_cancels) > 1000:  # cancels of jobs on other workers
            horizon = time.monotonic() - 60
            self._early_cancels = {j: t for j, t in self._early_cancels.items() if t > horizon}

    def _engine_loop(self) -> None:
        while not self._stop_engine.is_set():
            self._admit()
            if not self.scheduler.has_work:
                self._collect()  # nothing to overlap with: store the last step now
                self._idle.set()
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            self._idle.clear()
            try:
                self._step()
            except Exception:
                # A worker whose engine thread died would look alive (its
                # heartbeat goes on) and serve nothing: log, and keep stepping.
                log.exception("engine step failed")
                self._stop_engine.wait(0.1)
        self._collect()

    def _step(self) -> None:
        """Step N+1 runs while Redis stores step N: its writes go out only once
        step N's are stored, so no token is sent before the one it follows."""
        outputs = self.engine.step()
        stats = self.engine.stats
        self.metrics.step_done(stats.last_batch, stats.last_step_s, outputs)
        fenced = self._collect()
        if fenced:
            outputs = [o for o in outputs if o.seq.job_id not in fenced]
        self.publisher.send(outputs)
        self._sent = outputs

    def _collect(self) -> set[str]:
        """Wait until the step sent last is stored; hold the engine while Redis
        is away, since a token that is not stored must not be followed by the
        next one. Returns the ids of jobs a newer attempt owns (dropped here)."""
        if not self.publisher.in_flight:
            return set()
        outputs, self._sent = self._sent, []
        backoff = 0.05
        while True:
            try:
                fenced = self.publisher.collect()
                break
            except (ConnectionError, TimeoutError, OSError) as exc:
                if self._stop_engine.is_set():
                    return set()  # the entries stay pending: another worker redoes them
                log.warning("redis unavailable for results (%s); retrying", exc)
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
        finished = [o.seq.job_id for o in outputs if o.finished]
        if finished:
            self._held.difference_update(finished)
            self.feeder.slots_freed.set()
        for job_id in fenced:
            log.warning("job %s is owned by a newer attempt; dropping it here", job_id)
            self.scheduler.drop(job_id)
            self._held.discard(job_id)
        return fenced

    # -- side loops ------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        while True:
            try:
                self._beat()
            except (ConnectionError, TimeoutError, OSError) as exc:
                log.warning("heartbeat failed: %s", exc)
            if self._stop_engine.wait(self.settings.heartbeat_s):
                return

    def describe(self) -> dict[str, Any]:
        """What the heartbeat stores and ``inspect engine_stats`` returns."""
        return {
            "name": self.name, "host": socket.gethostname(), "pid": os.getpid(),
            "queue": self.queue, "model": self.model_name, "device": self.settings.device,
            "chat": int(self.feeder.admission.has_chat_template),  # for the gateway's chat
            "max_batch": self.settings.max_batch, "prefetch": self.settings.prefetch,
            "running": self.scheduler.num_running, "waiting": self.scheduler.num_waiting,
            "draining": int(self.feeder.paused.is_set() or self._stop_intake.is_set()),
            "stats": self.engine.stats.as_dict(), "last_seen": time.time(),
        }

    def _observe_queue(self) -> None:
        """Queue gauges for the metrics: depth, lag and pending per level, backlog."""
        levels: dict[str, dict[str, Any]] = {}
        pipe = self.redis.pipeline(transaction=False)
        for _name, stream in self.feeder.levels:
            pipe.xlen(stream)
            pipe.xinfo_groups(stream)
        pipe.get(self.keys.backlog(self.queue))
        replies = pipe.execute(raise_on_error=False)
        for i, priority in enumerate(PRIORITIES):
            depth, groups = replies[2 * i], replies[2 * i + 1]
            group: dict[str, Any] = next(
                (g for g in groups if g["name"] == GROUP.encode()), {}
            ) if isinstance(groups, list) else {}
            pending = int(group.get("pending") or 0)
            lag = group.get("lag")
            levels[priority] = {"depth": depth if isinstance(depth, int) else 0,
                                "pending": pending,
                                "lag": lag if lag is not None else max(0, int(depth or 0) - pending)}
        backlog = replies[-1]
        self.metrics.queue_state(levels, int(backlog or 0) if not isinstance(backlog, Exception)
                                 else 0, self.scheduler.num_running)

    def _beat(self) -> None:
        if self.settings.metrics_port:
            self._observe_queue()
        key = self.keys.worker(self.name)
        running = list(self.scheduler.running) + list(self.scheduler.waiting)
        info: dict[Any, Any] = self.describe()
        info["stats"] = dumps(info["stats"])
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(key, mapping=info)
        pipe.expire(key, max(3 * int(self.settings.heartbeat_s), 5))
        # Who serves this model, for submit(require_worker=True) and the status view.
        pipe.zadd(self.keys.queue_workers(self.queue), {self.name: time.time()})
        # Touch the pending entries still being worked on: their idle time
        # restarts, so XAUTOCLAIM elsewhere never takes a job from a live worker.
        by_stream: dict[str, list[Any]] = {}
        for seq in running:
            if seq.entry_id:
                by_stream.setdefault(self.keys.queue(seq.queue), []).append(seq.entry_id)
        for stream, ids in by_stream.items():
            pipe.xclaim(stream, GROUP, self.name, 0, ids, justid=True)
        pipe.execute()

    def _cancel_loop(self) -> None:
        while not self._stop_engine.is_set():
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.keys.cancels)
                while not self._stop_engine.is_set():
                    message = pubsub.get_message(timeout=0.5)
                    if message is not None:
                        self.cancel(message["data"].decode())
            except (ConnectionError, TimeoutError, OSError) as exc:
                log.warning("cancel listener lost redis (%s); resubscribing", exc)
                self._stop_engine.wait(0.5)
            finally:
                pubsub.close()
