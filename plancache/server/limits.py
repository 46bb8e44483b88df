"""Per-process budgets of the server: bytes held in flight, and token buckets for writes a low-privilege token may make.

- :class:`ByteBudget` (``Settings.max_inflight_bytes``): request bodies are counted while they are read and
  until their handler returns, inlined resolve answers until they are sent. A request that does not fit waits
  up to ``Settings.inflight_wait_seconds``, then gets 503 ``server_busy`` with ``Retry-After``.
- :class:`RateLimiter`: a token bucket per API token (``POST /v1/specs`` and recorded misses).
- :class:`MissCallers`: which misses raise a key's count, and a token's share of the automatic tuning they lead to.
- :class:`LogBudget`: the log lines a client's refused or failed requests may write (:mod:`plancache.server.errors`).

Both live in one process (app.state); N server processes allow N times as much. docs/DEPLOYMENT.md
("Request limits") has the figures and the memory formula.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import threading
import time
from typing import Any

from ..errors import ServerBusy
from .memo import TtlMemory

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


#: A caller's misses of one key on one environment raise its count once per this many seconds (per server process,
#: while it remembers them: :class:`MissCallers`' ``max_items``).
DISTINCT_MISS_SECONDS = 7 * 86_400
#: The period of a caller's share of keys raised past their first count (the autotune budget's period).
SHARE_SECONDS = 3600


def miss_caller(principal: Any, address: str | None) -> str:
    """Whose share a miss takes: its token (``identity``), else the anonymous caller's address."""
    return getattr(principal, "identity", None) or f"address:{address or 'unknown'}"


class MissCallers:
    """Which misses count, so that the count of a key on an environment is of distinct callers and no caller can
    make the autotune policy tune what it alone asks for:

    - a caller (a token, or an anonymous address) and the process it names count a key
      once per :data:`DISTINCT_MISS_SECONDS` (:data:`~plancache.http.PROCESS_HEADER`);
    - a caller's first count of a key is free; raising a key it counted already (from another process) takes one
      of its ``share`` keys an hour (:data:`SHARE_SECONDS`; a key once taken is free for the rest of the hour), past
      which such misses are not counted. So a key one caller alone misses stays at 1 however many processes it
      names, unless the caller spends its share on it. With ``share`` half the autotune budget, one token's processes bring at
      most half of an hour's automatic jobs.

    Per server process, in memory; N replicas allow N times as much."""

    def __init__(self, share: int, max_items: int = 200_000) -> None:
        self._seen: TtlMemory[bool] = TtlMemory(DISTINCT_MISS_SECONDS, max_items)  # (caller, process, env, key)
        self._first: TtlMemory[bool] = TtlMemory(DISTINCT_MISS_SECONDS, max_items)  # (caller, env, key)
        self._shared: TtlMemory[bool] = TtlMemory(SHARE_SECONDS, max_items)  # (caller, env, key) taken from the share
        self._share = RateLimiter(share * 60 * 60 / SHARE_SECONDS, share)

    @staticmethod
    def _key(*parts: str) -> str:
        return hashlib.blake2b("\0".join(parts).encode(), digest_size=16).hexdigest()

    def counted(self, caller: str, process: str, env_id: str, keys: list[str]) -> list[str]:
        """The keys of ``keys`` whose miss by ``caller`` from ``process`` on ``env_id`` counts now."""
        out = []
        for key in keys:
            seen = self._key(caller, process, env_id, key)
            if self._seen.get(seen) is not None:
                continue
            first = self._key(caller, env_id, key)
            if self._first.get(first) is not None and self._shared.get(first) is None:
                if not self._share.take(caller):
                    continue
                self._shared.put(first, True)
            self._first.put(first, True)
            self._seen.put(seen, True)
            out.append(key)
        return out
