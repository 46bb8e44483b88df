"""plancache's route for PyTorch's cuDNN attention: the two ATen kernels behind it, run from served plans.

:func:`install` replaces the CUDA kernels of ``aten::_scaled_dot_product_cudnn_attention`` and
``aten::_scaled_dot_product_cudnn_attention_backward``: what ``F.scaled_dot_product_attention`` calls under the
``CUDNN_ATTENTION`` backend, and by default where torch's own choice is cuDNN (Hopper and newer with a recent
cuDNN). The ops' schemas, their autograd formula and the fake (meta) kernels that ``torch.compile`` traces stay
torch's own: only the kernel that runs changes, so eager, compiled and CUDA-graph-captured code take the route alike.

Each configuration (shapes, strides, dtype, device and flags) is prepared once: the FE graph torch's op stands for
is written without a handle, keyed as a spec, and its plan taken from the :class:`~plancache.client.PlanCache`
ladder (memory, disk, server; a plan is deserialized without the op graph's re-lowering and warm-up), or built by
FE where the ladder allows it. A later call is one dict lookup of that executor, its outputs and workspace from
torch's caching allocator on the current stream, and one launch through FE's ordered execute: no graph work and
no Python validation, since the lookup key holds every layout the plan was built for.

Calls that go to torch's own C++ kernel, counted in :func:`stats` by :data:`ATEN_REASONS`: see that table.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import PlanMiss
from . import hook

if TYPE_CHECKING:
    from .core import PlanCache

log = logging.getLogger("plancache.client")

__all__ = ["ATEN_REASONS", "CHOICES", "NATIVE", "NATIVE_MARGIN", "OPS", "check_choice", "install", "installed", "stats",
           "uninstall"]

#: The ATen ops whose CUDA kernels the route replaces.
OPS = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward")

#: Why a call runs torch's own kernel instead of a served plan (``stats()`` keys ``fwd_aten:<reason>``).
ATEN_REASONS = {
    "dropout": "dropout: its mask comes from torch's generator, and the tuner's float32 reference cannot "
               "reproduce a random mask, so such a graph cannot be checked before it is served",
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
#: ``fastest`` takes a native kernel only when the worker measured it this much faster than the plan (a tie within
#: timing noise keeps the plan).
NATIVE_MARGIN = 0.02

_UID = {"q": 1, "k": 2, "v": 3, "bias": 4, "o": 100, "stats": 101, "dO": 200, "dQ": 201, "dK": 202, "dV": 203}
_ALIGNMENT = 16


@dataclass(slots=True)
class _Executor:
    """A loaded plan of one configuration and how to feed it."""

    graph: Any
    uids: tuple[int, ...]  # canonical uids, in the order of the call's buffers
    workspace: int
    out_strides: tuple[int, ...]  # the forward's output layout (torch's meta kernel's); () for the backward
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
class _Aten:
    """A configuration left to torch's kernel, and why (an :data:`ATEN_REASONS` key)."""

    reason: str


class _Route:
    """The installed route: its cache, its device, its prepared executors and the call counters."""

    def __init__(self, cache: PlanCache, lib: Any, choice: str) -> None:
        import torch

        self.cache = cache
        self.lib = lib
        self.choice = choice
        self.device = cache.context.backend.device
        self.index = self.device.index or 0
        self.executors: dict[tuple[Any, ...], _Executor | _Native | _Aten] = {}
        self.counts: dict[str, int] = {"fwd": 0, "bwd": 0}
        self.prepare_seconds = 0.0  # first calls of configurations: writing, keying and loading their plans
        self.prepare_lock = threading.Lock()
        self.tls = threading.local()
        self.raw_stream: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda i: int(torch.cuda.current_stream(i).cuda_stream))

    def count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

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


def install(cache: PlanCache, *, attention: str = "fastest") -> None:
    """Serve torch's cuDNN attention kernels from ``cache`` (its device's tensors; others run torch's kernel).
    ``attention``: what runs a configuration, one of :data:`CHOICES`."""
    global _route
    import torch

    check_choice(attention)
    with _lock:
        if _route is not None:
            if _route.cache is cache and _route.choice == attention:
                return
            _uninstall_locked()
        lib = torch.library.Library("aten", "IMPL")
        lib.impl(OPS[0], _forward, "CUDA")
        lib.impl(OPS[1], _backward, "CUDA")
        _route = _Route(cache, lib, attention)


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
        _route.lib._destroy()
        _route = None


def installed() -> bool:
    return _route is not None


def stats() -> dict[str, float]:
    """Calls served by the route (``fwd``, ``bwd``), plans loaded by source (``load:<source>``), calls run by a
    native kernel chosen as measured faster or pinned (``fwd_native:<kernel>``, ``bwd_native:<kernel>``), calls left
    to torch's kernel (``fwd_aten:<reason>``, ``bwd_aten:<reason>``), and ``prepare_seconds``: the wall time the first calls of
    configurations spent writing, keying and loading their plans (the waits for a warm start included)."""
    route = _route
    if route is None:
        return {}
    return {**route.counts, "prepare_seconds": route.prepare_seconds}


