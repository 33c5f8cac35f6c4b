"""``tokenfleet batch``: submit a JSONL file of requests as a batch, follow it,
cancel it, list batches; ``batch drive`` runs the batch driver without a gateway.

A batch runs wherever a batch driver runs: every gateway runs one; without a
gateway, ``tokenfleet batch drive`` (or ``batch submit --wait``, while it waits).
"""

from __future__ import annotations

import asyncio
import datetime
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import orjson

if TYPE_CHECKING:
    from tokenfleet.client.aio import AsyncFleetClient
    from tokenfleet.client.batch_records import Batch, BatchRecord

redis_option = click.option("--redis-url", default=None,
                            help="Redis URL (default: $TOKENFLEET_REDIS_URL)")
files_option = click.option("--files-url", default=None,
                            help="the file store (default: $TOKENFLEET_FILES_URL)")
tenant_option = click.option("--tenant", default=None,
                             help="whose batch it is (default: the tenant 'default')")
# How often --wait reads the batch: a terminal's line is redrawn, a pipe gets
# a line only when the counts changed.
PROGRESS_S = 0.5
READ_CHUNK = 1 << 20


def _client(redis_url: str | None, files_url: str | None = None) -> AsyncFleetClient:
    import os

    from tokenfleet.client.aio import AsyncFleetClient
    from tokenfleet.cli.common import apply_env

    if files_url is not None:
        os.environ["TOKENFLEET_FILES_URL"] = files_url
    apply_env(redis_url=redis_url)
    return AsyncFleetClient()


def _endpoint_of(path: Path) -> str | None:
    """The url of the file's first line (the batch's endpoint), if it names one."""
    with path.open("rb") as handle:
        for raw in handle:
            if raw.strip():
                try:
                    url = orjson.loads(raw).get("url")
                except (orjson.JSONDecodeError, AttributeError):
                    return None
                return url if isinstance(url, str) else None
    return None


def _chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as handle:
        while chunk := handle.read(READ_CHUNK):
            yield chunk


def _summary(batch: Batch) -> str:
    counts = batch.request_counts
    return (f"{batch.id} {batch.status}: {counts.completed} done, {counts.failed} failed, "
            f"{counts.total} in all")


def progress(record: BatchRecord, elapsed_s: float) -> str:
    """One line: lines done, failed, in all; tokens a second; time left."""
    batch = record.batch
    counts = batch.request_counts
    finished = counts.completed + counts.failed
    rate = record.tokens / elapsed_s if elapsed_s > 0 else 0.0
    eta = "?"
    if 0 < finished < counts.total:
        eta = f"{elapsed_s * (counts.total - finished) / finished:.0f}s"
    elif counts.total and finished >= counts.total:
        eta = "0s"
    return (f"{batch.id} {batch.status}: {counts.completed} done / {counts.failed} failed / "
            f"{counts.total} total, {rate:.1f} tokens/s, ETA {eta}")


@click.group()
def batch() -> None:
    """Batches of requests (OpenAI's batch file format), run at priority batch."""


@batch.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--wait", is_flag=True, help="run a batch driver here and wait for the end")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="with --wait: write the result lines (output, then errors) here")
@click.option("--endpoint", type=click.Choice(["/v1/completions", "/v1/chat/completions"]),
              default=None, help="the lines' endpoint (default: the first line's url)")
@click.option("--completion-window", default="24h", show_default=True,
              help="the deadline: '24h', or shorter as '<N>h', '<N>m', '<N>s'")
@tenant_option
@files_option
@redis_option
def submit(file: Path, wait: bool, output: Path | None, endpoint: str | None,
           completion_window: str, tenant: str | None, files_url: str | None,
           redis_url: str | None) -> None:
    """Upload FILE.jsonl and create a batch of its lines; prints the batch id."""
    from tokenfleet.shared.wire.errors import InvalidRequest
    from tokenfleet.cli.common import JobFailed, NotEnqueued
    from tokenfleet.cli.errors import said

    if output is not None and not wait:
        raise click.UsageError("--output needs --wait (the results exist once the batch ends)")
    endpoint = endpoint or _endpoint_of(file) or "/v1/chat/completions"
    try:
        ended = asyncio.run(_submit(file, wait, output, endpoint, completion_window, tenant,
                                    _client(redis_url, files_url)))
    except InvalidRequest as exc:
        raise NotEnqueued(said(exc)) from None
    if ended is not None and ended.status != "completed":
        raise JobFailed(_summary(ended))


