"""Reading a batch's input file (blocking: the driver runs these in a thread).

Lines are numbered without the blank ones; the number is the line's index
everywhere (its idempotency key, its bit in the done bitmap, its place in a
part). The file is read from its start each time a driver takes a batch up:
the store has no reads from an offset, and a pass is quick (50,000 lines in
about a tenth of a second).
"""

from __future__ import annotations

from collections.abc import Iterator

from tokenfleet.batches import lines as batch_lines
from tokenfleet.batches.lines import LineError
from tokenfleet.client.batch_records import BatchError
from tokenfleet.shared.file_store import FileStore, Overlong, read_lines

# A batch's errors list this many of its lines' problems, at most.
MAX_ERRORS = 10


def numbered_lines(store: FileStore, name: str, max_line: int | None = None
                   ) -> Iterator[tuple[int, bytes]]:
    """The input's lines that are not blank, with their index (blocking). The
    file is opened now: FileNotFoundError here, not at the first line. A line
    over ``max_line`` bytes is an ``Overlong`` (its bytes never held)."""
    return _numbered(read_lines(store, name, max_line))


def _numbered(lines: Iterator[bytes]) -> Iterator[tuple[int, bytes]]:
    index = 0
    for line in lines:
        if isinstance(line, Overlong) or line.strip():
            yield index, line
            index += 1


def validated(store: FileStore, name: str, endpoint: str, max_line: int | None = None
              ) -> tuple[int, int, list[int], list[BatchError]]:
    """The input's count of lines, of valid ones, the duplicates' indexes and
    the first problems found (blocking: one pass over the file)."""
    total = valid = 0
    dups: list[int] = []
    errors: list[BatchError] = []
    seen: set[str] = set()
    for index, raw in numbered_lines(store, name, max_line):
        total += 1
        parsed = batch_lines.parse(raw, endpoint)
        if isinstance(parsed.body, LineError):
            if len(errors) < MAX_ERRORS:
                errors.append(BatchError(code=parsed.body.code, message=parsed.body.message,
                                         line=index + 1))
            continue
        assert parsed.custom_id is not None
        if parsed.custom_id in seen:
            dups.append(index)
            continue
        seen.add(parsed.custom_id)
        valid += 1
    return total, valid, dups, errors


def skipped(store: FileStore, name: str, next_line: int, wanted: set[int],
            max_line: int | None = None
            ) -> tuple[Iterator[tuple[int, bytes]], dict[int, bytes]]:
    """The input's lines from ``next_line`` on, and the lines before it that
    are ``wanted`` (blocking; FileNotFoundError when the input is gone)."""
    lines = numbered_lines(store, name, max_line)
    raws: dict[int, bytes] = {}
    if next_line == 0:
        return lines, raws
    for index, raw in lines:
        if index in wanted:
            raws[index] = raw
        if index + 1 >= next_line:
            break
    return lines, raws


def take(lines: Iterator[tuple[int, bytes]], n: int) -> list[tuple[int, bytes]]:
    out = []
    for item in lines:
        out.append(item)
        if len(out) >= n:
            break
    return out
