"""A store call that requests wait for within a bound (readiness, metrics): one call in flight at a time, shared
by every waiter, so a database that hangs costs one blocked thread and each request at most ``timeout`` seconds."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")

#: Seconds ``/readyz`` and a ``/metrics`` scrape wait for the store.
STORE_WAIT = 2.0


class Bounded(Generic[T]):
    """``fn``'s result for :meth:`get`: the last one while younger than ``max_age`` seconds, else the one of the call
    in flight (started if none is), waited for at most ``timeout`` seconds."""

    def __init__(self, fn: Callable[[], T], *, timeout: float, max_age: float = 0.0, name: str = "bounded") -> None:
        self._fn, self.timeout, self.max_age, self.name = fn, timeout, max_age, name
        self._lock = threading.Lock()
        self._running: Future[T] | None = None
        self._last: tuple[float, T] | None = None

    def get(self) -> T:
        """The result; ``TimeoutError`` when the call is not back within ``timeout`` (it goes on, and the next
        :meth:`get` waits for it instead of starting another), or the call's own exception."""
        with self._lock:
            if self._last is not None and time.monotonic() - self._last[0] <= self.max_age:
                return self._last[1]
            future = self._running
            if future is None:
                future = self._running = Future()
                threading.Thread(target=self._run, args=(future,), name=f"plancache-{self.name}", daemon=True).start()
        return future.result(self.timeout)

    def _run(self, future: Future[T]) -> None:
        try:
            value = self._fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiters
            with self._lock:
                self._running = None
            future.set_exception(exc)
            return
        with self._lock:
            self._running = None
            self._last = (time.monotonic(), value)
        future.set_result(value)
