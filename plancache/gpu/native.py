"""torch's own attention kernels (flash, and its C++ cuDNN path), called as plancache's route calls them.

The worker times them beside a tuned SDPA plan, after checking their outputs against the same float32 reference
(:func:`measure`), and publishes the medians in the plan record (``PlanMeta.native_median_ms``); the route
(:mod:`plancache.client.sdpa`) runs the fastest. Both go through the calls below, so the kernel timed is the kernel
run, layout copies included: outputs come back in the layouts torch's cuDNN attention ops promise (their meta
kernels'), whichever kernel wrote them.

Only torch is imported here (no cuDNN FE): the route loads this module on its first native call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from ..protocol import NATIVE_KERNELS

if TYPE_CHECKING:
    from ..spec import GraphSpec
    from ..spec.document import NodeDoc

log = logging.getLogger(__name__)

__all__ = ["NATIVE_KERNELS", "NativeCall", "backward", "forward", "matching_layout", "measure", "native_call"]

Tensor: TypeAlias = torch.Tensor


def matching_layout(like: Tensor, d_last: int) -> tuple[int, ...]:
    """Strides of a (B, H, S, ``d_last``) output in ``like``'s dimension order: torch's meta kernels' rule for the
    cuDNN attention output (``like`` the query) and, with ``d_last`` its own, for the gradients."""
    if d_last == like.shape[3]:
        return tuple(torch.empty_like(like, device="meta").stride())
    shape = (*like.shape[:3], d_last)
    order = sorted(range(4), key=lambda i: like.stride(i), reverse=True)
    strides = [0] * 4
    acc = 1
    for i in reversed(order):
        strides[i] = acc
        acc *= shape[i]
    return tuple(strides)


def _in_layout(t: Tensor, strides: tuple[int, ...]) -> Tensor:
    if tuple(t.stride()) == strides:
        return t
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)


def _unused(device: torch.device) -> Tensor:
    return torch.empty((), dtype=torch.long, device=device)


def forward(kernel: str, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, is_causal: bool,
            scale: float | None) -> tuple[Tensor, Tensor]:
    """``(O, LSE)`` of attention without dropout by ``kernel`` (``flash`` or ``cudnn_aten``): O in
    :func:`matching_layout` of q, the log-sum-exp float32 (B, H, Sq, 1), natural log, as cuDNN's Stats (always
    computed: flash computes it anyway, and the backward of any of them reads it)."""
    if kernel == "flash":
        if bias is not None:
            raise ValueError("torch's flash kernel takes no attention bias")
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)[:2]
    elif kernel == "cudnn_aten":
        out, lse = torch.ops.aten._cudnn_attention_forward(q, k, v, bias, None, None, q.shape[2], k.shape[2],
                                                           True, 0.0, is_causal, False, scale=scale)[:2]
    else:
        raise ValueError(f"unknown native attention kernel {kernel!r}; expected one of {NATIVE_KERNELS}")
    lse = lse if lse.dim() == 4 else lse.unsqueeze(-1)
    return _in_layout(out, matching_layout(q, v.shape[3])), lse


def backward(kernel: str, d_o: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             bias: Tensor | None, is_causal: bool, scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(dQ, dK, dV)`` by ``kernel`` from a forward's O and LSE (any of the kernels' or a cuDNN plan's: they state
    the same log-sum-exp), each in its input's :func:`matching_layout`."""
    sq, skv = q.shape[2], k.shape[2]
    if kernel == "flash":
        if bias is not None:
            raise ValueError("torch's flash kernel takes no attention bias")
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            d_o, q, k, v, out, lse.reshape(lse.shape[:3]).contiguous(), None, None, sq, skv, 0.0, is_causal,
            _unused(q.device), _unused(q.device), scale=scale)
    elif kernel == "cudnn_aten":
        grads = torch.ops.aten._cudnn_attention_backward(
            d_o, q, k, v, out, lse, _unused(q.device), _unused(q.device), bias, None, None, sq, skv, 0.0, is_causal,
            scale=scale)
    else:
        raise ValueError(f"unknown native attention kernel {kernel!r}; expected one of {NATIVE_KERNELS}")
    dq, dk, dv = (_in_layout(g, matching_layout(t, t.shape[3])) for g, t in zip(grads, (q, k, v), strict=True))
    return dq, dk, dv


# ------------------------------------------------------------------ the worker's side


@dataclass(frozen=True)
class NativeCall:
    """An SDPA graph as torch's kernels take it: the uids of its ports, its scale and causality, and which
    kernels can run it."""

    backward: bool
    ports: dict[str, int]  # port → uid: q, k, v, (bias), O, (Stats) / q, k, v, o, dO, stats, dQ, dK, dV
    is_causal: bool
    scale: float
    kernels: tuple[str, ...]


