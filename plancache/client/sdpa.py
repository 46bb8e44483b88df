"""plancache's route for PyTorch's cuDNN attention: the two ATen kernels behind it, run from served plans.

:func:`install` replaces the CUDA kernels of ``aten::_scaled_dot_product_cudnn_attention`` and
``aten::_scaled_dot_product_cudnn_attention_backward``: what ``F.scaled_dot_product_attention`` calls under the
``CUDNN_ATTENTION`` backend, and by default where torch's own choice is cuDNN (Hopper and newer with a recent
cuDNN). The ops' schemas, their autograd formula and the fake (meta) kernels that ``torch.compile`` traces stay
torch's own: only the kernel that runs changes, so eager, compiled and CUDA-graph-captured code take the route alike.

Each configuration (shapes, strides, dtype, device and flags) is prepared once: the FE graph torch's op stands for
is written without a handle, keyed as a spec, and its plan taken from the :class:`~plancache.client.PlanCache`
ladder (memory, disk, server; a plan is deserialized without the op graph's re-lowering and warm-up), or built by
FE where the ladder allows it. A training forward (``compute_log_sumexp``) prepares the backward its outputs will
feed with it: both plans come in one round trip to the server, and the backward's first call finds its executor
(with the C++ steady path, the backward's plan loads there on the route's loader thread while the forward goes on,
and its first call waits for it only if it is not loaded yet).
A later call is one dict lookup of that executor, its outputs and workspace from torch's caching allocator on the
current stream, and one launch through FE's ordered execute: no graph work and no Python validation, since the
lookup key holds every layout the plan was built for.

Calls that go to torch's own C++ kernel, counted in :func:`stats` by :data:`ATEN_REASONS`: see that table.

The steady path runs in C++ where its extension is built (:mod:`~plancache.client.sdpa_ext`,
``plancache/csrc/sdpa_route.cpp``): kernels registered over these, holding the plans of the configurations that ran
a plan (:data:`_HELD` here). A later call of one is served there with no Python at all (dropout drawn from torch's
generator as :func:`_philox` draws it), except a mask this route converts (:func:`_bias`), which comes here to be
converted and is then served there; every other call comes here. ``install(cpp=...)`` (``PLANCACHE_ATTENTION_CPP``):
``"auto"`` (the default) takes the extension where this machine has it built and otherwise starts its build in the
background, for the processes after this one; ``True`` builds it now; ``False`` keeps every call in Python. Where
the extension cannot be had, the route runs as above and says why once.

cuDNN's execute spends tens of microseconds of host time a call, which bounds a step of short kernels. The C++
path therefore captures a plan's launches as a CUDA graph the second time a configuration's call binds the same
addresses (buffers and workspace: a steady loop's, since torch's caching allocator hands out the same blocks each
step) and replays them for every later call there: the same kernels with the same arguments, for one graph launch
(``install(replay=False)``, ``PLANCACHE_ATTENTION_REPLAY=false``: always execute). Never while the caller's stream
is capturing; bounded per configuration; a capture that fails leaves that configuration executing as before.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from ..errors import PlanMiss
from . import hook

if TYPE_CHECKING:
    from .core import PlanCache

log = logging.getLogger("plancache.client")

__all__ = ["ATEN_REASONS", "CHOICES", "NATIVE", "NATIVE_MARGIN", "OPS", "SPEC_NAMES", "check_choice", "install",
           "installed", "preload", "stats", "uninstall"]

#: The ATen ops whose CUDA kernels the route replaces.
OPS = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward")

#: Why a call runs torch's own kernel instead of a served plan (``stats()`` keys ``fwd_aten:<reason>``).
ATEN_REASONS = {
    "dropout": "dropout under CUDA-graph capture (torch hands a captured kernel its generator's seed and offset on "
               "the device, at each replay), or a dropout call pinned to one of torch's own kernels",
    "debug_mask": "return_debug_mask asks for the attention probabilities, which cuDNN does not return",
    "nested": "a nested (ragged) batch: torch passes per-sequence offsets this route does not bind",
    "device": "the tensors are on another device than the PlanCache's (one cache serves one device)",
    "layout": "an input whose innermost stride is not 1 or whose address is not 16-byte aligned",
    "capture": "a configuration first seen while a CUDA graph is being captured (plans load before capture)",
    "unsupported": "FE cannot express or build this configuration (the log line says why)",
}

#: What the route runs for a configuration (``install(attention=...)``, ``PLANCACHE_ATTENTION``): ``fastest`` (the
#: default) the served plan unless its record says one of torch's own kernels measured faster on the worker;
#: ``plan`` always the plan; ``flash`` or ``cudnn_aten`` that kernel of torch's (flash only where it can run the call:
#: no attention bias, as many key as query heads, and not a backward under deterministic algorithms).
NATIVE = ("flash", "cudnn_aten")  # plancache.protocol.NATIVE_KERNELS (not imported here: pydantic; a test pins them)
CHOICES = ("fastest", "plan", *NATIVE)
#: The names of the route's specs, by direction: in a capture file, and what a warm start loads whole.
SPEC_NAMES = {"fwd": "torch fwd attention", "bwd": "torch bwd attention"}
#: How much faster than the plan ``fastest`` needs a native kernel measured on the worker to take it: beyond timing
#: noise for flash; more for torch's own cuDNN, which runs the same cuDNN engines (within 2.5 % of the served plan
#: either way, measured on an H100) and builds its own plan in every process, 0.7-1.4 s a shape.
NATIVE_MARGIN = {"flash": 0.02, "cudnn_aten": 0.05}

_UID = {"q": 1, "k": 2, "v": 3, "bias": 4, "seed": 5, "offset": 6, "o": 100, "stats": 101, "dO": 200, "dQ": 201,
        "dK": 202, "dV": 203}
_ALIGNMENT = 16


@dataclass(slots=True)
class _Executor:
    """A loaded plan of one configuration and how to feed it."""

    graph: Any
    uids: tuple[int, ...]  # canonical uids, in the order of the call's buffers
    workspace: int
    out_strides: tuple[int, ...]  # the forward's output layout (torch's meta kernel's); () for the backward
    graph_key: str  # its spec's: the verified blob the C++ steady path loads
    ordered: bool = True  # FE's ordered execute; False once it refused this graph (then by uid mapping)


@dataclass(frozen=True, slots=True)
class _Native:
    """A configuration run by one of torch's own kernels (:mod:`plancache.gpu.native`), measured or pinned: its
    calls, bound once (no import on the steady path)."""

    kernel: str
    forward: Callable[..., Any]
    backward: Callable[..., Any]

    @classmethod
    def of(cls, kernel: str) -> _Native:
        from functools import partial

        from ..gpu import native

        return cls(kernel, partial(native.forward, kernel), partial(native.backward, kernel))


@dataclass(frozen=True, slots=True)
class _Held:
    """A configuration whose plan the C++ steady path holds: it serves the calls, and this route meets only the
    first one (which it hands there too)."""


_HELD = _Held()


@dataclass(frozen=True, slots=True)
class _Aten:
    """A configuration left to torch's kernel, and why (an :data:`ATEN_REASONS` key)."""

    reason: str


