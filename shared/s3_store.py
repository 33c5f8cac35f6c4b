"""The file store on S3-compatible object storage (``s3://bucket/prefix``).

Where the storage is comes from boto3's own settings, not from tokenfleet's:
``AWS_ENDPOINT_URL_S3`` (or ``AWS_ENDPOINT_URL``) for MinIO, Cloudflare R2, Ceph
or any other S3-compatible service (unset: AWS itself), and the credentials
from AWS's usual chain (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, a
profile, an instance or pod role), the region from ``AWS_DEFAULT_REGION``.

A write is a multipart upload in parts of ``part_bytes`` (8 MiB), so memory
stays bounded whatever the object's size; an object smaller than one part goes
in a single PUT. The object appears only when the upload completes, whole; an
upload that fails (or is refused by the caller's checks) is aborted, so the
storage keeps none of its parts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from tokenfleet.shared.file_store import READ_CHUNK, checked_name

# S3 asks at least 5 MiB of every part but the last.
PART_BYTES = 8 << 20
# Keys one DeleteObjects request may name.
DELETE_BATCH = 1000
# Threads of one process (uploads and reads running side by side) share the
# client's connections; boto3's default of 10 would make the eleventh wait.
MAX_CONNECTIONS = 32
MISSING = frozenset({"NoSuchKey", "404", "NotFound"})


def s3_client() -> Any:
    """A client configured as boto3 reads its environment (endpoint, credentials)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:  # the bare install has no boto3
        raise ValueError("files_url: s3:// needs boto3: pip install 'tokenfleet[s3]'") from exc
    # A session of its own: boto3's default session is not thread-safe, a client is.
    return boto3.session.Session().client(
        "s3", config=Config(max_pool_connections=MAX_CONNECTIONS,
                            retries={"mode": "standard"}))


def _missing(exc: Exception) -> bool:
    error = getattr(exc, "response", {}).get("Error", {})
    return str(error.get("Code", "")) in MISSING


class S3Store:
    """Objects under ``prefix`` in ``bucket``; the store's name ``a/b`` is the key
    ``<prefix>/a/b``. ``client`` defaults to one made from the environment."""

    def __init__(self, bucket: str, prefix: str = "", *, client: Any = None,
                 part_bytes: int = PART_BYTES) -> None:
        self.bucket = bucket
        prefix = prefix.strip("/")
        self.prefix = f"{prefix}/" if prefix else ""
        self.client = client if client is not None else s3_client()
        self.part_bytes = part_bytes

    def _key(self, name: str) -> str:
        return self.prefix + checked_name(name)

    def put(self, name: str, chunks: Iterable[bytes]) -> int:
        key = self._key(name)
        buffer = bytearray()
        size = 0
        upload: _Upload | None = None
        try:
            for chunk in chunks:
                buffer += chunk
                size += len(chunk)
                while len(buffer) >= self.part_bytes:
                    if upload is None:
                        upload = _Upload(self.client, self.bucket, key)
                    with memoryview(buffer) as view:
                        part = bytes(view[:self.part_bytes])
                    del buffer[:self.part_bytes]
                    upload.add(part)
            if upload is None:
                self.client.put_object(Bucket=self.bucket, Key=key, Body=bytes(buffer))
            else:
                if buffer:  # the last part may be short
                    upload.add(bytes(buffer))
                upload.complete()
        except BaseException:
            # A refused or broken upload leaves nothing: S3 would keep (and bill)
            # the parts of an upload neither completed nor aborted.
            if upload is not None:
                upload.abort()
            raise
        return size

    def read(self, name: str) -> Iterator[bytes]:
        # Requested here, not on the first next(), so a missing key raises at the call.
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"]
        except Exception as exc:
            if _missing(exc):
                raise FileNotFoundError(f"no object {name!r} in the file store") from exc
            raise

        def chunks() -> Iterator[bytes]:
            with contextlib.closing(body):
                yield from body.iter_chunks(READ_CHUNK)

        return chunks()

    def delete(self, name: str) -> None:
        # As the directory store removes a folder: the object, and any under ``name/``.
        key = self._key(name)
        self.client.delete_object(Bucket=self.bucket, Key=key)
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=key + "/", PaginationConfig={"PageSize": DELETE_BATCH})
        for page in pages:
            objects = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if objects:
                self.client.delete_objects(Bucket=self.bucket,
                                           Delete={"Objects": objects, "Quiet": True})

    def exists(self, name: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(name))
        except Exception as exc:
            if _missing(exc):
                return False
            raise
        return True


class _Upload:
    """One multipart upload, its parts numbered in the order they are added."""

    def __init__(self, client: Any, bucket: str, key: str) -> None:
        self.client, self.bucket, self.key = client, bucket, key
        self.id: str = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        self.parts: list[dict[str, Any]] = []

    def add(self, data: bytes) -> None:
        number = len(self.parts) + 1
        answer = self.client.upload_part(Bucket=self.bucket, Key=self.key, UploadId=self.id,
                                         PartNumber=number, Body=data)
        self.parts.append({"PartNumber": number, "ETag": answer["ETag"]})

    def complete(self) -> None:
        self.client.complete_multipart_upload(Bucket=self.bucket, Key=self.key,
                                              UploadId=self.id,
                                              MultipartUpload={"Parts": self.parts})

    def abort(self) -> None:
        # The error that brought us here is the one to raise, not one of the abort's.
        with contextlib.suppress(Exception):
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key,
                                               UploadId=self.id)
