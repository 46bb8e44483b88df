"""Blobs in S3-compatible object storage (and Google Cloud Storage, Azure Blob Storage), on ``obstore``.

Objects are ``<prefix>/ab/cd/<sha256>``, the folder store's layout (a folder copies into a bucket as it is).
Credentials, region and endpoint come from the environment as obstore reads it: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``, ``AWS_ALLOW_HTTP=true``
for a plain-http endpoint (``GOOGLE_*`` and ``AZURE_*`` for the other two). obstore ships with the ``server`` extra.
"""

from __future__ import annotations

import errno
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from functools import partial
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from ..errors import BlobStoreUnavailable
from .base import CHUNK_BYTES, BlobStore, BlobStream, Data, checked, checked_chunks, proven, shard

if TYPE_CHECKING:
    from obstore.store import AzureStore, GCSStore, S3Store

#: URL schemes of the object stores, as obstore names them.
OBJECT_STORE_SCHEMES = ("s3", "gs", "az")
#: The longest a presigned URL may stay valid (S3's own limit for a signature by access key).
MAX_PRESIGN_EXPIRY = timedelta(days=7)
#: A request failing on the network or with a 5xx is tried again with backoff, this often and this long at most
#: (obstore's defaults, 10 times and 3 minutes, would hold a publish that long).
RETRIES, RETRY_TIMEOUT = 3, timedelta(seconds=30)
#: A read (a HEAD, a GET and its body) ends after this long, its connection after CONNECT_TIMEOUT, and is tried
#: once more at most: a frozen endpoint holds a reader about twice this, not obstore's 30 s per try.
READ_TIMEOUT, CONNECT_TIMEOUT = timedelta(seconds=10), timedelta(seconds=2)
#: After a read failed on the network or with a 5xx, reads fail at once for this many seconds (the circuit is open)
#: instead of each waiting out READ_TIMEOUT: what the server answers then is 503 with this as ``Retry-After``.
CIRCUIT_SECONDS = 15
#: obstore's client options that its environment variables (``AWS_ALLOW_HTTP``, ``GOOGLE_…``, ``AZURE_…``) set,
#: which client options given in code replace: carried over to the reads' client.
_CLIENT_ENV = ("ALLOW_HTTP", "ALLOW_INVALID_CERTIFICATES", "PROXY_URL", "PROXY_CA_CERTIFICATE", "PROXY_EXCLUDES")
#: Objects per page of :meth:`ObjectStoreBlobs.objects_older_than` and per request of :meth:`ObjectStoreBlobs.delete_many`
#: (S3 answers and deletes at most 1,000 at a time).
LIST_BATCH = 500
#: A blob's key under the prefix: ``ab/cd/<sha256>``, its shard folders the digest's first four hex digits.
_BLOB_KEY = re.compile(r"([0-9a-f]{2})/([0-9a-f]{2})/(\1\2[0-9a-f]{60})")

T = TypeVar("T")


class StoredObject(NamedTuple):
    """An object holding a blob's bytes, as the listing describes it."""

    sha256: str
    size: int


def _seconds(delta: timedelta) -> str:
    return f"{delta.total_seconds():g}s"


def _client_env() -> dict[str, str]:
    """The client options of :data:`_CLIENT_ENV` set in the environment, as obstore reads them there."""
    return {key.lower(): value for prefix in ("AWS_", "GOOGLE_", "AZURE_") for key in _CLIENT_ENV
            if (value := os.environ.get(prefix + key)) is not None}


def _obstore() -> ModuleType:
    try:
        import obstore
        import obstore.store
    except ImportError as exc:
        raise ImportError(f"an object-store blob store needs obstore ({exc}): pip install 'plancache[server]'") from None
    return obstore


