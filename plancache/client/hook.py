"""Opt-in: route FE's own ``pygraph.build()`` (and so ``@cudnn.jit`` and ``@cudnn.graph_cache`` code) through a
:class:`~plancache.client.PlanCache`.

::

    cache = PlanCache()
    with plancache.client.hook.installed(cache):   # or hook.install(cache) for the whole process
        g, uids = my_jit_graph(...)                 # @cudnn.jit calls g.build(); plancache serves it

While installed, ``pygraph.build(heuristics)`` calls ``cache.build(graph)`` instead. A graph the spec
cannot represent (a score_mod callback, say) is built by FE as usual, with a log line saying why.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

from ..errors import UnsupportedGraph
from .core import PlanCache

log = logging.getLogger("plancache.client")

_lock = threading.Lock()
_original: Any = None
_cache: PlanCache | None = None


def install(cache: PlanCache) -> None:
    """Route every ``cudnn.pygraph.build()`` in this process through ``cache`` until :func:`uninstall`."""
    import cudnn

    global _original, _cache
    with _lock:
        if _original is None:
            _original = cudnn.pygraph.build
            cudnn.pygraph.build = _build
        _cache = cache


def uninstall() -> None:
    """Give ``cudnn.pygraph.build`` back to FE."""
    import cudnn

    global _original, _cache
    with _lock:
        if _original is not None:
            cudnn.pygraph.build = _original
        _original, _cache = None, None


@contextlib.contextmanager
def installed(cache: PlanCache) -> Iterator[PlanCache]:
    """:func:`install` for the duration of a ``with`` block."""
    install(cache)
    try:
        yield cache
    finally:
        uninstall()


def _build(graph: Any, heuristics: Any = None, ctx: Any = None) -> Any:
    cache, original = _cache, _original
    if cache is None or original is None or ctx is not None:
        return (original or type(graph).build)(graph, heuristics, ctx=ctx)
    try:
        cache.build(graph)
    except UnsupportedGraph as exc:
        log.info("plancache: building %s with FE directly: %s", getattr(graph, "_cpp_graph_kwargs", {}).get("name"), exc)
        original(graph, heuristics)
    return None