class _Route:
    """The installed route: its cache, its device, its prepared executors and the call counters."""

    def __init__(self, cache: PlanCache, lib: Any, choice: str, ext: Any = None, cpp: bool | str = False,
                 replay: bool = True) -> None:
        import torch

        self.cache = cache
        self.lib = lib
        self.choice = choice
        self.cpp = cpp  # what install() was asked for
        self.replay = replay
        self.ext = ext  # the C++ steady path (sdpa_ext), installed over ``lib``'s kernels; None: Python only
        self.handed: set[tuple[Any, ...]] = set()  # configurations handed to ``ext`` (or that it refused)
        self.device = cache.context.backend.device
        self.index = self.device.index or 0
        self.executors: dict[tuple[Any, ...], _Executor | _Native | _Held | _Aten] = {}
        self.counts: dict[str, int] = {"fwd": 0, "bwd": 0}
        self.prepare_seconds = 0.0  # first calls of configurations: writing, keying and loading their plans
        self.prepare_lock = threading.Lock()
        #: backwards written ahead whose plans the C++ steady path is loading on :attr:`loader`: whether it took each
        self.pending: dict[tuple[Any, ...], Future[bool]] = {}
        self.loader: ThreadPoolExecutor | None = None  # one thread, made at its first load (its own cuDNN handle)
        self.tls = threading.local()
        self.raw_stream: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda i: int(torch.cuda.current_stream(i).cuda_stream))

    def count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def load_later(self, ckey: tuple[Any, ...], give: Callable[[], bool], counted: str) -> None:
        """Run ``give`` (a backward's plan handed to the C++ steady path) on the loader thread, counted as
        ``counted`` (``load:<source>``) once taken; its configuration's first call takes the outcome (:meth:`taken`)."""
        def load() -> bool:
            took = give()
            if took:
                self.count(counted)
            return took

        if self.loader is None:
            self.loader = ThreadPoolExecutor(1, thread_name_prefix="plancache-attention-load")
        self.pending[ckey] = self.loader.submit(load)

    def taken(self, ckey: tuple[Any, ...]) -> bool | None:
        """Whether the C++ steady path took the plan :meth:`load_later` handed it for ``ckey``, once that is done
        (waited for); None when none was handed."""
        future = self.pending.pop(ckey, None)
        return None if future is None else future.result()

    def close(self) -> None:
        """Wait for the loads under way (they end before the C++ steady path is uninstalled)."""
        if self.loader is not None:
            self.loader.shutdown(wait=True)

    def handle(self) -> Any:
        """This thread's cuDNN handle for the route's device, bound to the thread's current stream."""
        tls = self.tls
        h = getattr(tls, "handle", None)
        if h is None:
            import cudnn
            import torch

            with torch.cuda.device(self.device):
                h = tls.handle = cudnn.create_handle()
            tls.stream = None
        stream = self.raw_stream(self.index)
        if stream != tls.stream:
            import cudnn

            cudnn.set_stream(handle=h, stream=stream)
            tls.stream = stream
        return h


_lock = threading.Lock()
_route: _Route | None = None


def install(cache: PlanCache, *, attention: str = "fastest", cpp: bool | str = "auto", replay: bool = True) -> None:
    """Serve torch's cuDNN attention kernels from ``cache`` (its device's tensors; others run torch's kernel).
    ``attention``: what runs a configuration, one of :data:`CHOICES`. ``cpp``: the steady path in C++, ``"auto"``,
    True or False (see the module docstring); where it cannot be had, the log says why and Python serves.
    ``replay``: the C++ steady path replays the launches of a call whose buffers sit at an earlier call's addresses
    (see the module docstring)."""
    global _route
    import torch

    check_choice(attention)
    if cpp not in (True, False, "auto"):
        raise ValueError(f"cpp={cpp!r}: expected True, False or 'auto'")
    cpp = cpp if cpp == "auto" else bool(cpp)
    with _lock:
        if _route is not None:
            if (_route.cache is cache and _route.choice == attention and _route.cpp == cpp
                    and _route.replay == replay):
                return
            _uninstall_locked()
        lib = torch.library.Library("aten", "IMPL")
        lib.impl(OPS[0], _forward, "CUDA")
        lib.impl(OPS[1], _backward, "CUDA")
        ext = _load_ext(cpp) if cpp else None
        if ext is not None:
            try:
                ext.install(cache.context.backend.device.index or 0, _forward, _backward, replay)
            except Exception as exc:  # noqa: BLE001 - registered in full or not at all: Python serves
                log.warning("plancache: the attention route runs in Python: its C++ steady path did not install: "
                            "%s", exc)
                ext = None
        _route = _Route(cache, lib, attention, ext, cpp, replay)
        if cpp and ext is None:
            _route.count("cpp_unavailable")


