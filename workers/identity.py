"""One live process per worker name.

A worker's name is its consumer in the stream's group: two live processes
under one name would read each other's pending entries, and the second one's
start re-takes (and so fences) every job the first one is running. So a
process refuses a name whose heartbeat says it is live (its ``alive_until``,
``tokenfleet.shared.redis.liveness``), unless that heartbeat is its own
predecessor's on this host (a crashed process restarted under its name, which
must re-read its entries: that is how crash recovery resumes them).
"""

from __future__ import annotations

import os
import socket
from typing import Any

from tokenfleet.shared.redis.clock import redis_now
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.redis.liveness import MIN_LIVE_S, live_since


class NameTaken(RuntimeError):
    """Another live process already serves under this worker name."""


def check_name(redis: Any, keys: Keys, name: str) -> None:
    """Raise ``NameTaken`` if a live process other than this one holds ``name``."""
    fields = {k.decode(): v.decode() for k, v in redis.hgetall(keys.worker(name)).items()}
    if not fields:
        return
    try:
        last_seen = float(fields.get("last_seen", "0"))
        # A heartbeat without alive_until is an older worker's: live for the
        # least any heartbeat keeps its worker live.
        alive_until = float(fields.get("alive_until", last_seen + MIN_LIVE_S))
        now = redis_now(redis)  # the clock the heartbeat's times are on
        age = now - last_seen
        pid = int(fields.get("pid", "0"))
    except ValueError:
        return  # not a heartbeat we wrote: nothing to protect
    if alive_until < live_since(now):
        return
    host = fields.get("host", "")
    if host == socket.gethostname() and (pid == os.getpid() or not _alive(pid)):
        return
    raise NameTaken(
        f"worker name {name!r} is in use by process {pid} on {host or 'another host'} "
        f"(heartbeat {age:.1f}s ago): give this worker another name (--name)"
    )


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True
