"""The fleet at a glance: queues and workers, as ``tokenfleet status`` shows them."""

from __future__ import annotations

import importlib.util
import sys
import time
from dataclasses import dataclass
from typing import Any, NamedTuple, TextIO

from redis.exceptions import ResponseError

from tokenfleet.shared.wire.client_scripts import ExpireVerdict, expire, forget_queue
from tokenfleet.shared.redis.clock import redis_now
from tokenfleet.shared.wire.declared import declared_queues
from tokenfleet.shared.wire.keys import (GROUP, PRIORITIES, Keys, job_model, level_owner,
                                        level_priority, level_tenant, model_of,
                                        queue_of_partition)
from tokenfleet.shared.redis.liveness import live_since
from tokenfleet.shared.wire.schemas import (
    EXPIRED_ERROR,
    FinishReason,
    JobState,
    JobStatus,
    QueueEntry,
    queue_entry,
)
from tokenfleet.shared.wire.serialization import end_event, loads
from tokenfleet.shared.wire.topology import QueueTopology, level_stream, tenants_of

# The window of a worker's rate when its stats do not say (an older worker's).
RATE_WINDOW_S = 10.0


def fleet_status(client: Any) -> dict[str, Any]:
    """Read every queue's depth and group state and every live worker's heartbeat.

    A read: nothing is written. A queue with nothing waiting or pending and no
    live worker is left out: a model name submitted once (mistyped, or queued
    ahead and expired) would otherwise show for good. ``repair_fleet`` deletes
    its keys. A declared queue (``tokenfleet queue create``) always shows, with
    its ``min_workers``: its pool may be scaled to zero. Every age and
    liveness is judged on Redis's clock, the one heartbeats and queue entry
    ids are written on. A partitioned queue's partitions are summed into one row.
    """
    r, keys = client.redis, client.keys
    declared = {d.queue: d.min_workers for d in declared_queues(r, keys)}
    workers = sorted(raw.decode() for raw in r.scan_iter(match=keys.workers_pattern(), count=500))
    return fleet_report(client, sorted({*queue_models(r, keys), *declared}), declared, workers)


def fleet_report(client: Any, models: list[str], declared: dict[str, int],
                 worker_keys: list[str]) -> dict[str, Any]:
    """``fleet_status`` of the queues (and partitions) ``models``, the declared
    queues' floors ``declared`` and the workers whose hashes are ``worker_keys``:
    each read once, so its cost is that of the rows it returns (the console
    finds its names without a scan, ``tokenfleet status`` with one)."""
    r, keys = client.redis, client.keys
    now = redis_now(r)
    parts: dict[str, list[dict[str, Any]]] = {}
    for model in models:
        parts.setdefault(queue_of_partition(model), []).append(_queue(r, keys, model, now))
    queues = [_summed(name, found) for name, found in parts.items()]
    workers = []
    for raw in worker_keys:
        fields = {k.decode(): v.decode() for k, v in r.hgetall(raw).items()}
        if not fields:
            continue
        stats = loads(fields.pop("stats", "{}"))
        worker = {**_typed(fields), "stats": stats,
                  "age_s": round(now - float(fields.get("last_seen", now)), 2)}
        # Its hash outlives it by up to a second (a TTL in whole seconds): it
        # shows dead from the moment its liveness lapses, when its jobs move on.
        worker["live"] = _live(worker, now)
        workers.append(worker)
    for q in queues:
        q["workers"] = sum(1 for w in workers if w["live"]
                           and queue_of_partition(str(w.get("queue"))) == q["queue"])
        q["unserved"] = q["workers"] == 0
        q["min_workers"] = declared.get(q["queue"])  # None: not declared
    queues = [q for q in queues if q["min_workers"] is not None
              or not (q["unserved"] and q["depth"] == 0 and q["pending"] == 0)]
    return {
        "queues": queues,
        "workers": workers,
        # A worker that stopped beating (killed) keeps its last rate in its hash
        # until it expires: only the live ones' count.
        "tokens_per_s": round(sum(float(w["stats"].get("tokens_per_s", 0)) for w in workers
                                  if _live(w, now)), 2),
        # The window the workers take their rates over (their stats say).
        "rate_window_s": max((float(w["stats"].get("rate_window_s", RATE_WINDOW_S))
                              for w in workers), default=RATE_WINDOW_S),
        "at": now,
    }


