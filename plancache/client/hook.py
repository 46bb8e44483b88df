"""Opt-in: every ``cudnn.pygraph`` the process builds, by any route, takes a :class:`~plancache.client.PlanCache`'s
tuned plan first.

::

    cache = PlanCache()
    with plancache.client.hook.installed(cache):   # or hook.install(cache) for the whole process
        out = cudnn.sdpa_torch(q, k, v, ...)        # FE's own ops, cudnn.Graph, @cudnn.jit, g.build(): served

FE builds a graph in five steps: ``validate()`` → ``build_operation_graph()`` → ``create_execution_plans(modes)``
→ ``check_support()`` → ``build_plans(policy)``; ``build()``, ``@cudnn.jit``, ``@cudnn.graph_cache``,
``cudnn.Graph``, ``cudnn.sdpa_torch`` and ``cudnn.ops.norm`` all run these. While installed:

- ``validate()`` first reads the graph's spec (FE's IR, before lowering) and renumbers its auto-assigned uids to
  the canonical ones; uids the caller set never change.
- ``create_execution_plans(modes)`` records ``modes`` and defers: the heuristic query is what a served graph
  skips. ``check_support()`` of a deferred graph is answered by ``build_plans``.
- ``build_plans()`` asks the cache (:meth:`PlanCache.serve`: memory, disk, server, the rebuild of a tuned
  record; never a local heuristic build) and loads the tuned plan into the caller's graph, which then runs
  with its own ``execute`` (Tensor handles, names or uids), ``get_workspace_size`` and CUDA-graph capture.
  On a miss in normal mode FE runs the deferred steps exactly as the caller asked them (same heuristic modes,
  filters and policy); in strict and replay-only mode :class:`~plancache.errors.PlanMiss` is raised.
- FE's norm ops (``cudnn.ops.norm``) are served whole (:mod:`plancache.client.fe_ops`): a new shape's graph in
  the op's graph cache is the served plan loaded on its own; FE never lowers or builds the op's graph.
- With a capture file (``install(..., capture=FILE)`` or ``PLANCACHE_CAPTURE=FILE``) every graph whose spec is read
  is also counted into that file (:mod:`plancache.client.capture`); ``install(None, capture=FILE)`` only captures
  (FE builds every graph itself), which is what ``plancache capture -- CMD`` does.
- A warm start (``install(cache, warm=FILE)`` or ``PLANCACHE_WARM=FILE``, a capture file of an earlier run, or
  ``warm=specs``): on a background thread, the plans of all those graphs (and of their variants along the shape axes
  of ``warm_vary``) are fetched and verified in one resolve round trip (:meth:`PlanCache.warm`); a graph built later
  waits for it, then loads its kept blob with no further request.
- Each graph is served by a cache of its own device (its handle's, else the thread's current one): the installed
  cache for its device, and for another device a cache the hook makes with the same options on that device
  (:func:`caches`); a cache whose backend cannot be made for another device leaves such a graph to FE (strict and
  replay-only: :class:`~plancache.errors.PlanMiss`). A served plan needing more workspace than
  ``PLANCACHE_HOOK_MAX_WORKSPACE_BYTES`` is refused before it is loaded (``stats().rejects["workspace"]``), and FE
  builds the graph as on a miss.
- An unexpected error of the hook's own (not FE's) leaves the graph to FE in normal mode, logged once and counted
  (``fe_builds["error"]``); strict and replay-only mode raise it.
- A call that chooses among FE's own candidates (``build_plans(ALL)``, the plan-index APIs, engine and note
  filters, ``create_execution_plan``), a graph the spec cannot represent (a ``score_mod`` callback), an
  override-shape graph and a graph validated before the hook was installed are built by FE unchanged, with
  one log line saying why, and counted in ``stats().fe_builds`` -- never a plan the caller did not ask for.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import PlanCacheError, PlanMiss, SpecError, UnsupportedGraph
from . import fe_ops
from .core import PlanCache
from .startup import WarmLoader, WarmStart, warm_specs
from .startup import WarmSource as WarmSource  # plancache.torch names it hook.WarmSource

if TYPE_CHECKING:
    from ..spec import GraphSpec

log = logging.getLogger("plancache.client")

__all__ = ["FE_BUILD_REASONS", "PLAN_LIST_CALLS", "caches", "install", "installed", "uninstall"]

#: ``stats().fe_builds`` keys: why the hook left a graph to FE.
FE_BUILD_REASONS = {
    "miss": "no tuned plan for this environment (normal mode)",
    "unsupported": "the spec cannot represent the graph",
    "override_shape": "an override-shape graph executes with shapes other than the ones a plan was tuned for",
    "validated_early": "the graph was validated before the hook was installed, so its spec could not be read",
    "fe_candidates": "the caller chooses among FE's own candidate plans",
    "other_device": "the graph is built for another device than the cache's, and no cache can be made for it",
    "error": "the hook itself failed on this graph (normal mode; logged once)",
}

#: Methods that choose among, or read, FE's candidate list: on a deferred graph they make FE plan it first.
PLAN_LIST_CALLS = (
    "build_plan_at_index", "create_execution_plan", "deselect_behavior_notes", "deselect_engines",
    "deselect_numeric_notes", "deselect_workspace_greater_than", "execute_plan_at_index",
    "get_behavior_notes_for_plan_at_index", "get_engine_and_knobs_at_index", "get_plan_name_at_index",
    "get_workspace_size_plan_at_index", "select_behavior_notes", "select_numeric_notes", "select_plan",
)
_PIPELINE = ("validate", "create_execution_plans", "check_support", "build_plans", "get_execution_plan_count")


@dataclass
class _Graph:
    """What the hook knows of one graph."""

    spec: GraphSpec | None
    why_not: str | None = None   # a FE_BUILD_REASONS key when the cache cannot serve it
    detail: str = ""
    deferred: bool = False       # create_execution_plans was recorded, not run
    heuristics: Any = None
    served: bool = False
    fe: bool = False             # FE planned it (the hook no longer steps in); never while deferred
    missed: bool = False         # offered whole (fe_ops) and the cache had no plan: build_plans does not ask again


_lock = threading.Lock()
_local = threading.local()       # .inside: the hook's own calls into FE (the ladder building in a graph)
_cache: PlanCache | None = None
_originals: dict[type, dict[str, Any]] = {}  # per patched class, what its own __dict__ held
_graphs: weakref.WeakKeyDictionary[Any, _Graph] = weakref.WeakKeyDictionary()
_recorder: Any = None            # a capture.Recorder while capturing
_counted: weakref.WeakSet[Any] = weakref.WeakSet()  # graphs the recorder counted
_warm_start = WarmStart()        # the warm start under way or done
_devices: dict[int | None, PlanCache] = {}  # caches the hook made for devices other than the installed cache's
_max_workspace: int | None = None  # PLANCACHE_HOOK_MAX_WORKSPACE_BYTES (None: no cap)
_error_logged = False            # the first error of the hook's own was logged with its traceback

def install(cache: PlanCache | None, *, graph_class: type | None = None, capture: str | os.PathLike[str] | None = None,
            warm: WarmSource | None = None, warm_vary: Mapping[str, Sequence[int]] | None = None,
            warm_load: Collection[str] = (), warm_loader: WarmLoader | None = None) -> None:
    """Route every build of a ``graph_class`` (default ``cudnn.pygraph``) in this process through ``cache`` until
    :func:`uninstall`. Installing again switches the cache. ``capture`` (default ``PLANCACHE_CAPTURE``): a capture file
    that counts every graph built; with ``cache`` None the hook only captures.

    ``warm`` (default ``PLANCACHE_WARM``): the graphs this process will build, as a capture file or specs; their plans
    are fetched and verified on a background thread (:meth:`PlanCache.warm`) and each graph built later loads its own
    with no further request. ``warm_vary``: their variants too, at every combination of these sizes of shape axes
    (``{"s": [1024, 2048]}``, :func:`~plancache.spec.axes.variants`), for the graphs that have those axes.
    ``warm_load``: names of graphs whose plans the warm start also deserializes, each into an empty graph of its own
    (graphs run from that loaded graph, as :mod:`plancache.client.sdpa`'s are: their first call loads nothing);
    ``warm_loader(spec, blob)`` loads them instead where it returns True (the attention route's C++ steady path). The
    plans of the graphs FE's norm ops write (:func:`~plancache.client.fe_ops.held_whole`) are deserialized there too,
    where those ops are served whole (torch is imported), and the handles those ops keep per thread made ahead. A
    capture file that cannot be read or is malformed raises :class:`~plancache.errors.SpecError` naming it in strict
    and replay-only mode (nothing is installed); in normal mode it is logged and the hook serves as without it."""
    global _cache, _max_workspace
    from ..settings import ClientSettings  # pydantic-settings: not on the import of this module

    settings = ClientSettings()
    _max_workspace = settings.hook_max_workspace_bytes or None
    if warm is not None and cache is None:
        raise ValueError("a warm start fetches plans into a cache: give install() a PlanCache with warm=")
    warm = warm if warm is not None else settings.warm
    specs = warm_specs(cache.mode, warm, warm_vary or {}) if cache is not None and warm is not None else []
    _start_capture(capture if capture is not None else settings.capture)
    if graph_class is None:
        import cudnn

        graph_class = cudnn.pygraph
    with _lock:
        if graph_class not in _originals:
            missing = [name for name in _PIPELINE if not hasattr(graph_class, name)]
            if missing:  # an FE whose build pipeline is not FE 1.32's: nothing is patched
                raise SpecError(f"{graph_class.__module__}.{graph_class.__qualname__} has no "
                                f"{', '.join(missing)}: plancache's hook patches FE 1.32's build pipeline "
                                "and cannot serve this FE; nothing was installed")
            wrappers = {name: _wrap(name, _find(graph_class, name), _HANDLERS[name]) for name in _PIPELINE}
            wrappers.update({name: _wrap(name, _find(graph_class, name), _plan_list_call)
                             for name in PLAN_LIST_CALLS if hasattr(graph_class, name)})
            _originals[graph_class] = {name: graph_class.__dict__[name] for name in wrappers
                                       if name in graph_class.__dict__}
            for name, wrapper in wrappers.items():
                setattr(graph_class, name, wrapper)
        if cache is not None:
            fe_ops.patch()
        if cache is not _cache:
            _close_device_caches_locked()
        _cache = cache
    if specs and cache is not None:
        whole = fe_ops.patched()
        _warm_start.start(cache, specs, warm_load, warm_loader, whole=fe_ops.held_whole if whole else None,
                          then=functools.partial(_stock_handles, cache) if whole else None)


def uninstall() -> None:
    """Give FE its methods back (graphs already served stay served), after the warm start under way has ended (what
    it does after its loads included)."""
    global _cache
    _warm_start.join()
    with _lock:
        _warm_start.forget()
        for cls, methods in _originals.items():
            for name in (*_PIPELINE, *PLAN_LIST_CALLS):
                if name in methods:
                    setattr(cls, name, methods[name])
                elif name in cls.__dict__:
                    delattr(cls, name)
        _originals.clear()
        fe_ops.unpatch()
        _cache = None
        _close_device_caches_locked()
    _stop_capture()


def caches() -> dict[int | None, PlanCache]:
    """The caches serving the hook's graphs, by CUDA device ordinal: the installed one (under its device, None where
    its backend has no CUDA device) and those made for other devices."""
    with _lock:
        found: dict[int | None, PlanCache] = {} if _cache is None else {_device_index(_cache): _cache}
        return {**found, **_devices}


def _close_device_caches_locked() -> None:
    for made in _devices.values():
        made.close()
    _devices.clear()


def _stock_handles(cache: PlanCache) -> None:
    """FE's norm ops' cuDNN handles made ahead on ``cache``'s CUDA device
    (:func:`~plancache.client.fe_ops.stock_handles`)."""
    index = _device_index(cache)
    if index is None:
        return
    try:
        fe_ops.stock_handles(index, cache._backend.new_handle)
    except Exception as exc:  # noqa: BLE001 - only made ahead: each thread's first op makes its own, as without it
        log.info("plancache: FE's norm ops' cuDNN handles were not made ahead (%s: %s); each thread's first op makes "
                 "its own", type(exc).__name__, exc)


def _device_index(cache: PlanCache) -> int | None:
    return getattr(cache._backend.device, "index", None)


def _device_of(graph: Any) -> int | None:
    """The CUDA device FE builds ``graph`` for: its handle's, else the thread's current device (FE's default handle is
    the current device's); None where neither is known."""
    handle = getattr(graph, "_handle", None)
    ordinal = getattr(handle, "_ordinal", None)
    if ordinal is None and handle is not None:
        ordinal = getattr(getattr(handle, "device", None), "ordinal", None)  # FE's own answer
    if ordinal is None:
        torch = sys.modules.get("torch")  # FE's ops have imported it; the hook does not import it itself
        if torch is not None and torch.cuda.is_available():
            ordinal = torch.cuda.current_device()
    return None if ordinal is None else int(ordinal)


def _cache_for(graph: Any, cache: PlanCache) -> PlanCache | None:
    """The cache that serves ``graph``: ``cache`` on its own device (or where a device is unknown), else the cache
    made for the graph's device with ``cache``'s options (made on first use); None where ``cache``'s backend cannot be
    made for another device."""
    mine, theirs = _device_index(cache), _device_of(graph)
    if mine is None or theirs is None or theirs == mine:
        return cache
    with _lock:
        made = _devices.get(theirs)
        if made is None:
            for_device = getattr(cache._backend, "for_device", None)
            if for_device is None:
                return None
            # the environment is that device's own fingerprint (another GPU model is another environment)
            made = _devices[theirs] = PlanCache(replace(cache.config, backend=for_device(theirs), environment=None))
            log.info("plancache: the hook serves cuda:%d from a cache of its own (%s)", theirs,
                     made.environment.describe())
        return made


def _hook_failed(cache: PlanCache, exc: Exception) -> None:
    """An error of the hook's own: raised in strict and replay-only mode; in normal mode logged (with its traceback
    the first time in the process) and FE builds the graph."""
    global _error_logged
    if cache.mode != "normal":
        raise exc
    if not _error_logged:
        _error_logged = True
        log.warning("plancache: the hook failed (%s: %s); FE builds such graphs itself, counted in "
                    "stats().fe_builds['error'] (logged once)", type(exc).__name__, exc, exc_info=exc)
    else:
        log.debug("plancache: the hook failed again (%s: %s)", type(exc).__name__, exc)


def _start_capture(path: str | os.PathLike[str] | None) -> None:
    global _recorder
    if path is None:
        return
    from .capture import Recorder

    with _lock:
        if _recorder is None or _recorder.path != Path(path).absolute():
            _stop_capture_locked()
            _recorder = Recorder(Path(path).absolute())
            atexit.register(_flush_at_exit, _recorder)
            log.info("plancache: capturing every graph built into %s", _recorder.path)


def _await_warm() -> None:
    """Wait for the warm start under way, so a graph is served from it (bounded: the host's turn to fetch and the
    server exchange each take at most the cache's request deadline)."""
    _warm_start.wait()


def _stop_capture() -> None:
    with _lock:
        _stop_capture_locked()


def _stop_capture_locked() -> None:
    global _recorder
    if _recorder is not None:
        atexit.unregister(_flush_at_exit)
        _flush_at_exit(_recorder)
        _recorder = None
        _counted.clear()


def _flush_at_exit(recorder: Any) -> None:
    try:
        recorder.flush()
    except (OSError, ValueError, PlanCacheError) as exc:
        log.warning("plancache: could not write the capture file %s: %s", recorder.path, exc)


def _count(graph: Any, spec: GraphSpec) -> None:
    """Count a graph into the capture file once (the first validate that read its spec)."""
    recorder = _recorder
    if recorder is not None and graph not in _counted:
        _counted.add(graph)
        try:
            recorder.add(spec)
        except (OSError, ValueError, PlanCacheError) as exc:  # capturing never breaks the program's build
            log.warning("plancache: could not write the capture file %s: %s", recorder.path, exc)


@contextlib.contextmanager
def installed(cache: PlanCache, *, graph_class: type | None = None) -> Iterator[PlanCache]:
    """:func:`install` for the duration of a ``with`` block; an install around the block stays, with its cache."""
    global _cache
    with _lock:
        before, was_installed = _cache, bool(_originals)
    install(cache, graph_class=graph_class)
    try:
        yield cache
    finally:
        if was_installed:
            _await_warm()
            with _lock:
                _cache = before
        else:
            uninstall()


@contextlib.contextmanager
def _inside() -> Iterator[None]:
    """The ladder's own FE calls (a rebuild in the caller's graph) go straight to FE."""
    before = getattr(_local, "inside", False)
    _local.inside = True
    try:
        yield
    finally:
        _local.inside = before


def _find(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    raise AttributeError(f"{cls.__name__} has no {name}")


Handler = Callable[[Callable[..., Any], str, Any, PlanCache, tuple[Any, ...], dict[str, Any]], Any]


def _wrap(name: str, original: Callable[..., Any], handler: Handler) -> Callable[..., Any]:
    @functools.wraps(original)
    def method(graph: Any, *args: Any, **kwargs: Any) -> Any:
        cache = _cache
        if getattr(_local, "inside", False):
            return original(graph, *args, **kwargs)
        if cache is None or cache.forked:  # a forked child's builds are FE's own (its parent's cache is not its)
            if name == "validate" and _recorder is not None and graph._lowered_graph is None:
                _capture_only(graph)
            return original(graph, *args, **kwargs)
        return handler(original, name, graph, cache, args, kwargs)

    return method


def _leave_to_fe(cache: PlanCache, state: _Graph, reason: str, detail: str) -> None:
    if not state.fe:
        state.fe = True
        cache.count_fe_build(reason)
        log.info("plancache: FE builds %s itself: %s%s", _name(state), FE_BUILD_REASONS[reason],
                 f" ({detail})" if detail else "")


def _name(state: _Graph) -> str:
    if state.spec is None:
        return "a graph"
    return f"{state.spec.name or 'graph'} ({state.spec.graph_key[:12]})"


def _validate(original: Callable[..., Any], _: str, graph: Any, cache: PlanCache,
              args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    whole = fe_ops.take_offer()
    if graph._lowered_graph is None and not graph._planning_done:  # FE's IR is still readable
        try:
            state = _graphs[graph] = _capture(graph, cache)
        except Exception as exc:  # noqa: BLE001 - the hook's own failure: FE builds the graph (normal mode)
            _hook_failed(cache, exc)
            _graphs[graph] = _Graph(None, "error", f"{type(exc).__name__}: {exc}")
        else:
            if whole and state.why_not is None and state.spec is not None and fe_ops.binds_own_uids(state.spec):
                _serve_whole(graph, cache, state)  # raises fe_ops.Served when it loaded the plan
    return original(graph, *args, **kwargs)


def _serve_whole(graph: Any, cache: PlanCache, state: _Graph) -> None:
    """A graph an FE op's graph cache is building (:mod:`plancache.client.fe_ops`): its served plan loaded into an
    empty graph, handed over by raising :class:`~plancache.client.fe_ops.Served`, which ends the op's build. On a miss
    the build goes on and ``build_plans`` leaves it to FE without asking again (strict and replay-only mode:
    :class:`PlanMiss` here, as ``build_plans`` would raise it); a failure of the hook's own leaves it to FE."""
    assert state.spec is not None
    serving, plan = _serve(graph, cache, state.spec, whole=True)
    if isinstance(plan, Exception):  # FE builds the graph (normal mode)
        state.why_not, state.detail = "error", f"{type(plan).__name__}: {plan}"
    elif plan is not None:
        raise fe_ops.Served(plan.graph, plan.workspace_size)
    elif serving is not None:  # without a cache for the graph's device, build_plans says why
        state.missed = True


def _serve(graph: Any, cache: PlanCache, spec: GraphSpec, *, whole: bool) -> tuple[PlanCache | None, Any]:
    """The cache serving ``graph`` (None: none for its device) and its plan of ``spec`` loaded into ``graph``, or on
    its own when ``whole``: None on a miss in normal mode (:class:`PlanMiss` raised in strict and replay-only mode),
    or the exception of a failure of the hook's own (:func:`_hook_failed`)."""
    _await_warm()
    serving = None
    try:
        serving = _cache_for(graph, cache)
        if serving is None:
            return None, None
        with _inside():
            return serving, serving.serve(None if whole else graph, spec, max_workspace=_max_workspace)
    except PlanMiss:
        raise
    except Exception as exc:  # noqa: BLE001 - the hook's own failure: FE builds the graph (normal mode)
        _hook_failed(cache, exc)
        return serving, exc


def _capture(graph: Any, cache: PlanCache) -> _Graph:
    from ..spec import from_pygraph

    try:
        spec = from_pygraph(graph)
    except UnsupportedGraph as exc:
        return _Graph(None, "unsupported", exc.message)
    _count(graph, spec)
    if spec.graph.is_override_shape_enabled:
        return _Graph(spec, "override_shape")
    cache._backend.prepare_graph(graph, spec)
    return _Graph(spec)


def _capture_only(graph: Any) -> None:
    from ..spec import from_pygraph

    try:
        _count(graph, from_pygraph(graph))
    except UnsupportedGraph as exc:
        log.info("plancache: a graph the spec cannot represent is not captured (%s)", exc.message)


def _state(graph: Any) -> _Graph:
    state = _graphs.get(graph)
    if state is None:
        state = _graphs[graph] = _Graph(None, "validated_early")
    return state


def _create_execution_plans(original: Callable[..., Any], _: str, graph: Any, cache: PlanCache,
                            args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if not graph._is_validated:
        graph.validate()
    state = _state(graph)
    if state.why_not is not None or state.deferred or state.fe or graph._planning_done:
        if state.why_not is not None:
            _leave_to_fe(cache, state, state.why_not, state.detail)
        return original(graph, *args, **kwargs)
    state.deferred = True
    state.heuristics = (args, kwargs)
    return None


def _check_support(original: Callable[..., Any], _: str, graph: Any, cache: PlanCache,
                   args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    state = _graphs.get(graph)
    if state is not None and (state.served or state.deferred):
        return None  # answered by build_plans (a served plan is supported: it loaded)
    return original(graph, *args, **kwargs)


def _build_plans(original: Callable[..., Any], _: str, graph: Any, cache: PlanCache,
                 args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    state = _graphs.get(graph)
    if state is None or state.fe:
        return original(graph, *args, **kwargs)
    if state.served:
        return None
    if state.missed:  # asked when the op's graph cache offered it whole
        if state.deferred:
            _plan_with_fe(graph, cache, state, "miss", "")
        else:
            _leave_to_fe(cache, state, "miss", "")
        return original(graph, *args, **kwargs)
    if not state.deferred:  # FE plans first (build_plans would call create_execution_plans itself)
        graph.create_execution_plans()
        if state.fe:
            return original(graph, *args, **kwargs)
    if _builds_all(args, kwargs):
        _plan_with_fe(graph, cache, state, "fe_candidates", "build_plans(ALL)")
        return original(graph, *args, **kwargs)
    if state.spec is None:  # unreachable: a graph without a spec has a why_not, so FE planned it
        raise RuntimeError("plancache hook: a deferred graph without a spec")
    serving, plan = _serve(graph, cache, state.spec, whole=False)
    if isinstance(plan, Exception):
        _plan_with_fe(graph, cache, state, "error", f"{type(plan).__name__}: {plan}")
        return original(graph, *args, **kwargs)
    if serving is None:
        detail = (f"it is built for cuda:{_device_of(graph)}, the cache serves cuda:{_device_index(cache)} and its "
                  "backend cannot be made for another device: install a cache of that device")
        if cache.mode != "normal":
            raise PlanMiss(f"{_name(state)}: {detail}")
        _plan_with_fe(graph, cache, state, "other_device", detail)
        return original(graph, *args, **kwargs)
    if plan is not None:
        state.served = True
        return None
    _plan_with_fe(graph, cache, state, "miss", "")
    return original(graph, *args, **kwargs)


def _builds_all(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    import cudnn

    policy = cudnn.build_plan_policy.ALL
    return any(a == policy for a in args) or kwargs.get("policy") == policy


def _plan_with_fe(graph: Any, cache: PlanCache, state: _Graph, reason: str, detail: str) -> None:
    """Run what was deferred, as the caller asked: FE's heuristic query, then its support check."""
    args, kwargs = state.heuristics
    state.deferred = False
    _leave_to_fe(cache, state, reason, detail)
    with _inside():
        graph.create_execution_plans(*args, **kwargs)
        graph.check_support()


def _plan_list_call(original: Callable[..., Any], name: str, graph: Any, cache: PlanCache,
                    args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    state = _graphs.get(graph)
    if state is not None and state.deferred:
        _plan_with_fe(graph, cache, state, "fe_candidates", f"{name}()")
    return original(graph, *args, **kwargs)


def _get_execution_plan_count(original: Callable[..., Any], name: str, graph: Any, cache: PlanCache,
                              args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    state = _graphs.get(graph)
    if state is not None and state.served:
        return max(1, int(original(graph, *args, **kwargs)))  # a loaded plan is one plan
    return _plan_list_call(original, name, graph, cache, args, kwargs)


_HANDLERS: dict[str, Handler] = {
    "validate": _validate, "create_execution_plans": _create_execution_plans, "check_support": _check_support,
    "build_plans": _build_plans, "get_execution_plan_count": _get_execution_plan_count,
}