def _load_ext(cpp: bool | str) -> Any:
    """The C++ steady path's module, or None (logged) where it cannot be had here: with ``cpp`` ``"auto"``, where
    it is not built yet, its build is started in the background for the processes after this one."""
    from . import sdpa_ext

    try:
        return sdpa_ext.load(build=cpp is True)
    except sdpa_ext.NotBuilt as exc:
        started = sdpa_ext.build_in_background()
        log.warning("plancache: this process's attention route runs in Python: %s; %s", exc,
                    "compiling it in the background for the next processes (a minute or two; "
                    "python -m plancache.client.sdpa_ext builds it ahead)" if started
                    else "a build is under way, or python -m plancache.client.sdpa_ext makes one")
    except sdpa_ext.ExtensionUnavailable as exc:
        (log.warning if cpp is True else log.info)(
            "plancache: the attention route runs in Python: its C++ steady path is unavailable: %s", exc)
    return None


def check_choice(attention: str) -> None:
    """Raise ``ValueError`` unless ``attention`` is one of :data:`CHOICES`."""
    if attention not in CHOICES:
        raise ValueError(f"attention={attention!r}: expected one of {', '.join(CHOICES)}")


def uninstall() -> None:
    """Give the two kernels back to torch."""
    with _lock:
        _uninstall_locked()


def _uninstall_locked() -> None:
    global _route
    if _route is not None:
        _route.close()
        if _route.ext is not None:
            _route.ext.uninstall()  # first: its kernels were registered over the Python ones
        _route.lib._destroy()
        _route = None


def installed() -> bool:
    return _route is not None


def stats() -> dict[str, float]:
    """Calls served by the route (``fwd``, ``bwd``; of which by the C++ steady path ``cpp:fwd``, ``cpp:bwd``),
    plans loaded by source (``load:<source>``), calls run by a native kernel chosen as measured faster or pinned
    (``fwd_native:<kernel>``, ``bwd_native:<kernel>``), calls left to torch's kernel (``fwd_aten:<reason>``,
    ``bwd_aten:<reason>``), and ``prepare_seconds``: the wall time the first calls of configurations spent writing,
    keying and loading their plans (the waits for a warm start, and for a backward's plan loading on the route's
    loader thread, included; that load itself counts in the cache's ``deserialize_seconds``, as every C++ load
    does). With the C++ steady path asked for
    (``auto`` or True): ``cpp_unavailable`` (1: it is not built yet, or cannot be built or loaded) and
    configurations it refused (``fwd_cpp_refused``, ``bwd_cpp_refused``; Python serves them); where it serves,
    ``cpp:fwd_replayed``, ``cpp:bwd_replayed`` (its calls served by replaying captured launches), ``cpp:captured``
    (launches captured) and ``cpp:capture_failed`` (executors whose capture or replay failed: they execute as
    before)."""
    route = _route
    if route is None:
        return {}
    counts: dict[str, float] = {**route.counts, "prepare_seconds": route.prepare_seconds}
    if route.ext is not None:
        served = route.ext.counts()
        for direction in ("fwd", "bwd"):
            counts[f"cpp:{direction}"] = served[direction]
            counts[direction] += served[direction]
        for name in ("fwd_replayed", "bwd_replayed", "captured", "capture_failed"):
            counts[f"cpp:{name}"] = served[name]
    return counts


# ------------------------------------------------------------------ the kernels


def _refusal(route: _Route | None, query: Any, dropout_p: float, other: str | None) -> str | None:
    """The :data:`ATEN_REASONS` key of a call the route leaves to torch before looking it up (``other``: a reason
    of one direction only), or None."""
    if route is None or query.device != route.device:
        return "device"
    if other is None and dropout_p and _capturing():
        return "dropout"
    return other


def _capturing() -> bool:
    """Whether this thread's current CUDA stream is being captured into a CUDA graph."""
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _forward(query: Any, key: Any, value: Any, attn_bias: Any, compute_log_sumexp: bool, dropout_p: float = 0.0,
             is_causal: bool = False, return_debug_mask: bool = False, *, scale: float | None = None) -> Any:
    route = _route
    reason = _refusal(route, query, dropout_p, "debug_mask" if return_debug_mask else None)
    if reason is None:
        assert route is not None
        bias = None if attn_bias is None else _bias(attn_bias, query, key)
        ckey = _forward_key(query, key, value, bias, compute_log_sumexp, is_causal, scale, dropout_p)
        ex = route.executors.get(ckey)
        if ex is None:
            ex = _prepare(route, _Config(ckey, _flash_takes(query, key, value, bias) and not dropout_p,
                                         lambda: _forward_graph(query, key, value, bias, compute_log_sumexp, is_causal,
                                                                scale, dropout_p),
                                         _inner_strided(query, key, value, bias),
                                         (query, key, value, bias, compute_log_sumexp, dropout_p, is_causal, scale)),
                          _backward_ahead(query, key, value, bias, is_causal, scale, dropout_p)
                          if compute_log_sumexp else None)
        if isinstance(ex, _Aten):
            reason = ex.reason
        elif (query.data_ptr() | key.data_ptr() | value.data_ptr() | _address(bias)) % _ALIGNMENT:
            reason = "layout"
        elif isinstance(ex, _Native):
            out, lse = ex.forward(query, key, value, bias, is_causal, scale)
            route.count(f"fwd_native:{ex.kernel}")
            return out, lse, None, None, query.shape[2], key.shape[2], *_unused_rng(query), None
        elif isinstance(ex, _Held):
            served = route.ext.serve_forward(query, key, value, bias, compute_log_sumexp, dropout_p, is_causal, scale)
            if served is not None:
                return served
            reason = _lost(ckey)
        else:
            import torch

            b, h, s = query.shape[0], query.shape[1], query.shape[2]
            out = torch.empty_strided((b, h, s, value.shape[3]), ex.out_strides, dtype=query.dtype,
                                      device=query.device)
            lse = torch.empty((b, h, s, 1), dtype=torch.float32, device=query.device)
            # detached: FE reads a tensor that requires grad (autograd's inputs and saved outputs) through a
            # Python fallback of tens of microseconds, where it reads any other natively
            buffers = [query.detach(), key.detach(), value.detach(), out]
            if compute_log_sumexp:
                buffers.append(lse)
            if bias is not None:
                buffers.append(bias.detach())
            rng = _philox(query, key) if dropout_p else _unused_rng(query)
            if dropout_p:
                buffers += rng
            _run(route, ex, buffers)
            route.counts["fwd"] += 1
            if route.ext is not None and ckey not in route.handed:
                _hand(route, ckey, (query, key, value, bias, compute_log_sumexp, dropout_p, is_causal, scale), ex)
            return out, lse, None, None, s, key.shape[2], *rng, None
    if route is not None:
        route.count(f"fwd_aten:{reason}")
    return _aten_forward(query, key, value, attn_bias, None, None, query.size(-2), key.size(-2), compute_log_sumexp,
                         dropout_p, is_causal, return_debug_mask, scale=scale)


