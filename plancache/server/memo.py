"""Per-process memories that keep the hot read path off the database: blob bytes (immutable, content-addressed,
so never stale) in a :class:`~plancache.blobs.MemoryBlobs`, plan records as a resolve answer writes them, by version (never stale
either: a resolve reads the versions first), and, for a few seconds, authenticated tokens and presigned URLs.

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

from cachetools import LRUCache

from ..blobs import MemoryBlobs
from ..store.plans import PlanVersion

V = TypeVar("V")


def blob_memory(max_bytes: int) -> MemoryBlobs:
    """The blob bytes a server process keeps, ``max_bytes`` at most (0: none); a blob over ``max_bytes // 16`` is
    never kept, so a few large blobs cannot flush the many small ones."""
    return MemoryBlobs(max_bytes, max_item=max_bytes // 16)


#: Bytes of serialized records a :class:`RecordMemo` keeps by default (some 30,000 signed records).
RECORD_MEMO_BYTES = 64 * 1024 * 1024
#: Presigned URLs a server process keeps (some 600 bytes each).
PRESIGNED_URLS = 16_384


class RecordMemo:
    """A plan record's part of a resolve answer, by the record's :class:`~plancache.store.plans.PlanVersion`: at
    most ``max_bytes`` of them, the least recently used dropped first. A version stands for one record's content,
    so an entry is never stale: a replaced plan has another version and a withdrawn one none, as the resolve that
    reads the versions before it asks here sees at once."""

    def __init__(self, max_bytes: int = RECORD_MEMO_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be 1 or more, got {max_bytes}")
        self._items: LRUCache[PlanVersion, bytes] = LRUCache(maxsize=max_bytes, getsizeof=len)
        self._lock = threading.Lock()

    def get(self, version: PlanVersion) -> bytes | None:
        with self._lock:
            return self._items.get(version)

    def put(self, version: PlanVersion, data: bytes) -> None:
        """Keep ``data``, written from the record of ``version`` (nothing when it alone is over ``max_bytes``)."""
        if len(data) <= self._items.maxsize:
            with self._lock:
                self._items[version] = data

    @property
    def bytes(self) -> int:
        return int(self._items.currsize)

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
