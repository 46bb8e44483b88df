"""The autotune policy in the background of a server process (:mod:`plancache.store.autotune` says what one step
does). Never on a request's path: a daemon thread runs a step every ``PLANCACHE_AUTOTUNE_INTERVAL`` seconds
(each replica runs its own; the store serializes them), and ``POST /v1/admin/autotune/run`` runs one at once."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from fastapi import Request

from ..protocol import Job
from ..settings import ServerSettings
from ..store import Store
from ..store.autotune import AutotunePolicy, run_autotune
from ..store.db import utcnow

log = logging.getLogger("plancache.server")


def autotune_policy(request: Request) -> AutotunePolicy | None:
    """The app's autotune policy, or None when ``PLANCACHE_AUTOTUNE`` is off (for explaining misses)."""
    policy: AutotunePolicy = request.app.state.autotuner.policy
    return policy if request.app.state.settings.autotune else None


def policy_from(settings: ServerSettings) -> AutotunePolicy:
    return AutotunePolicy(min_misses=settings.autotune_min_misses, jobs_per_hour=settings.autotune_jobs_per_hour,
                          worker_window=timedelta(seconds=settings.autotune_worker_window))


@dataclass
class Autotuner:
    """Runs the policy's steps for one server process and remembers the last one."""

    store: Callable[[], Store | None]
    policy: AutotunePolicy
    interval: float
    counted: Callable[[int], None] = lambda n: None  # told how many jobs each step created (the metrics)
    last_run_at: datetime | None = None
    last_enqueued: int = 0
    last_error: str | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def step(self) -> list[Job]:
        """One step now (the admin route, and each tick of the thread)."""
        store = self.store()
        if store is None:
            return []
        with self._lock:
            try:
                created = run_autotune(store, self.policy)
            except Exception as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                raise
            self.last_run_at, self.last_enqueued, self.last_error = utcnow(), len(created), None
        self.counted(len(created))
        if created:
            log.info("plancache: autotune enqueued %d jobs (%s)", len(created),
                     ", ".join(f"{j.graph_key[:12]} on sm{j.target.sm}" for j in created[:5]))
        return created

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="plancache-autotune", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.step()
            except Exception:  # a database hiccup: logged, the next tick tries again
                log.warning("plancache: autotune step failed", exc_info=True)
