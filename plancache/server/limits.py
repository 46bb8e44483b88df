"""Per-process budgets of the server: bytes held in flight, and token buckets for writes a low-privilege token may make.

- :class:`ByteBudget` (``Settings.max_inflight_bytes``): request bodies are counted while they are read and
  until their handler returns, inlined resolve answers until they are sent. A request that does not fit waits
  up to ``Settings.inflight_wait_seconds``, then gets 503 ``server_busy`` with ``Retry-After``.
- :class:`RateLimiter`: a token bucket per API token (``POST /v1/specs`` and recorded misses).
- :class:`LogBudget`: the log lines a client's refused or failed requests may write (:mod:`plancache.server.errors`).

Both live in one process (app.state); N server processes allow N times as much. docs/DEPLOYMENT.md
("Request limits") has the figures and the memory formula.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from typing import Any

from ..errors import ServerBusy

#: How long a client told to come back (Retry-After) waits when the server is busy, in seconds.
BUSY_RETRY_AFTER = 1


def server_busy(what: str) -> ServerBusy:
    return ServerBusy(f"the server holds too many {what} in flight; retry later", retry_after=BUSY_RETRY_AFTER)

#: Blob uploads receive their bytes on threads of their own (``app.state.upload_threads``), at most this many at once
#: per server process; more wait, on no thread, for one. An upload's thread waits for the network, and uploads sent
#: slowly on the threads every other route shares (anyio's 40) stalled them all.
UPLOAD_THREADS = 8


class ByteBudget:
    """At most ``capacity`` bytes taken at once. Thread-safe; :meth:`take` waits on the event loop."""

    def __init__(self, capacity: int, wait_seconds: float) -> None:
        self.capacity = capacity
        self.wait_seconds = wait_seconds
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    def try_take(self, n: int) -> bool:
        with self._lock:
            if self._used + n > self.capacity:
                return False
            self._used += n
            return True

    def take_up_to(self, n: int) -> int:
        """Take as much of ``n`` as is free now (maybe 0), without waiting; how much was taken."""
        with self._lock:
            granted = max(0, min(n, self.capacity - self._used))
            self._used += granted
            return granted

    def release(self, n: int) -> None:
        if n:
            with self._lock:
                self._used = max(0, self._used - n)

    async def take(self, n: int, what: str = "request bytes") -> None:
        """Take ``n`` bytes, waiting up to ``wait_seconds`` for them; else 503 (:func:`server_busy`)."""
        if self.try_take(n):
            return
        if n > self.capacity:
            raise server_busy(what)
        deadline = time.monotonic() + self.wait_seconds
        delay = 0.005
        while not self.try_take(n):
            if time.monotonic() >= deadline:
                raise server_busy(what)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)


class Held:
    """``n`` bytes taken from ``budget``, given back once: by :meth:`release` or when this is garbage-collected
    (an answer dropped before it was sent)."""

    def __init__(self, budget: ByteBudget, n: int) -> None:
        self.budget, self.n = budget, n

    def release(self) -> None:
        n, self.n = self.n, 0
        self.budget.release(n)

    __del__ = release


def rate_key(principal: Any) -> str:
    """Whose bucket a request draws from: its API token (``identity``), else its name (``anonymous``)."""
    return getattr(principal, "identity", None) or f"name:{principal.name}"


class RateLimiter:
    """A token bucket per key: ``burst`` at first, refilled at ``per_minute``; ``per_minute <= 0`` is no limit.

    The bucket table forgets full buckets once it holds more than ``max_keys`` keys (keys are API tokens, so
    it stays small)."""

    def __init__(self, per_minute: float, burst: int, max_keys: int = 10_000) -> None:
        self.rate = per_minute / 60.0
        self.burst = max(1, burst)
        self.max_keys = max_keys
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)
        self._lock = threading.Lock()

    @property
    def unlimited(self) -> bool:
        return self.rate <= 0

    def _level(self, key: str, now: float) -> float:
        tokens, at = self._buckets.get(key, (float(self.burst), now))
        return min(float(self.burst), tokens + (now - at) * self.rate)

    def take(self, key: str, n: int = 1, *, partial: bool = False) -> int:
        """Take ``n`` tokens of ``key``'s bucket; how many were taken: ``n`` or 0, or with ``partial`` as many as
        the bucket holds."""
        if self.unlimited or n <= 0:
            return max(n, 0)
        now = time.monotonic()
        with self._lock:
            level = self._level(key, now)
            granted = n if level >= n else (int(level) if partial else 0)
            self._buckets[key] = (level - granted, now)
            if len(self._buckets) > self.max_keys:
                self._buckets = {k: v for k, v in self._buckets.items() if self._level(k, now) < self.burst}
            return granted

    def retry_after(self, key: str, n: int = 1) -> int:
        """Whole seconds until ``key``'s bucket holds ``n`` tokens (at least 1)."""
        if self.unlimited:
            return 1
        with self._lock:
            missing = n - self._level(key, time.monotonic())
        return max(1, math.ceil(missing / self.rate))


class LogBudget:
    """Log lines per client: ``burst`` at first, then ``per_minute``. :meth:`admit` says whether a line may be
    written and how many of the client's lines were left out since its last one, so a client sending a
    thousand bad requests writes a few lines, not a thousand."""

    def __init__(self, per_minute: float, burst: int, max_keys: int = 10_000) -> None:
        self._limiter = RateLimiter(per_minute, burst, max_keys)
        self._left_out: dict[str, int] = {}
        self._lock = threading.Lock()
        self.max_keys = max_keys

    def admit(self, client: str) -> int | None:
        """None: leave this line out (counted); else how many of ``client``'s lines were left out before it."""
        with self._lock:
            if self._limiter.take(client):
                return self._left_out.pop(client, 0)
            if len(self._left_out) >= self.max_keys and client not in self._left_out:
                self._left_out.clear()  # counts only: a flood of distinct clients cannot grow the table
            self._left_out[client] = self._left_out.get(client, 0) + 1
            return None


def miss_caller(principal: Any, address: str | None) -> str:
    """Whose share a miss takes: its token (``identity``), else the anonymous caller's address."""
    return getattr(principal, "identity", None) or f"address:{address or 'unknown'}"


def miss_share(autotune_jobs_per_hour: int) -> int:
    """A caller's share of keys it raises past their first count, per hour (:mod:`plancache.store.misses`): half
    the autotune budget, so one token's processes bring at most half of an hour's automatic jobs."""
    return max(1, autotune_jobs_per_hour // 2)
