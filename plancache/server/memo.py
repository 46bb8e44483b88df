"""Per-process memories that keep the hot read path off the database: blob bytes (immutable, content-addressed,
so never stale) in a byte-bounded LRU, and authenticated tokens for a few seconds.

A blob GET served from memory costs no database round trip and no worker thread; a token seen in the last
``token_cache_seconds`` is not looked up again, so a revoked token may still be accepted by a server process
for that long (docs/DEPLOYMENT.md, "Revoking a token").
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V")


class BlobMemory:
    """Blob bytes by sha256, least recently used dropped past ``max_bytes``; a blob over ``max_bytes // 16`` is
    never kept (so a few large blobs cannot flush the many small ones). ``max_bytes`` 0 keeps nothing."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be 0 or more, got {max_bytes}")
        self.max_bytes = max_bytes
        self.max_item = max_bytes // 16
        self.bytes = 0
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, sha256: str) -> bytes | None:
        with self._lock:
            data = self._items.get(sha256)
            if data is not None:
                self._items.move_to_end(sha256)
            return data

    def put(self, sha256: str, data: bytes) -> None:
        """Keep ``data`` (the caller has read it from the blob store under ``sha256``)."""
        if len(data) > self.max_item:
            return
        with self._lock:
            if sha256 in self._items:
                return
            self._items[sha256] = data
            self.bytes += len(data)
            while self.bytes > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self.bytes -= len(old)

    def __len__(self) -> int:
        return len(self._items)


class TtlMemory(Generic[V]):
    """Values by key for ``ttl`` seconds (0: nothing is kept), at most ``max_items`` (oldest dropped first)."""

    def __init__(self, ttl: float, max_items: int = 10_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.max_items = max_items
        self._clock = clock
        self._items: OrderedDict[str, tuple[float, V]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            if item[0] <= self._clock():
                del self._items[key]
                return None
            return item[1]

    def put(self, key: str, value: V) -> None:
        if self.ttl <= 0:
            return
        with self._lock:
            self._items.pop(key, None)
            self._items[key] = (self._clock() + self.ttl, value)
            while len(self._items) > self.max_items:
                self._items.popitem(last=False)