def _backward(grad_out: Any, query: Any, key: Any, value: Any, out: Any, logsumexp: Any, philox_seed: Any,
              philox_offset: Any, attn_bias: Any, cum_seq_q: Any, cum_seq_k: Any, max_q: int, max_k: int,
              dropout_p: float, is_causal: bool, *, scale: float | None = None) -> Any:
    import torch

    route = _route
    unseeded = dropout_p and (philox_seed is None or philox_offset is None  # not what a cuDNN forward returns
                              or not philox_seed.device == philox_offset.device == query.device)
    reason = _refusal(route, query, dropout_p, "nested" if cum_seq_q is not None else "dropout" if unseeded else None)
    if reason is None:
        assert route is not None
        if grad_out.stride() != out.stride():  # cuDNN reads dO in O's layout
            grad_out = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=out.device).copy_(grad_out)
        lse = logsumexp if logsumexp.dim() == 4 else logsumexp.unsqueeze(-1)
        bias = None if attn_bias is None else _bias(attn_bias, query, key)
        deterministic = torch.are_deterministic_algorithms_enabled()
        ckey = _backward_key(query, key, value, out, lse, bias, is_causal, scale, deterministic, dropout_p)
        ex = route.executors.get(ckey)
        if ex is None:
            ex = _prepare(route, _backward_config(ckey, query, key, value, out, lse, bias, is_causal, scale,
                                                  deterministic, dropout_p))
        if isinstance(ex, _Aten):
            reason = ex.reason
        elif (query.data_ptr() | key.data_ptr() | value.data_ptr() | out.data_ptr() | grad_out.data_ptr()
              | lse.data_ptr() | _address(bias)) % _ALIGNMENT:
            reason = "layout"
        elif isinstance(ex, _Native):
            route.count(f"bwd_native:{ex.kernel}")
            return ex.backward(grad_out, query, key, value, out, lse, bias, is_causal, scale)
        elif isinstance(ex, _Held):
            served = route.ext.serve_backward(grad_out, query, key, value, out, lse, philox_seed, philox_offset, bias,
                                              dropout_p, is_causal, scale)
            if served is not None:
                return served
            reason = _lost(ckey)
        else:
            dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
            buffers = [query.detach(), key.detach(), value.detach(), out.detach(), grad_out.detach(), lse, dq, dk, dv]
            if bias is not None:
                buffers.append(bias.detach())
            if dropout_p:
                buffers += (philox_seed, philox_offset)
            _run(route, ex, buffers)
            route.counts["bwd"] += 1
            if route.ext is not None and ckey not in route.handed:
                _hand(route, ckey, (query, key, value, out, lse, bias, dropout_p, is_causal, scale, deterministic), ex)
            return dq, dk, dv
    if route is not None:
        route.count(f"bwd_aten:{reason}")
    return _aten_backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias,
                          cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, scale=scale)


def _aten_forward(*args: Any, **kwargs: Any) -> Any:
    """torch's own forward kernel (the C++ op the replaced kernel calls, not replaced itself)."""
    import torch

    return torch.ops.aten._cudnn_attention_forward(*args, **kwargs)


def _aten_backward(*args: Any, **kwargs: Any) -> Any:
    import torch

    return torch.ops.aten._cudnn_attention_backward(*args, **kwargs)


def _run(route: _Route, ex: _Executor, buffers: list[Any]) -> None:
    import torch

    handle = route.handle()
    workspace = torch.empty(max(ex.workspace, 1), dtype=torch.uint8, device=route.device)
    if ex.ordered:
        try:
            ex.graph.execute(buffers, workspace, handle=handle, tensor_uids=ex.uids)
            return
        except (ValueError, KeyError, TypeError) as exc:  # refused while binding, before any launch
            log.info("plancache: FE's ordered execute refused a loaded attention plan (%s); binding by uid", exc)
            ex.ordered = False
            route.count("unordered")
    ex.graph.execute(dict(zip(ex.uids, buffers)), workspace, handle=handle)


def _hand(route: _Route, ckey: tuple[Any, ...], call: tuple[Any, ...], ex: _Executor) -> None:
    """Hand a configuration this route ran to the C++ steady path (:func:`_give`): its plan as the verified blob the
    cache admitted, or a plan built here serialized; from then on it is held there. Not while a CUDA graph is
    captured (loading a plan is not capturable): a later eager call hands it."""
    if _capturing():
        return
    held = route.cache.context.verified.get(ex.graph_key)
    blob = held[1] if held is not None else bytes(ex.graph.serialize(as_bytes=True))
    if _give(route, ckey, call, ex.graph_key, blob, ex.uids, ex.out_strides):
        route.executors[ckey] = _HELD  # a call that comes here (a mask to convert) is served there too