# ------------------------------------------------------------------ the kernels


def _refusal(route: _Route | None, query: Any, dropout_p: float, other: str | None) -> str | None:
    """The :data:`ATEN_REASONS` key of a call the route leaves to torch before looking it up (``other``: a reason
    of one direction only), or None."""
    if route is None or query.device != route.device:
        return "device"
    return "dropout" if dropout_p else other


def _forward(query: Any, key: Any, value: Any, attn_bias: Any, compute_log_sumexp: bool, dropout_p: float = 0.0,
             is_causal: bool = False, return_debug_mask: bool = False, *, scale: float | None = None) -> Any:
    route = _route
    reason = _refusal(route, query, dropout_p, "debug_mask" if return_debug_mask else None)
    if reason is None:
        assert route is not None
        bias = None if attn_bias is None else _bias(attn_bias, query, key)
        ckey = ("fwd", query.shape, query.stride(), key.shape, key.stride(), value.shape, value.stride(), query.dtype,
                is_causal, scale, compute_log_sumexp,
                None if bias is None else (bias.shape, bias.stride()))
        ex = route.executors.get(ckey)
        if ex is None:
            ex = _prepare(route, ckey, _flash_takes(query, key, value, bias),
                          lambda: _forward_graph(query, key, value, bias, compute_log_sumexp, is_causal, scale))
        if isinstance(ex, _Aten):
            reason = ex.reason
        elif _misaligned(query, key, value, bias):
            reason = "layout"
        elif isinstance(ex, _Native):
            out, lse = ex.forward(query, key, value, bias, is_causal, scale)
            route.count(f"fwd_native:{ex.kernel}")
            return out, lse, None, None, query.shape[2], key.shape[2], *_unused_rng(query), None
        else:
            import torch

            b, h, s = query.shape[0], query.shape[1], query.shape[2]
            out = torch.empty_strided((b, h, s, value.shape[3]), ex.out_strides, dtype=query.dtype,
                                      device=query.device)
            lse = torch.empty((b, h, s, 1), dtype=torch.float32, device=query.device)
            buffers = [query, key, value, out]
            if compute_log_sumexp:
                buffers.append(lse)
            if bias is not None:
                buffers.append(bias)
            _run(route, ex, buffers)
            route.counts["fwd"] += 1
            return out, lse, None, None, s, key.shape[2], *_unused_rng(query), None
    if route is not None:
        route.count(f"fwd_aten:{reason}")
    return _aten_forward(query, key, value, attn_bias, None, None, query.size(-2), key.size(-2), compute_log_sumexp,
                         dropout_p, is_causal, return_debug_mask, scale=scale)


def _backward(grad_out: Any, query: Any, key: Any, value: Any, out: Any, logsumexp: Any, philox_seed: Any,
              philox_offset: Any, attn_bias: Any, cum_seq_q: Any, cum_seq_k: Any, max_q: int, max_k: int,
              dropout_p: float, is_causal: bool, *, scale: float | None = None) -> Any:
    import torch

    route = _route
    reason = _refusal(route, query, dropout_p, "nested" if cum_seq_q is not None else None)
    if reason is None:
        assert route is not None
        if grad_out.stride() != out.stride():  # cuDNN reads dO in O's layout
            grad_out = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=out.device).copy_(grad_out)
        lse = logsumexp if logsumexp.dim() == 4 else logsumexp.unsqueeze(-1)
        bias = None if attn_bias is None else _bias(attn_bias, query, key)
        deterministic = torch.are_deterministic_algorithms_enabled()
        ckey = ("bwd", query.shape, query.stride(), key.shape, key.stride(), value.shape, value.stride(),
                out.stride(), lse.stride(), query.dtype, is_causal, scale, deterministic,
                None if bias is None else (bias.shape, bias.stride()))
        ex = route.executors.get(ckey)
        if ex is None:
            ex = _prepare(route, ckey, _flash_takes(query, key, value, bias) and not deterministic,
                          lambda: _backward_graph(query, key, value, out, lse, bias, is_causal, scale, deterministic))
        if isinstance(ex, _Aten):
            reason = ex.reason
        elif _misaligned(query, key, value, bias, out, grad_out, lse):
            reason = "layout"
        elif isinstance(ex, _Native):
            route.count(f"bwd_native:{ex.kernel}")
            return ex.backward(grad_out, query, key, value, out, lse, bias, is_causal, scale)
        else:
            dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
            buffers = [query, key, value, out, grad_out, lse, dq, dk, dv]
            if bias is not None:
                buffers.append(bias)
            _run(route, ex, buffers)
            route.counts["bwd"] += 1
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
    None for a local build) states a native kernel measured :data:`NATIVE_MARGIN` faster on the worker."""
    if choice != "fastest":
        return choice if choice != "flash" or flash else "plan"
    native = {} if record is None else {k: ms for k, ms in record.native_median_ms.items()
                                        if k in NATIVE and (k != "flash" or flash)}  # a later release's: not run
    if not native:
        return "plan"
    kernel, ms = min(native.items(), key=lambda item: item[1])
    return kernel if ms < record.winner_median_ms * (1 - NATIVE_MARGIN) else "plan"


def _misaligned(*tensors: Any) -> bool:
    return any(t is not None and (t.data_ptr() % _ALIGNMENT or t.stride(-1) != 1) for t in tensors)


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


def _prepare(route: _Route, ckey: tuple[Any, ...], flash: bool,
             write: Callable[[], tuple[Any, tuple[str, ...], tuple[int, ...]]]) -> _Executor | _Native | _Aten:
    """The executor of a configuration seen for the first time: its plan from the cache (``PlanMiss`` in strict
    and replay-only mode) or the native kernel :func:`_pick` names (``flash``: whether flash can run it), or
    torch's kernel where FE cannot take it."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return _Aten("capture")  # not remembered: the first eager call prepares it
    t0 = time.perf_counter()
    try:
        return _load(route, ckey, flash, write)
    finally:
        route.prepare_seconds += time.perf_counter() - t0


