"""Where an output lives: a local directory, or a prefix in an S3-compatible object store.

The output code names the files of an output as paths. :func:`as_path` turns a location into one:
a :class:`pathlib.Path` for ``/local/dir``, an :class:`ObjectPath` for ``s3://bucket/prefix``.
``ObjectPath`` has the few path operations that code uses (``/``, ``name``, ``parent``, ``exists``,
``is_file``, ``is_dir``, ``iterdir``, ``read_bytes``, ``read_text``, ``write_bytes``, ``unlink``,
``replace``) and what a store adds: :meth:`ObjectPath.commit_bytes`, a put that succeeds only if
the object is unchanged since this process last read or wrote it (``If-Match`` on its ETag) or, when
it has not seen it, only if it does not exist (``If-None-Match: *``); :meth:`ObjectPath.create_bytes`,
a put of a new object only (``If-None-Match: *``); :meth:`ObjectPath.upload` of a
local file; reads through :func:`open_input` (the object downloaded whole, for a reader that checks
its checksum) or :func:`open_ranged` (ranged GETs of what is read, for the token loader and
``inspect``).

A store has no rename, so a shard is encoded into a local spool file (:func:`spool_file`, under
``HSX_SPOOL`` or the temp directory), uploaded under its hidden staging name, committed to the
manifest, and then copied to its visible name on the server (``replace``: copy, then delete).

Endpoint, region and credentials come from boto3's own chain only: ``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and ``~/.aws/config`` / ``credentials``; retries as
``AWS_MAX_ATTEMPTS`` / ``AWS_RETRY_MODE`` say. A location that carries credentials or options
(``s3://KEY:SECRET@bucket``, ``?endpoint_override=``) is refused: nothing secret is ever part of
a path, a message, the saved config or the manifest.
"""

from __future__ import annotations

import io
import os
import re
import tempfile
import threading
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

from hsx.errors import HsxError

SCHEMES = ("s3://",)
# any other "scheme://" (gs://, hf://, az://, http://): refused, not taken for a local folder named "gs:"
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class StoreError(HsxError, OSError):
    """The store could not be reached or refused a request; the message names the store and the object."""


class ConditionFailed(Exception):
    """A conditional put found the object changed (``If-Match``) or present (``If-None-Match``)."""


def is_remote(location) -> bool:
    return isinstance(location, ObjectPath) or (isinstance(location, str) and location.startswith(SCHEMES))


def as_path(location):
    """``location`` as a path: :class:`ObjectPath` for ``s3://...`` (or one already), else :class:`pathlib.Path`."""
    if isinstance(location, ObjectPath):
        return location
    if isinstance(location, str) and location.startswith(SCHEMES):
        bucket, key = _split(location)
        return ObjectPath(store_for(bucket), key)
    if isinstance(location, str) and _URI.match(location):
        if location.startswith("file://"):
            return Path(urlsplit(location).path)
        raise HsxError(f"{location}: hsx reads and writes local paths and s3:// locations (any S3-compatible "
                       f"store, through AWS_ENDPOINT_URL), not {_URI.match(location).group(1)}://: an output's "
                       "commit needs the store's conditional puts, which hsx implements and tests for S3 only")
    return Path(location)


def _split(uri: str) -> tuple[str, str]:
    parts = urlsplit(uri)
    if "@" in parts.netloc or parts.query or parts.fragment:
        # the location is saved in the run's config: it must not carry credentials or options
        raise HsxError("an s3:// location takes no credentials or options (s3://BUCKET/PREFIX); set the "
                       "endpoint and credentials through AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
                       "AWS_SECRET_ACCESS_KEY (or an AWS profile)")
    if not parts.netloc:
        raise HsxError(f"{uri}: no bucket (expected s3://BUCKET/PREFIX)")
    return parts.netloc, parts.path.strip("/")


def open_input(path, local):
    """A readable pyarrow file: ``local(str(path))`` (``pa.OSFile``, ``pa.memory_map``) for a local path; for an
    ObjectPath the same, on a local copy downloaded for this open (:meth:`ObjectStore.open_input`)."""
    if isinstance(path, ObjectPath):
        return path.store.open_input(path.key, local)
    return local(str(path))


def open_ranged(path, buffer_size: int = 8 << 20):
    """A readable, seekable pyarrow file that reads only the bytes asked for: ``pa.OSFile`` for a local path;
    for an ObjectPath, ranged GETs of ``buffer_size`` bytes or more (a Parquet reader then fetches the
    footer and the column chunks it reads, not the object)."""
    if isinstance(path, ObjectPath):
        return path.store.open_ranged(path.key, buffer_size)
    import pyarrow as pa

    return pa.OSFile(str(path))


