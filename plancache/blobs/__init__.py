"""Content-addressed blob bytes, apart from records: one interface, a backend per place bytes are kept.

A blob is named by the sha256 of its bytes. :class:`BlobReader` reads (``has``, ``size``, ``get``, ``open`` as a
stream), :class:`BlobStore` also writes (``put`` from bytes or a stream, the digest checked while writing, nothing
stored on a mismatch; ``delete``). No read returns bytes whose sha256 is not their name:

============================ ================================ ==============================================
backend (URL)                 bytes checked                    notes
============================ ================================ ==============================================
:class:`FolderBlobs`          on every read (hashed as read)   ``file:///path``; files ``ab/cd/<sha256>``,
                                                               atomic and fsynced, opened ``O_NOFOLLOW``
:class:`MemoryBlobs`          once, when put                   ``memory://[?max_bytes=N]``; byte-bounded LRU
:class:`ObjectStoreBlobs`     on every read (hashed as read)   ``s3://bucket/prefix`` (``gs://``, ``az://``);
                                                               obstore; presigned GET URLs
============================ ================================ ==============================================

A stream (:class:`BlobStream`) fails before its last chunk when the whole does not hash to its name, so a wrong
blob is never completed, even when streamed on. :func:`open_blobs` opens a backend by URL. No SQL, JSON or base64
here: the catalog of blobs and the records that name them are the store's (:mod:`plancache.store.blobs`).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, urlsplit
from urllib.request import url2pathname

from .base import CHUNK_BYTES, BlobReader, BlobStore, BlobStream
from .folder import FolderBlobs
from .memory import DEFAULT_MEMORY_BYTES, MemoryBlobs
from .objects import MAX_PRESIGN_EXPIRY, OBJECT_STORE_SCHEMES, ObjectStoreBlobs

__all__ = [
    "BLOB_URL_FORMS",
    "BlobReader",
    "BlobStore",
    "BlobStream",
    "CHUNK_BYTES",
    "DEFAULT_MEMORY_BYTES",
    "FolderBlobs",
    "MAX_PRESIGN_EXPIRY",
    "MemoryBlobs",
    "OBJECT_STORE_SCHEMES",
    "ObjectStoreBlobs",
    "blob_url_kind",
    "open_blobs",
]

#: The URLs :func:`open_blobs` takes, for error messages.
BLOB_URL_FORMS = "file:///absolute/path, memory:// or s3://bucket/prefix (gs://, az://)"


def _folder(url: str) -> Path:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or not parts.path.startswith("/") or parts.query or parts.fragment:
        raise ValueError(f"blob store {url!r}: a folder is file:///absolute/path")
    return Path(url2pathname(parts.path))


def _memory_bytes(url: str) -> int:
    parts = urlsplit(url)
    query = parse_qs(parts.query, keep_blank_values=True)
    try:
        if parts.netloc or parts.path or parts.fragment or set(query) - {"max_bytes"} or len(query.get(
                "max_bytes", [""])) != 1:
            raise ValueError
        max_bytes = int(query["max_bytes"][0]) if query else DEFAULT_MEMORY_BYTES
        if max_bytes < 1:
            raise ValueError
    except ValueError:
        raise ValueError(f"blob store {url!r}: memory is memory:// or memory://?max_bytes=N (N >= 1)") from None
    return max_bytes


def _object_store(url: str) -> str:
    parts = urlsplit(url)
    if "@" in parts.netloc or ":" in parts.netloc:
        raise ValueError(f"blob store {parts.scheme}://…: no credentials or port in the URL; set them in the "
                         "environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, docs/DEPLOYMENT.md)")
    if not parts.netloc or parts.query or parts.fragment or "//" in parts.path.rstrip("/"):
        raise ValueError(f"blob store {url!r}: object storage is {parts.scheme}://bucket/optional/prefix")
    return url


def blob_url_kind(url: str) -> str:
    """Which backend ``url`` names: ``file``, ``memory`` or ``object`` (object storage); ValueError naming
    the problem for any other value. Nothing is opened or touched."""
    scheme = urlsplit(url).scheme
    if scheme == "file":
        _folder(url)
        return "file"
    if scheme == "memory":
        _memory_bytes(url)
        return "memory"
    if scheme in OBJECT_STORE_SCHEMES:
        _object_store(url)
        return "object"
    raise ValueError(f"blob store {url!r}: use {BLOB_URL_FORMS}")


def open_blobs(url: str) -> BlobStore:
    """The blob store ``url`` names (see :func:`blob_url_kind`); a folder is created when absent."""
    kind = blob_url_kind(url)
    if kind == "file":
        return FolderBlobs(_folder(url))
    if kind == "memory":
        return MemoryBlobs(_memory_bytes(url))
    return ObjectStoreBlobs(url)
