"""Per-process memories that keep the hot read path off the database: blob bytes (immutable, content-addressed,
so never stale) in a byte-bounded LRU, plan records as a resolve answer writes them, by version (never stale
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

from ..store.plans import PlanVersion

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
