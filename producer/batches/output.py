"""A batch's results on their way to its output and error files.

The store has no append, so a driver writes the lines it finished in one step
as a part of their own (``batches/<id>/out/<n>.jsonl``, ``.../err/<n>.jsonl``,
each line prefixed with its line index), and only then marks them done in
Redis. A crash between the two writes a line again in a later part; joining
the parts into the final file keeps each line index's first result only (a
bitmap: memory one bit a line, whatever the batch's size).
"""

from __future__ import annotations

from collections.abc import Iterator

from tokenfleet.shared.file_store import FileStore, read_lines

KINDS = ("out", "err")
JOIN_CHUNK = 1 << 20


def part_name(batch_id: str, kind: str, part: int) -> str:
    return f"batches/{batch_id}/{kind}/{part}.jsonl"


def write_part(store: FileStore, batch_id: str, kind: str, part: int,
               lines: list[tuple[int, bytes]]) -> None:
    """One part: each (line index, result line) as '<index> <line>' (blocking)."""
    store.put(part_name(batch_id, kind, part),
              (b"%d %s\n" % (index, line) for index, line in lines))


def joined(store: FileStore, batch_id: str, kind: str, parts: int, total: int
           ) -> Iterator[bytes]:
    """The parts 1..``parts`` of one kind as one file, each line index once, in
    the order the lines finished (blocking; streamed in chunks)."""
    seen = bytearray((total + 7) // 8)
    chunk = bytearray()
    for part in range(1, parts + 1):
        name = part_name(batch_id, kind, part)
        if not store.exists(name):
            continue  # this part had no line of this kind
        for line in read_lines(store, name):
            head, _, result = line.partition(b" ")
            index = int(head)
            byte, bit = divmod(index, 8)
            if seen[byte] & (1 << bit):
                continue  # written again after a crash: the first one stands
            seen[byte] |= 1 << bit
            chunk += result + b"\n"
            if len(chunk) >= JOIN_CHUNK:
                yield bytes(chunk)
                chunk.clear()
    if chunk:
        yield bytes(chunk)


def delete_parts(store: FileStore, batch_id: str, parts: int) -> None:
    """Remove the batch's parts once its files are written (blocking)."""
    for part in range(1, parts + 1):
        for kind in KINDS:
            store.delete(part_name(batch_id, kind, part))
    store.delete(f"batches/{batch_id}")  # the emptied folder of a directory store