def native_call(spec: GraphSpec) -> NativeCall | None:
    """The call torch's kernels would make for ``spec``, or None: a graph of one SDPA or SDPA_BWD node on
    float16/bfloat16 dense (B, H, S, D) tensors, with no dropout, paging, ragged or padded sequences, ALiBi,
    sliding window, dBias or deterministic request, causal only top-left (torch's ``is_causal``). Flash takes it
    only without a bias and with as many key as query heads."""
    from ..spec.nodes import decode_param

    if len(spec.nodes) != 1 or spec.nodes[0].type not in ("SDPA", "SDPA_BWD"):
        return None
    node = spec.nodes[0]
    bwd = node.type == "SDPA_BWD"
    p = {k: decode_param(v) for k, v in node.params.items()}
    allowed_in = {"q", "k", "v", "bias", "attn_scale"} | ({"o", "dO", "stats"} if bwd else set())
    allowed_out = {"dQ", "dK", "dV"} if bwd else {"O", "Stats"}
    if set(node.inputs) - allowed_in or set(node.outputs) - allowed_out or _masked(p):
        return None
    if any(spec.tensor(u).ragged_offset is not None for u in node.inputs.values()):
        return None
    q = spec.tensor(node.inputs["q"])
    if spec.data_type_of(q) not in ("HALF", "BFLOAT16") or len(q.dim) != 4:
        return None
    is_causal = _causal(p, q.dim[2], spec.tensor(node.inputs["k"]).dim[2])
    if is_causal is None:
        return None
    scale = _scale(spec, node, p)
    if scale is None:
        return None
    same_heads = spec.tensor(node.inputs["k"]).dim[1] == q.dim[1] == spec.tensor(node.inputs["v"]).dim[1]
    kernels = tuple(k for k in NATIVE_KERNELS if k != "flash" or ("bias" not in node.inputs and same_heads))
    return NativeCall(bwd, {**node.inputs, **node.outputs}, is_causal, scale, kernels)


def _masked(p: dict[str, Any]) -> bool:
    """Whether the node's params ask for what torch's kernels do not do here."""
    return bool(p.get("use_padding_mask") or p.get("use_alibi_mask") or p.get("use_deterministic_algorithm")
                or p.get("stats_use_log2") or p.get("diagonal_band_left_bound") is not None
                or p.get("sliding_window_length") is not None or "_dropout_n" in p)


def _causal(p: dict[str, Any], sq: int, skv: int) -> bool | None:
    """torch's ``is_causal`` for these params (top-left, right bound 0), False without a mask, None otherwise."""
    right = p.get("diagonal_band_right_bound")
    if p.get("use_causal_mask_bottom_right"):
        return True if sq == skv else None
    if p.get("use_causal_mask"):
        return True
    if right is None:
        return False
    top_left = p.get("diagonal_alignment", "TOP_LEFT") == "TOP_LEFT" or sq == skv
    return True if right == 0 and top_left else None


def _scale(spec: GraphSpec, node: NodeDoc, p: dict[str, Any]) -> float | None:
    """The attention scale, as the graph states it (1.0 when it names none, as cuDNN and the reference take it;
    torch's own default is not assumed); None when it is a tensor bound at run time."""
    if "attn_scale" in node.inputs:
        doc = spec.tensor(node.inputs["attn_scale"])
        return None if doc.pass_by_value is None else float(doc.pass_by_value)
    v = p.get("attn_scale")
    return 1.0 if v is None else float(v)


def measure(spec: GraphSpec, pack: dict[int, Tensor], check: Callable[[dict[int, Tensor]], str | None],
            timer: Callable[[Callable[[], object]], float]) -> dict[str, float]:
    """Median ms of each native kernel that runs ``spec``'s call (:func:`native_call`) on ``pack`` (the tuner's
    inputs by uid) and whose outputs pass ``check`` (None when within tolerance, else why not); {} for a graph
    they cannot run. A kernel that raises or fails the check is left out, logged."""
    call = native_call(spec)
    if call is None:
        return {}
    x = {port: pack[uid] for port, uid in call.ports.items() if uid in pack}
    out: dict[str, float] = {}
    for kernel in call.kernels:
        try:
            run = _runner(kernel, call, x)
            results = run()
            outputs = {call.ports[port]: t for port, t in results.items() if port in call.ports}
            why = check(outputs)
            if why is not None:
                log.warning("torch's %s kernel is not a candidate for %s: %s", kernel, spec.name or "this graph", why)
                continue
            out[kernel] = timer(run)
        except Exception as exc:  # noqa: BLE001 - torch's kernel refuses the call: it is no alternative
            log.info("torch's %s kernel does not run %s: %s", kernel, spec.name or "this graph", exc)
    return out


def _runner(kernel: str, call: NativeCall, x: dict[str, Tensor]) -> Callable[[], dict[str, Tensor]]:
    bias = x.get("bias")
    if not call.backward:
        def fwd() -> dict[str, Tensor]:
            o, lse = forward(kernel, x["q"], x["k"], x["v"], bias, call.is_causal, call.scale)
            return {"O": o, "Stats": lse}
        return fwd
    # the kernel's own forward gives the O and LSE its backward reads (flash's LSE is not a cuDNN plan's bit for bit)
    o, lse = forward(kernel, x["q"], x["k"], x["v"], bias, call.is_causal, call.scale)

    def bwd() -> dict[str, Tensor]:
        dq, dk, dv = backward(kernel, x["dO"], x["q"], x["k"], x["v"], o, lse, bias, call.is_causal, call.scale)
        return {"dQ": dq, "dK": dk, "dV": dv}
    return bwd