def _give(route: _Route, ckey: tuple[Any, ...], call: tuple[Any, ...], graph_key: str, blob: bytes,
          uids: tuple[int, ...], layout: tuple[int, ...]) -> bool:
    """The C++ steady path takes the plan of graph ``graph_key`` (loaded ahead by :func:`preload`, else ``blob``
    loaded now) for the configuration ``ckey``, keyed there by ``call`` (the call's tensors and flags; a backward
    written ahead: meta tensors of its O and log-sum-exp), its buffers bound by ``uids`` in call order. False when it
    refuses it (logged and counted once; this route keeps serving it). A plan it deserialized now (not preloaded)
    counts its time in the cache's ``deserialize_seconds``."""
    route.handed.add(ckey)
    t0 = time.perf_counter()
    loaded = True  # a plan refused while loading took its time too
    try:
        if ckey[0] == "fwd":
            loaded = route.ext.add_forward(*call, graph_key, blob, list(uids), list(layout))
        else:
            loaded = route.ext.add_backward(*call, graph_key, blob, list(uids))
    except Exception as exc:  # noqa: BLE001 - this route keeps serving it
        log.warning("plancache: the C++ steady path did not take the attention %s of %s (Python serves it): %s",
                    ckey[0], _describe(ckey), exc)
        route.count(f"{ckey[0]}_cpp_refused")
        return False
    finally:
        if loaded:
            route.cache.count_load(time.perf_counter() - t0)
    return True


def preload(spec: Any, blob: bytes) -> bool:
    """Load a verified plan of the route's (a warm start's: ``hook.install(warm_loader=...)``) into the C++ steady
    path ahead of its configurations' first calls, which then only bind it. False where that path is not installed
    or refuses it (logged): the caller loads it itself."""
    route = _route
    if route is None or route.ext is None:
        return False
    t0 = time.perf_counter()
    try:
        route.ext.preload(spec.graph_key, blob)
    except Exception as exc:  # noqa: BLE001 - its configurations load it at their first calls
        log.warning("plancache: the C++ steady path did not load the attention plan %s ahead: %s",
                    spec.graph_key[:12], exc)
        return False
    finally:
        route.cache.count_load(time.perf_counter() - t0)
    return True


def _lost(ckey: tuple[Any, ...]) -> str:
    """The :data:`ATEN_REASONS` key of a held configuration the C++ steady path did not serve (it keeps what it is
    given until uninstalled, so this is a defect): torch's kernel runs the call, logged."""
    log.error("plancache: the C++ steady path lost the attention %s of %s; torch's kernel runs it", ckey[0],
              _describe(ckey))
    return "unsupported"


def _philox(query: Any, key: Any) -> tuple[Any, Any]:
    """The seed and offset a dropout forward hands cuDNN, as torch's own cuDNN kernel takes them: the device's
    generator's seed, and its offset, which is then advanced by one draw per element of the attention matrix (so
    the next random op of the process draws past them). Tensors on the query's device, written there by the stream
    (no host sync); a 64-bit seed is held as the int64 of the same bits, as torch hands it over."""
    import torch

    gen = _generator(query.device)
    seed, offset = gen.initial_seed(), gen.get_offset()
    draws = query.shape[0] * query.shape[1] * query.shape[2] * key.shape[2]
    gen.set_offset(offset + (draws + 3) // 4 * 4)
    seed = seed - (1 << 64) if seed >= 1 << 63 else seed
    return (torch.full((), seed, dtype=torch.long, device=query.device),
            torch.full((), offset, dtype=torch.long, device=query.device))


def _generator(device: Any) -> Any:
    import torch

    return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]


def _unused_rng(query: Any) -> tuple[Any, Any]:
    """The forward's philox seed and offset, which a call without dropout leaves unread."""
    import torch

    return (torch.empty((), dtype=torch.long, device=query.device),
            torch.empty((), dtype=torch.long, device=query.device))


def _flash_takes(query: Any, key: Any, value: Any, bias: Any) -> bool:
    """Whether torch's flash kernel can run this call (:func:`plancache.gpu.native.native_call`'s rule)."""
    return bias is None and query.shape[1] == key.shape[1] == value.shape[1]


def _pick(choice: str, record: Any, flash: bool) -> str:
    """What runs a configuration: the pinned ``choice``, or for ``fastest`` the plan unless ``record`` (the plan's,
    None for a local build) states a native kernel measured faster on the worker by its :data:`NATIVE_MARGIN`."""
    if choice != "fastest":
        return choice if choice != "flash" or flash else "plan"
    faster = {} if record is None else {
        k: ms for k, ms in record.native_median_ms.items()
        if k in NATIVE and (k != "flash" or flash)  # a later release's kernel: not run
        and ms < record.winner_median_ms * (1 - NATIVE_MARGIN[k])}
    return min(faster, key=faster.__getitem__) if faster else "plan"


def _address(t: Any) -> int:
    """The address of an optional tensor (0 for None), for the per-call alignment check."""
    return 0 if t is None else t.data_ptr()


def _inner_strided(*tensors: Any) -> bool:
    """Whether any of these (optional) tensors has an innermost stride other than 1: a property of the
    configuration's key, so checked when it is prepared, not at each call."""
    return any(t is not None and t.stride(-1) != 1 for t in tensors)


