"""Where uploaded files and batch outputs live: a directory or S3-compatible storage.

Redis holds a batch's state and counters; the JSONL itself (up to 200 MB a
file) lives here, named by the store's callers (``files/<file id>``,
``batches/<batch id>/...``). The store is synchronous (object storage clients
are); async callers run it in a thread. Writes take an iterable of chunks, so
a file is never held whole in memory, and reads give one back.

``store_for(url)`` is the one store of a URL in a process: the gateway's routes
and the batch driver share it (and, for S3, its connection pool).
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlsplit

READ_CHUNK = 1 << 20
# The store of a host's service (its account, a container's volume), where
# this process may write; else the user's own (``default_files_url``).
SYSTEM_DIR = Path("/var/lib/tokenfleet/files")


def default_files_url() -> str:
    """``file:///var/lib/tokenfleet/files`` where this user may write it, else
    the user's data directory (``$XDG_DATA_HOME/tokenfleet/files``, or
    ``~/.local/share/tokenfleet/files``)."""
    if _may_create(SYSTEM_DIR):
        return SYSTEM_DIR.as_uri()
    base = os.environ.get("XDG_DATA_HOME", "")
    if not os.path.isabs(base):  # unset, or relative: the spec says to ignore it
        try:
            base = str(Path.home() / ".local" / "share")
        except RuntimeError:  # no home directory to be found: the service's path
            return SYSTEM_DIR.as_uri()
    return (Path(base) / "tokenfleet" / "files").as_uri()


def _may_create(path: Path) -> bool:
    """Whether ``path`` is, or can be made, a directory this process writes in:
    its nearest existing ancestor is a directory it may write."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


class StoreUnwritable(OSError):
    """The file store's directory cannot be written by this process."""

    def __init__(self, root: Path, exc: OSError) -> None:
        self.root, self.reason = root, exc.strerror or type(exc).__name__
        super().__init__(f"{self.where()}: set TOKENFLEET_FILES_URL to "
                         "file:///a/directory/this/user/can/write or s3://bucket/prefix")

    def where(self) -> str:
        """What cannot be written, and why."""
        return (f"the file store {self.root.as_uri()} cannot be written: {self.root} "
                f"({self.reason})")


class FileStore(Protocol):
    """A flat namespace of immutable objects, written whole and read as a stream."""

    def put(self, name: str, chunks: Iterable[bytes]) -> int:
        """Write ``name`` from ``chunks`` (replacing it whole, never seen half
        written) and return its size in bytes."""
        ...

    def read(self, name: str) -> Iterator[bytes]:
        """The bytes of ``name`` in chunks; FileNotFoundError if there is none."""
        ...

    def delete(self, name: str) -> None:
        """Remove ``name``; nothing happens if it is not there."""
        ...

    def exists(self, name: str) -> bool:
        ...


class Overlong(bytes):
    """A line longer than its reader's limit, in its place: empty, never its
    bytes (they were skipped as they streamed), with how long it was."""

    size: int
    limit: int

    def __new__(cls, size: int, limit: int) -> Overlong:
        line = super().__new__(cls)
        line.size, line.limit = size, limit
        return line


def read_lines(store: FileStore, name: str, max_line: int | None = None) -> Iterator[bytes]:
    """The lines of ``name`` without their line ends, streamed: the file is
    opened now (FileNotFoundError here, not at the first line). A line of more
    than ``max_line`` bytes comes as an ``Overlong``: it is counted as it
    streams and never held, so memory is the longest line allowed, not the
    longest line sent."""
    return _lines(store.read(name), max_line)


def _lines(chunks: Iterator[bytes], max_line: int | None) -> Iterator[bytes]:
    most = max_line if max_line is not None else -1
    rest = bytearray()  # the line so far, when it began in an earlier chunk
    skipped = 0  # the length so far of an overlong line being skipped; 0: none
    for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            length = skipped + len(rest) + end - start
            if skipped or 0 <= most < length:
                yield Overlong(length, most)
            elif rest:
                rest += chunk[start:end]
                yield bytes(rest).removesuffix(b"\r")
            else:
                yield chunk[start:end].removesuffix(b"\r")
            rest.clear()
            skipped = 0
            start = end + 1
        tail = len(chunk) - start
        if skipped or 0 <= most < len(rest) + tail:
            skipped += len(rest) + tail
            rest.clear()
        else:
            rest += chunk[start:]
    if skipped:
        yield Overlong(skipped, most)
    elif rest:
        yield bytes(rest).removesuffix(b"\r")


def checked_name(name: str) -> str:
    """``name`` if it is a store name: ``/``-separated parts, none empty, ``.`` or ``..``."""
    if not name or any(p in ("", ".", "..") for p in name.split("/")):
        raise ValueError(f"not a store name: {name!r}")
    return name


class DirectoryStore:
    """Objects as files under one directory (a shared volume for several gateways).

    A write goes to a temporary file beside its target and is renamed into
    place, so a reader (or a crash) never sees half a file.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def _path(self, name: str) -> Path:
        return self.root.joinpath(*checked_name(name).split("/"))

    def put(self, name: str, chunks: Iterable[bytes]) -> int:
        path = self._path(name)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".part-")
        except OSError as exc:  # not a disk full (that comes later): the directory
            raise StoreUnwritable(self.root, exc) from exc
        size = 0
        try:
            with os.fdopen(fd, "wb") as out:
                for chunk in chunks:
                    out.write(chunk)
                    size += len(chunk)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return size

    def read(self, name: str) -> Iterator[bytes]:
        path = self._path(name)
        # Opened here, not on the first next(), so a missing file raises at the call.
        handle = path.open("rb")

        def chunks() -> Iterator[bytes]:
            with handle:
                while chunk := handle.read(READ_CHUNK):
                    yield chunk

        return chunks()

    def delete(self, name: str) -> None:
        path = self._path(name)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()


def open_store(url: str) -> FileStore:
    """The store a ``TOKENFLEET_FILES_URL`` names: ``file:///dir`` or ``s3://bucket/prefix``."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"files_url: a file:// URL names a local directory, got {url!r}")
        return DirectoryStore(unquote(parts.path))
    if parts.scheme == "s3":
        if not parts.netloc:
            raise ValueError(f"files_url: an s3:// URL names a bucket, got {url!r}")
        from tokenfleet.shared.s3_store import S3Store  # boto3 only where s3:// is used
        return S3Store(parts.netloc, unquote(parts.path))
    raise ValueError(f"files_url must be file:///dir or s3://bucket/prefix, got {url!r}")


@functools.lru_cache(maxsize=16)
def store_for(url: str) -> FileStore:
    """The store of ``url``, made once per process (stores are thread-safe)."""
    return open_store(url)
