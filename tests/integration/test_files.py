"""OpenAI's Files API on the gateway, driven by the official ``openai`` client,
with the files in a directory and on S3 (moto's, on a free port)."""

from __future__ import annotations

import time
import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import pytest
import redis

from tokenfleet.files import records as files
from tokenfleet.shared.wire.api_keys import create_key, new_key
from tokenfleet.shared.file_store import store_for
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.s3_store import S3Store
from tokenfleet.shared.wire.schemas import ApiKey

from gateway_server import gateways, port_of
from helpers import wait_until

pytestmark = pytest.mark.timeout(60)

LINE = b'{"custom_id": "r%d", "method": "POST", "url": "/v1/completions", "body": {}}\n'


def jsonl(lines: int) -> bytes:
    return b"".join(LINE % i for i in range(lines))


@pytest.fixture(params=["directory", "s3"])
def files_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "directory":
        return (tmp_path / "files").as_uri()
    url: str = request.getfixturevalue("s3_url")
    return url


@pytest.fixture
def gateway(settings: Any, r: redis.Redis, files_url: str) -> Iterator[SimpleNamespace]:
    """A gateway that asks for keys, its files at ``files_url``; ``client(tenant)``
    is an OpenAI client with a new key of that tenant."""
    keys = Keys(settings.namespace)

    def client(tenant: str) -> openai.OpenAI:
        key, key_id = new_key()
        create_key(r, keys, ApiKey(key_id=key_id, tenant=tenant, created_at=time.time()), key)
        base_url = f"http://127.0.0.1:{port_of(http)}/v1" if http else "http://unused"
        return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30)

    http: httpx.Client | None = None

    with gateways(settings) as start:
        client("bootstrap")  # a key exists before the gateway starts: it asks for keys
        http = start(files_url=files_url)
        yield SimpleNamespace(http=http, client=client, url=files_url)


def stored(url: str) -> list[str]:
    """Everything the store at ``url`` holds: object keys, and S3's unfinished uploads."""
    store = store_for(url)
    if isinstance(store, S3Store):
        listed = store.client.list_objects_v2(Bucket=store.bucket, Prefix=store.prefix)
        uploads = store.client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix)
        return ([item["Key"] for item in listed.get("Contents", [])]
                + [item["Key"] for item in uploads.get("Uploads", [])])
    root = Path(urlsplit(url).path)
    return [str(p) for p in root.rglob("*") if p.is_file()] if root.exists() else []


def test_a_file_uploads_reads_back_lists_and_deletes(gateway: SimpleNamespace) -> None:
    oa = gateway.client("acme")
    data = jsonl(4000)  # bigger than a request's body may be (TOKENFLEET_MAX_PAYLOAD_BYTES)
    assert len(data) > 256_000
    made = oa.files.create(file=("requests.jsonl", data), purpose="batch")
    assert made.id.startswith("file-") and made.object == "file"
    assert (made.bytes, made.filename, made.purpose) == (len(data), "requests.jsonl", "batch")
    assert oa.files.retrieve(made.id) == made
    listed = oa.files.list(purpose="batch")
    assert [f.id for f in listed.data] == [made.id]
    assert oa.files.content(made.id).read() == data
    assert oa.files.delete(made.id).deleted is True
    with pytest.raises(openai.NotFoundError, match="never uploaded, or deleted"):
        oa.files.retrieve(made.id)
    assert oa.files.list().data == []
    assert stored(gateway.url) == []


def test_the_content_is_served_as_jsonl_with_its_length(gateway: SimpleNamespace) -> None:
    oa = gateway.client("acme")
    made = oa.files.create(file=("a.jsonl", jsonl(3)), purpose="batch")
    response = gateway.http.get(f"/v1/files/{made.id}/content",
                                headers={"Authorization": f"Bearer {oa.api_key}"})
    assert response.headers["content-type"] == "application/jsonl"
    assert int(response.headers["content-length"]) == made.bytes == len(response.content)


def test_pages_of_the_list_follow_limit_after_and_order(gateway: SimpleNamespace) -> None:
    oa = gateway.client("acme")
    made = {oa.files.create(file=(f"{i}.jsonl", jsonl(1)), purpose="batch").id for i in range(3)}
    first = oa.files.list(limit=2)
    assert len(first.data) == 2 and first.has_more
    rest = oa.files.list(limit=2, after=first.data[-1].id)
    assert len(rest.data) == 1 and not rest.has_more
    newest_first = [f.id for f in first.data + rest.data]
    assert set(newest_first) == made
    assert [f.id for f in oa.files.list(order="asc").data] == newest_first[::-1]
    # The client's own paging reads them all.
    assert [f.id for f in oa.files.list(limit=1)] == newest_first