def _bias(bias: Any, query: Any, key: Any) -> Any:
    """torch's ``attn_bias`` as the additive tensor cuDNN reads: dense (B, 1 or H, Sq, Skv), a head dim broadcast by
    torch kept at size 1, the batch, query-sequence and key-sequence dims materialised. On an H200 (cuDNN 9.19)
    cuDNN's backward gave wrong gradients (normalised error 2-4.6) for a padding mask broadcast over the query rows,
    (B, 1, 1, S) or (1, 1, 1, S), and every tuning candidate of that graph failed the float32 reference, while a
    dense (B, 1, Sq, Skv) bias was right, forward and backward. A boolean mask becomes 0 / the dtype's lowest value
    (not -inf: exp of either is 0), converted at its broadcast size before it is expanded."""
    import torch

    b, h, sq, skv = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    bias = bias.expand(b, h, sq, skv)  # torch's broadcasting rules, as views
    bias = bias[tuple(slice(0, 1) if bias.stride(i) == 0 else slice(None) for i in range(4))]
    if bias.dtype == torch.bool:
        bias = torch.zeros(bias.shape, dtype=query.dtype, device=bias.device).masked_fill_(
            ~bias, torch.finfo(query.dtype).min)
    elif bias.dtype != query.dtype:
        bias = bias.to(query.dtype)
    bias = bias.expand(b, bias.shape[1], sq, skv)
    if any(bias.stride(i) == 0 and bias.shape[i] > 1 for i in (0, 2, 3)) or bias.stride(3) != 1:
        bias = bias.contiguous()
    return bias


# ------------------------------------------------------------------ preparing a configuration


@dataclass(frozen=True, slots=True)
class _Config:
    """A configuration seen for the first time: its key, whether torch's flash kernel can run it, and the writer of
    its FE graph (the graph, the roles of its buffers in call order, the forward output's strides)."""

    ckey: tuple[Any, ...]
    flash: bool
    write: Callable[[], tuple[Any, tuple[str, ...], tuple[int, ...]]]
    strided: bool = False  # an input's innermost stride is not 1: torch's kernel runs it ("layout")
    #: The C++ steady path's key of it: the tensors (the bias as :func:`_bias` makes it) and flags ``add_forward`` /
    #: ``add_backward`` take.
    cpp_call: tuple[Any, ...] = ()

    @property
    def dropout_p(self) -> float:
        return float(self.ckey[-1])  # every configuration's key ends with it


def _forward_key(query: Any, key: Any, value: Any, bias: Any, stats: bool, is_causal: bool, scale: float | None,
                 dropout_p: float) -> tuple[Any, ...]:
    return ("fwd", query.shape, query.stride(), key.shape, key.stride(), value.shape, value.stride(), query.dtype,
            is_causal, scale, stats, None if bias is None else (bias.shape, bias.stride()), dropout_p)


def _backward_key(query: Any, key: Any, value: Any, out: Any, lse: Any, bias: Any, is_causal: bool,
                  scale: float | None, deterministic: bool, dropout_p: float) -> tuple[Any, ...]:
    return ("bwd", query.shape, query.stride(), key.shape, key.stride(), value.shape, value.stride(), out.stride(),
            lse.stride(), query.dtype, is_causal, scale, deterministic,
            None if bias is None else (bias.shape, bias.stride()), dropout_p)


def _backward_config(ckey: tuple[Any, ...], query: Any, key: Any, value: Any, out: Any, lse: Any, bias: Any,
                     is_causal: bool, scale: float | None, deterministic: bool, dropout_p: float) -> _Config:
    return _Config(ckey, _flash_takes(query, key, value, bias) and not deterministic and not dropout_p,
                   lambda: _backward_graph(query, key, value, out, lse, bias, is_causal, scale, deterministic,
                                           dropout_p),
                   _inner_strided(query, key, value, out, lse, bias),
                   (query, key, value, out, lse, bias, dropout_p, is_causal, scale, deterministic))


def _backward_ahead(query: Any, key: Any, value: Any, bias: Any, is_causal: bool, scale: float | None,
                    dropout_p: float) -> _Config:
    """The configuration of the backward a training forward's outputs will feed: O in the forward's layout, its
    log-sum-exp as the forward returns it, the deterministic setting of now (a backward under another one prepares
    its own)."""
    import torch

    from ..gpu.native import matching_layout

    b, h, s = query.shape[0], query.shape[1], query.shape[2]
    out = torch.empty_strided((b, h, s, value.shape[3]), matching_layout(query, value.shape[3]), dtype=query.dtype,
                              device="meta")
    lse = torch.empty((b, h, s, 1), dtype=torch.float32, device="meta")
    deterministic = torch.are_deterministic_algorithms_enabled()
    ckey = _backward_key(query, key, value, out, lse, bias, is_causal, scale, deterministic, dropout_p)
    return _backward_config(ckey, query, key, value, out, lse, bias, is_causal, scale, deterministic, dropout_p)


@dataclass(frozen=True, slots=True)
class _Written:
    """A configuration's FE graph, written and keyed as a spec."""

    config: _Config
    spec: Any
    roles: tuple[str, ...]
    layout: tuple[int, ...]


def _prepare(route: _Route, config: _Config, ahead: _Config | None = None) -> _Executor | _Native | _Held | _Aten:
    """The executor of a configuration seen for the first time: its plan from the cache (``PlanMiss`` in strict
    and replay-only mode) or the native kernel :func:`_pick` names, or torch's kernel where FE cannot take it.
    ``ahead``: the backward a training forward will need, whose plan is asked for in the same round trip and
    prepared too when it can be (otherwise its own first call prepares it, and raises there)."""
    if _capturing():
        return _Aten("capture")  # not remembered: the first eager call prepares it
    t0 = time.perf_counter()
    try:
        return _load(route, config, ahead)
    finally:
        route.prepare_seconds += time.perf_counter() - t0


