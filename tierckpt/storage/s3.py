"""An S3-compatible bucket as a byte store, through obstore (Rust ``object_store``, native asyncio).

Why obstore: its async calls run on the engine's own event loop with no thread per request, a data
object is one multipart upload whose parts go up ``concurrency`` at a time while the writer threads
encode the next chunks, and a restore's 16 MiB window (:mod:`tierckpt.storage.coalesce`) is one ranged
GET (``get_range``) that releases the GIL while it waits. Measured against the local SeaweedFS server in ``benchmarks/object_store.py``.

:class:`Bucket` is the prefix ``s3://bucket/prefix`` of a tier: every key here is relative to it. It
is the read half of a byte store (what the CLI and export read through);
:class:`~tierckpt.storage.s3store.BucketStore` is the whole store a tier writes through. This module
moves bytes and turns the client's errors into ``OSError`` s naming the object's URL and the HTTP
status (:class:`ObjectStoreError`; a missing object is ``FileNotFoundError``), which the flusher turns
into a :class:`~tierckpt.errors.FlushError` naming tier and step.

Credentials (never from the YAML): ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``
(``AWS_SESSION_TOKEN``), else the profile ``AWS_PROFILE`` (or ``default``) of the AWS credentials and
config files, else the client's own chain (web identity, container and instance metadata) unless
``AWS_EC2_METADATA_DISABLED=true``, in which case requests go unsigned (anonymous access).
Throttling (503 SlowDown), 5xx answers, timeouts and connection resets are retried by the client
with exponential backoff and jitter, ``retries`` times within ``timeout``.
"""

from __future__ import annotations

import configparser
import datetime
import errno
import os
import re
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import obstore
from obstore.store import S3Store

from tierckpt._buffers import copy_bytes
from tierckpt.config import TierConfig
from tierckpt.errors import CorruptCheckpointError
from tierckpt.storage.plan import WriteItem, WritePlan
from tierckpt.storage.s3uploads import Signer, abort_upload, list_uploads
from tierckpt.storage.coalesce import SMALL, CoalescingReader, group_spans, window_spans
from tierckpt.storage.store import DataWriter, RangeReader, ReadableStore, TooLarge

__all__ = ["Bucket", "ObjectStoreError", "S3DataWriter", "S3Reader", "credentials", "store_error"]

_STATUS = re.compile(r"status code: (\d{3})(?: ([A-Za-z ]+))?")
_CODE = re.compile(r"<Code>([A-Za-z]+)</Code>")
_TRUE = ("1", "true", "yes", "on")


class ObjectStoreError(OSError):
    """A request the store refused or never answered: ``filename`` is the object's URL, ``status`` the
    HTTP status (None: no answer), ``code`` the S3 error code (``SlowDown``, ``NoSuchBucket``...)."""

    def __init__(self, message: str, url: str, *, status: int | None = None, code: str | None = None, err: int = errno.EIO) -> None:
        super().__init__(err, message, url)
        self.status = status
        self.code = code


def store_error(exc: BaseException, url: str, doing: str) -> OSError:
    """``exc`` (an obstore error) as an OSError naming ``url``, what was being done and the HTTP status."""
    text = str(exc)
    if isinstance(exc, FileNotFoundError):
        return FileNotFoundError(errno.ENOENT, f"{doing}: no such object", url)
    found = _STATUS.search(text)
    code = _CODE.search(text)
    status = int(found.group(1)) if found else None
    if status is not None:
        reason = f"HTTP {status}{' ' + found.group(2).strip() if found and found.group(2) else ''}{f' ({code.group(1)})' if code else ''}"
    else:
        reason = text.split("\n", 1)[0].split(" - ")[-1].strip()[:200] or type(exc).__name__
        reason = f"no answer: {reason}"
    err = errno.EACCES if status in (401, 403) else errno.EIO
    return ObjectStoreError(f"{doing} failed: {reason}", url, status=status, code=code.group(1) if code else None, err=err)