class ObjectStoreBlobs(BlobStore):
    """Blobs as objects under ``url`` (``s3://bucket/prefix``, ``gs://bucket/prefix``, ``az://container/prefix``).

    A put uploads in one atomic write (a multipart upload is aborted when the bytes do not hash to their name, so
    nothing is stored) and always writes, replacing a damaged object; two puts of one blob at once leave one whole
    object. Every read hashes the bytes as they arrive. :meth:`presign` hands out a GET URL that needs no
    credentials, valid for a short time. Nothing is sent until the first call; ValueError when the environment
    lacks what the URL needs (an Azure account)."""

    def __init__(self, url: str) -> None:
        obstore = _obstore()
        self.url = url.rstrip("/")
        self._obs = obstore
        try:
            self._store: S3Store | GCSStore | AzureStore = obstore.store.from_url(
                self.url, retry_config={"max_retries": RETRIES, "retry_timeout": RETRY_TIMEOUT})
            self._reads: S3Store | GCSStore | AzureStore = obstore.store.from_url(
                self.url, retry_config={"max_retries": 1, "retry_timeout": READ_TIMEOUT},
                client_options={**_client_env(), "timeout": _seconds(READ_TIMEOUT),
                                "connect_timeout": _seconds(CONNECT_TIMEOUT)})
        except obstore.exceptions.BaseError as exc:  # e.g. an Azure account not named in the environment
            raise ValueError(f"blob store {self.url}: {str(exc).splitlines()[0]}") from None
        self._closed_at = 0.0  # monotonic time the circuit closes again; reads fail at once before it

    def _call(self, call: Callable[[], T]) -> T:
        """``call()``, obstore's errors other than not-found raised as :class:`BlobStoreUnavailable` (an OSError:
        unreachable, refused, denied)."""
        try:
            return call()
        except self._obs.exceptions.BaseError as exc:
            raise BlobStoreUnavailable(f"blob store {self.url}: {str(exc).splitlines()[0]}") from exc

    def _read(self, call: Callable[[], T]) -> T:
        """:meth:`_call` for a read, behind the circuit: while it is open, :class:`BlobStoreUnavailable` at once; a
        read that fails so opens it for :data:`CIRCUIT_SECONDS`, one that succeeds closes it."""
        left = self._closed_at - time.monotonic()
        if left > 0:
            raise BlobStoreUnavailable(f"blob store {self.url}: a read failed less than {CIRCUIT_SECONDS} s ago; "
                                       "not asked again before then", retry_after=math.ceil(left))
        try:
            result = self._call(call)
        except BlobStoreUnavailable as exc:
            self._closed_at = time.monotonic() + CIRCUIT_SECONDS
            exc.retry_after = CIRCUIT_SECONDS
            raise
        self._closed_at = 0.0
        return result

    def _write(self, call: Callable[[], T]) -> T:
        """:meth:`_call` for a write. A not-found there is raised as :class:`BlobStoreUnavailable` when the bucket
        (or container) cannot be listed, as when it does not exist; otherwise (a multipart upload whose parts were
        collected meanwhile: S3's NoSuchUpload) as a FileNotFoundError with ``errno`` ENOENT, a lost race: the
        server answers it 503, retry, as for a folder's file removed while written."""
        try:
            return self._call(call)
        except FileNotFoundError as exc:
            if self._listable():
                raise FileNotFoundError(errno.ENOENT, f"blob store {self.url}: the upload was lost while it was "
                                        f"written ({str(exc).splitlines()[0]})") from exc
            raise BlobStoreUnavailable(f"blob store {self.url}: the bucket does not exist "
                                       f"({str(exc).splitlines()[0]})") from exc

    def _listable(self) -> bool:
        """Whether the first key under the prefix can be listed (an empty bucket can)."""
        try:
            next(self._obs.list(self._store, chunk_size=1), None)
        except (self._obs.exceptions.BaseError, FileNotFoundError):  # obstore's 404 for a missing bucket is generic
            return False
        return True

    def size(self, sha256: str) -> int | None:
        try:
            return int(self._read(lambda: self._obs.head(self._reads, shard(sha256)))["size"])
        except FileNotFoundError:  # obstore's not-found (also for a bucket that does not exist)
            return None

    def open(self, sha256: str) -> BlobStream | None:
        try:
            result = self._read(lambda: self._obs.get(self._reads, shard(sha256)))
        except FileNotFoundError:
            return None
        return BlobStream(sha256, int(result.meta["size"]), self._pieces(result.stream(min_chunk_size=CHUNK_BYTES)),
                          source=self.url)

    def _pieces(self, stream: Iterator[bytes]) -> Iterator[bytes]:
        while True:
            piece = self._read(lambda: next(stream, b""))
            if not piece:
                return
            yield piece

    def put(self, sha256: str, data: Data) -> None:
        key = shard(sha256)
        if isinstance(data, bytes):  # one request: checked first, in one piece
            whole = data if proven(sha256, data) else b"".join(checked(sha256, [data]))
            self._write(lambda: self._obs.put(self._store, key, whole))
        else:  # a multipart upload, completed only after the last chunk passed the check
            self._write(lambda: self._obs.put(self._store, key, checked_chunks(sha256, data)))

    def delete(self, sha256: str) -> None:
        self._call(lambda: self._obs.delete(self._store, shard(sha256)))

    def delete_many(self, digests: list[str]) -> None:
        """Delete the objects of ``digests`` (absent ones are no error), :data:`LIST_BATCH` per request."""
        for start in range(0, len(digests), LIST_BATCH):
            self._call(partial(self._obs.delete, self._store, [shard(d) for d in digests[start:start + LIST_BATCH]]))

    def check_listable(self) -> None:
        """Raise :class:`BlobStoreUnavailable` unless the first key under the prefix can be listed now: one read,
        behind the circuit and its timeout, so a frozen endpoint holds the caller about twice :data:`READ_TIMEOUT`."""
        pages = self._read(lambda: self._obs.list(self._reads, chunk_size=1))
        self._read(lambda: next(pages, None))

    def objects_older_than(self, cutoff: datetime) -> Iterator[list[StoredObject]]:
        """The blob objects (``ab/cd/<sha256>`` under the prefix) last modified before ``cutoff``, a page of the
        listing (:data:`LIST_BATCH` objects or fewer) at a time, so a bucket of any size is listed in bounded
        memory. Any other key under the prefix (another name, a blob's name in the wrong shard) is left out."""
        pages = self._read(lambda: self._obs.list(self._reads, chunk_size=LIST_BATCH))  # bounded, behind the circuit
        while page := self._read(lambda: next(pages, None)):
            old = [StoredObject(m[3], int(meta["size"])) for meta in page
                   if meta["last_modified"] < cutoff and (m := _BLOB_KEY.fullmatch(meta["path"]))]
            if old:
                yield old

    def presign(self, sha256: str, expires_in: timedelta = timedelta(minutes=5)) -> str:
        """A URL that GETs the blob without credentials until ``expires_in`` from now (at most
        :data:`MAX_PRESIGN_EXPIRY`). Whoever GETs it must check the bytes against ``sha256``; the URL is made
        locally, whether the object exists or not."""
        if not timedelta(0) < expires_in <= MAX_PRESIGN_EXPIRY:
            raise ValueError(f"a presigned URL expires after more than 0 and at most {MAX_PRESIGN_EXPIRY}, "
                             f"not {expires_in}")
        return str(self._obs.sign(self._store, "GET", shard(sha256), expires_in))
