"""A pool of spawned processes whose results come back in submission order, isolating native crashes and hangs.

Building a cuDNN plan is CPU work inside native code: it does not run in parallel on threads, a bug in it can kill
the process, and a compile can hang. :class:`OrderedPool` runs such tasks in ``spawn``-ed processes, one task per
process at a time, so the pool knows which task each process runs:

- a process that dies takes only its own task with it: the task runs once more on a fresh process, and a second
  death is reported as :class:`Crashed`;
- a task running longer than ``task_timeout`` seconds (counted from when its process took it) has its process
  killed and is reported as :class:`TimedOut`;

and in both cases only that process is replaced; the other processes' tasks go on. Several batches may be
outstanding at once; tasks run first in, first out. A management thread hands out the tasks and collects the
results, so processes stay busy while the caller is doing something else.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import os
import pickle
import threading
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

#: What a pool process sends once its initializer has run.
_READY = "ready"


@dataclass(frozen=True)
class Crashed(Generic[T]):
    """``item``'s task killed its process twice."""

    item: T


@dataclass(frozen=True)
class TimedOut(Generic[T]):
    """``item``'s task ran longer than ``seconds`` and its process was killed."""

    item: T
    seconds: float


def _serve(conn: Connection, environ: dict[str, str], setup: bytes) -> None:
    """A pool process: set ``environ``, then unpickle ``setup`` (the initializer and its arguments: their modules
    are imported only now, under that environment), set up, say so, then run one task at a time until told to stop
    (None or a closed pipe)."""
    os.environ.update(environ)
    initializer, initargs = pickle.loads(setup)
    if initializer is not None:
        initializer(*initargs)
    conn.send(_READY)
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        fn, item = task
        try:
            reply: tuple[bool, Any] = (True, fn(item))
        except Exception as exc:  # noqa: BLE001 - re-raised in the caller
            reply = (False, exc)
        try:
            conn.send(reply)  # pickled whole before anything is written
        except Exception as exc:  # noqa: BLE001 - a result or exception that does not pickle
            conn.send((False, RuntimeError(f"the task's outcome could not be sent back: {exc!r}")))


class _StartFailed(Exception):
    """A pool process died before it was ready; the cause says how."""


@dataclass(eq=False)
class _Task:
    fn: Callable[[Any], Any]
    item: Any
    future: Future[Any] = field(default_factory=Future)
    crashes: int = 0


@dataclass(eq=False)
class _Process:
    process: BaseProcess
    conn: Connection
    ready: bool = False
    task: _Task | None = None
    started: float = 0.0


