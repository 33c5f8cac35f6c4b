"""A batch's input is read line by line in memory bounded by the longest line
allowed: a 190 MB line without a newline (a file that reached the store
without an upload's checks) fails its batch in seconds, the reader's memory
growing by far less than the line, on a real redis-server and file store."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.batches.driver import BatchDriver
from tokenfleet.client.batch_records import create_batch
from tokenfleet.files.records import FileObject, new_file_id, register, store_name
from tokenfleet.shared.file_store import DirectoryStore

pytestmark = pytest.mark.timeout(120)

LINE_MB = 190


class PeakRss:
    """The most resident memory this process had while the block ran, sampled
    every few milliseconds, over what it had at the start."""

    def __init__(self) -> None:
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while not self._stop.wait(0.003):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.start) / 1e6


def long_line() -> Iterator[bytes]:
    """A batch line of LINE_MB megabytes and no newline, made as it is written."""
    yield b'{"custom_id": "big", "method": "POST", "url": "/v1/completions", "body": {"prompt": "'
    block = b"a" * 1_000_000
    for _ in range(LINE_MB):
        yield block


def test_a_190_mb_line_fails_its_batch_reading_at_most_50_mb(
    settings: Any, tmp_path: Path
) -> None:
    settings = settings.model_copy(update={"files_url": f"file://{tmp_path}"})
    store = DirectoryStore(tmp_path)
    file = FileObject(id=new_file_id(), bytes=0, created_at=int(time.time()),
                      filename="big.jsonl", purpose="batch")
    file.bytes = store.put(store_name(file.id), long_line())

    async def drive() -> tuple[Any, float, float]:
        async with AsyncFleetClient(settings=settings) as client:
            await register(client.redis, client.keys, file, "acme")
            batch = await create_batch(client.redis, client.keys, input_file_id=file.id,
                                       endpoint="/v1/completions", completion_window="24h",
                                       metadata=None, tenant="acme")
            driver = BatchDriver(client, store)
            with PeakRss() as rss:
                started = time.monotonic()
                record = await driver.drive(batch.id, timeout=60)
                took = time.monotonic() - started
            return record, took, rss.growth_mb

    record, took, growth_mb = asyncio.run(drive())
    print(f"190 MB line: failed in {took:.2f} s, the reader grew {growth_mb:.1f} MB")
    assert record.batch.status == "failed"
    assert record.batch.errors is not None
    error = record.batch.errors.data[0]
    assert error.code == "line_too_long"
    assert f"the line is {file.bytes} bytes" in error.message
    # What it holds is the behaviour (the line is never read whole); how long it
    # took is a figure, printed above (the drive's own timeout bounds it).
    assert growth_mb < 50, f"the reader grew by {growth_mb:.0f} MB"
