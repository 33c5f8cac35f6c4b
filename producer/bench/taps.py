"""Listening taps: one pattern subscription that timestamps every message of a run.

A client following hundreds of jobs with a connection each would spend the
benchmark's CPU on itself; one ``PSUBSCRIBE`` for the whole namespace, read by
one thread that only stamps and files each message, keeps the measuring cheap.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import redis

from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.serialization import loads

END_PREFIX = b'{"k":"end"'  # how a job's end event starts (orjson keeps the key order)


class PatternTap:
    """Calls ``handle(suffix, data, when)`` for each message on ``prefix*``."""

    def __init__(self, url: str, prefix: str) -> None:
        self._client = redis.Redis.from_url(url)
        self._pubsub = self._client.pubsub()  # type: ignore[no-untyped-call,unused-ignore]
        self._pubsub.psubscribe(f"{prefix}*")
        self._skip = len(prefix.encode())
        deadline = time.monotonic() + 10
        while True:  # only after the confirmation is every later publish heard
            message = self._pubsub.get_message(timeout=1.0)
            if message is not None and message["type"] == "psubscribe":
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no confirmation of the subscription to {prefix}*")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-tap", daemon=True)
        self._thread.start()

    def handle(self, suffix: bytes, data: bytes, when: float) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        get, clock, skip = self._pubsub.get_message, time.perf_counter, self._skip
        while not self._stop.is_set():
            message = get(timeout=0.05)
            if message is not None and message["type"] == "pmessage":
                self.handle(message["channel"][skip:], message["data"], clock())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pubsub.close()
        self._client.close()


class EventTap(PatternTap):
    """Every token and end event of a fleet namespace, by job id."""

    def __init__(self, url: str, keys: Keys, record: bool = True) -> None:
        self.tokens: dict[bytes, list[float]] = defaultdict(list)
        self.ended: dict[bytes, float] = {}
        self.on_end: Callable[[bytes], None] | None = None
        self.record = record  # False: only call on_end (a long soak keeps nothing)
        super().__init__(url, keys.events(""))

    def handle(self, suffix: bytes, data: bytes, when: float) -> None:
        suffix = suffix.replace(b"{", b"", 1).replace(b"}", b"", 1)  # the job id (keys.job_id_in)
        if data.startswith(END_PREFIX):
            if self.record:
                self.ended[suffix] = when
            if self.on_end is not None:
                self.on_end(suffix)
        elif self.record:
            # An event carries one token or several (the worker coalesces them):
            # a time for each, all heard at once.
            self.tokens[suffix].extend([when] * len(loads(data)["token_ids"]))


class ResultTap(PatternTap):
    """Every result a Celery Redis result backend publishes, by task id."""

    def __init__(self, url: str, task_keyprefix: str) -> None:
        self.results: dict[bytes, tuple[float, dict[str, Any]]] = {}
        self.on_result: Callable[[bytes], None] | None = None
        super().__init__(url, task_keyprefix)

    def handle(self, suffix: bytes, data: bytes, when: float) -> None:
        meta = loads(data)
        if meta.get("status") in ("SUCCESS", "FAILURE"):
            self.results[suffix] = (when, meta)
            if self.on_result is not None:
                self.on_result(suffix)