def _profile_keys(env: Mapping[str, str]) -> dict[str, str]:
    """The profile's keys from the AWS credentials file, then the config file (``[profile name]``)."""
    profile = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
    home = Path(env.get("HOME", "~")).expanduser()
    files = [
        (Path(env.get("AWS_SHARED_CREDENTIALS_FILE", home / ".aws" / "credentials")), profile),
        (Path(env.get("AWS_CONFIG_FILE", home / ".aws" / "config")), profile if profile == "default" else f"profile {profile}"),
    ]
    for path, section in files:
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(path)
        except (OSError, configparser.Error):
            continue
        if parser.has_option(section, "aws_access_key_id") and parser.has_option(section, "aws_secret_access_key"):
            keys = {"access_key_id": parser.get(section, "aws_access_key_id"), "secret_access_key": parser.get(section, "aws_secret_access_key")}
            if parser.has_option(section, "aws_session_token"):
                keys["session_token"] = parser.get(section, "aws_session_token")
            return keys
    return {}


def credentials(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The client's credential settings, found the standard way (see the module docstring)."""
    env = os.environ if env is None else env
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        keys = {"access_key_id": env["AWS_ACCESS_KEY_ID"], "secret_access_key": env["AWS_SECRET_ACCESS_KEY"]}
        if env.get("AWS_SESSION_TOKEN"):
            keys["session_token"] = env["AWS_SESSION_TOKEN"]
        return keys
    keys = _profile_keys(env)
    if keys:
        return keys
    if env.get("AWS_EC2_METADATA_DISABLED", "").lower() in _TRUE:
        return {"skip_signature": True}  # no credentials anywhere, and no metadata service: anonymous
    return {}  # the client's own chain: web identity, container credentials, instance metadata


class Bucket(ReadableStore):
    """The prefix ``config.url`` of a bucket: its keys, and the requests on them (see the module docstring)."""

    noun = "object"

    def __init__(self, config: TierConfig) -> None:
        assert config.url is not None  # guaranteed by TierConfig validation
        self.url = config.url.rstrip("/")
        bucket, _, prefix = self.url[len("s3://"):].partition("/")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.endpoint = config.endpoint
        self.part_size = config.part_size
        self.concurrency = config.concurrency
        region = config.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        options: dict[str, Any] = {"timeout": f"{max(1, int(config.timeout_s))}s", "connect_timeout": "5s"}
        keys = credentials()
        settings: dict[str, Any] = {"region": region, **keys}
        self.signer = Signer.of(config.endpoint, region, keys)  # for what obstore has no call for
        if config.endpoint is not None:
            settings["endpoint"] = config.endpoint.rstrip("/")
            options["allow_http"] = config.endpoint.startswith("http://")
        retry = {
            "max_retries": config.retries,
            "retry_timeout": datetime.timedelta(seconds=config.timeout_s),
            "backoff": {"init_backoff": datetime.timedelta(milliseconds=100), "max_backoff": datetime.timedelta(seconds=5), "base": 2.0},
        }
        self.store = S3Store(bucket, prefix=self.prefix or None, client_options=options, retry_config=retry, **settings)  # type: ignore[arg-type]
        self.direct = False

    def url_of(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    async def listing(self, under: str = "") -> dict[str, int]:
        """Every object under ``under`` (a key prefix ending in ``/``, or the whole prefix): key -> size."""
        found: dict[str, int] = {}
        try:
            async for batch in obstore.list(self.store, under or None, chunk_size=1000):
                for meta in batch:
                    found[meta["path"]] = meta["size"]
        except Exception as exc:
            raise store_error(exc, self.url_of(under), "listing") from exc
        return found

    def keys_under(self, under: str) -> list[str]:
        """:meth:`listing`'s keys, blocking (from a worker thread)."""
        try:
            return [meta["path"] for batch in obstore.list(self.store, under or None, chunk_size=1000) for meta in batch]
        except Exception as exc:
            raise store_error(exc, self.url_of(under), "listing") from exc

    def _whole(self, key: str, size: int, limit: int) -> None:
        if size > limit:
            raise TooLarge(size, limit)

    async def get(self, key: str, limit: int) -> bytes:
        """Object ``key`` whole, refused when it has more than ``limit`` bytes."""
        try:
            result = await obstore.get_async(self.store, key)
        except Exception as exc:
            raise store_error(exc, self.url_of(key), "reading") from exc
        self._whole(key, result.meta["size"], limit)
        try:
            return bytes(await result.bytes_async())
        except Exception as exc:
            raise store_error(exc, self.url_of(key), "reading") from exc

    def read_small(self, key: str, limit: int) -> bytes:
        """:meth:`get`, blocking (from a worker thread)."""
        try:
            result = obstore.get(self.store, key)
        except Exception as exc:
            raise store_error(exc, self.url_of(key), "reading") from exc
        self._whole(key, result.meta["size"], limit)
        try:
            return bytes(result.bytes())
        except Exception as exc:
            raise store_error(exc, self.url_of(key), "reading") from exc

    async def put(self, key: str, data: bytes, *, create: bool = False, etag: str | None = None) -> str | None:
        """Write object ``key`` in one request (atomic: whole or not at all); returns its ETag.

        ``create``: only if there is none (FileExistsError otherwise); ``etag``: only over that version
        of it (FileExistsError when it changed since).
        """
        mode: Any = "create" if create else ({"e_tag": etag} if etag is not None else "overwrite")
        try:
            result = await obstore.put_async(self.store, key, data, mode=mode, use_multipart=False)
        except (obstore.exceptions.AlreadyExistsError, obstore.exceptions.PreconditionError) as exc:
            raise FileExistsError(errno.EEXIST, "written by someone else meanwhile", self.url_of(key)) from exc
        except Exception as exc:
            raise store_error(exc, self.url_of(key), f"writing {len(data)} bytes") from exc
        return result.get("e_tag")

    async def head(self, key: str) -> dict[str, Any]:
        try:
            return dict(await obstore.head_async(self.store, key))
        except Exception as exc:
            raise store_error(exc, self.url_of(key), "looking up") from exc

    async def delete(self, keys: Sequence[str]) -> None:
        """Remove ``keys`` (a batch request per thousand); a key already gone is no error."""
        for start in range(0, len(keys), 1000):
            batch = keys[start:start + 1000]
            try:
                await obstore.delete_async(self.store, batch)
            except FileNotFoundError:
                continue
            except Exception as exc:
                raise store_error(exc, self.url_of(batch[0]), f"deleting {len(batch)} object(s) from") from exc

    def abort_uploads(self, under: str, timeout: float = 30.0) -> int | None:
        """Abort the incomplete multipart uploads of keys under ``under`` (blocking); how many, or None
        when there are no credentials in hand to sign the requests with (see :mod:`~tierckpt.storage.s3uploads`)."""
        if self.signer is None:
            return None
        full = f"{self.prefix}/{under}" if self.prefix else under
        uploads = list_uploads(self.signer, self.bucket, full, timeout=timeout)
        for upload in uploads:
            abort_upload(self.signer, self.bucket, upload, timeout=timeout)
        return len(uploads)

    def open_data(self, key: str, plan: WritePlan) -> S3DataWriter:
        return S3DataWriter(self, key, plan)

    def open_reader(
        self, key: str, *, size: int | None = None, spans: Sequence[tuple[int, int]] = (), every_chunk: bool = True, direct: bool = False
    ) -> RangeReader:
        """Ranged GETs of ``key``: in fixed 16 MiB windows when every chunk is read (the raw client's
        GETs), else a GET per chunk with the chunks under 1 MiB together, so that a GET fetches little
        that nothing reads (:mod:`tierckpt.storage.coalesce`). No HEAD when ``size`` is given."""
        if size is None:
            try:
                size = int(obstore.head(self.store, key)["size"])
            except Exception as exc:
                raise store_error(exc, self.url_of(key), "looking up") from exc
        reader = S3Reader(self, key, size)
        groups = window_spans(spans) if every_chunk else group_spans(spans, below=SMALL)
        return CoalescingReader(reader, groups, ahead=every_chunk) if groups else reader


class S3DataWriter(DataWriter):
    """A data object as one multipart upload: items are packed in the order they arrive (parts must go
    in order, so a fixed offset of the plan is only where the item would lie on a disk), the bytes
    copied (the client would upload the caller's buffer later, as it is then) into the client's part
    buffer, which uploads ``concurrency`` parts at a time.

    Nothing is visible before :meth:`finish` completes the upload; :meth:`close` without it aborts it.
    """

    def __init__(self, bucket: Bucket, key: str, plan: WritePlan) -> None:
        self.bucket, self.key = bucket, key
        self._offsets = [0] * len(plan.items)
        self._end = 0
        self._lock = threading.Lock()
        self._done = False
        self._failed: OSError | None = None
        self._writer = obstore.open_writer(bucket.store, key, buffer_size=bucket.part_size, max_concurrency=bucket.concurrency)

    def write(self, item: WriteItem, data: memoryview) -> None:
        with self._lock:  # appended in arrival order: the offset recorded is where the bytes go
            if self._failed is not None:
                raise self._failed
            offset = self._end
            try:
                # A copy: obstore keeps a reference to the buffer it is given and uploads it later, and
                # the caller reuses its buffer (a compressed chunk's scratch) once this returns.
                self._writer.write(bytes(data))
            except Exception as exc:
                self._failed = store_error(exc, self.bucket.url_of(self.key), f"uploading {data.nbytes} bytes at offset {offset} of")
                raise self._failed from exc
            self._end += data.nbytes
        self._offsets[item.index] = offset

    def finish(self) -> tuple[int, ...]:
        try:
            self._writer.close()  # the last part, then CompleteMultipartUpload: the object exists from here
        except Exception as exc:
            raise store_error(exc, self.bucket.url_of(self.key), f"completing the upload of {self._end} bytes to") from exc
        finally:
            self._done = True
        return tuple(self._offsets)

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            # An exception through the context manager aborts the multipart upload: no object appears.
            self._writer.__exit__(RuntimeError, RuntimeError("aborted"), None)
        except Exception:
            pass  # the unfinished upload is the server's to expire (see docs/object-storage.md: a lifecycle rule)


class S3Reader(RangeReader):
    """Ranged GETs of one object of ``size`` bytes (its size from the listing: no HEAD per object)."""

    def __init__(self, bucket: Bucket, key: str, size: int) -> None:
        self.bucket, self.key, self.size = bucket, key, size

    @property
    def direct(self) -> bool:
        return False

    def _get(self, offset: int, length: int, what: str) -> memoryview:
        if length == 0:
            return memoryview(b"")
        try:
            data = memoryview(obstore.get_range(self.bucket.store, self.key, start=offset, length=length))
        except Exception as exc:
            raise store_error(exc, self.bucket.url_of(self.key), f"reading {length} bytes at offset {offset} of") from exc
        if data.nbytes != length:
            raise CorruptCheckpointError(f"{what}: the object ends before byte {offset + length}")
        return data

    def read_span(self, offset: int, length: int, scratch: memoryview, *, what: str) -> memoryview:
        return self._get(offset, length, what)  # the client's own buffer: no copy

    def read_into(self, out: memoryview, offset: int, scratch: memoryview, *, what: str) -> None:
        copy_bytes(out.cast("B"), self._get(offset, out.nbytes, what).cast("B"))  # without the GIL

    def close(self) -> None:
        pass
