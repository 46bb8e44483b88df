"""Bytes that carry the sha256 they were hashed to as they were read, so that they are not hashed twice.

A blob store hashes every blob it reads (:class:`~plancache.blobs.BlobStream`) and returns the whole as
:class:`Digested`; :func:`~plancache.verify.verify_blob` then compares that digest with the record's instead of
hashing the bytes again (about 0.5 ms per MiB). Bytes are immutable, so the digest stays theirs; any other bytes are
hashed as before.
"""

from __future__ import annotations

import hashlib
from typing import Any

__all__ = ["Digested", "sha256_of"]


class Digested(bytes):
    """``data`` as bytes, with ``sha256``: the hex digest they hashed to when they were read. Made only by code that
    hashed them; copies (slices, pickles) are plain bytes."""

    sha256: str

    def __new__(cls, data: bytes, sha256: str) -> Digested:
        obj = super().__new__(cls, data)
        obj.sha256 = sha256
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return bytes, (bytes(self),)  # a copy elsewhere is plain bytes: hashed again where it is checked


def sha256_of(data: bytes) -> str:
    """The hex sha256 of ``data``: the digest it carries when it is :class:`Digested`, else computed."""
    return data.sha256 if type(data) is Digested else hashlib.sha256(data).hexdigest()
