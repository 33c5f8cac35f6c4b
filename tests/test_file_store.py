"""The file store, on a directory and on S3 (moto's, on a free port): the same
contract from both, whole objects or none, and memory bounded whatever the size."""

from __future__ import annotations

import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenfleet.files.records import _Checked
from tokenfleet.shared import file_store
from tokenfleet.shared.file_store import (DirectoryStore, FileStore, Overlong, StoreUnwritable,
                                          default_files_url, open_store, read_lines, store_for)
from tokenfleet.shared.s3_store import S3Store

from helpers import S3_BUCKET, s3_client

pytestmark = pytest.mark.timeout(60)

PART = 1 << 20  # small parts (the test server allows them), so that 20 MB is many


@pytest.fixture(params=["directory", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> FileStore:
    if request.param == "directory":
        return DirectoryStore(tmp_path / "files")
    endpoint: str = request.getfixturevalue("s3_server")
    return S3Store(S3_BUCKET, f"t{uuid.uuid4().hex[:10]}", client=s3_client(endpoint),
                   part_bytes=PART)


def blocks(total: int, size: int = 64 << 10, fail_after: int | None = None) -> Iterator[bytes]:
    """``total`` bytes in chunks of ``size`` (one object, yielded again and again,
    so the source itself allocates nothing); raises after ``fail_after`` bytes."""
    block = b"x" * (size - 1) + b"\n"
    sent = 0
    while sent < total:
        if fail_after is not None and sent >= fail_after:
            raise OSError("the client went away")
        yield block
        sent += size


def test_an_object_reads_back_as_written_and_is_gone_once_deleted(store: FileStore) -> None:
    assert store.put("files/a", [b'{"n": 1}\n', b'{"n"', b": 2}"]) == 17
    assert store.exists("files/a")
    assert b"".join(store.read("files/a")) == b'{"n": 1}\n{"n": 2}'
    assert list(read_lines(store, "files/a")) == [b'{"n": 1}', b'{"n": 2}']
    assert store.put("files/a", [b"new"]) == 3  # replaced whole
    assert b"".join(store.read("files/a")) == b"new"
    store.delete("files/a")
    store.delete("files/a")  # a second delete is no error
    assert not store.exists("files/a")


def test_an_empty_object_is_an_object(store: FileStore) -> None:
    assert store.put("empty", []) == 0
    assert store.exists("empty") and b"".join(store.read("empty")) == b""


def test_deleting_a_folder_name_deletes_what_is_under_it(store: FileStore) -> None:
    for name in ("batches/b1/output", "batches/b1/errors", "batches/b2/output"):
        store.put(name, [name.encode()])
    store.delete("batches/b1")
    assert not store.exists("batches/b1/output") and not store.exists("batches/b1/errors")
    assert store.exists("batches/b2/output")


def test_reading_a_missing_object_raises_at_the_call(store: FileStore) -> None:
    with pytest.raises(FileNotFoundError):
        store.read("files/never")
    assert not store.exists("files/never")


@pytest.mark.parametrize("name", ["", "/a", "a//b", "../a", "a/./b"])
def test_a_name_that_could_leave_the_store_is_refused(store: FileStore, name: str) -> None:
    with pytest.raises(ValueError, match="not a store name"):
        store.put(name, [b"x"])


def test_a_refused_upload_leaves_nothing(store: FileStore, tmp_path: Path) -> None:
    # Past several parts, so that S3's multipart upload has begun.
    with pytest.raises(OSError, match="went away"):
        store.put("files/broken", blocks(8 * PART, fail_after=3 * PART))
    assert not store.exists("files/broken")
    if isinstance(store, S3Store):  # no parts kept (and billed) by the storage
        uploads = store.client.list_multipart_uploads(Bucket=S3_BUCKET, Prefix=store.prefix)
        assert uploads.get("Uploads", []) == []
    else:
        assert [p.name for p in (tmp_path / "files" / "files").iterdir()] == []


def test_a_20_mb_object_streams_through_in_bounded_memory(store: FileStore) -> None:
    total = 20 * 1000 * 1000
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        assert store.put("files/big", blocks(total)) >= total
        put_peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        read = sum(len(chunk) for chunk in store.read("files/big"))
        read_peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert read >= total
    # A part and its copy on the way out, a read chunk: a few MiB, not 20 MB.
    assert put_peak < 5 * PART, put_peak
    assert read_peak < 5 * PART, read_peak


def test_an_s3_url_opens_the_s3_store_at_its_prefix(s3_url: str) -> None:
    store = open_store(s3_url + "/inner/")
    assert isinstance(store, S3Store)
    assert store.bucket == S3_BUCKET and store.prefix.endswith("/inner/")
    store.put("files/a", [b"hello"])
    key = store.prefix + "files/a"
    assert store.client.get_object(Bucket=S3_BUCKET, Key=key)["Body"].read() == b"hello"


def test_store_for_gives_one_store_per_url(tmp_path: Path, s3_url: str) -> None:
    url = (tmp_path / "files").as_uri()
    assert store_for(url) is store_for(url)
    assert store_for(s3_url) is store_for(s3_url) is not store_for(url)


@pytest.mark.parametrize("url", ["s3://", "ftp://host/dir", "file://elsewhere/dir"])
def test_a_files_url_of_another_kind_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="files_url"):
        open_store(url)



class ChunkedStore:
    """A store of one object, read back in the chunks given (to cut lines anywhere)."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    def read(self, name: str) -> Iterator[bytes]:
        return iter(self.chunks)


def cut(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)])]


@given(lines=st.lists(st.binary(max_size=12).map(lambda b: b.replace(b"\n", b" ")), max_size=12),
       cuts=st.lists(st.integers(0, 200), max_size=8), max_line=st.integers(0, 10),
       newline_at_end=st.booleans())
def test_lines_read_in_any_chunks_are_the_files_lines_and_the_long_ones_only_counted(
    lines: list[bytes], cuts: list[int], max_line: int, newline_at_end: bool
) -> None:
    data = b"\n".join(lines) + (b"\n" if newline_at_end and lines else b"")
    store: Any = ChunkedStore(cut(data, cuts))
    expected = data.split(b"\n")
    if expected and expected[-1] == b"":
        expected.pop()  # a file's last newline ends its last line, it starts none
    read = list(read_lines(store, "x", max_line))
    assert len(read) == len(expected)
    for got, line in zip(read, expected):
        if len(line) > max_line:
            assert isinstance(got, Overlong) and got.size == len(line) and got == b""
        else:
            assert not isinstance(got, Overlong) and got == line.removesuffix(b"\r")


@given(lines=st.lists(st.sampled_from([b"", b" ", b"\t\r", b"{}", b" x ", b"ab"]), max_size=20),
       cuts=st.lists(st.integers(0, 100), max_size=8))
def test_an_upload_counts_only_the_lines_that_are_not_blank_however_it_is_cut(
    lines: list[bytes], cuts: list[int]
) -> None:
    checked = _Checked("batch", max_bytes=10_000, max_lines=10_000, max_line=100)
    for chunk in cut(b"\n".join(lines), cuts):
        checked.check(chunk)
    assert checked.lines == sum(1 for line in lines if line.strip())
def test_the_default_store_is_the_services_where_this_user_may_write_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(file_store, "SYSTEM_DIR", tmp_path / "lib" / "tokenfleet" / "files")
    assert default_files_url() == (tmp_path / "lib" / "tokenfleet" / "files").as_uri()


def test_else_the_default_store_is_in_the_users_data_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a-file").write_text("")  # nothing can be made under a file, even by root
    monkeypatch.setattr(file_store, "SYSTEM_DIR", tmp_path / "a-file" / "files")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    assert default_files_url() == (tmp_path / "home/.local/share/tokenfleet/files").as_uri()
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert default_files_url() == (tmp_path / "data/tokenfleet/files").as_uri()
    monkeypatch.setenv("XDG_DATA_HOME", "relative/data")  # not absolute: ignored, as the spec says
    assert default_files_url() == (tmp_path / "home/.local/share/tokenfleet/files").as_uri()


def test_a_directory_that_cannot_be_made_is_one_sentence_naming_the_store(
        tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    store = DirectoryStore(tmp_path / "a-file" / "files")
    with pytest.raises(StoreUnwritable) as refused:
        store.put("files/x", [b"data"])
    assert str(refused.value).startswith(
        f"the file store {(tmp_path / 'a-file' / 'files').as_uri()} cannot be written")
    assert "TOKENFLEET_FILES_URL" in str(refused.value)
