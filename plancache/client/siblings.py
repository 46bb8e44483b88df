"""The tuned plans of a graph's other shapes, fetched ahead of their first call (``PLANCACHE_PREFETCH_SIBLINGS``).

A model that runs attention at one batch size or sequence length soon runs it at others, and each new shape's first
call would wait for a round trip to the server. Once a load brings plans from the server, their graphs that have
shape axes (:func:`plancache.spec.axes.sibling_key`: attention forward and backward) are asked about on a background
thread, once per sibling key and process: one ``POST /v1/plans/siblings`` names the plans the server holds for the
same graphs at other shapes on this GPU (up to the setting's count per graph, the most recently published first),
and the cache then fetches and verifies theirs like a warm start (:meth:`~plancache.client.PlanCache.warm`: the disk
cache first, then one resolve with the blobs inline; kept in memory and written to the disk cache). They are not
deserialized here: the thread makes no CUDA call, so a CUDA graph captured meanwhile on another thread (in torch's
default global capture mode) is never disturbed. A later new shape among them loads with no request
(``stats().hits["memory"]``) and deserializes its plans at its first call. Counted in ``stats().siblings``. A server
without the route (API 1.3 or older: it answers 405) is asked once; after a failure (logged) a graph's siblings are
asked about again when another of its shapes is loaded from the server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ..errors import PlanCacheError, SpecError
from ..protocol import MAX_SIBLING_KEYS
from .background import Background

if TYPE_CHECKING:
    from ..spec import GraphSpec
    from .context import LoadContext

log = logging.getLogger("plancache.client")

#: What a server without ``POST /v1/plans/siblings`` answers it: 405 (its ``GET /v1/plans/{graph_key}`` takes the
#: path), or 404.
NO_ROUTE = frozenset({404, 405})


class Siblings:
    """Fetches the plans of other shapes of the graphs :meth:`offer` is given, on one background thread, into the
    cache through ``warm`` (:meth:`~plancache.client.PlanCache.warm`); ``limit`` per graph (0: never)."""

    def __init__(self, context: LoadContext, limit: int, warm: Callable[[list[GraphSpec]], Any]) -> None:
        self.context = context
        self.limit = limit
        self._warm = warm
        self._seen: set[str] = set()  # graph keys offered or fetched as siblings: each is looked at once
        self._asked: set[str] = set()  # sibling keys asked about (or being asked about)
        self._lock = threading.Lock()
        self._background = Background("plancache-siblings", self.fetch, "fetching the plans of other shapes")
        self._off = context.remote is None or limit <= 0

    def offer(self, specs: Iterable[GraphSpec]) -> None:
        """Graphs whose plans a load just brought from the server: their siblings are asked about (started
        on the background thread when none runs); a graph once per process, cheaply skipped when it has no axes."""
        from ..spec.axes import AXES

        if self._off:
            return
        with self._lock:
            fresh = [s for s in specs if s.graph_key not in self._seen and all(n.type in AXES for n in s.nodes)]
            self._seen.update(s.graph_key for s in fresh)
        self._background.put(fresh)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the fetches under way, if any (at most ``timeout`` seconds)."""
        self._background.join(timeout)

    def fetch(self, specs: list[GraphSpec]) -> None:
        """Ask the server for the siblings of ``specs`` (those whose sibling key was not asked about yet), then fetch
        and keep their plans through ``warm``, within the cache's ``request_deadline`` each."""
        from ..spec import parse_spec
        from ..spec.axes import sibling_key

        c = self.context
        if self._off:
            return
        asking: dict[str, str] = {}  # sibling key -> the graph key asked about
        for spec in specs:
            shared = sibling_key(spec)
            with self._lock:
                if shared is None or shared in self._asked:
                    continue
                self._asked.add(shared)
            asking[shared] = spec.graph_key
        shared_keys = list(asking)
        for start in range(0, len(shared_keys), MAX_SIBLING_KEYS):
            part = shared_keys[start:start + MAX_SIBLING_KEYS]
            assert c.remote is not None
            try:
                docs = c.remote.siblings(c.environment, [asking[shared] for shared in part], limit=self.limit,
                                         deadline=time.monotonic() + c.request_deadline)
            except PlanCacheError as exc:
                if exc.http_status in NO_ROUTE:  # a server of API 1.3 or older
                    log.info("plancache: %s does not list the plans of other shapes (an older server): not asked "
                             "again", c.remote.where)
                    self._off = True
                    return
                log.info("plancache: the plans of other shapes of %d graphs were not listed: %s", len(part), exc.message)
                with self._lock:
                    self._asked.difference_update(part)  # asked again at another shape's load
                continue
            with self._lock:  # no more than asked for, whatever the answer holds (a load's offer waits on this lock)
                new = {k: doc for k, doc in list(docs.items())[:self.limit * len(part)] if k not in self._seen}
                self._seen.update(new)
            wanted = []
            for key, doc in new.items():
                try:
                    wanted.append(parse_spec(doc))
                except SpecError as exc:
                    log.debug("plancache: a sibling spec %s was not read: %s", key[:12], exc.message)
            fresh = [s for s in wanted if s.graph_key not in c.verified and s.graph_key not in c.memory]
            if fresh:
                kept = len(self._warm(fresh))
                with c.lock:
                    c.stats.siblings += kept