def _summed(queue: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One queue's row from its partitions' (a queue of one partition: its own)."""
    if len(parts) == 1:
        return {**parts[0], "queue": queue}
    # The queue's own name counts with them (a declared queue's, what it held
    # before it had partitions), not as a partition.
    info: dict[str, Any] = {"queue": queue, "levels": dict.fromkeys(PRIORITIES, 0),
                            "tenants": {},
                            "partitions": sum(1 for p in parts if p["queue"] != queue)}
    for name in ("depth", "lag", "pending", "backlog_tokens", "dead_letters"):
        info[name] = sum(p[name] for p in parts)
    waits = [p["oldest_wait_s"] for p in parts if p["oldest_wait_s"] is not None]
    info["oldest_wait_s"] = max(waits) if waits else None
    for p in parts:
        for priority, depth in p["levels"].items():
            info["levels"][priority] += depth
        for tenant, depth in p["tenants"].items():
            info["tenants"][tenant] = info["tenants"].get(tenant, 0) + depth
    return info


def _live(worker: dict[str, Any], now: float) -> bool:
    """Live by its heartbeat's own word (``shared/redis/liveness.py``), not by its
    hash still being there; a heartbeat without a readable ``alive_until`` (an
    older worker's) by its hash alone."""
    until = worker.get("alive_until")
    return not isinstance(until, float) or until >= now


def _typed(fields: dict[str, str]) -> dict[str, Any]:
    """Heartbeat fields as they were meant: numbers as numbers (a hash holds strings)."""
    out: dict[str, Any] = dict(fields)
    for name, kind in _NUMBERS.items():
        if name in out:
            try:
                out[name] = kind(out[name])
            except ValueError:
                pass  # not ours to fix here: shown as written
    return out


_NUMBERS: dict[str, type] = {"pid": int, "max_batch": int, "prefetch": int, "running": int,
                             "waiting": int, "draining": int, "last_seen": float,
                             "alive_until": float}


def queue_models(r: Any, keys: Keys) -> list[str]:
    """Every model with a stream key (any level)."""
    return sorted({model_of(keys.queue_of(raw.decode()))
                   for raw in r.scan_iter(match=keys.queues_pattern(), count=500)})


@dataclass(frozen=True)
class Progress:
    """What a job's record does not say while it runs: the record gets the tokens
    only when the job ends, and names a worker that may have died since."""

    worker_live: bool | None  # None: the record names no worker
    tokens_logged: int
    text_logged: str


def job_progress(client: Any, state: JobState) -> Progress:
    """Whether the job's worker is live (its heartbeat still counts), and what the
    job's token log holds. A read: nothing is written."""
    r, keys = client.redis, client.keys
    live = None
    if state.worker is not None:
        # The job's partition (its id's queue part) is where its worker beats.
        until = r.zscore(keys.queue_workers(job_model(state.id) or state.model), state.worker)
        live = until is not None and until >= live_since(redis_now(r))
    events = [loads(fields[b"e"]) for _id, fields in r.xrange(keys.out(state.id))]
    return Progress(live, sum(len(e["token_ids"]) for e in events),
                    "".join(e["text"] for e in events))


@dataclass(frozen=True)
class Repaired:
    """What ``repair_fleet`` changed."""

    expired: int  # jobs queued past their deadline, ended now
    forgotten: list[str]  # queues whose keys were deleted


def repair_fleet(client: Any, page: int = 500) -> Repaired:
    """Do the writes no worker would do: end the jobs queued past their
    deadline on queues no live worker serves (``expire.lua``: expired, off the
    queue and out of the backlog), then delete the keys of queues nobody uses
    (``forget_queue.lua``: nothing queued, no consumer group, no live worker).

    Each script checks again, atomically, so a worker or a submit in between
    keeps its job or its queue. A served queue's overdue jobs are its
    workers' to end, as they read them.
    """
    r, keys = client.redis, client.keys
    now = redis_now(r)  # the clock deadlines and heartbeats are written on
    since = live_since(now)
    models = queue_models(r, keys)
    expired = 0
    for model in models:
        if r.zcount(keys.queue_workers(model), since, "+inf"):
            continue
        for priority, tenant, owner in level_streams(r, keys, model):
            stream = level_stream(keys, model, priority, tenant, owner)
            for entry in _overdue(r, stream, page, now):
                verdict = expire(
                    keys, job_id=entry.job_id, model=model, priority=priority, tenant=tenant,
                    owner=owner, now=now,
                    result_ttl_s=client.settings.result_ttl_s,
                    end_event=end_event(JobStatus.EXPIRED, FinishReason.DEADLINE, EXPIRED_ERROR),
                    error=EXPIRED_ERROR).run(r)
                expired += verdict is ExpireVerdict.EXPIRED
    forgotten = [model for model in models
                 if forget_queue(keys, model=model, live_since=since,
                                 tenants=[t.decode() for t in r.smembers(keys.tenants(model))]
                                 ).run(r)]
    return Repaired(expired, forgotten)


def _overdue(r: Any, stream: str, page: int, now: float) -> list[QueueEntry]:
    """The entries of ``stream`` whose deadline has passed at ``now`` (an entry
    no job can come from is a worker's to dead-letter: skipped)."""
    start, found = "-", []
    while entries := r.xrange(stream, start, "+", count=page):
        for _id, fields in entries:
            entry = queue_entry(fields)
            if entry is not None and entry.deadline_at is not None and entry.deadline_at <= now:
                found.append(entry)
        start = "(" + entries[-1][0].decode()
    return found


class LevelStream(NamedTuple):
    """One stream of a model's queue (or partition)."""

    priority: str
    tenant: str
    owner: str | None  # the tag of the worker whose own stream it is (placement by prefix)


def level_streams(r: Any, keys: Keys, model: str) -> list[LevelStream]:
    """Each stream of a model: the default tenant's and each named tenant's at
    every level, then the workers' own streams (placement by prefix), whose
    jobs are the queue's as much as the shared streams' are."""
    topology = QueueTopology(keys, model, 1, tuple(tenants_of(r, keys, model)))
    owned = sorted(level.decode() for level in r.smembers(keys.owned_levels(model)))
    return [*(LevelStream(p, t, None) for _, p, t in topology.levels()),
            *(LevelStream(level_priority(level), level_tenant(level), level_owner(level))
              for level in owned if level_owner(level) is not None)]


def _queue(r: Any, keys: Any, model: str, now: float) -> dict[str, Any]:
    """One model's queue: its priority levels and tenants added up."""
    info: dict[str, Any] = {"queue": model, "depth": 0, "lag": 0, "pending": 0,
                            "oldest_wait_s": None, "levels": dict.fromkeys(PRIORITIES, 0),
                            "tenants": {},
                            "backlog_tokens": int(r.get(keys.backlog(model)) or 0),
                            "dead_letters": r.xlen(keys.dlq(model))}
    for priority, tenant, owner in level_streams(r, keys, model):
        stream = level_stream(keys, model, priority, tenant, owner)
        depth = r.xlen(stream)
        info["levels"][priority] += depth
        info["tenants"][tenant] = info["tenants"].get(tenant, 0) + depth
        info["depth"] += depth
        lag, pending = depth, 0
        try:
            for group in r.xinfo_groups(stream):
                if group["name"] == GROUP.encode():
                    pending = group["pending"]
                    lag = group.get("lag") if group.get("lag") is not None else depth - pending
        except ResponseError:
            pass  # no such stream yet
        info["lag"] += lag
        info["pending"] += pending
        first = r.xrange(stream, "-", "+", count=1)
        if first:
            wait = round(now - int(first[0][0].split(b"-")[0]) / 1000, 3)
            info["oldest_wait_s"] = max(wait, info["oldest_wait_s"] or 0.0)
    return info


Table = tuple[str, list[str], list[list[str]]]  # title, columns, rows


def render(report: dict[str, Any], out: TextIO | None = None) -> None:
    """The fleet view: rich's tables on a terminal, and where rich is not
    installed (the bare client) or the output is a pipe, plain columns that
    keep every value whole (rich cuts cells to the terminal's width, 80 in a pipe)."""
    out = out or sys.stdout
    if out.isatty() and importlib.util.find_spec("rich") is not None:
        from rich.console import Console

        Console(file=out).print(view(report))
    else:
        out.write(plain(report))


def watch(client: Any, interval_s: float = 1.0) -> None:
    """Redraw the fleet view until Ctrl-C."""
    try:
        if importlib.util.find_spec("rich") is None:
            while True:
                sys.stdout.write("\033[H\033[J" + plain(fleet_status(client)))
                sys.stdout.flush()
                time.sleep(interval_s)
        from rich.live import Live

        with Live(view(fleet_status(client)), refresh_per_second=4) as live:
            while True:
                time.sleep(interval_s)  # the refresh period of the view
                live.update(view(fleet_status(client)))
    except KeyboardInterrupt:
        pass


def tables(report: dict[str, Any]) -> list[Table]:
    """The fleet's queues and workers as rows of text, for either renderer."""
    queues = []
    for q in report["queues"]:
        wait = "-" if q["oldest_wait_s"] is None else f"{q['oldest_wait_s']:.1f}s"
        levels = "/".join(str(q["levels"][p]) for p in PRIORITIES)
        queues.append([q["queue"], f"{q['depth']} ({levels})", str(q["lag"]), str(q["pending"]),
                       wait, str(q["backlog_tokens"]), str(q["dead_letters"]),
                       _workers_cell(q)])
    workers = []
    for w in report["workers"]:
        stats = w["stats"]
        jobs = ", ".join(f"{k} {v}" for k, v in sorted(stats.get("jobs", {}).items())) or "-"
        workers.append([w.get("name", "?"), w.get("device", "?"), w.get("model", "?"),
                        w.get("queue", "?"), f"{w.get('running', 0)}/{w.get('max_batch', '?')}",
                        str(stats.get("peak_batch", 0)), f"{stats.get('tokens_per_s', 0):.1f}",
                        jobs, f"{w['age_s']:.1f}s ago" + ("" if w.get("live", True) else ", dead")])
    return [("queues", ["queue", f"depth ({'/'.join(PRIORITIES)})", "lag", "pending", "oldest wait",
                        "backlog tokens", "dead letters", "workers"], queues),
            ("workers", ["node", "device", "model", "queue", "batch", "peak",
                         f"tokens/s (last {report['rate_window_s']:g} s)", "jobs",
                         "heartbeat"], workers)]


def _workers_cell(queue: dict[str, Any]) -> str:
    """Live workers; for a declared queue its pool's floor too (a pool scaled
    to zero is no fault: its backlog wakes it)."""
    shown = str(queue["workers"]) if queue["workers"] else "none"
    floor = queue.get("min_workers")
    return shown if floor is None else f"{shown} (autoscaled, min {floor})"


def plain(report: dict[str, Any]) -> str:
    """The fleet view as plain text: columns as wide as their widest value."""
    lines = []
    for title, columns, rows in tables(report):
        widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
        lines.append(title)
        for row in [columns, *rows]:
            lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
        lines.append("")
    lines.append(throughput(report))
    return "\n".join(lines) + "\n"


def view(report: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.table import Table as RichTable
    from rich.text import Text

    shown = []
    for title, columns, rows in tables(report):
        table = RichTable(title=title)
        for column in columns:
            table.add_column(column)
        for row in rows:
            table.add_row(*("[red]none[/red]" if column == "workers" and value == "none"
                            else value for column, value in zip(columns, row)))
        shown.append(table)
    return Group(*shown, Text(throughput(report)))


def throughput(report: dict[str, Any]) -> str:
    """The fleet's line: its rate, with the window it is taken over."""
    return (f"fleet throughput over the last {report['rate_window_s']:g} s: "
            f"{report['tokens_per_s']:.1f} tokens/s")
