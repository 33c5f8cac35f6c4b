"""The fleet at a glance: queues and workers, as ``tokenfleet status`` shows them."""

from __future__ import annotations

import time
from typing import Any

from redis.exceptions import NoPermissionError, ResponseError

from tokenfleet.protocol import live_since
from tokenfleet.shared.keys import GROUP, PRIORITIES, level_queue, model_of
from tokenfleet.shared.scripts import Scripts
from tokenfleet.shared.serialization import loads


def fleet_status(client: Any) -> dict[str, Any]:
    """Read every queue's depth and group state and every live worker's heartbeat.

    A queue with nothing waiting or pending and no live worker is left out: a
    model name submitted once (mistyped, or queued ahead and expired) would
    otherwise show for good. If no worker ever served it (no consumer group),
    its keys are deleted too (``forget_queue.lua``, atomic against a submit).
    """
    r, keys = client.redis, client.keys
    now = time.time()
    models = sorted({model_of(keys.queue_of(raw.decode()))
                     for raw in r.scan_iter(match=keys.queues_pattern(), count=500)})
    queues = [_queue(r, keys, model, now) for model in models]
    workers = []
    for raw in sorted(r.scan_iter(match=keys.workers_pattern(), count=500)):
        fields = {k.decode(): v.decode() for k, v in r.hgetall(raw).items()}
        if not fields:
            continue
        stats = loads(fields.pop("stats", "{}"))
        workers.append({**_typed(fields), "stats": stats,
                        "age_s": round(now - float(fields.get("last_seen", now)), 2)})
    for q in queues:
        q["workers"] = sum(1 for w in workers if w.get("queue") == q["queue"])
        q["unserved"] = q["workers"] == 0
    unused = [q["queue"] for q in queues
              if q["unserved"] and q["depth"] == 0 and q["pending"] == 0]
    if unused:
        _forget(r, keys, unused)
        queues = [q for q in queues if q["queue"] not in unused]
    return {
        "queues": queues,
        "workers": workers,
        "tokens_per_s": round(sum(float(w["stats"].get("tokens_per_s", 0)) for w in workers), 2),
        "at": now,
    }


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


def _forget(r: Any, keys: Any, models: list[str]) -> None:
    """Delete the keys of unused queues that no worker ever served; the script
    checks again, atomically, so a submit or a worker in between keeps its queue."""
    forget, since = Scripts(r).forget_queue, repr(live_since())
    for model in models:
        try:
            forget(keys=[*(keys.queue(level_queue(model, p)) for p in PRIORITIES),
                         keys.backlog(model), keys.queue_workers(model)], args=[since])
        except NoPermissionError:
            return  # a read-only user: leaving them is harmless, they are not shown


def _queue(r: Any, keys: Any, model: str, now: float) -> dict[str, Any]:
    """One model's queue: its priority levels added up."""
    info: dict[str, Any] = {"queue": model, "depth": 0, "lag": 0, "pending": 0,
                            "oldest_wait_s": None, "levels": {},
                            "backlog_tokens": int(r.get(keys.backlog(model)) or 0),
                            "dead_letters": r.xlen(keys.dlq(model))}
    for priority in PRIORITIES:
        stream = keys.queue(level_queue(model, priority))
        depth = r.xlen(stream)
        info["levels"][priority] = depth
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


def render(report: dict[str, Any]) -> None:
    from rich.console import Console

    Console().print(view(report))


def watch(client: Any, interval_s: float = 1.0) -> None:
    """Redraw the fleet view until Ctrl-C."""
    from rich.live import Live

    with Live(view(fleet_status(client)), refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(interval_s)  # the refresh period of the view
                live.update(view(fleet_status(client)))
        except KeyboardInterrupt:
            pass


def view(report: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    queues = Table(title="queues")
    for col in ("queue", "depth (high/normal/low)", "lag", "pending", "oldest wait",
                "backlog tokens", "dead letters", "workers"):
        queues.add_column(col)
    for q in report["queues"]:
        wait = "-" if q["oldest_wait_s"] is None else f"{q['oldest_wait_s']:.1f}s"
        served = str(q["workers"]) if q["workers"] else "[red]none[/red]"
        levels = "/".join(str(q["levels"][p]) for p in PRIORITIES)
        queues.add_row(q["queue"], f"{q['depth']} ({levels})", str(q["lag"]), str(q["pending"]),
                       wait, str(q["backlog_tokens"]), str(q["dead_letters"]), served)
    workers = Table(title="workers")
    for col in ("node", "device", "model", "queue", "batch", "peak", "tokens/s", "jobs",
                "heartbeat"):
        workers.add_column(col)
    for w in report["workers"]:
        stats = w["stats"]
        jobs = ", ".join(f"{k} {v}" for k, v in sorted(stats.get("jobs", {}).items())) or "-"
        workers.add_row(w.get("name", "?"), w.get("device", "?"), w.get("model", "?"),
                        w.get("queue", "?"), f"{w.get('running', 0)}/{w.get('max_batch', '?')}",
                        str(stats.get("peak_batch", 0)), f"{stats.get('tokens_per_s', 0):.1f}",
                        jobs, f"{w['age_s']:.1f}s ago")
    return Group(queues, workers, Text(f"fleet throughput: {report['tokens_per_s']:.1f} tokens/s"))
