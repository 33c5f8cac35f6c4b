"""One worker's credits, shared by the feeders of its queue's partitions.

A worker that serves a queue of P partitions runs a feeder per partition (a
blocking read waits on one node, and each partition's slot may be another
node's). They read against one count of credits, the worker's free slots plus
its prefetch: so they take turns (``with credits:``), each reading and handing
over its entries before the next one counts what is left, and the worker never
holds more than one feeder alone would.

A turn's share is fair among the partitions that have work: the credits are
dealt to them in a rotating order, starting with the one after the partition
that read last (so with one credit free at a time the partitions get it in
turn, whichever feeder's thread wakes first). A feeder whose last turn found
its partition empty is left out of the deal until it finds an entry again, so
one busy partition gets every credit, and P busy ones a P-th each.

Several credits free at once (two jobs ending in the same step) are dealt the
same way, but the next deal starts after whichever feeder read last: one that
comes before a partition dealt a credit ahead of it takes that partition's
turn, so the order is then only roughly fair.
"""

from __future__ import annotations

import threading
from types import TracebackType


class SharedCredits:
    def __init__(self, partitions: list[str]) -> None:
        # Re-entrant: a feeder hands over what a blocking read brought inside a
        # turn of its own, whether or not it holds one already.
        self._lock = threading.RLock()
        self._order = list(partitions)
        self._next = 0  # where the next deal starts, in ``_order``
        self._busy = set(partitions)  # those whose last turn found entries

    def __enter__(self) -> SharedCredits:
        self._lock.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._lock.release()

    def share(self, partition: str, credits: int) -> int:
        """This partition's part of ``credits`` dealt to the busy partitions (and
        this one) from the next in turn; 0 when none falls to it."""
        if credits <= 0:
            return 0
        n = len(self._order)
        dealt = [p for p in (self._order[(self._next + i) % n] for i in range(n))
                 if p in self._busy or p == partition]
        most, extra = divmod(credits, len(dealt))
        return most + (1 if dealt.index(partition) < extra else 0)

    def found(self, partition: str, entries: int) -> None:
        """What the partition's turn read: the next deal starts after it; none
        leaves it out of the deals until it finds an entry again."""
        self._next = (self._order.index(partition) + 1) % len(self._order)
        if entries:
            self._busy.add(partition)
        else:
            self._busy.discard(partition)