def spool_file(path) -> Path:
    """The local file a shard destined for ``path`` is encoded into: ``path`` itself when it is local, else a
    new file in the spool directory (removed once uploaded, or by the writer's abort)."""
    if isinstance(path, ObjectPath):
        fd, name = tempfile.mkstemp(prefix="hsx-spool-", suffix=f"-{path.name}", dir=path.store.spool())
        os.close(fd)
        return Path(name)
    return Path(path)


SMALL_OBJECT = 8 << 20  # bytes: an object opened for reading that is at most this large comes in one GET
_STORES: dict[tuple, "ObjectStore"] = {}
_STORES_LOCK = threading.Lock()


def store_for(bucket: str) -> "ObjectStore":
    """One store object per bucket and client configuration in a process, so that the ETags it has
    seen (what a conditional put compares against) are shared by every path into it."""
    # keyed by process too: a client's connections must not be shared with a forked child (a DataLoader worker)
    env = (os.getpid(), *(os.environ.get(k) for k in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_PROFILE",
                                                       "AWS_REGION", "AWS_ACCESS_KEY_ID")))
    with _STORES_LOCK:
        store = _STORES.get((bucket, env))
        if store is None:
            store = _STORES[(bucket, env)] = ObjectStore(bucket)
        return store


class ObjectStore:
    """One bucket of an S3-compatible store, through boto3: puts, conditional puts, listings, copies,
    uploads and downloads."""

    def __init__(self, bucket: str):
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise HsxError("s3:// outputs need boto3: pip install 'hsx[s3]'") from None
        self.bucket = bucket
        self._session = boto3.session.Session()
        self.client = self._session.client("s3", config=Config(s3={"addressing_style": "path"}))
        self.endpoint = self.client.meta.endpoint_url
        self.etags: dict[str, str] = {}  # key -> the ETag this process last read or wrote
        self.lease = None  # the run's lease, checked before every commit (hsx.storage.lease)
        self._spool: Path | None = None

    def where(self, key: str) -> str:
        return f"s3://{self.bucket}/{key} (store {self.endpoint})"

    def _call(self, what: str, key: str, fn, *args, **kwargs):
        """Run one request, turning the client's failures into FileNotFoundError, ConditionFailed or StoreError."""
        import boto3.exceptions
        import botocore.exceptions as be

        try:
            return fn(*args, **kwargs)
        except be.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code"))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                raise ConditionFailed(self.where(key)) from None
            if code in ("NoSuchKey", "404", "NotFound"):
                raise FileNotFoundError(2, "no such object", self.where(key)) from None
            raise StoreError(f"{self.where(key)}: {what} refused: {code} (HTTP {status})") from None
        except (be.BotoCoreError, boto3.exceptions.Boto3Error) as e:
            raise StoreError(f"{self.where(key)}: {what} failed, the store did not answer ({e})") from None

    def _remember(self, key: str, etag: str | None) -> str | None:
        if etag:
            self.etags[key] = etag
        return etag

    def get(self, key: str) -> bytes:
        r = self._call("read", key, self.client.get_object, Bucket=self.bucket, Key=key)
        body = self._call("read", key, r["Body"].read)
        self._remember(key, r.get("ETag"))
        return body

    def get_with_age(self, key: str) -> tuple[bytes, str, float]:
        """The object, its ETag and its age in seconds by the server's clock (its ``Date`` minus ``Last-Modified``)."""
        r = self._call("read", key, self.client.get_object, Bucket=self.bucket, Key=key)
        body = self._call("read", key, r["Body"].read)
        now = parsedate_to_datetime(r["ResponseMetadata"]["HTTPHeaders"]["date"])
        return body, r["ETag"], (now - r["LastModified"]).total_seconds()

    def put(self, key: str, data: bytes, *, if_match: str | None = None, if_none_match: bool = False) -> str:
        extra = {"IfMatch": if_match} if if_match else {"IfNoneMatch": "*"} if if_none_match else {}
        try:
            r = self._call("write", key, self.client.put_object, Bucket=self.bucket, Key=key, Body=data, **extra)
        except FileNotFoundError:  # If-Match on an object deleted since: some stores say 404, others 412
            raise ConditionFailed(self.where(key)) from None
        return self._remember(key, r.get("ETag"))

    def upload(self, key: str, local: Path) -> None:
        self._call("upload", key, self.client.upload_file, str(local), self.bucket, key)
        self.etags.pop(key, None)

    def copy(self, src: str, dst: str) -> None:
        self._call("copy", src, self.client.copy_object, Bucket=self.bucket, Key=dst,
                   CopySource={"Bucket": self.bucket, "Key": src})

    def delete(self, key: str) -> None:
        self._call("delete", key, self.client.delete_object, Bucket=self.bucket, Key=key)
        self.etags.pop(key, None)

    def head(self, key: str) -> dict | None:
        try:
            return self._call("look up", key, self.client.head_object, Bucket=self.bucket, Key=key)
        except FileNotFoundError:
            return None

    def list(self, prefix: str) -> Iterator[tuple[str, bool]]:
        """(key, is a folder) one level below ``prefix`` (which ends with ``/`` or is empty)."""
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix, Delimiter="/")
        for page in self._call("list", prefix, list, pages):
            for p in page.get("CommonPrefixes", []):
                yield p["Prefix"].rstrip("/"), True
            for o in page.get("Contents", []):
                yield o["Key"], False

    def any_under(self, prefix: str) -> bool:
        r = self._call("list", prefix, self.client.list_objects_v2, Bucket=self.bucket, Prefix=prefix, MaxKeys=1)
        return r.get("KeyCount", 0) > 0

    def open_input(self, key: str, local):
        """Fetch the object into a spool file and open it with ``local``; the file is unlinked at once, so it
        lasts as long as the open file does. An object of at most ``SMALL_OBJECT`` bytes comes in one GET (a
        range from its start that turns out to hold all of it); a larger one in one download of parallel
        ranged GETs. Either way the reader then works on a local file as for a disk, not a request per read."""
        fd, tmp = tempfile.mkstemp(prefix="hsx-read-", dir=self.spool())
        os.close(fd)
        try:
            first = self._first_bytes(key)
            if first is not None:
                Path(tmp).write_bytes(first)
            else:  # larger: the transfer manager's parallel ranged GETs (its threads cost more than one GET)
                self._call("read", key, self.client.download_file, self.bucket, key, tmp)
            return local(tmp)
        finally:
            os.unlink(tmp)

    def _first_bytes(self, key: str) -> bytes | None:
        """The whole object if it holds at most ``SMALL_OBJECT`` bytes (one GET of a range from its start),
        else None."""
        import botocore.exceptions as be

        try:
            r = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes=0-{SMALL_OBJECT - 1}")
        except be.ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 416:  # an empty object has no range
                return b""
            return None  # the download says what is wrong (a missing object, a refusal), as before
        except be.BotoCoreError:
            return None
        total = r.get("ContentRange", "").rsplit("/", 1)[-1]
        if total.isdigit() and int(total) > SMALL_OBJECT:
            r["Body"].close()
            return None
        return self._call("read", key, r["Body"].read)

    def open_ranged(self, key: str, buffer_size: int = 8 << 20):
        """The object as a seekable pyarrow file read by ranged GETs (:class:`_RangedObject`)."""
        import pyarrow as pa

        info = self.head(key)
        if info is None:
            raise FileNotFoundError(2, "no such object", self.where(key))
        raw = _RangedObject(self, key, int(info["ContentLength"]), info.get("ETag"))
        return pa.PythonFile(io.BufferedReader(raw, buffer_size), mode="r")

    def get_range(self, key: str, start: int, stop: int, etag: str | None) -> bytes:
        """Bytes ``start..stop-1`` of an object; ``etag``: only of that version of it (a rewrite is an error)."""
        extra = {"IfMatch": etag} if etag else {}
        try:
            r = self._call("read", key, self.client.get_object, Bucket=self.bucket, Key=key,
                           Range=f"bytes={start}-{stop - 1}", **extra)
        except ConditionFailed:
            raise StoreError(f"{self.where(key)}: rewritten while it was being read") from None
        return self._call("read", key, r["Body"].read)

    def spool(self) -> Path:
        """Where shards are encoded before their upload, and downloaded for reading: ``HSX_SPOOL``, else
        the temp directory."""
        if self._spool is None:
            base = os.environ.get("HSX_SPOOL")
            if base:
                Path(base).mkdir(parents=True, exist_ok=True)
            self._spool = Path(base or tempfile.gettempdir())
        return self._spool