async def _submit(file: Path, wait: bool, output: Path | None, endpoint: str,
                  window: str, tenant: str | None, client: AsyncFleetClient) -> Batch | None:
    from tokenfleet.client.batches import results
    from tokenfleet.batches.driver import BatchDriver
    from tokenfleet.client.batch_records import create_batch
    from tokenfleet.files.records import create_file, max_line_bytes
    from tokenfleet.shared.file_store import open_store

    async with client:
        store = open_store(client.settings.files_url)
        uploaded = await create_file(client.redis, client.keys, store, _chunks(file),
                                     filename=file.name, purpose="batch", tenant=tenant,
                                     max_files=client.settings.files_max_per_tenant,
                                     max_line=max_line_bytes(client.settings.max_payload_bytes))
        made = await create_batch(client.redis, client.keys, input_file_id=uploaded.id,
                                  endpoint=endpoint, completion_window=window, metadata=None,
                                  tenant=tenant, max_open=client.settings.batch_max_open)
        click.echo(made.id)
        if not wait:
            return None
        driver = BatchDriver(client, store)
        driving = asyncio.get_running_loop().create_task(driver.run())
        try:
            ended = await _follow(client, made.id)
        finally:
            driving.cancel()
            await asyncio.gather(driving, return_exceptions=True)
            await driver.release()
        if output is not None:
            lines = await asyncio.to_thread(_write_results, output, results(store, ended))
            click.echo(f"wrote {lines} result lines to {output}")
        return ended


async def _follow(client: AsyncFleetClient, batch_id: str) -> Batch:
    """Show the batch's progress until it ends: a line redrawn on a terminal,
    a line per change when piped."""
    from tokenfleet.client.batch_records import read_record

    started = time.monotonic()
    terminal = sys.stdout.isatty()
    last = ""
    while True:
        record = await read_record(client.redis, client.keys, batch_id)
        assert record is not None
        line = progress(record, time.monotonic() - started)
        if terminal:
            click.echo("\r\x1b[2K" + line, nl=False)
        elif line.split(",")[0] != last.split(",")[0]:  # the counts changed
            click.echo(line)
        last = line
        if record.batch.is_ended:
            if terminal:
                click.echo()
            return record.batch
        await asyncio.sleep(PROGRESS_S)


def _write_results(path: Path, lines: Iterator[dict[str, Any]]) -> int:
    count = 0
    with path.open("wb") as out:
        for line in lines:
            out.write(orjson.dumps(line) + b"\n")
            count += 1
    return count


def _found(batch_id: str, found: Batch | None) -> Batch:
    from tokenfleet.cli.common import JobFailed

    if found is None:
        raise JobFailed(f"no batch {batch_id!r} (`tokenfleet batch list` shows them)")
    return found


@batch.command()
@click.argument("batch_id")
@tenant_option
@redis_option
def status(batch_id: str, tenant: str | None, redis_url: str | None) -> None:
    """The batch as OpenAI shows it (JSON), after a one-line summary."""
    from tokenfleet.client.batch_records import get_batch

    async def main() -> Batch | None:
        async with _client(redis_url) as client:
            return await get_batch(client.redis, client.keys, batch_id, tenant)
    found = _found(batch_id, asyncio.run(main()))
    click.echo(_summary(found))
    click.echo(found.model_dump_json(indent=2))


@batch.command()
@click.argument("batch_id")
@tenant_option
@redis_option
def cancel(batch_id: str, tenant: str | None, redis_url: str | None) -> None:
    """Cancel the batch: its lines' jobs are cancelled, finished lines are kept."""
    from tokenfleet.client.batch_records import cancel_batch

    async def main() -> Batch | None:
        async with _client(redis_url) as client:
            return await cancel_batch(client.redis, client.keys, batch_id, tenant)
    click.echo(_summary(_found(batch_id, asyncio.run(main()))))


@batch.command("list")
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True)
@tenant_option
@redis_option
def list_(limit: int, tenant: str | None, redis_url: str | None) -> None:
    """The tenant's batches, newest first."""
    from tokenfleet.client.batch_records import list_batches

    async def main() -> list[Batch]:
        async with _client(redis_url) as client:
            found, _more = await list_batches(client.redis, client.keys, tenant, limit=limit)
            return found
    found = asyncio.run(main())
    if not found:
        click.echo("no batches")
        return
    click.echo(f"{'BATCH ID':<32}{'STATUS':<13}{'CREATED (UTC)':<22}DONE/FAILED/TOTAL")
    for b in found:
        made = datetime.datetime.fromtimestamp(b.created_at, datetime.UTC)
        c = b.request_counts
        click.echo(f"{b.id:<32}{b.status:<13}{made:%Y-%m-%d %H:%M:%S}   "
                   f"{c.completed}/{c.failed}/{c.total}")


@batch.command()
@files_option
@redis_option
def drive(files_url: str | None, redis_url: str | None) -> None:
    """Run the batch driver until interrupted: for a fleet without a gateway
    (every gateway runs one)."""
    from tokenfleet.batches.driver import BatchDriver
    from tokenfleet.shared.file_store import open_store

    async def main() -> None:
        async with _client(redis_url, files_url) as client:
            driver = BatchDriver(client, open_store(client.settings.files_url))
            click.echo(f"driving batches as {driver.name} (Ctrl-C stops)")
            try:
                await driver.run()
            finally:
                await driver.release()
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
