"""Work done off a load's path: items handed over and taken in batches by one daemon thread (:class:`Background`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

log = logging.getLogger("plancache.client")

T = TypeVar("T")


class Background(Generic[T]):
    """``work(batch)`` for the items :meth:`put` hands over, on one daemon thread named ``name``: started when items
    arrive and none runs, taking all that came meanwhile each turn, ended when none are left. An exception of
    ``work`` is logged (``what`` says of what), never raised: background work must not take the process down."""

    def __init__(self, name: str, work: Callable[[list[T]], None], what: str) -> None:
        self.name = name
        self._work = work
        self._what = what
        self._queue: list[T] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def put(self, items: Iterable[T]) -> None:
        """Queue ``items`` for the thread (started when none runs). At interpreter exit (no new threads) they are
        dropped."""
        with self._lock:
            self._queue.extend(items)
            if not self._queue or self._thread is not None:
                return
            thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            try:
                thread.start()
            except RuntimeError:  # the interpreter is exiting
                self._queue.clear()
                return
            self._thread = thread

    def join(self, timeout: float | None = None) -> None:
        """Wait for the work under way, if any (at most ``timeout`` seconds)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._lock:
                batch, self._queue = self._queue, []
                if not batch:
                    self._thread = None
                    return
            try:
                self._work(batch)
            except Exception:  # noqa: BLE001 - a background task must never take the process down
                log.exception("plancache: %s failed (%d items)", self._what, len(batch))
