"""A warm start: the plans of the graphs a process will build, fetched and verified on a background thread before
they are built (:meth:`~plancache.client.PlanCache.warm`), from a capture file or specs and their variants along
shape axes (:mod:`plancache.client.capture`). The hook starts one at install and waits for it at each build."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from ..errors import SpecError
from .context import Mode
from .core import PlanCache, SpecLike

if TYPE_CHECKING:
    from ..spec import GraphSpec

log = logging.getLogger("plancache.client")

#: What a warm start takes: a capture file, or specs.
WarmSource = str | os.PathLike[str] | Iterable[SpecLike]
#: What loads a warm start's named plans in place of the cache (a spec, its verified blob): True when it took it.
WarmLoader = Callable[["GraphSpec", bytes], bool]


def warm_specs(mode: Mode, source: WarmSource, axes: Mapping[str, Sequence[int]]) -> list[GraphSpec]:
    """The specs a warm start fetches: those of ``source``, then their variants along ``axes`` (of the specs that have
    them all); an unusable capture file raises in strict and replay-only ``mode``, and warms nothing in normal mode."""
    from ..spec import parse_spec
    from ..spec.axes import AXES, AXIS_ALIASES, axes_of, variants
    from .capture import read_capture

    known = {axis for by_node in AXES.values() for axis in by_node} | set(AXIS_ALIASES)
    unknown = sorted(set(axes) - known)
    if unknown:
        raise ValueError(f"warm_vary: no shape axis {', '.join(unknown)} (axes: {', '.join(sorted(known))})")
    bad = [f"{axis}={n!r}" for axis, sizes in axes.items() for n in sizes
           if not isinstance(n, int) or isinstance(n, bool) or n < 1]
    if bad:
        raise ValueError(f"warm_vary: sizes are positive integers, not {', '.join(bad)}")
    if isinstance(source, (str, os.PathLike)):
        try:
            specs = [spec for spec, _ in read_capture(source)]
        except SpecError as exc:
            if mode != "normal":
                raise
            log.warning("plancache: no warm start: %s", exc.message)
            return []
    else:
        specs = [parse_spec(s) for s in source]
    varied = []
    for spec in specs:
        if axes and set(axes) <= set(axes_of(spec)):
            try:
                varied += [variant for _, variant in variants(spec, axes)]
            except SpecError as exc:  # a graph whose other tensors would have to move too: itself only
                log.info("plancache: warm start: no variants of %s: %s", spec.name or spec.graph_key[:12], exc.message)
    return specs + varied


class WarmStart:
    """The warm start of a process: one background thread at a time, waited for by the graphs built meanwhile."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._loaded = threading.Event()  # the thread's fetches and loads are done (what builds wait for)

    def start(self, cache: PlanCache, specs: list[GraphSpec], load: Collection[str] = (),
              loader: WarmLoader | None = None, *, whole: Callable[[GraphSpec], bool] | None = None,
              then: Callable[[], None] | None = None) -> None:
        """Fetch and verify the plans of ``specs`` into ``cache`` on a thread of its own, and deserialize those of
        the specs named one of ``load`` (:meth:`PlanCache.warm`'s ``load``): by ``loader(spec, blob)`` where it
        returns True, else into an empty graph each; and those of the specs ``whole`` says a graph takes loaded on
        its own (FE's norm ops': :func:`plancache.client.fe_ops.held_whole`), into an empty graph each. Where any
        is, ``then()`` runs on that thread last (FE's norm ops' handles made ahead), not waited for by builds."""
        named = frozenset(s.graph_key for s in specs if s.name in load)
        held = frozenset(s.graph_key for s in specs if whole is not None and whole(s)) - named
        loaded = threading.Event()
        thread = threading.Thread(target=_warm, args=(cache, specs, named, held, loader, loaded,
                                                      then if held else None), name="plancache-warm", daemon=True)
        self._thread, self._loaded = thread, loaded
        thread.start()

    def wait(self) -> None:
        """Wait for the warm start under way to have fetched and loaded its plans (not from its own thread)."""
        thread, loaded = self._thread, self._loaded
        if thread is not None and thread is not threading.current_thread():
            loaded.wait()

    def join(self) -> None:
        """Wait for the warm start under way to end, what it does after its loads included (not from its own
        thread)."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def forget(self) -> None:
        """No warm start is under way any more (the hook was uninstalled)."""
        self._thread = None


def _warm(cache: PlanCache, specs: list[GraphSpec], named: frozenset[str], held: frozenset[str],
          loader: WarmLoader | None, loaded: threading.Event, then: Callable[[], None] | None) -> None:
    try:
        _load(cache, specs, named, held, loader)
    finally:
        loaded.set()
    if then is not None:
        try:
            then()
        except Exception as exc:  # noqa: BLE001 - what comes after the loads is never needed: logged only
            log.warning("plancache: warm start: the work after its loads failed (%s: %s)", type(exc).__name__, exc)


def _load(cache: PlanCache, specs: list[GraphSpec], named: frozenset[str], held: frozenset[str],
          loader: WarmLoader | None) -> None:
    t0 = time.perf_counter()
    try:
        if loader is None:
            kept = cache.warm(specs, load=named | held)
        else:  # fetched and verified (kept): the loader loads what it can of those named, the cache the rest
            kept = cache.warm(specs, load=held)
            verified = cache.context.verified
            declined = [s for s in specs if s.graph_key in named and s.graph_key in verified
                        and not loader(s, verified[s.graph_key][1])]
            if declined:
                cache.warm(declined, load={s.graph_key for s in declined})
    except Exception as exc:  # noqa: BLE001 - a failed warm start only leaves each graph to the ladder, as without it
        log.warning("plancache: warm start failed (%s: %s); each graph is served when it is built", type(exc).__name__,
                    exc)
        return
    log.info("plancache: warm start: verified plans of %d of %d graphs kept (%d of them loaded) in %.0f ms",
             len(kept), len({s.graph_key for s in specs}), len((named | held).intersection(kept)),
             (time.perf_counter() - t0) * 1000)
