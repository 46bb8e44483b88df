"""Blob bytes as a server sent them, read as a blob store: checked against their name when read."""

from __future__ import annotations

from ..blobs import BlobReader, BlobStream
from ..digest import sha256_of


class ReceivedBlobs(BlobReader):
    """Blobs by the sha256 their sender named them with, unchecked until read: :meth:`open` streams them through the
    digest check (:class:`~plancache.blobs.BlobStream`), so a forged or damaged blob is never returned whole. Of two
    blobs received under one name, the first that hashes to it is kept. ``url``: where they came from (for logs)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._items: dict[str, bytes] = {}

    def add(self, sha256: str, data: bytes) -> None:
        """Hold ``data`` under ``sha256`` (replacing bytes held under it that do not hash to it)."""
        held = self._items.get(sha256)
        if held is None or sha256_of(held) != sha256:
            self._items[sha256] = data

    def size(self, sha256: str) -> int | None:
        data = self._items.get(sha256)
        return None if data is None else len(data)

    def open(self, sha256: str) -> BlobStream | None:
        data = self._items.get(sha256)
        return None if data is None else BlobStream(sha256, len(data), [data], source=self.url)