def _load(route: _Route, config: _Config, ahead: _Config | None) -> _Executor | _Native | _Held | _Aten:
    hook._await_warm()  # a warm start under way holds this process's plans: load from it, not the server again
    with route.prepare_lock:
        ckey = config.ckey
        ex = route.executors.get(ckey)
        if ex is not None:
            return ex
        if route.taken(ckey):  # a backward the C++ steady path loaded ahead; refused: loaded below, in Python
            ex = route.executors[ckey] = _HELD
            return ex
        also = None
        if config.strided:
            ex = route.executors[ckey] = _Aten("layout")
            return ex
        try:
            if (pinned := _pick(route.choice, None, config.flash)) != "plan":
                # pinned: no plan is loaded; torch's own kernels run dropout only through torch's own op
                ex = route.executors[ckey] = _Aten("dropout") if config.dropout_p else _Native.of(pinned)
                return ex
            fetched: dict[str, Any] = {}
            with hook._inside():  # plancache's own FE calls: not the user's builds the hook serves and counts
                written = _write(config)
                also = _write_ahead(route, ahead)
                taken = _load_cpp(route, written, also)
                if also is not None and also.config.ckey in taken:
                    route.executors[also.config.ckey] = taken[also.config.ckey]
                    also = None  # held or native
                elif also is not None and also.config.ckey in route.pending:
                    also = None  # loading in C++: its first call takes it
                if ckey in taken:
                    ex = route.executors[ckey] = taken[ckey]
                    if also is not None:
                        _load_ahead(route, also, None)
                    return ex
                if also is not None:
                    fetched = _fetch(route, [written.spec, also.spec])
                plan = fetched.get(written.spec.graph_key) or route.cache.plan(written.spec)
            ex = _executor(route, written, plan)
        except PlanMiss:
            raise
        except Exception as exc:  # noqa: BLE001 - FE refuses the configuration: torch's kernel serves it
            log.warning("plancache: torch's cuDNN attention %s runs torch's own kernel for %s: %s", ckey[0],
                        _describe(ckey), exc)
            ex = _Aten("unsupported")
        route.executors[ckey] = ex
        if also is not None:
            _load_ahead(route, also, fetched.get(also.spec.graph_key))
        return ex


def _write(config: _Config) -> _Written:
    from ..spec import from_pygraph  # pydantic: not on the import of plancache.torch

    graph, roles, layout = config.write()
    spec = from_pygraph(graph, name=SPEC_NAMES[config.ckey[0]])
    hook._count(graph, spec)  # into the capture file, when one is being written: the next warm start's
    return _Written(config, spec, roles, layout)


def _write_ahead(route: _Route, ahead: _Config | None) -> _Written | None:
    """``ahead`` written, unless it is prepared already (or loading in C++), pinned to a native kernel or FE refuses
    it (its own first call then says why)."""
    if (ahead is None or ahead.strided or ahead.ckey in route.executors or ahead.ckey in route.pending
            or _pick(route.choice, None, ahead.flash) != "plan"):
        return None
    try:
        return _write(ahead)
    except Exception as exc:  # noqa: BLE001 - left to the backward's own first call
        log.debug("plancache: the attention backward of %s is left to its first call: %s", _describe(ahead.ckey), exc)
        return None


def _load_cpp(route: _Route, written: _Written, ahead: _Written | None) -> dict[tuple[Any, ...], _Held | _Native]:
    """The configurations (``written``, and the backward written ``ahead`` of it) the C++ steady path takes from
    verified blobs, by key: their plans asked for together (:meth:`~plancache.client.PlanCache.verified_blobs`: one
    round trip to the server for those it is asked for) and loaded there only, never into a Python graph; or the
    native kernel a record measured faster. ``ahead``'s plan loads on the route's loader thread while the forward's
    loads here and the forward goes on (:meth:`_Route.load_later`; not in the result). The others (no C++ path, no
    verified plan, a plan it refused once) load here as before."""
    wanted = [w for w in (written, ahead) if w is not None and w.config.ckey not in route.handed]
    if route.ext is None or not wanted:
        return {}
    try:
        blobs = route.cache.verified_blobs([w.spec for w in wanted])
    except Exception as exc:  # noqa: BLE001 - the ladder's own calls meet it again, and raise it
        log.debug("plancache: attention plans asked for the C++ steady path: %s", exc)
        return {}
    taken: dict[tuple[Any, ...], _Held | _Native] = {}
    for w in reversed(wanted):  # ``ahead`` first: its load on the loader thread overlaps the forward's here
        held = blobs.get(w.spec.graph_key)
        if held is None:
            continue
        ckey = w.config.ckey
        if not w.config.dropout_p and (kernel := _pick(route.choice, held.record, w.config.flash)) != "plan":
            taken[ckey] = _Native.of(kernel)  # never for dropout: torch's own kernels run it only through its own op
        else:
            give = partial(_give, route, ckey, w.config.cpp_call, w.spec.graph_key, held.blob, _uids(w), w.layout)
            if w is ahead:
                route.load_later(ckey, give, f"load:{held.source}")  # counted there once taken
                continue
            if not give():
                continue
            taken[ckey] = _HELD
        route.count(f"load:{held.source}")
    return taken


def _fetch(route: _Route, specs: list[Any]) -> dict[str, Any]:
    """The plans of ``specs`` asked for together (one round trip to the server for those it is asked for), by graph
    key: each counted once in ``stats().hits``, by where it came from. What is missing or fails is met again, and
    raised, by the plan() call of its own configuration (then a memory hit for those loaded here)."""
    try:
        return route.cache.prefetch(specs)
    except Exception as exc:  # noqa: BLE001 - PlanMiss (strict mode) names the ones the server lacks
        log.debug("plancache: attention plans asked for together: %s", exc)
        return {}


def _load_ahead(route: _Route, written: _Written, plan: Any) -> None:
    """The executor of a backward written ahead by its forward, from ``plan``, fetched with the forward's (None: not
    fetched, asked of the cache now); when it cannot be had now (strict mode without its plan, a build failure) the
    backward's own call tries again."""
    try:
        if plan is None:
            with hook._inside():
                plan = route.cache.plan(written.spec)
        route.executors[written.config.ckey] = _executor(route, written, plan)
    except Exception as exc:  # noqa: BLE001 - left to the backward's own first call
        log.debug("plancache: the attention backward of %s is left to its first call: %s",
                  _describe(written.config.ckey), exc)