class OrderedPool:
    """``processes`` spawned workers, each set up once by ``initializer(*initargs)``; started on first use.
    ``task_timeout``: seconds a task may run before its process is killed (None: no limit). ``environ``: variables
    each process sets before it imports anything of the initializer's or the tasks' (a library that reads one at
    start-up, such as CUDA's ``CUDA_VISIBLE_DEVICES``, sees it), while this process's own environment is left
    alone (changing it while other threads run is not safe)."""

    def __init__(self, processes: int, *, initializer: Callable[..., None] | None = None,
                 initargs: tuple[Any, ...] = (), task_timeout: float | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        if processes < 1:
            raise ValueError(f"an OrderedPool needs at least 1 process, got {processes}")
        if task_timeout is not None and not task_timeout > 0:
            raise ValueError(f"task_timeout must be positive seconds or None, got {task_timeout}")
        self.processes = processes
        self.task_timeout = task_timeout
        self._setup = pickle.dumps((initializer, initargs))
        self._environ = dict(environ or {})
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._queue: collections.deque[_Task] = collections.deque()
        self._manager: threading.Thread | None = None
        self._stopping = False
        self._wake_r, self._wake_w = -1, -1
        #: Processes replaced so far (after a crash, a timeout or a failed start).
        self.restarts = 0

    # ------------------------------------------------------------ the caller's side

    def map_ordered(self, fn: Callable[[T], R],
                    items: Sequence[T]) -> Generator[R | Crashed[T] | TimedOut[T], None, None]:
        """Submit ``fn(item)`` for every item now; the iterator yields results in ``items`` order.

        ``fn`` and the items must pickle; an exception raised by ``fn`` is re-raised here (tasks should return
        failures as data). Closing the iterator early cancels the tasks not yet started."""
        tasks = [_Task(fn, item) for item in items]
        with self._lock:
            self._queue.extend(tasks)
            self._ensure_started()
            self._wake()
        return self._results(tasks)

    @staticmethod
    def _results(tasks: list[_Task]) -> Generator[Any, None, None]:
        try:
            for task in tasks:
                yield task.future.result()
        finally:
            for task in tasks:
                task.future.cancel()  # only those not started yet

    def start(self) -> None:
        """Start every process now (each runs the initializer) instead of with the first task."""
        with self._lock:
            self._ensure_started()

    def close(self) -> None:
        """Cancel the tasks not started, wait for the running ones (at most ``task_timeout``), stop the processes.
        The pool starts again if used later."""
        with self._lock:
            manager = self._manager
            if manager is None:
                return
            self._stopping = True
            self._wake()
        manager.join()

    def __enter__(self) -> OrderedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ the management thread

    def _ensure_started(self) -> None:
        """Spawn the processes and the thread that runs them, unless running (call with the lock held)."""
        if self._manager is not None:
            return
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        procs = [self._spawn() for _ in range(self.processes)]
        self._manager = threading.Thread(target=self._manage, args=(procs,), daemon=True, name="procpool-manager")
        self._manager.start()

    def _wake(self) -> None:
        """Make the management thread look at the queue again (call with the lock held: the pipe stays open)."""
        with contextlib.suppress(BlockingIOError):  # already woken: the pipe is full
            os.write(self._wake_w, b"x")

    def _spawn(self) -> _Process:
        ours, theirs = self._context.Pipe()
        process = self._context.Process(target=_serve, args=(theirs, self._environ, self._setup), daemon=True)
        process.start()
        theirs.close()
        return _Process(process, ours)

    @staticmethod
    def _taken(task: _Task) -> bool:
        """Mark ``task`` running; False when it was cancelled (a task run again after a crash is running already)."""
        return task.future.running() or task.future.set_running_or_notify_cancel()

    def _next_task(self) -> _Task | None:
        with self._lock:
            if self._stopping:
                while self._queue:
                    self._queue.popleft().future.cancel()
            while self._queue:
                task = self._queue.popleft()
                if self._taken(task):
                    return task
        return None

    def _manage(self, procs: list[_Process]) -> None:
        error: BaseException | None = None
        try:
            while self._step(procs):
                pass
        except _StartFailed as exc:
            error = exc.__cause__
        except BaseException as exc:  # noqa: BLE001 - every waiting caller learns of it
            error = exc
            raise
        finally:
            for p in procs:
                self._stop(p, kill=error is not None)
            with self._lock:
                self._manager, self._stopping = None, False
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_r, self._wake_w = -1, -1
                queued, self._queue = list(self._queue), collections.deque()
            for task in queued:  # submitted while the thread ended
                if error is None:
                    task.future.cancel()
                elif self._taken(task):
                    task.future.set_exception(error)
            if error is not None:
                self._fail_running(procs, error)

    def _step(self, procs: list[_Process]) -> bool:
        """Hand out tasks, wait for one event, handle it; False once stopping and nothing runs."""
        for p in procs:
            if p.ready and p.task is None and (task := self._next_task()) is not None:
                p.task, p.started = task, time.monotonic()
                try:
                    p.conn.send((task.fn, task.item))
                except Exception as exc:  # noqa: BLE001 - a task that does not pickle
                    p.task = None
                    task.future.set_exception(exc)
        with self._lock:
            stopping = self._stopping
        if stopping and not any(p.task for p in procs):
            return False
        deadlines = [p.started + self.task_timeout for p in procs if p.task and self.task_timeout is not None]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        events = wait([self._wake_r, *(p.conn for p in procs)], timeout)
        if self._wake_r in events:
            os.read(self._wake_r, 4096)
        for n, p in enumerate(procs):
            if p.conn in events:
                try:
                    message = p.conn.recv()
                except (EOFError, OSError):  # the process died
                    procs[n] = self._died(p)
                    continue
                if message == _READY:
                    p.ready = True
                elif p.task is not None:
                    task, p.task = p.task, None
                    ok, value = message
                    if ok:
                        task.future.set_result(value)
                    else:
                        task.future.set_exception(value)
            elif p.task is not None and self.task_timeout is not None and \
                    time.monotonic() >= p.started + self.task_timeout:
                task, p.task = p.task, None
                procs[n] = self._replace(p)  # killed before the caller learns of it
                task.future.set_result(TimedOut(task.item, self.task_timeout))
        return True

    def _died(self, p: _Process) -> _Process:
        """A process that died: its task runs once more (a second death is :class:`Crashed`). One that died before
        it was ready (its initializer failed) stops the pool, failing every task: its replacement would fail too."""
        if not p.ready:
            p.process.join()
            raise _StartFailed from ChildProcessError(
                f"a pool process exited with code {p.process.exitcode} while starting (its initializer failed)")
        task, p.task = p.task, None
        replacement = self._replace(p)
        if task is not None:
            task.crashes += 1
            if task.crashes >= 2:
                task.future.set_result(Crashed(task.item))
            else:
                with self._lock:
                    self._queue.appendleft(task)
        return replacement

    def _replace(self, p: _Process) -> _Process:
        self._stop(p, kill=True)
        self.restarts += 1
        return self._spawn()

    @staticmethod
    def _fail_running(procs: list[_Process], exc: BaseException) -> None:
        for p in procs:
            if p.task is not None:
                p.task.future.set_exception(exc)
                p.task = None

    @staticmethod
    def _stop(p: _Process, *, kill: bool = False) -> None:
        """End ``p``: killed at once, or asked to exit (killed if it does not within a few seconds)."""
        if not kill:
            with contextlib.suppress(OSError):  # already gone
                p.conn.send(None)
            p.process.join(5.0)
        if p.process.is_alive():
            p.process.kill()
            p.process.join()
        p.conn.close()