class _RangedObject(io.RawIOBase):
    """A read-only, seekable raw file over one version of an object: each read is one ranged GET."""

    def __init__(self, store: ObjectStore, key: str, size: int, etag: str | None):
        super().__init__()
        self.store, self.key, self.size, self.etag, self.pos = store, key, size, etag, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, b) -> int:
        n = min(len(b), self.size - self.pos)
        if n <= 0:
            return 0
        data = self.store.get_range(self.key, self.pos, self.pos + n, self.etag)
        if len(data) != n:
            raise StoreError(f"{self.store.where(self.key)}: asked for {n} bytes at {self.pos}, got {len(data)}")
        b[:n] = data
        self.pos += n
        return n


@dataclass(frozen=True)
class _Stat:
    st_size: int
    st_mtime: float


class ObjectPath:
    """An object (or a prefix of objects) in a store, with the path operations the output code uses."""

    __slots__ = ("store", "key", "_folder")

    def __init__(self, store: ObjectStore, key: str, folder: bool | None = None):
        self.store, self.key, self._folder = store, key.strip("/"), folder

    def __str__(self) -> str:
        return f"s3://{self.store.bucket}/{self.key}" if self.key else f"s3://{self.store.bucket}"

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __reduce__(self):
        # a copy in another process (a DataLoader worker, a Ray task) gets a client of its own
        return as_path, (str(self),)

    def __eq__(self, other) -> bool:
        return isinstance(other, ObjectPath) and (other.store, other.key) == (self.store, self.key)

    def __hash__(self) -> int:
        return hash((self.store.bucket, self.key))

    def __truediv__(self, name: str) -> "ObjectPath":
        return ObjectPath(self.store, f"{self.key}/{name}" if self.key else str(name))

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> "ObjectPath":
        return ObjectPath(self.store, self.key.rsplit("/", 1)[0] if "/" in self.key else "", folder=True)

    @property
    def parents(self) -> tuple:
        return ()  # no local folder lies above an object

    def resolve(self) -> "ObjectPath":
        return self

    def expanduser(self) -> "ObjectPath":
        return self

    def _prefix(self) -> str:
        return f"{self.key}/" if self.key else ""

    def is_file(self) -> bool:
        if self._folder is not None:
            return not self._folder
        return self.store.head(self.key) is not None

    def is_dir(self) -> bool:
        if self._folder is not None:
            return self._folder
        return self.store.any_under(self._prefix())

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def stat(self) -> _Stat:
        info = self.store.head(self.key)
        if info is None:
            raise FileNotFoundError(2, "no such object", self.store.where(self.key))
        return _Stat(int(info["ContentLength"]), info["LastModified"].timestamp())

    def iterdir(self, startswith: str = "") -> Iterator["ObjectPath"]:
        """The objects and folders one level below this prefix (those whose names start with ``startswith``)."""
        for key, folder in self.store.list(self._prefix() + startswith):
            yield ObjectPath(self.store, key, folder=folder)

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """A store has no folders: a prefix exists once an object is under it."""

    def rmdir(self) -> None:
        """A store has no folders: nothing to remove."""

    def read_bytes(self) -> bytes:
        return self.store.get(self.key)

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes) -> None:
        self.store.put(self.key, data)

    def commit_bytes(self, data: bytes) -> None:
        """Put ``data`` only if the object is as this process last saw it (absent, if it never saw it),
        and only while the run's lease holds: the commit of a single writer."""
        if self.store.lease is not None:
            self.store.lease.check()
        etag = self.store.etags.get(self.key)
        try:
            self.store.put(self.key, data, if_match=etag, if_none_match=etag is None)
        except ConditionFailed:
            raise HsxError(f"{self}: changed by another writer since this run {'read' if etag else 'started'} it; "
                           "this run's last commit was not made. Only one run may write an output at a time.") from None

    def create_bytes(self, data: bytes) -> None:
        """Put ``data`` only if no object has this name yet, and only while the run's lease holds: how a
        single writer adds a record to a log (a second writer's record of the same number is refused)."""
        if self.store.lease is not None:
            self.store.lease.check()
        try:
            self.store.put(self.key, data, if_none_match=True)
        except ConditionFailed:
            raise HsxError(f"{self}: already written by another writer; this run's last commit was not made. "
                           "Only one run may write an output at a time.") from None

    def upload(self, local: Path) -> None:
        self.store.upload(self.key, local)

    def unlink(self, missing_ok: bool = False) -> None:
        self.store.delete(self.key)  # deleting a missing object succeeds in S3

    def replace(self, target: "ObjectPath") -> None:
        """Server-side copy to ``target``, then delete this object: a store's rename (not atomic, but the
        manifest, not the name, is what commits a shard)."""
        self.store.copy(self.key, target.key)
        self.store.delete(self.key)

