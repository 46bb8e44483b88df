"""FE's normalization ops (``cudnn.ops.norm``: ``layer_norm``, ``rms_norm``) served whole: a new shape's graph is the
served plan loaded on its own, not a graph of the op's that FE lowers and then loads the plan into.

Each of those ops keeps one ``(graph, workspace size)`` per shape in a graph cache (FE 1.32's
``cudnn.ops.norm._common.GraphCache``) and, on a miss, writes its graph and builds it through FE's five steps, which
the hook serves by loading the tuned plan into the op's graph part-way: FE validates and lowers the graph to cuDNN's
operation graph, then deserializes the plan into it with a warm-up run. While the hook is installed (:func:`patch`),
the cache's build runs with an offer open on its thread: the hook reads the graph's spec at ``validate()`` as for
any graph and, when the graph's every bound tensor carries a uid the op set itself (so the op's ``execute`` binds the
plan's canonical uids) and the cache has a tuned plan for it (memory, disk, server, the rebuild of a tuned record),
loads the plan into an empty graph, the way plancache's attention route loads its plans, and ends the build by
raising :class:`Served`. The op's cache keeps that graph (:class:`Loaded`) and its workspace size, and the op runs
it with its own ``execute``. Without a plan the build goes on as it always does: the hook leaves it to FE (normal mode) without
asking the cache again, or raises :class:`~plancache.errors.PlanMiss` (strict and replay-only mode)."""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..spec import GraphSpec

log = logging.getLogger("plancache.client")

__all__ = ["HANDLES_AHEAD", "NODES", "Loaded", "Served", "binds_own_uids", "held_whole", "patch", "patched",
           "stock_handles", "take_offer", "unpatch"]

#: Where FE 1.32 keeps its norm ops' graph cache (imported only once torch is: those ops are torch ops).
GRAPH_CACHE_MODULE = "cudnn.ops.norm._common"

#: The node types of the graphs FE's norm ops write: ``layer_norm`` and ``rms_norm``, forward and backward.
NODES = frozenset({"LAYERNORM", "LAYERNORM_BWD", "RMSNORM", "RMSNORM_BWD"})

#: The cuDNN handles a warm start makes ahead for FE's norm ops (:func:`stock_handles`): the thread calling an op and
#: autograd's, which runs its backward.
HANDLES_AHEAD = 2

_local = threading.local()  # .offer: a graph cache's build is under way on this thread and takes a served graph
_patched: list[tuple[Any, str, Any]] = []  # (owner, attribute, FE's own): what patch() replaced, restored by unpatch()
_stock: dict[int, list[Any]] = {}  # cuDNN handles made ahead, by device ordinal (stock_handles)
_stock_lock = threading.Lock()


class Served(Exception):  # noqa: N818 - control flow, never an error: the build it ends has its graph
    """Raised by the hook's ``validate()`` inside an offered build: the served plan's graph, loaded on its own, and its
    workspace size, which the graph cache keeps in place of the graph the op was writing."""

    def __init__(self, graph: Any, workspace_size: int) -> None:
        super().__init__("a served plan ends the graph's build")
        self.graph = graph
        self.workspace_size = workspace_size


def take_offer() -> bool:
    """Whether the graph being validated on this thread is the one a graph cache's build writes and takes served
    whole (:class:`Served`); the offer is taken: a second graph of the same build is built as any other."""
    offer = getattr(_local, "offer", False)
    _local.offer = False
    return offer


def binds_own_uids(spec: GraphSpec) -> bool:
    """Whether every tensor ``execute`` binds carries a uid its writer set (so the canonical uids are the writer's,
    and a plan loaded on its own binds the buffers its writer hands over)."""
    return all(t.uid_assigned for t in (*spec.input_tensors(), *spec.output_tensors()))


def held_whole(spec: GraphSpec) -> bool:
    """Whether ``spec`` is a graph of FE's norm ops, whose graph cache takes its served plan loaded on its own: one
    node of :data:`NODES`, every bound uid set by the op. A warm start deserializes those plans ahead, so a known
    shape's first call loads nothing (:func:`plancache.client.hook.install`)."""
    return len(spec.nodes) == 1 and spec.nodes[0].type in NODES and binds_own_uids(spec)


