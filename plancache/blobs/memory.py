"""Blobs in this process's memory, least recently used dropped past a byte budget (tests, caches)."""

from __future__ import annotations

import threading

from cachetools import LRUCache

from ..digest import Digested
from .base import BlobStore, BlobStream, Data, check_name, checked_chunks

#: The byte budget of ``memory://`` without ``max_bytes``.
DEFAULT_MEMORY_BYTES = 256 * 1024 * 1024


class MemoryBlobs(BlobStore):
    """At most ``max_bytes`` of blob bytes (0: none); putting one more drops the least recently read or written
    first. No blob over ``max_item`` bytes (default ``max_bytes``) is taken, so a cache can keep a few large blobs
    from flushing the many small ones. Bytes are checked once, when put, and kept as immutable ``bytes``.
    Thread-safe."""

    def __init__(self, max_bytes: int = DEFAULT_MEMORY_BYTES, *, max_item: int | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be 0 or more, got {max_bytes}")
        self.max_bytes = max_bytes
        self.max_item = max_bytes if max_item is None else min(max_item, max_bytes)
        self.url = f"memory://?max_bytes={max_bytes}"
        self._items: LRUCache[str, bytes] = LRUCache(maxsize=max_bytes, getsizeof=len)
        self._lock = threading.Lock()

    def size(self, sha256: str) -> int | None:
        data = self.get(sha256)
        return None if data is None else len(data)

    def get(self, sha256: str) -> bytes | None:
        check_name(sha256)
        with self._lock:
            return self._items.get(sha256)

    def open(self, sha256: str) -> BlobStream | None:
        data = self.get(sha256)
        return None if data is None else BlobStream(sha256, len(data), [data], source=self.url)

    def put(self, sha256: str, data: Data) -> None:
        check_name(sha256)
        whole = b"".join(checked_chunks(sha256, data))
        if len(whole) > self.max_item:
            raise ValueError(f"blob {sha256} has {len(whole)} bytes, more than this memory store holds "
                             f"({self.max_item})")
        with self._lock:
            self._items[sha256] = Digested(whole, sha256)  # hashed just now: gets carry it

    def delete(self, sha256: str) -> None:
        check_name(sha256)
        with self._lock:
            self._items.pop(sha256, None)
