"""The worker's heartbeat: its stats hash, its place in the served set and
its limits (``submit.lua`` reads them), the queue gauges, and the idle-time
renewal of the entries it is still generating (so a long job is never
reclaimed from a live worker).

Thread: the heartbeat thread's (``run``), and ``Worker.start``'s first beat
before that thread starts. It only reads the worker's state (snapshots).
"""

from __future__ import annotations

import logging
import math
import os
import socket
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from tokenfleet.shared.redis import liveness
from tokenfleet.shared.wire import fleet_history
from tokenfleet.shared.wire.keys import GROUP, PRIORITIES, level_priority, level_tenant
from tokenfleet.shared.redis.cluster import reread_slot_map
from tokenfleet.shared.redis.connect import node_client
from tokenfleet.shared.wire.serialization import dumps
from tokenfleet.workers import limits

if TYPE_CHECKING:
    from tokenfleet.workers.service import Worker

log = logging.getLogger(__name__)

# How long a queue's last heartbeat is remembered (``Keys.served_until``): a
# submit to a queue served within it that finds no live worker is told to
# retry (WorkersGone), not that the name is unknown.
SERVED_MEMORY_S = 86_400


class Heartbeat:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.next_sample = 0.0  # when the console's next sample is due (Redis's clock)

    def first_beat(self) -> None:
        """One beat before the feeders read: a peer takes the pending entries of a
        consumer the served set does not list as live for a dead worker's
        (``Feeder._reclaim``), so the worker must be listed before it holds any."""
        try:
            self.beat()
        except (RedisError, OSError) as exc:  # the heartbeat thread beats on
            log.warning("first heartbeat failed: %s", exc)

    def run(self) -> None:
        while True:
            try:
                self.beat()
            except (RedisError, OSError) as exc:  # OOM, READONLY too: beat on
                log.warning("heartbeat failed: %s", exc)
            if self.worker.stopping.wait(self.worker.settings.heartbeat_s):
                return

    def describe(self) -> dict[str, Any]:
        """What the heartbeat stores and ``inspect engine_stats`` returns."""
        worker, engine, admission = self.worker, self.worker.engine, self.worker.admission
        return {
            "name": worker.name, "host": socket.gethostname(), "pid": os.getpid(),
            "queue": worker.queue, "model": worker.model_name, "device": worker.settings.device,
            "chat": int(admission.has_chat_template),  # for the gateway's chat
            "fim": int(admission.fim is not None),  # and its suffix
            "tools": admission.tool_format,  # and its tool_choice "auto"
            "max_batch": worker.max_batch, "prefetch": worker.settings.prefetch,
            "running": engine.num_running, "waiting": engine.num_waiting,
            "draining": int(worker.paused.is_set() or worker.stop_intake.is_set()),
            "fatal": worker.fatal_reason or "", "failing": worker.engine_loop.failing,
            "stats": engine.stats.as_dict(), "last_seen": worker.clock.now(),
        }

    def observe_queue(self) -> None:
        """Queue gauges for the metrics: depth, lag and pending per level and
        per tenant, backlog."""
        streams = [level for feeder in self.worker.feeders for level in feeder.levels]
        pipe = self.worker.redis.pipeline(transaction=False)
        for _name, stream in streams:
            pipe.xlen(stream)
            pipe.xinfo_groups(stream)
        for part in self.worker.partitions:
            pipe.get(self.worker.keys.backlog(part))
        replies = pipe.execute(raise_on_error=False)
        levels = {p: {"depth": 0, "pending": 0, "lag": 0} for p in PRIORITIES}
        tenants: dict[str, dict[str, int]] = {}
        for i, (name, _stream) in enumerate(streams):
            depth, groups = replies[2 * i], replies[2 * i + 1]
            depth = depth if isinstance(depth, int) else 0
            group: dict[str, Any] = next(
                (g for g in groups if g["name"] == GROUP.encode()), {}
            ) if isinstance(groups, list) else {}
            pending = int(group.get("pending") or 0)
            lag = group.get("lag")
            one = {"depth": depth, "pending": pending,
                   "lag": lag if lag is not None else max(0, depth - pending)}
            for into in (levels[level_priority(name)],
                         tenants.setdefault(level_tenant(name), {"depth": 0, "pending": 0})):
                for k in into:
                    into[k] += one[k]
        backlog = sum(int(b or 0) for b in replies[2 * len(streams):]
                      if not isinstance(b, Exception))
        self.worker.metrics.queue_state(levels, backlog, self.worker.engine.num_running, tenants)

    def beat(self) -> None:
        if self.worker.settings.metrics_port:
            self.observe_queue()
        try:  # a fresh reading of Redis's clock when due, from the queue's node
            self.worker.clock.read(node_client(self.worker.redis, self.worker.keys.queue(self.worker.queue)))
        except (RedisError, OSError) as exc:  # the last reading carries on meanwhile
            log.warning("reading Redis's clock failed: %s", exc)
            reread_slot_map(self.worker.redis)
        key = self.worker.keys.worker(self.worker.name)
        # The jobs still being worked on: running, waiting, and those the step
        # in flight finished (their end is not stored yet). ``sent`` belongs to
        # the output thread; reading the list it points to now is enough here.
        sent = [o.seq for o in self.worker.output.sent if o.finished]
        running = [*self.worker.engine.unfinished(), *sent]
        info: dict[Any, Any] = self.describe()
        info["stats"] = dumps(info["stats"])
        # Until when this worker counts as live: every reader compares this
        # with Redis's clock too (shared.liveness), and the hash expires about then.
        info["alive_until"] = liveness.alive_until(self.worker.settings.heartbeat_s, info["last_seen"])
        # The queue's renewals go first and alone: on a Redis Cluster this
        # worker's hash may live on another node than its queue, and that node's
        # death must not stop what keeps the queue served and its jobs owned.
        pipe = self.worker.redis.pipeline(transaction=False)
        # Who serves this model, for submit(require_worker=True) and the status view.
        for part in self.worker.partitions:
            pipe.zadd(self.worker.keys.queue_workers(part), {self.worker.name: info["alive_until"]})
            # Kept past this worker's leaving: submits wait out a restart for
            # no_worker_grace_s after it, and a name served within a day is
            # not an unknown one (submit.lua).
            pipe.set(self.worker.keys.served_until(part), repr(info["alive_until"]),
                     ex=SERVED_MEMORY_S)
            limits.publish(pipe, self.worker.keys, part, self.worker.name, self.worker.limits.model_dump_json(),
                           self.worker.settings.heartbeat_s)
        # Touch the pending entries still being worked on: their idle time
        # restarts, so the reclaim (XPENDING + XCLAIM) elsewhere never takes a job from a live worker.
        by_stream: dict[str, list[Any]] = {}
        for seq in running:
            if seq.entry_id:
                by_stream.setdefault(self.worker.keys.queue(seq.queue), []).append(seq.entry_id)
        for stream, ids in by_stream.items():
            pipe.xclaim(stream, GROUP, self.worker.name, 0, ids, justid=True)
        pipe.execute()
        for part in self.worker.partitions:
            limits.forget_dead(self.worker.redis, self.worker.keys, part, info["last_seen"])
        pipe = self.worker.redis.pipeline(transaction=False)
        pipe.hset(key, mapping=info)
        pipe.expire(key, math.ceil(liveness.live_for_s(self.worker.settings.heartbeat_s)))
        pipe.execute()
        if info["last_seen"] >= self.next_sample:
            self.next_sample = info["last_seen"] + fleet_history.HISTORY_EVERY_S
            self.sample(info)

    def sample(self, info: dict[str, Any]) -> None:
        """The console's sample of this worker (``shared/wire/fleet_history.py``)."""
        w = self.worker
        pipe = w.redis.pipeline(transaction=False)
        for part in w.partitions:
            pipe.get(w.keys.backlog(part))
        backlog = sum(int(b or 0) for b in pipe.execute())
        pipe = w.redis.pipeline(transaction=False)
        fleet_history.add(pipe, w.keys, worker=w.name, queue=w.queue,
                          tokens_per_s=w.engine.stats.tokens_per_s(),
                          running=int(info["running"]), waiting=int(info["waiting"]),
                          backlog_tokens=backlog, now=info["last_seen"],
                          tenant_tokens=dict(w.engine.stats.tenant_tokens))
        pipe.execute()
