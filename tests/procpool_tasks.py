"""Tasks for tests/unit/test_procpool.py: importable by the spawned processes of an OrderedPool."""

from __future__ import annotations

import os
import time


def square_after(item: tuple[int, float]) -> int:
    """``n * n`` after sleeping ``delay`` seconds (later items finish first when their delay is shorter)."""
    n, delay = item
    time.sleep(delay)
    return n * n


def crash_on(item: tuple[int, str]) -> int:
    """Kill this process (like a native crash) for the items marked ``crash``; else ``n + 1``."""
    n, what = item
    if what == "crash":
        os._exit(17)
    return n + 1


def crash_once(item: tuple[int, str]) -> int:
    """Kill the process the first time ``n`` runs (a marker file remembers); succeed on the retry."""
    n, marker = item
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(17)
    return n


def raise_for(item: int) -> int:
    if item == 2:
        raise ValueError("task 2 is bad")
    return item


def pid(item: int) -> int:
    """This process's id, after a pause long enough for the other processes to take the next items."""
    time.sleep(0.1)
    return os.getpid()


def finished_at(item: tuple[int, float]) -> tuple[int, float]:
    """``(n, the wall-clock time it finished)`` after sleeping ``delay`` seconds."""
    n, delay = item
    time.sleep(delay)
    return n, time.time()


def hang_on(item: tuple[int, str]) -> int:
    """Never return for the items marked ``hang`` (like a deadlocked compile); else ``n + 1``."""
    n, what = item
    while what == "hang":
        time.sleep(60)
    return n + 1


def exit_at_start() -> None:
    """An initializer that fails: the process exits before it is ready."""
    os._exit(3)


def build_or_hang(task: tuple[str, str, int, tuple[int | None, tuple[tuple[str, int], ...]]]) -> int:
    """A stand-in for a builder's task (``gpu.candidates._build_task``'s argument): the candidate index, or never
    returning for index 1 (a hung compile)."""
    index = task[2]
    while index == 1:
        time.sleep(60)
    return index
