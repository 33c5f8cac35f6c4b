"""When a worker counts as live: one rule, written by the worker, read by everyone.

Every heartbeat stores the time until which its worker counts as live,
``alive_until``: as the worker's score in ``<ns>:served:<queue>`` and as a
field of its hash ``<ns>:workers:<name>``, whose TTL ends about then too. Both
the worker and every reader take the time from Redis's clock
(``shared.clock.FleetClock``), never from their hosts' own clocks, which may
disagree by minutes. A reader compares ``alive_until`` with that time (a score
at or above now is a live worker) and never needs the worker's ``heartbeat_s``:
a producer, the gateway, ``tokenfleet status`` and a second process asking for
the same worker name all agree on who is live, whatever heartbeat period each
worker runs with.
"""

from __future__ import annotations

# A worker stays live until it has missed this many heartbeats in a row: one
# late beat (a pause of the process, a slow Redis round trip) must not make it
# look gone, and submits to its queue fail with ``NoWorker``.
MISSED_BEATS = 3
# ...and for no less than this, however short its heartbeat: a host busy
# loading a model can hold a heartbeat thread back for seconds.
MIN_LIVE_S = 10.0


def live_for_s(heartbeat_s: float) -> float:
    """How long one heartbeat keeps its worker live."""
    return max(MISSED_BEATS * heartbeat_s, MIN_LIVE_S)


def alive_until(heartbeat_s: float, sent_at: float) -> float:
    """The time (Redis's clock) until which a heartbeat sent at ``sent_at`` keeps it live."""
    return sent_at + live_for_s(heartbeat_s)


def live_since(now: float) -> float:
    """The least ``alive_until`` a worker live at ``now`` (Redis's clock) has."""
    return now
