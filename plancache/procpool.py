"""A pool of spawned processes whose results come back in submission order, isolating native crashes.

Building a cuDNN plan is CPU work inside native code: it does not run in parallel on threads, and a
bug in it can kill the process. :class:`OrderedPool` runs such tasks in ``spawn``-ed processes. When a
process dies, the pool is restarted, the task being waited for is retried alone (so the crash is pinned
on the task that caused it: a second death reports it as :class:`Crashed`), and the later tasks are
resubmitted; the caller never sees ``BrokenProcessPool``. Several batches may be outstanding at once (tasks run
first in, first out): a restart for one batch's crash resubmits the other batches' unfinished tasks too, as each
is consumed.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import CancelledError, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def _nothing() -> None:
    """A task that makes a process start."""


@dataclass(frozen=True)
class Crashed(Generic[T]):
    """``item``'s task killed its process twice, the second time running alone."""

    item: T


class OrderedPool:
    """``processes`` spawned workers, each set up once by ``initializer(*initargs)``; started on first use."""

    def __init__(self, processes: int, *, initializer: Callable[..., None] | None = None,
                 initargs: tuple[Any, ...] = ()) -> None:
        if processes < 1:
            raise ValueError(f"an OrderedPool needs at least 1 process, got {processes}")
        self.processes = processes
        self._initializer = initializer
        self._initargs = initargs
        self._executor: ProcessPoolExecutor | None = None
        self.restarts = 0

    def _pool(self) -> ProcessPoolExecutor:
        if self._executor is None:
            self._executor = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=self._initializer, initargs=self._initargs)
        return self._executor

    def _restart(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        self._executor = None
        self.restarts += 1

    def map_ordered(self, fn: Callable[[T], R], items: Sequence[T]) -> Generator[R | Crashed[T], None, None]:
        """Submit ``fn(item)`` for every item now; the iterator yields results in ``items`` order.

        ``fn`` and the items must pickle; an exception raised by ``fn`` is re-raised here (tasks should
        return failures as data). Closing the iterator early cancels the tasks not yet started."""
        futures = {k: self._submit(fn, item) for k, item in enumerate(items)}
        return self._results(fn, items, futures)

    def _submit(self, fn: Callable[[T], R], item: T) -> Future[R]:
        """``fn(item)`` on the pool; a pool that broke meanwhile (a task killed its process while others were
        being submitted) gives a future that fails with ``BrokenProcessPool``, handled where it is consumed."""
        try:
            return self._pool().submit(fn, item)
        except BrokenProcessPool as exc:
            failed: Future[R] = Future()
            failed.set_exception(exc)
            return failed

    def _results(self, fn: Callable[[T], R], items: Sequence[T],
                 futures: dict[int, Future[R]]) -> Generator[R | Crashed[T], None, None]:
        try:
            for k, item in enumerate(items):
                result: R | Crashed[T]
                while True:
                    try:
                        result = futures.pop(k).result()
                    except CancelledError:  # a restart for another batch's crash cancelled it before it ran
                        futures[k] = self._submit(fn, item)
                        self._resubmit_unfinished(fn, items, futures)
                        continue
                    except BrokenProcessPool:
                        result = self._alone(fn, item)
                        self._resubmit_unfinished(fn, items, futures)
                    break
                yield result
        finally:
            for fut in futures.values():
                fut.cancel()

    def _resubmit_unfinished(self, fn: Callable[[T], R], items: Sequence[T], futures: dict[int, Future[R]]) -> None:
        """The batch's later tasks after a restart: keep what finished, run the rest again."""
        for j, fut in list(futures.items()):
            if not (fut.done() and not fut.cancelled() and fut.exception() is None):
                futures[j] = self._submit(fn, items[j])

    def _alone(self, fn: Callable[[T], R], item: T) -> R | Crashed[T]:
        """Run ``item`` on a fresh pool with nothing else submitted; a second death is its own."""
        self._restart()
        try:
            return self._submit(fn, item).result()
        except BrokenProcessPool:
            self._restart()
            return Crashed(item)

    def start(self) -> None:
        """Start every process now (each runs the initializer) instead of one by one as work arrives."""
        pool = self._pool()
        for _ in range(self.processes):
            pool.submit(_nothing)

    def close(self) -> None:
        """Stop the processes (waiting for running tasks); the pool starts again if used later."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> OrderedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
