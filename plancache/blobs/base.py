"""The content-addressed interface every blob backend implements, and the digest check they share."""

from __future__ import annotations

import hashlib
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import BinaryIO

from ..digest import Digested
from ..errors import IntegrityError
from ..protocol import SHA256_PATTERN

log = logging.getLogger("plancache.blobs")

#: Bytes read or written at a time when a blob is streamed.
CHUNK_BYTES = 1024 * 1024
_SHA256 = re.compile(SHA256_PATTERN)

#: What :meth:`BlobStore.put` takes: the bytes, or a binary stream read to its end.
Data = bytes | BinaryIO


def check_name(sha256: str) -> str:
    """``sha256`` if it is a lowercase hex sha256 digest; ValueError otherwise (it becomes a path or a key)."""
    if not _SHA256.fullmatch(sha256):
        raise ValueError(f"not a sha256 hex digest: {sha256[:80]!r}")
    return sha256


def shard(sha256: str) -> str:
    """Where a blob lives under a store's root, ``ab/cd/<sha256>``: the same in a folder and a bucket."""
    return f"{sha256[:2]}/{sha256[2:4]}/{check_name(sha256)}"


def chunks(data: Data) -> Iterator[bytes]:
    """``data`` in pieces of at most :data:`CHUNK_BYTES`."""
    if isinstance(data, bytes | bytearray | memoryview):
        view = memoryview(data)
        for start in range(0, len(view), CHUNK_BYTES):
            yield bytes(view[start:start + CHUNK_BYTES])
        return
    while piece := data.read(CHUNK_BYTES):
        yield piece


def checked(sha256: str, pieces: Iterable[bytes]) -> Iterator[bytes]:
    """``pieces``, passed on while hashed; IntegrityError at their end, before the last piece is passed on, when
    they do not hash to ``sha256`` (or are empty: no blob is)."""
    digest, pending, size = hashlib.sha256(), b"", 0
    for piece in pieces:
        if not piece:
            continue
        if pending:
            yield pending
        digest.update(piece)
        pending, size = piece, size + len(piece)
    actual = digest.hexdigest()
    if actual != sha256 or not size:
        raise IntegrityError(f"blob bytes ({size} bytes) hash to {actual}, not {sha256}")
    yield pending


def proven(sha256: str, data: Data) -> bool:
    """``data`` is :class:`~plancache.digest.Digested` bytes that hashed to ``sha256`` when they were read: they need
    not be hashed again."""
    return type(data) is Digested and data.sha256 == sha256 and bool(data)


def checked_chunks(sha256: str, data: Data) -> Iterator[bytes]:
    """``data`` in pieces, checked against ``sha256`` as :func:`checked` does, unless :func:`proven`."""
    return chunks(data) if proven(sha256, data) else checked(sha256, chunks(data))


class BlobStream:
    """The bytes of one stored blob, read as they arrive and checked against its name: iterating yields its chunks
    and raises :class:`~plancache.errors.IntegrityError` instead of the last one when the whole does not hash to
    ``sha256`` (so a reader never completes a wrong blob). ``size`` is the stored size, ``source`` the store's URL.
    Close it (or use ``with``)."""

    def __init__(self, sha256: str, size: int, pieces: Iterable[bytes], close: Callable[[], None] = lambda: None,
                 *, source: str) -> None:
        self.sha256, self.size, self.source = sha256, size, source
        self._pieces = checked(sha256, pieces)
        self._close = close

    def __iter__(self) -> Iterator[bytes]:
        return self._pieces

    def read(self) -> Digested:
        """The whole blob, carrying its digest (IntegrityError when it does not hash to its name)."""
        return Digested(b"".join(self._pieces), self.sha256)

    def whole(self) -> bytes | None:
        """The whole blob; None when it does not hash to its name (logged: treated as missing, the next
        :meth:`BlobStore.put` of the right bytes replaces it). Closes the stream."""
        with self:
            try:
                return self.read()
            except IntegrityError as exc:
                log.warning("%s: blob %s is damaged, treated as missing: %s", self.source, self.sha256, exc)
                return None

    def close(self) -> None:
        self._close()

    def __enter__(self) -> BlobStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BlobReader(ABC):
    """Blob bytes by sha256, read-only. No read returns bytes whose sha256 is not their name."""

    url: str

    @abstractmethod
    def size(self, sha256: str) -> int | None:
        """The stored size, None when absent. Not a check of the bytes: :meth:`get` or :meth:`open` does that."""

    @abstractmethod
    def open(self, sha256: str) -> BlobStream | None:
        """The stored bytes as a checked stream, None when absent."""

    def has(self, sha256: str) -> bool:
        return self.size(sha256) is not None

    def get(self, sha256: str) -> bytes | None:
        """The stored bytes, None when absent or when they do not hash to ``sha256`` (logged: treated as missing,
        the next :meth:`BlobStore.put` of the right bytes replaces them)."""
        stream = self.open(sha256)
        return None if stream is None else stream.whole()


class BlobStore(BlobReader):
    """Blob bytes by sha256, written whole or not at all."""

    @abstractmethod
    def put(self, sha256: str, data: Data) -> None:
        """Store ``data`` (bytes, or a binary stream read to its end) under ``sha256``, checking the digest while
        writing: :class:`~plancache.errors.IntegrityError` when it differs, and nothing is stored. Idempotent; bytes
        stored before under that name that do not hash to it are replaced."""

    @abstractmethod
    def delete(self, sha256: str) -> None:
        """Drop the bytes; nothing to do when absent."""

    def delete_many(self, digests: list[str]) -> None:
        """Drop the bytes of each of ``digests`` (absent ones are no error); a backend with a bulk delete overrides
        this."""
        for sha256 in digests:
            self.delete(sha256)