def _load(route: _Route, ckey: tuple[Any, ...], flash: bool,
          write: Callable[[], tuple[Any, tuple[str, ...], tuple[int, ...]]]) -> _Executor | _Native | _Aten:
    from ..spec import from_pygraph  # pydantic: not on the import of plancache.torch

    hook._await_warm()  # a warm start under way holds this process's plans: load from it, not the server again
    with route.prepare_lock:
        ex = route.executors.get(ckey)
        if ex is not None:
            return ex
        try:
            if (pinned := _pick(route.choice, None, flash)) != "plan":
                ex = route.executors[ckey] = _Native.of(pinned)  # pinned: no plan is loaded
                return ex
            with hook._inside():  # plancache's own FE calls: not the user's builds the hook serves and counts
                graph, roles, layout = write()
                spec = from_pygraph(graph, name=f"torch {ckey[0]} attention")
                hook._count(graph, spec)  # into the capture file, when one is being written: the next warm start's
                plan = route.cache.plan(spec)
            route.count(f"load:{plan.source}")
            if (kernel := _pick(route.choice, plan.record, flash)) != "plan":
                ex = _Native.of(kernel)
            else:
                canonical = spec.canonical_uids()
                ex = _Executor(plan.graph, tuple(canonical[_UID[r]] for r in roles), plan.workspace_size, layout)
        except PlanMiss:
            raise
        except Exception as exc:  # noqa: BLE001 - FE refuses the configuration: torch's kernel serves it
            log.warning("plancache: torch's cuDNN attention %s runs torch's own kernel for %s: %s", ckey[0],
                        _describe(ckey), exc)
            ex = _Aten("unsupported")
        route.executors[ckey] = ex
        return ex


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


def _forward_graph(query: Any, key: Any, value: Any, bias: Any, stats: bool, is_causal: bool,
                   scale: float | None) -> tuple[Any, tuple[str, ...], tuple[int, ...]]:
    """FE's graph of torch's forward kernel, the roles of its buffers in call order, and the output's strides."""
    io, f32 = _fe_types(query.dtype)
    g = _new_graph(io, f32)
    q, k, v = _tensor(g, "q", query, io), _tensor(g, "k", key, io), _tensor(g, "v", value, io)
    extra = {"bias": _tensor(g, "bias", bias, io)} if bias is not None else {}
    o, lse = g.sdpa(name="sdpa", q=q, k=k, v=v, generate_stats=stats, attn_scale=_scale(scale, query),
                    **extra, **_mask_args(is_causal))
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
    return g, roles + (("bias",) if bias is not None else ()), layout


def _backward_graph(query: Any, key: Any, value: Any, out: Any, lse: Any, bias: Any, is_causal: bool,
                    scale: float | None, deterministic: bool) -> tuple[Any, tuple[str, ...], tuple[int, ...]]:
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
                                 **extra, **_mask_args(is_causal))
    for grad, name, like in ((dq, "dQ", query), (dk, "dK", key), (dv, "dV", value)):
        layout = torch.empty_like(like, device="meta").stride()
        grad.set_uid(_UID[name]).set_output(True).set_dim(list(like.shape)).set_stride(list(layout)) \
            .set_data_type(io)
    roles = ("q", "k", "v", "o", "dO", "stats", "dQ", "dK", "dV")
    return g, roles + (("bias",) if bias is not None else ()), ()