def _executor(route: _Route, written: _Written, plan: Any) -> _Executor | _Native:
    """How a configuration runs given its plan: the plan, or the native kernel :func:`_pick` names from its
    record (never for dropout: torch's own kernels run it only through torch's own op)."""
    route.count(f"load:{plan.source}")
    config = written.config
    if not config.dropout_p and (kernel := _pick(route.choice, plan.record, config.flash)) != "plan":
        return _Native.of(kernel)
    return _Executor(plan.graph, _uids(written), plan.workspace_size, written.layout, written.spec.graph_key)


def _uids(written: _Written) -> tuple[int, ...]:
    """The canonical uids of a written configuration's buffers, in call order."""
    canonical = written.spec.canonical_uids()
    return tuple(canonical[_UID[r]] for r in written.roles)


def _describe(ckey: tuple[Any, ...]) -> str:
    return f"q {tuple(ckey[1])} k {tuple(ckey[3])} v {tuple(ckey[5])}"


def _fe_types(dtype: Any) -> tuple[Any, Any]:
    import cudnn
    import torch

    io = {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16}.get(dtype)
    if io is None:
        raise ValueError(f"cuDNN attention takes float16 or bfloat16, not {dtype}")
    return io, cudnn.data_type.FLOAT


def _new_graph(io: Any, f32: Any) -> Any:
    import cudnn

    return cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32)


def _tensor(g: Any, name: str, t: Any, io: Any) -> Any:
    return g.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=io, uid=_UID[name])


def _mask_args(is_causal: bool) -> dict[str, Any]:
    import cudnn

    if not is_causal:
        return {}
    return {"diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT, "diagonal_band_right_bound": 0}


def _scale(scale: float | None, query: Any) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(query.shape[3])


def _dropout_args(g: Any, dropout_p: float) -> dict[str, Any]:
    """FE's ``dropout=(p, seed, offset)``: cuDNN draws each element's dropout from a seed and an offset (int64 tensors
    on the device, bound per call as roles ``seed`` and ``offset``)."""
    import cudnn

    if not dropout_p:
        return {}
    seed, offset = (g.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT64,
                             uid=_UID[name]) for name in ("seed", "offset"))
    return {"dropout": (float(dropout_p), seed, offset)}


def _extra_roles(bias: Any, dropout_p: float) -> tuple[str, ...]:
    """The roles a graph's optional inputs add after its fixed ones, in call order."""
    return (("bias",) if bias is not None else ()) + (("seed", "offset") if dropout_p else ())


def _forward_graph(query: Any, key: Any, value: Any, bias: Any, stats: bool, is_causal: bool,
                   scale: float | None, dropout_p: float = 0.0) -> tuple[Any, tuple[str, ...], tuple[int, ...]]:
    """FE's graph of torch's forward kernel, the roles of its buffers in call order, and the output's strides."""
    io, f32 = _fe_types(query.dtype)
    g = _new_graph(io, f32)
    q, k, v = _tensor(g, "q", query, io), _tensor(g, "k", key, io), _tensor(g, "v", value, io)
    extra = {"bias": _tensor(g, "bias", bias, io)} if bias is not None else {}
    o, lse = g.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=stats, attn_scale=_scale(scale, query),
                    **extra, **_mask_args(is_causal), **_dropout_args(g, dropout_p))
    b, h, s, _ = query.shape
    d_v = value.shape[3]
    from ..gpu.native import matching_layout

    layout = matching_layout(query, d_v)
    o.set_uid(_UID["o"]).set_output(True).set_dim([b, h, s, d_v]).set_stride(list(layout)).set_data_type(io)
    roles: tuple[str, ...] = ("q", "k", "v", "o")
    if stats:
        lse.set_uid(_UID["stats"]).set_output(True).set_dim([b, h, s, 1]).set_stride([h * s, s, 1, 1]) \
            .set_data_type(f32)
        roles += ("stats",)
    return g, roles + _extra_roles(bias, dropout_p), layout


def _backward_graph(query: Any, key: Any, value: Any, out: Any, lse: Any, bias: Any, is_causal: bool,
                    scale: float | None, deterministic: bool,
                    dropout_p: float = 0.0) -> tuple[Any, tuple[str, ...], tuple[int, ...]]:
    """FE's graph of torch's backward kernel (dO in O's layout, gradients in their inputs' layouts)."""
    import torch

    io, f32 = _fe_types(query.dtype)
    g = _new_graph(io, f32)
    q, k, v = _tensor(g, "q", query, io), _tensor(g, "k", key, io), _tensor(g, "v", value, io)
    o = _tensor(g, "o", out, io)
    do = g.tensor(name="dO", dim=list(out.shape), stride=list(out.stride()), data_type=io, uid=_UID["dO"])
    stats = g.tensor(name="stats", dim=list(lse.shape), stride=list(lse.stride()), data_type=f32, uid=_UID["stats"])
    extra = {"bias": _tensor(g, "bias", bias, io)} if bias is not None else {}
    dq, dk, dv = g.sdpa_backward(name="sdpa_backward", q=q, k=k, v=v, o=o, dO=do, stats=stats,
                                 attn_scale=_scale(scale, query), use_deterministic_algorithm=deterministic,
                                 **extra, **_mask_args(is_causal), **_dropout_args(g, dropout_p))
    for grad, name, like in ((dq, "dQ", query), (dk, "dK", key), (dv, "dV", value)):
        layout = torch.empty_like(like, device="meta").stride()
        grad.set_uid(_UID[name]).set_output(True).set_dim(list(like.shape)).set_stride(list(layout)) \
            .set_data_type(io)
    roles = ("q", "k", "v", "o", "dO", "stats", "dQ", "dK", "dV")
    return g, roles + _extra_roles(bias, dropout_p), ()