def test_an_upload_over_the_limits_is_a_400_naming_it_and_keeps_nothing(
        gateway: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(files, "MAX_FILE_BYTES", 20_000)
    monkeypatch.setattr(files, "MAX_BATCH_LINES", 50)
    oa = gateway.client("acme")
    with pytest.raises(openai.BadRequestError, match="over 20000 bytes") as too_big:
        oa.files.create(file=("big.jsonl", b"x" * 19_999 + b"\n" + jsonl(10)), purpose="batch")
    assert too_big.value.param == "file"
    with pytest.raises(openai.BadRequestError, match="over 50 lines"):
        oa.files.create(file=("long.jsonl", jsonl(51)), purpose="batch")
    # A declared body past the file limit and its form is refused before it is read.
    declared = gateway.http.post(
        "/v1/files", headers={"Authorization": f"Bearer {oa.api_key}"},
        files={"file": ("big.jsonl", b"x" * 100_000)}, data={"purpose": "batch"})
    assert declared.status_code == 400 and "the most an upload may send" in declared.text
    assert oa.files.list().data == []
    assert stored(gateway.url) == []
    assert oa.files.create(file=("ok.jsonl", jsonl(50)), purpose="batch").bytes == len(jsonl(50))


def test_a_wrong_or_missing_purpose_or_file_is_a_400(gateway: SimpleNamespace) -> None:
    oa = gateway.client("acme")
    with pytest.raises(openai.BadRequestError, match="must be 'batch'") as wrong:
        oa.files.create(file=("a.jsonl", jsonl(2)), purpose="fine-tune")
    assert wrong.value.param == "purpose"
    auth = {"Authorization": f"Bearer {oa.api_key}"}
    # The file first, its purpose after it (as some clients send a form): checked,
    # and the file written meanwhile removed.
    boundary = "b" + uuid.uuid4().hex
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
            f'filename="a.jsonl"\r\n\r\n').encode() + jsonl(2) + (
            f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n'
            f'assistants\r\n--{boundary}--\r\n').encode()
    late = gateway.http.post("/v1/files", content=body, headers={
        **auth, "Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert late.status_code == 400 and late.json()["error"]["param"] == "purpose"
    missing = gateway.http.post("/v1/files", headers=auth, files={"file": ("a.jsonl", b"{}\n")})
    assert missing.status_code == 400 and "purpose: missing" in missing.text
    no_file = gateway.http.post("/v1/files", headers=auth, data={"purpose": "batch"},
                                files={"other": ("x", b"")})
    assert no_file.status_code == 400 and "file: missing" in no_file.text
    not_a_form = gateway.http.post("/v1/files", headers=auth, json={"purpose": "batch"})
    assert not_a_form.status_code == 400 and "multipart/form-data" in not_a_form.text
    assert stored(gateway.url) == []


def test_another_tenants_file_is_a_404(gateway: SimpleNamespace) -> None:
    mine, theirs = gateway.client("team-a"), gateway.client("team-b")
    made = mine.files.create(file=("a.jsonl", jsonl(2)), purpose="batch")
    for read in (theirs.files.retrieve, theirs.files.content, theirs.files.delete):
        with pytest.raises(openai.NotFoundError):
            read(made.id)
    assert theirs.files.list().data == []
    assert mine.files.retrieve(made.id) == made  # untouched by the other's delete
    with pytest.raises(openai.NotFoundError):
        mine.files.retrieve("file-" + "0" * 24)


def test_every_files_route_asks_for_a_key(gateway: SimpleNamespace) -> None:
    routes = [("POST", "/v1/files"), ("GET", "/v1/files"), ("GET", "/v1/files/file-x"),
              ("DELETE", "/v1/files/file-x"), ("GET", "/v1/files/file-x/content")]
    for method, path in routes:
        response = gateway.http.request(method, path)
        assert response.status_code == 401, (method, path)
        assert response.json()["error"]["code"] == "invalid_api_key"


def test_a_client_that_leaves_mid_upload_leaves_nothing(gateway: SimpleNamespace) -> None:
    key = gateway.client("acme").api_key

    def body() -> Iterator[bytes]:
        yield (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
               b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n')
        yield jsonl(100)
        raise ConnectionAbortedError("the client went away")

    with pytest.raises((ConnectionAbortedError, httpx.HTTPError)):
        gateway.http.post("/v1/files", content=body(), headers={
            "Authorization": f"Bearer {key}", "Content-Type": "multipart/form-data; boundary=b"})
    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port_of(gateway.http)}/v1", api_key=key,
                       max_retries=0)
    # The gateway notices the disconnect on its own time.
    wait_until(lambda: stored(gateway.url) == [], timeout=10, what="the half upload removed")
    assert oa.files.list().data == []


@pytest.mark.parametrize("files_url", ["directory"], indirect=True)
def test_a_20_mb_upload_streams_through_the_gateway_in_bounded_memory(
        gateway: SimpleNamespace) -> None:
    # The directory store: S3's own bound (a few parts) is tests/test_file_store.py's.
    key = gateway.client("acme").api_key
    block = b"x" * ((64 << 10) - 1) + b"\n"
    blocks = 20 * 1000 * 1000 // len(block) + 1

    def body() -> Iterator[bytes]:  # sent as it is made: the client holds one block
        yield (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
               b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n')
        for _ in range(blocks):
            yield block
        yield b"\r\n--b--\r\n"

    tracemalloc.start()
    try:
        response = gateway.http.post("/v1/files", content=body(), headers={
            "Authorization": f"Bearer {key}", "Content-Type": "multipart/form-data; boundary=b"})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert response.status_code == 200, response.text
    assert response.json()["bytes"] == blocks * len(block) > 20_000_000
    assert peak < 4 << 20, peak  # the gateway and the client together, for a 20 MB file