def patch() -> bool:
    """Open the offer in every build of FE's norm ops' graph cache, where FE has one and torch is imported (FE's norm
    ops are torch ops: a process that imports torch after this runs them served as any graph), and let a thread's
    first op take a handle made ahead (:func:`stock_handles`). Whether it is patched."""
    if _patched:
        return True
    if "torch" not in sys.modules:
        return False
    try:
        module = __import__(GRAPH_CACHE_MODULE, fromlist=["GraphCache"])
    except ImportError:
        return False
    cls = getattr(module, "GraphCache", None)
    original = None if not isinstance(cls, type) else cls.__dict__.get("get_or_build")
    if cls is None or original is None:  # not FE 1.32's graph cache: its ops are served as any graph
        log.info("plancache: %s has no GraphCache.get_or_build; FE's norm ops are served into their own graphs",
                 GRAPH_CACHE_MODULE)
        return False
    _replace(cls, "get_or_build", _offering(original))
    get_handle, tls = getattr(module, "get_handle", None), getattr(module, "_tls", None)
    if callable(get_handle) and isinstance(tls, threading.local):
        taking = _Taking(get_handle, tls)
        for owner in _norm_modules():  # the op modules imported already hold FE's own by name
            if getattr(owner, "get_handle", None) is get_handle:
                _replace(owner, "get_handle", taking)
    return True


def _norm_modules() -> list[Any]:
    """The modules of FE's norm ops' package imported so far (its graph cache's among them)."""
    package = GRAPH_CACHE_MODULE.rpartition(".")[0] + "."
    return [module for name, module in list(sys.modules.items()) if name.startswith(package)]


def _replace(owner: Any, name: str, new: Any) -> None:
    _patched.append((owner, name, getattr(owner, name)))
    setattr(owner, name, new)


def unpatch() -> None:
    """Give FE its graph cache's own ``get_or_build`` and its own ``get_handle`` back (graphs and handles they hold
    stay); the handles made ahead and not taken are dropped."""
    while _patched:
        owner, name, original = _patched.pop()
        setattr(owner, name, original)
    for owner in _norm_modules():  # an op module imported while patched took the patched one by name
        if isinstance(taking := getattr(owner, "get_handle", None), _Taking):
            setattr(owner, "get_handle", taking.original)  # noqa: B010 - FE's module, restored
    with _stock_lock:
        _stock.clear()


def patched() -> bool:
    return bool(_patched)


def stock_handles(device: int, make: Callable[[], Any], count: int = HANDLES_AHEAD) -> None:
    """Make cuDNN handles for ``device`` with ``make``, on the calling thread (the warm start's), until ``count`` are
    in stock, while patched. FE's norm ops keep one handle per thread and device, made at a thread's first op (16 ms
    each on an H100, twice in a process's first forward and backward); a thread's first op on ``device`` takes one of
    these as its own instead. A handle is used by the one thread that took it."""
    with _stock_lock:
        need = count - len(_stock.get(device, ())) if _patched else 0
    made = [make() for _ in range(need)]
    with _stock_lock:
        if _patched:
            _stock.setdefault(device, []).extend(made)


class _Taking:
    """FE's ``get_handle(device)`` while patched: a thread's first call for a device takes a handle made ahead, if one
    is in stock, as the thread's own; then FE's own (``original``) binds it to the current stream and returns it."""

    def __init__(self, original: Callable[[Any], Any], tls: threading.local) -> None:
        self.original = original
        self.tls = tls

    def __call__(self, device: Any) -> Any:
        handles, index = getattr(self.tls, "handles", None), getattr(device, "index", None)
        if _stock and index is not None and (handles is None or device not in handles):  # the thread's first op there
            with _stock_lock:
                spare = _stock.get(index)
                handle = spare.pop() if spare else None
            if handle is not None:
                if handles is None:
                    handles = self.tls.handles = {}
                handles[device] = handle
        return self.original(device)


def _offering(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_or_build(cache: Any, key: Any, build: Callable[[], Any]) -> Any:
        hit = getattr(cache, "_entries", {}).get(key)  # the op's steady path: one lookup, as FE's own
        if hit is not None:
            return hit
        return original(cache, key, functools.partial(_build, build))

    return get_or_build


def _build(build: Callable[[], Any]) -> Any:
    before = getattr(_local, "offer", False)
    _local.offer = True
    try:
        return build()
    except Served as served:
        return Loaded(served.graph), served.workspace_size
    finally:
        _local.offer = before


class Loaded:
    """A served plan's graph as an op's graph cache holds it: the op's ``execute`` with its buffers in its uids' order
    (FE's ordered execute), or, once FE refuses that for this graph before anything ran, the same buffers bound by
    uid; every other attribute is the graph's."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self.ordered = True

    def execute(self, buffers: Any, workspace: Any, *args: Any, tensor_uids: Any = None, **kwargs: Any) -> Any:
        if tensor_uids is None:
            return self.graph.execute(buffers, workspace, *args, **kwargs)
        if self.ordered:
            try:
                return self.graph.execute(buffers, workspace, *args, tensor_uids=tensor_uids, **kwargs)
            except (ValueError, KeyError, TypeError) as exc:  # refused while binding, before any launch
                log.info("plancache: FE's ordered execute refused a norm op's served plan (%s); binding by uid", exc)
                self.ordered = False
        return self.graph.execute(dict(zip(tensor_uids, buffers, strict=True)), workspace, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.graph, name)
