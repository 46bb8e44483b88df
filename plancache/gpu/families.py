"""Node families: every cuDNN FE node type plancache can check, defined once.

A :class:`Family` says what a node's float32 torch reference is (``reference``: a function of a
:class:`NodeCall` returning the node's outputs by port), whether a plan of a graph made only of
such nodes may come from a kernel cache (``kernel_cache_safe``: True only for CONV_FPROP and
POINTWISE -- SDPA plans built from a kernel cache gave wrong results on an H200), and which
example graphs of ``examples/fe/graphs.py`` exercise it. What a node type is (its ports' roles,
required inputs, output shapes, statistics kind) is the node-type table's
(:data:`plancache.spec.nodes.NODES`); a family holds what computing it takes.

The references follow cuDNN FE 1.32's semantics (see the comments of each). They compute in
float32 from float32 inputs (the evaluator in :mod:`plancache.gpu.reference` upcasts every input,
fp8 values included, and turns TF32 off); run with ``call.exact = False`` they compute in the
inputs' own dtypes (the eager-torch path benchmarks compare plans with).

Needs torch only (no cuDNN): it also runs on a CPU.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
import torch.nn.functional as F

from ..errors import TuningError
from ..spec import GraphSpec
from ..spec.document import NodeDoc, TensorDoc
from ..spec.nodes import conv_padding, decode_param, kind_of

Tensor: TypeAlias = torch.Tensor

__all__ = [
    "FAMILIES", "POINTWISE_MODES", "REDUCTION_MODES", "AttentionGeometry", "DropoutProbe", "Family", "NodeCall",
    "attention_geometry", "dropout_nodes", "dropout_probability", "dropout_probe", "family_of", "kernel_cache_safe",
    "node_label", "norm_axes", "uncovered",
]


# ------------------------------------------------------------------ params and the call


def node_label(spec: GraphSpec, node: NodeDoc) -> str:
    i = next((j for j, n in enumerate(spec.nodes) if n is node), None)
    name = f" {node.name!r}" if node.name else ""
    mode = node.params.get("mode") if node.type in ("POINTWISE", "REDUCTION") else None
    mode = f" mode {decode_param(mode)!r}" if mode is not None else ""
    return f"node {i}{name} ({node.type}{mode})"


@dataclass
class NodeCall:
    """One node evaluation: the node, its input tensors by port, and how to compute."""

    spec: GraphSpec
    node: NodeDoc
    #: inputs by port: float32 in exact mode (fp8 values upcast), else the tensors' own dtypes; integer
    #: and boolean tensors (sequence lengths, page tables, offsets) as bound; pass-by-value scalars as
    #: one-element float32 tensors on the evaluation device.
    x: dict[str, Tensor]
    #: the graph's inputs by uid exactly as bound (ragged gathers read their storage and offsets).
    raw: dict[int, Tensor] = field(default_factory=dict)
    exact: bool = True
    #: an attention node's dropout: the multiplier cuDNN applies to each probability, [b, h_q, s_q, s_kv] float32,
    #: 0 where it dropped the element and 1/(1-p) where it kept it (:func:`plancache.gpu.runtime.draw_dropout`).
    dropout: Tensor | None = None
    _params: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def params(self) -> dict[str, Any]:
        if self._params is None:
            self._params = {k: decode_param(v) for k, v in self.node.params.items()}
        return self._params

    @property
    def where(self) -> str:
        return node_label(self.spec, self.node)

    def fail(self, message: str) -> TuningError:
        return TuningError(f"{self.where}: {message}")

    def doc(self, port: str) -> TensorDoc:
        uid = self.node.inputs.get(port, self.node.outputs.get(port))
        if uid is None:
            raise self.fail(f"has no port {port!r}")
        return self.spec.tensor(uid)

    def dims(self, port: str) -> list[int] | None:
        """Dims of a port's tensor: the bound tensor's shape for inputs, the document's for outputs."""
        if port in self.x:
            return list(self.x[port].shape)
        uid = self.node.inputs.get(port, self.node.outputs.get(port))
        if uid is None:
            return None
        d = self.spec.tensor(uid).dim
        return list(d) if d else None

    def scalar(self, port: str, default: float | None = None) -> float:
        if port not in self.x:
            if default is None:
                raise self.fail(f"input {port!r} is missing")
            return default
        return float(self.x[port].reshape(-1)[0])

    def dtype(self) -> torch.dtype:
        """The compute dtype: float32 in exact mode, else the first floating input's dtype."""
        if self.exact:
            return torch.float32
        for t in self.x.values():
            if t.is_floating_point():
                return t.dtype
        return torch.float32

    def f(self, port: str) -> Tensor:
        """A floating input (integers and booleans become the compute dtype)."""
        t = self.x[port]
        return t if t.is_floating_point() else t.to(self.dtype())


Reference = Callable[[NodeCall], dict[str, Tensor]]
Check = Callable[[GraphSpec, NodeDoc], "str | None"]


@dataclass(frozen=True)
class Family:
    """A node family: ``reference(call) -> {output port: tensor}`` computes the node's outputs (float32 from
    float32 inputs in exact mode); ``kernel_cache_safe``: plans of graphs made only of such nodes may be built
    from a shared kernel cache; ``examples``: graphs of ``examples/fe/graphs.py`` that exercise it."""

    name: str
    node_types: tuple[str, ...]
    reference: Reference | None
    kernel_cache_safe: bool
    examples: tuple[str, ...] = ()
    description: str = ""
    #: POINTWISE / REDUCTION: the modes the reference covers (empty: every mode of the node type).
    modes: tuple[str, ...] = ()
    #: names what of a node the reference does not cover (dropout, a callback, ...), or None.
    unsupported: Check | None = None
    #: output ports summarising another output before its quantization (an fp8 attention's ``Amax_O``), each
    #: mapped to that output's port: they are compared at its data type's tolerance, since the kernel's own
    #: rounding of the quantized intermediate reaches both alike.
    tolerance_of: dict[str, str] = field(default_factory=dict)



def _sum_to(t: Tensor, shape: list[int] | tuple[int, ...]) -> Tensor:
    """Sum ``t`` over the axes where ``shape`` has 1 (a broadcast operand's gradient)."""
    if list(t.shape) == list(shape):
        return t
    if len(shape) != t.dim():
        return t.sum_to_size(*shape)
    axes = [i for i, (s, n) in enumerate(zip(shape, t.shape)) if s == 1 and n != 1]
    return t.sum(dim=axes, keepdim=True) if axes else t


# ------------------------------------------------------------------ convolution


def _conv_fn(spatial: int, call: NodeCall) -> Callable[..., Tensor]:
    fn: Callable[..., Tensor] | None = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}.get(spatial)
    if fn is None:
        raise call.fail(f"{spatial}-D convolution has no reference (1-D, 2-D and 3-D only)")
    return fn


def _conv_forward(call: NodeCall, x: Tensor, w: Tensor) -> Tensor:
    """cuDNN convolution forward (cross-correlation unless convolution_mode is CONVOLUTION), grouped when
    the image has more channels than the filter."""
    spatial = x.dim() - 2
    fn = _conv_fn(spatial, call)
    pre, post, stride, dil = conv_padding(call.params, spatial)
    if str(call.params.get("convolution_mode", "CROSS_CORRELATION")).upper() == "CONVOLUTION":
        w = w.flip(list(range(2, w.dim())))
    if w.shape[1] == 0 or x.shape[1] % w.shape[1]:
        raise call.fail(f"image channels {x.shape[1]} are not a multiple of filter channels {w.shape[1]}")
    groups = x.shape[1] // w.shape[1]
    if pre == post:
        return fn(x, w, stride=stride, padding=pre, dilation=dil, groups=groups)
    pads: list[int] = []
    for a, b in zip(reversed(pre), reversed(post)):
        pads += [a, b]
    return fn(F.pad(x, pads), w, stride=stride, padding=0, dilation=dil, groups=groups)


def _conv_fprop(call: NodeCall) -> dict[str, Tensor]:
    return {"Y": _conv_forward(call, call.f("image"), call.f("weight"))}


def _conv_dgrad(call: NodeCall) -> dict[str, Tensor]:
    """DX = d(conv(x, filter))/dx applied to ``loss`` (autograd of the forward: any padding/stride/dilation)."""
    dy, w = call.f("loss"), call.f("filter")
    dims = call.dims("DX") or kind_of(call.node.type).output_dims(
        "DX", {"loss": list(dy.shape), "filter": list(w.shape)}, call.params)
    with torch.enable_grad():
        x = torch.zeros(dims, dtype=dy.dtype, device=dy.device, requires_grad=True)
        y = _conv_forward(call, x, w.detach())
        if list(y.shape) != list(dy.shape):
            raise call.fail(f"loss dims {list(dy.shape)} do not match the forward output {list(y.shape)} of DX {dims}")
        (dx,) = torch.autograd.grad(y, x, dy)
    return {"DX": dx.detach()}


def _conv_wgrad(call: NodeCall) -> dict[str, Tensor]:
    """DW = d(conv(image, w))/dw applied to ``loss``."""
    x, dy = call.f("image"), call.f("loss")
    dims = call.dims("DW")
    if not dims:
        raise call.fail("DW has no dims (CONV_WGRAD output dims are required)")
    with torch.enable_grad():
        w = torch.zeros(dims, dtype=x.dtype, device=x.device, requires_grad=True)
        y = _conv_forward(call, x.detach(), w)
        if list(y.shape) != list(dy.shape):
            raise call.fail(f"loss dims {list(dy.shape)} do not match the forward output {list(y.shape)}")
        (dw,) = torch.autograd.grad(y, w, dy)
    return {"DW": dw.detach()}


# ------------------------------------------------------------------ matmul


def _matmul(call: NodeCall) -> dict[str, Tensor]:
    a, b = call.f("A"), call.f("B")
    if a.dtype != b.dtype:
        a, b = a.to(torch.float32), b.to(torch.float32)
    return {"C": torch.matmul(a, b)}


def _matmul_unsupported(spec: GraphSpec, node: NodeDoc) -> str | None:
    extra = sorted(set(node.inputs) - {"A", "B"})
    if extra:
        return f"inputs {extra} (m/n/k overrides) have no reference"
    if float(node.params.get("padding") or 0.0) != 0.0:
        return "a non-zero padding value has no reference"
    return None


# ------------------------------------------------------------------ pointwise


def _relu(x: Tensor, p: dict[str, Any], slope_key: str = "negative_slope") -> Tensor:
    """cuDNN RELU_FWD: x above lower_clip (default 0) passes, below it lower + slope*(x - lower); then min(upper)."""
    lower = p.get("lower_clip")
    lower = 0.0 if lower is None else float(lower)
    slope = p.get(slope_key)
    slope = 0.0 if slope is None else float(slope)
    y = torch.where(x > lower, x, lower + slope * (x - lower))
    upper = p.get("upper_clip")
    if upper is not None:
        y = torch.clamp(y, max=float(upper))
    return y


def _swish(x: Tensor, p: dict[str, Any]) -> Tensor:
    beta = p.get("swish_beta")
    beta = 1.0 if beta is None else float(beta)
    return x * torch.sigmoid(beta * x)


def _elu(x: Tensor, p: dict[str, Any]) -> Tensor:
    alpha = p.get("elu_alpha")
    return F.elu(x, alpha=1.0 if alpha is None else float(alpha))


def _softplus(x: Tensor, p: dict[str, Any]) -> Tensor:
    beta = p.get("softplus_beta")
    return F.softplus(x, beta=1.0 if beta is None else float(beta))


_UNARY: dict[str, Callable[[Tensor, dict[str, Any]], Tensor]] = {
    "abs": lambda x, p: x.abs(),
    "ceil": lambda x, p: torch.ceil(x),
    "cos": lambda x, p: torch.cos(x),
    "elu": _elu,
    "erf": lambda x, p: torch.erf(x),
    "exp": lambda x, p: torch.exp(x),
    "floor": lambda x, p: torch.floor(x),
    "gelu": lambda x, p: F.gelu(x),
    "gelu_approx_tanh": lambda x, p: F.gelu(x, approximate="tanh"),
    "identity": lambda x, p: x,
    "log": lambda x, p: torch.log(x),
    "logical_not": lambda x, p: (x == 0).to(x.dtype),
    "neg": lambda x, p: -x,
    "reciprocal": lambda x, p: torch.reciprocal(x),
    "rsqrt": lambda x, p: torch.rsqrt(x),
    "sigmoid": lambda x, p: torch.sigmoid(x),
    "sin": lambda x, p: torch.sin(x),
    "softplus": _softplus,
    "sqrt": lambda x, p: torch.sqrt(x),
    "tan": lambda x, p: torch.tan(x),
    "tanh": lambda x, p: torch.tanh(x),
    "relu": lambda x, p: _relu(x, p),
    "leaky_relu": lambda x, p: _relu(x, p),
    "swish": _swish,
}

_BINARY: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "add": torch.add,
    "bias": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "scale": torch.mul,
    "div": torch.div,
    "add_square": lambda a, b: a + b * b,  # ADD_SQUARE: first input plus the square of the second
    "max": torch.maximum,
    "min": torch.minimum,
    "mod": torch.fmod,
    "pow": torch.pow,
    "logical_and": lambda a, b: ((a != 0) & (b != 0)).to(a.dtype),
    "logical_or": lambda a, b: ((a != 0) | (b != 0)).to(a.dtype),
    "cmp_eq": lambda a, b: (a == b).to(a.dtype),
    "cmp_neq": lambda a, b: (a != b).to(a.dtype),
    "cmp_gt": lambda a, b: (a > b).to(a.dtype),
    "cmp_ge": lambda a, b: (a >= b).to(a.dtype),
    "cmp_lt": lambda a, b: (a < b).to(a.dtype),
    "cmp_le": lambda a, b: (a <= b).to(a.dtype),
}

#: ``X_backward(loss, input)`` = loss * X'(input), X's derivative at the forward input.
_BACKWARD: dict[str, str] = {
    "relu_backward": "relu", "leaky_relu_backward": "leaky_relu", "swish_backward": "swish",
    "gelu_backward": "gelu", "gelu_approx_tanh_backward": "gelu_approx_tanh", "sigmoid_backward": "sigmoid",
    "tanh_backward": "tanh", "softplus_backward": "softplus", "elu_backward": "elu",
}

#: Every POINTWISE mode (FE's builder name, ``params["mode"]``) the reference covers.
POINTWISE_MODES: tuple[str, ...] = tuple(sorted({*_UNARY, *_BINARY, *_BACKWARD, "binary_select", "gen_index"}))


def _pointwise(call: NodeCall) -> dict[str, Tensor]:
    mode = call.params.get("mode")
    p = call.params
    ins = [call.f(f"IN_{i}") for i in range(3) if f"IN_{i}" in call.x]
    if mode in _UNARY:
        y = _UNARY[mode](ins[0], p)
    elif mode in _BINARY:
        a, b = ins[0], ins[1]
        if a.dtype != b.dtype:
            a, b = a.to(torch.float32), b.to(torch.float32)
        y = _BINARY[mode](a, b)
    elif mode in _BACKWARD:
        loss, x = ins[0], ins[1]
        fwd = _UNARY[_BACKWARD[mode]]
        with torch.enable_grad():
            xx = x.detach().to(torch.float32).requires_grad_(True)
            yy = fwd(xx, p)
            (g,) = torch.autograd.grad(yy, xx, torch.ones_like(yy))
        y = loss * g.to(loss.dtype)
    elif mode == "binary_select":  # IN_2 (mask) true -> IN_0, else IN_1
        y = torch.where(ins[2] != 0, ins[0], ins[1])
    elif mode == "gen_index":
        x = ins[0]
        axis = int(p.get("axis") or 0)
        shape = [1] * x.dim()
        shape[axis] = x.shape[axis]
        y = torch.arange(x.shape[axis], device=x.device, dtype=torch.float32).view(shape).expand(x.shape)
    else:
        raise call.fail(f"pointwise mode {mode!r} has no reference")
    return {"OUT_0": y}


def _pointwise_unsupported(spec: GraphSpec, node: NodeDoc) -> str | None:
    mode = decode_param(node.params.get("mode"))
    if mode not in POINTWISE_MODES:
        return f"pointwise mode {mode!r} has no reference"
    return None


# ------------------------------------------------------------------ reduction

REDUCTION_MODES = ("ADD", "MUL", "MIN", "MAX", "AMAX", "AVG", "NORM1", "NORM2", "MUL_NO_ZEROS")


def _reduce(x: Tensor, axes: list[int], mode: str) -> Tensor:
    if mode in ("AMAX", "NORM1"):
        x = x.abs()
    if mode == "MUL_NO_ZEROS":
        x = torch.where(x == 0, torch.ones_like(x), x)
    if not axes:
        return x.abs() if mode == "NORM2" else x.clone()
    if mode in ("ADD", "NORM1"):
        return x.sum(dim=axes, keepdim=True)
    if mode in ("MAX", "AMAX"):
        return x.amax(dim=axes, keepdim=True)
    if mode == "MIN":
        return x.amin(dim=axes, keepdim=True)
    if mode == "AVG":
        return x.mean(dim=axes, keepdim=True)
    if mode == "NORM2":
        return torch.sqrt((x * x).sum(dim=axes, keepdim=True))
    if mode in ("MUL", "MUL_NO_ZEROS"):
        for a in axes:
            x = x.prod(dim=a, keepdim=True)
        return x
    raise ValueError(mode)


def _reduction(call: NodeCall) -> dict[str, Tensor]:
    x = call.f("input")
    mode = str(call.params.get("mode"))
    out = call.dims("OUT_0")
    if not out:
        raise call.fail("the reduction output has no dims (they name the reduced axes)")
    if len(out) != x.dim() or any(o not in (1, n) for o, n in zip(out, x.shape)):
        raise call.fail(f"output dims {out} are not input dims {list(x.shape)} with 1 on reduced axes")
    axes = [i for i, (o, n) in enumerate(zip(out, x.shape)) if o == 1 and n != 1]
    if mode not in REDUCTION_MODES:
        raise call.fail(f"reduction mode {mode!r} has no reference")
    return {"OUT_0": _reduce(x, axes, mode)}


def _reduction_unsupported(spec: GraphSpec, node: NodeDoc) -> str | None:
    mode = decode_param(node.params.get("mode"))
    if mode not in REDUCTION_MODES:
        return f"reduction mode {mode!r} has no reference"
    if "group_offset" in node.inputs:
        return "grouped reduction (group_offset) has no reference"
    return None


# ------------------------------------------------------------------ normalization
#
# Statistics axes. FE (``_norm_stats_like``, the C++ nodes' rule): a stat has the input's dims with 1
# wherever the scale is not 1 (layernorm/rmsnorm; every axis but 0 without a scale), so for the usual
# input [N, C, H, W] with scale [1, C, H, W] the stats are [N, 1, 1, 1] -- normalization over every
# axis but 0. Batchnorm keeps axis 1 (stats [1, C, 1, 1]), instancenorm axes 0 and 1 ([N, C, 1, 1]).
# Where the document gives the stats' dims (forward outputs, backward inputs), they decide: the
# normalized axes are those where the stat is 1 and the input is not.


def _axes_from_stats(x_shape: list[int] | torch.Size, stat: list[int] | None) -> list[int] | None:
    if not stat or len(stat) != len(x_shape):
        return None
    return [i for i, (s, n) in enumerate(zip(stat, x_shape)) if s == 1 and n != 1]


def norm_axes(node_type: str, x_shape: list[int] | torch.Size, scale_shape: list[int] | None,
              stat_dims: list[int] | None = None) -> list[int]:
    """The axes a normalization node reduces its statistics over (see the rule above)."""
    axes = _axes_from_stats(x_shape, stat_dims)
    if axes is not None:
        return axes
    rank = len(x_shape)
    statistics = kind_of(node_type).statistics
    if statistics == "batch":
        return [i for i in range(rank) if i != 1]
    if statistics == "instance":
        return list(range(2, rank))
    if scale_shape and len(scale_shape) == rank and any(s != 1 for s in scale_shape):
        return [i for i in range(rank) if scale_shape[i] != 1]
    return list(range(1, rank))


def _stat_dims(call: NodeCall, ports: tuple[str, ...]) -> list[int] | None:
    for port in ports:
        if port in call.node.outputs or port in call.node.inputs:
            d = call.dims(port)
            if d:
                return d
    return None


def _norm_forward(call: NodeCall) -> dict[str, Tensor]:
    """LAYERNORM / RMSNORM / INSTANCENORM / BATCHNORM forward: y = (x - mean) * inv_var * scale + bias with
    inv_var = 1/sqrt(var + eps), var biased (rmsnorm: mean 0, var = mean(x^2)). Batchnorm also updates the
    running stats: next = (1 - momentum) * running + momentum * batch stat, the variance unbiased (n/(n-1))."""
    t = call.node.type
    statistics = kind_of(t).statistics
    x = call.f("input")
    scale = call.f("scale") if "scale" in call.x else None
    bias = call.f("bias") if "bias" in call.x else None
    eps = call.scalar("epsilon")
    axes = norm_axes(t, list(x.shape), list(scale.shape) if scale is not None else None,
                     _stat_dims(call, ("mean", "inv_var")))
    if statistics == "rms":
        mean = None
        var = (x * x).mean(dim=axes, keepdim=True)
    else:
        mean = x.mean(dim=axes, keepdim=True)
        var = ((x - mean) ** 2).mean(dim=axes, keepdim=True)
    inv = torch.rsqrt(var + eps)
    y = (x if mean is None else x - mean) * inv
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias
    out = {"Y": y, "inv_var": inv}
    if mean is not None:
        out["mean"] = mean
    if statistics == "batch" and "in_running_mean" in call.x and mean is not None:
        m = call.scalar("momentum", 0.1)
        n = math.prod(x.shape[i] for i in axes)
        out["next_running_mean"] = (1 - m) * call.f("in_running_mean") + m * mean
        unbiased = var * (n / max(n - 1, 1))
        out["next_running_var"] = (1 - m) * call.f("in_running_var") + m * unbiased
    return out


def _batchnorm_inference(call: NodeCall) -> dict[str, Tensor]:
    """y = (x - mean) * inv_variance * scale + bias with the given statistics."""
    y = (call.f("input") - call.f("mean")) * call.f("inv_variance")
    if "scale" in call.x:
        y = y * call.f("scale")
    if "bias" in call.x:
        y = y + call.f("bias")
    return {"Y": y}


def _norm_backward(call: NodeCall) -> dict[str, Tensor]:
    """LAYERNORM_BWD / RMSNORM_BWD / BATCHNORM_BWD / INSTANCENORM_BWD with the GIVEN saved statistics (the
    kernels use them as they are): xhat = (x - mean) * inv, g = dy * scale, over the normalized axes A
    (n elements) dx = inv * (g - mean_A(g) - xhat * mean_A(g * xhat)) (rmsnorm: no mean_A(g) term, mean 0);
    dscale = sum(dy * xhat), dbias = sum(dy), both summed to the scale's shape."""
    t = call.node.type
    dy, x = call.f("grad"), call.f("input")
    inv = call.f("inv_variance")
    rms = kind_of(t).statistics == "rms"
    mean = None if rms else call.f("mean")
    scale = call.f("scale") if "scale" in call.x else None
    axes = norm_axes(t, list(x.shape), list(scale.shape) if scale is not None else None, list(inv.shape))
    xhat = (x if mean is None else x - mean) * inv
    g = dy * scale if scale is not None else dy
    gx = (g * xhat).mean(dim=axes, keepdim=True) if axes else g * xhat
    dx = g - xhat * gx
    if not rms:
        dx = dx - (g.mean(dim=axes, keepdim=True) if axes else g)
    out = {"DX": inv * dx}
    shape = list(scale.shape) if scale is not None else [1] * x.dim()
    out["DScale"] = _sum_to(dy * xhat, shape)
    out["DBias"] = _sum_to(dy, shape)
    return out


def _norm_unsupported(spec: GraphSpec, node: NodeDoc) -> str | None:
    if any(p.startswith("peer_stats") for p in node.inputs):
        return "peer_stats (multi-GPU batch statistics) have no reference"
    if "epsilon" in kind_of(node.type).required and "epsilon" not in node.inputs:
        return "no epsilon input"
    return None


# ------------------------------------------------------------------ attention
#
# Mask semantics (FE 1.32: include/cudnn_frontend/utils/attn_score_modifiers.h ``sliding_window_mask``,
# node/diagonal_band_mask.h, and cudnn/sdpa/graph_analyzer.py's resolution of the spellings). Row i
# (query), column j (key), per batch b:
#   * spellings: use_causal_mask = TOP_LEFT + right bound 0; use_causal_mask_bottom_right = BOTTOM_RIGHT +
#     right bound 0 (an explicit right bound wins over the flags' 0); the left bound is
#     diagonal_band_left_bound (sdpa) / left_bound (sdpa_fp8), else sliding_window_length /
#     sliding_window; the right bound diagonal_band_right_bound / right_bound. Without a causal flag the
#     alignment is the diagonal_alignment param (it only matters when some bound is set).
#   * shift = 0 for TOP_LEFT; for BOTTOM_RIGHT shift = s_kv(b) - s_q(b), the per-batch seq_len_kv /
#     seq_len_q tensors where the node has them, else the tensors' s_kv / s_q dims.
#   * right bound R kept:  j <= i + shift + R        (cuDNN: row + shift + R >= col, CMP_GE)
#   * left bound L kept:   j >  i + shift - L        (cuDNN: col + L - shift > row, CMP_GT), so with
#     R = 0 a query sees exactly L keys: i + shift - L < j <= i + shift.
#   * padding (use_padding_mask, and always for ragged/THD Q): kept i < seq_len_q(b) and j < seq_len_kv(b).
#   * alibi: score += (j - i) * slope[h], FE's get_alibi_slope(h_q) (2^(-8(k+1)/n) for the power of two n,
#     interleaved halves for the rest), added before the masks.
# Order (FE's composite SDPA): S = Q K^T * attn_scale (* descale_q * descale_k for fp8), + bias, + alibi,
# masks (-inf), softmax. An absent attn_scale is 1.0. Stats = logsumexp of the masked, scaled row
# (natural log; times log2(e) when stats_use_log2); score_max = the row max, score_sum_exp = sum of
# exp(S - max). A row with no visible key has O = 0 and Stats = -inf here and is a don't-care row in
# the comparison, as are padding rows (i >= seq_len_q).
#
# Layouts. Tensors are logical [b, h, s, d] (any strides). Paged K/V: k / v are page containers
# [num_blocks, h_kv, block_size, d]; paged_attention_k_table / _v_table [b, 1, pages, 1] int32 name the
# block holding tokens [p*block_size, (p+1)*block_size) of sequence b; s_kv is
# paged_attention_max_seq_len_kv (else pages * block_size). Ragged (THD): a tensor with a ragged_offset
# holds sequence b's token t, head h, element e at offset[b] * ragged_offset_multiplier + h*stride[1] +
# t*stride[2] + e*stride[3] of its buffer (offsets in elements; stride[0] unused); its live rows are the
# sequence lengths (seq_len_q for q/o/dO/stats/dQ, seq_len_kv for k/v/dK/dV).


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def alibi_slopes(n_heads: int) -> list[float]:
    """FE's ``detail::get_alibi_slope``."""
    n = 1 << int(math.log2(n_heads))
    slope = [float(i + 1) for i in range(n)]
    slope += [float(i + 1) * 0.5 for i in range(0, 2 * (n_heads - n), 2)]
    return [2.0 ** (s * -8.0 / n) for s in slope]


@dataclass
class AttentionGeometry:
    b: int
    h_q: int
    s_q: int
    s_kv: int
    lens_q: list[int] | None
    lens_kv: list[int] | None
    padding: bool
    left: int | None
    right: int | None
    bottom_right: bool
    alibi: bool

    def keep(self, device: torch.device | str) -> Tensor:
        """Boolean [b, 1, s_q, s_kv]: True where query i may attend key j."""
        row = torch.arange(self.s_q, device=device).view(1, 1, -1, 1)
        col = torch.arange(self.s_kv, device=device).view(1, 1, 1, -1)
        keep = torch.ones(self.b, 1, self.s_q, self.s_kv, dtype=torch.bool, device=device)
        lq = torch.tensor(self.lens_q if self.lens_q is not None else [self.s_q] * self.b, device=device).view(-1, 1, 1, 1)
        lkv = torch.tensor(self.lens_kv if self.lens_kv is not None else [self.s_kv] * self.b, device=device).view(-1, 1, 1, 1)
        if self.padding:
            keep &= (row < lq) & (col < lkv)
        shift = (lkv - lq) if self.bottom_right else torch.zeros_like(lq)
        if self.right is not None:
            keep &= col <= row + shift + self.right
        if self.left is not None:
            keep &= col > row + shift - self.left
        return keep

    def q_rows(self, device: torch.device | str) -> Tensor:
        """Boolean [b, 1, s_q, 1]: query rows that see at least one key (the compared rows of O/Stats/dQ)."""
        return self.keep(device).any(dim=-1, keepdim=True)

    def kv_rows(self, device: torch.device | str) -> Tensor:
        """Boolean [b, 1, s_kv, 1]: live key rows (j < seq_len_kv under padding; all otherwise)."""
        col = torch.arange(self.s_kv, device=device).view(1, 1, -1, 1)
        if not self.padding or self.lens_kv is None:
            return torch.ones(self.b, 1, self.s_kv, 1, dtype=torch.bool, device=device)
        return col < torch.tensor(self.lens_kv, device=device).view(-1, 1, 1, 1)


def _lens(x: dict[str, Tensor], port: str, cu_port: str) -> list[int] | None:
    if port in x:
        return [int(v) for v in x[port].reshape(-1).tolist()]
    if cu_port in x:
        cu = [int(v) for v in x[cu_port].reshape(-1).tolist()]
        return [b - a for a, b in itertools.pairwise(cu)]
    return None


def is_paged(node: NodeDoc) -> bool:
    return "paged_attention_k_table" in node.inputs or "paged_attention_v_table" in node.inputs


def kv_len(spec: GraphSpec, node: NodeDoc) -> int:
    """s_kv of an attention node: the paged max length, else k's dim 2."""
    k = spec.tensor(node.inputs["k"])
    if is_paged(node):
        port = "paged_attention_k_table" if "paged_attention_k_table" in node.inputs else "paged_attention_v_table"
        table = spec.tensor(node.inputs[port])
        block = k.dim[2]
        max_len = decode_param(node.params.get("paged_attention_max_seq_len_kv"))
        return int(max_len) if max_len else table.dim[2] * block
    return k.dim[2]


def attention_geometry(spec: GraphSpec, node: NodeDoc, x: dict[str, Tensor]) -> AttentionGeometry:
    """Sizes, sequence lengths and mask settings of an SDPA-family node (``x``: its bound inputs by port)."""
    p = {k: decode_param(v) for k, v in node.params.items()}
    q = spec.tensor(node.inputs["q"])
    b, h_q, s_q = q.dim[0], q.dim[1], q.dim[2]
    s_kv = kv_len(spec, node)
    lens_q = _lens(x, "seq_len_q", "cu_seq_len_q")
    lens_kv = _lens(x, "seq_len_kv", "cu_seq_len_kv")
    ragged = q.ragged_offset is not None
    padding = bool(p.get("use_padding_mask")) or (ragged and (lens_q is not None or lens_kv is not None))
    use_causal, use_br = bool(p.get("use_causal_mask")), bool(p.get("use_causal_mask_bottom_right"))
    left = _first(p.get("diagonal_band_left_bound"), p.get("left_bound"), p.get("sliding_window_length"),
                  p.get("sliding_window"))
    right = _first(p.get("diagonal_band_right_bound"), p.get("right_bound"))
    if use_causal or use_br:
        right = 0 if right is None else right
        bottom_right = use_br
    else:
        bottom_right = (right is not None or left is not None) and p.get("diagonal_alignment") == "BOTTOM_RIGHT"
    return AttentionGeometry(
        b=b, h_q=h_q, s_q=s_q, s_kv=s_kv, lens_q=lens_q, lens_kv=lens_kv, padding=padding,
        left=None if left is None else int(left), right=None if right is None else int(right),
        bottom_right=bool(bottom_right), alibi=bool(p.get("use_alibi_mask")))


#: Ports on the key/value side (their rows are keys); every other attention port is on the query side.
KV_SIDE = ("k", "v", "dK", "dV")


def ragged_gather(t: Tensor, doc: TensorDoc, offsets: Tensor, lens: list[int] | None) -> Tensor:
    """The logical [b, h, s, d] float32 view of a ragged (THD) tensor bound as ``t`` (rows past a sequence's
    length are 0)."""
    b, h, s, d = doc.dim
    st = list(t.stride())
    mult = doc.ragged_offset_multiplier or 1
    offs = [int(v) for v in offsets.reshape(-1).tolist()]
    out = torch.zeros(b, h, s, d, dtype=torch.float32, device=t.device)
    for i in range(b):
        n = min(s, lens[i] if lens is not None else s)
        if n <= 0:
            continue
        view = torch.as_strided(t, (h, n, d), (st[1], st[2], st[3]), t.storage_offset() + offs[i] * mult)
        out[i, :, :n] = view.to(torch.float32)
    return out


def ragged_scatter(dst: Tensor, doc: TensorDoc, offsets: Tensor, lens: list[int] | None, dense: Tensor) -> None:
    """Write the logical [b, h, s, d] ``dense`` into the ragged tensor ``dst`` (inverse of ragged_gather)."""
    b, h, s, d = doc.dim
    st = list(dst.stride())
    mult = doc.ragged_offset_multiplier or 1
    offs = [int(v) for v in offsets.reshape(-1).tolist()]
    for i in range(b):
        n = min(s, lens[i] if lens is not None else s)
        if n <= 0:
            continue
        view = torch.as_strided(dst, (h, n, d), (st[1], st[2], st[3]), dst.storage_offset() + offs[i] * mult)
        view.copy_(dense[i, :, :n].to(dst.dtype))


def paged_gather(container: Tensor, table: Tensor, b: int, s_kv: int) -> Tensor:
    """Dense [b, h, s_kv, d] from a page container [num_blocks, h, block_size, d] and its table [b, 1, pages, 1]."""
    nb, _, bs, _ = container.shape
    tab = table.reshape(b, -1).long().clamp(0, nb - 1)
    pos = torch.arange(s_kv, device=container.device)
    pages = (pos // bs).clamp(max=tab.shape[1] - 1)
    blocks = tab[:, pages]  # [b, s_kv]
    dense = container[blocks, :, (pos % bs).view(1, -1).expand(b, -1), :]  # [b, s_kv, h, d]
    return dense.permute(0, 2, 1, 3)


def _side_lens(geo: AttentionGeometry, port: str) -> list[int] | None:
    return geo.lens_kv if port in KV_SIDE else geo.lens_q


def _attn_input(call: NodeCall, port: str, geo: AttentionGeometry) -> Tensor:
    """A q/k/v/o/dO input as a dense logical [b, h, s, d] tensor (paged and ragged layouts resolved)."""
    if port in ("k", "v") and is_paged(call.node):
        own = f"paged_attention_{port}_table"
        table = call.x[own if own in call.x else "paged_attention_k_table"]
        return paged_gather(call.f(port), table, geo.b, geo.s_kv)
    doc = call.doc(port)
    if doc.ragged_offset is not None:
        offsets = call.raw.get(doc.ragged_offset)
        bound = call.raw.get(doc.uid)
        if offsets is None or bound is None:
            raise call.fail(f"ragged input {port!r} needs its bound tensor and ragged offsets")
        dense = ragged_gather(bound, doc, offsets, _side_lens(geo, port))
        return dense if call.exact else dense.to(call.x[port].dtype)
    return call.f(port)


def _attn_scale(call: NodeCall) -> float | Tensor:
    if "attn_scale" in call.x:
        return call.x["attn_scale"].reshape(()).to(call.dtype())
    v = call.params.get("attn_scale")
    return 1.0 if v is None else float(v)


def _expand_heads(t: Tensor, h: int) -> Tensor:
    return t if t.shape[1] == h else t.repeat_interleave(h // t.shape[1], dim=1)


#: Score-matrix bytes one chunk of heads may take (the attention reference runs batch by batch, heads in
#: chunks, so its scratch stays bounded whatever b and h are).
SCORE_CHUNK_BYTES = 1 << 29


def head_chunk(h: int, s_q: int, s_kv: int) -> int:
    return max(1, min(h, SCORE_CHUNK_BYTES // max(1, s_q * s_kv * 4)))


def _chunks(geo: AttentionGeometry) -> Iterator[tuple[int, slice]]:
    hc = head_chunk(geo.h_q, geo.s_q, geo.s_kv)
    for i in range(geo.b):
        for h0 in range(0, geo.h_q, hc):
            yield i, slice(h0, min(geo.h_q, h0 + hc))


def _bias_index(bias: Tensor, i: int, heads: slice) -> tuple[slice, slice]:
    """Where batch i / the heads of a chunk read a broadcastable [b|1, h|1, s_q, s_kv] bias."""
    bi = slice(i, i + 1) if bias.shape[0] != 1 else slice(0, 1)
    hi = heads if bias.shape[1] != 1 else slice(0, 1)
    return bi, hi


def _scores(q: Tensor, k: Tensor, scale: float | Tensor, geo: AttentionGeometry, keep: Tensor,
            bias: Tensor | None, heads: slice, extra_scale: float | Tensor | None = None) -> Tensor:
    """Masked scaled scores of one batch and chunk of heads (k already expanded to the query heads)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if extra_scale is not None:
        s = s * extra_scale
    if bias is not None:
        s = s + bias
    if geo.alibi:
        slopes = torch.tensor(alibi_slopes(geo.h_q)[heads], device=q.device, dtype=s.dtype).view(1, -1, 1, 1)
        row = torch.arange(s.shape[-2], device=q.device).view(-1, 1)
        col = torch.arange(s.shape[-1], device=q.device).view(1, -1)
        s = s + (col - row).to(s.dtype) * slopes
    return s.masked_fill(~keep, float("-inf"))


def _softmax(s: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(P, row max, row sum of exp(S - max)); a row with no visible key has P = 0, max -inf, sum 0."""
    m = s.amax(dim=-1, keepdim=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m_safe)
    l = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(l > 0, l, torch.ones_like(l))
    return p, m, l


def _lse(m: Tensor, l: Tensor) -> Tensor:
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return m_safe + torch.log(l)


def attention_forward(call: NodeCall, geo: AttentionGeometry | None = None, *, fp8: bool | None = None,
                      stats: bool | None = None) -> dict[str, Tensor]:
    """SDPA / SDPA_FP8 forward (see the semantics above), batch by batch and heads in chunks.

    SDPA_FP8: S = Q K^T * attn_scale * descale_q * descale_k; P = softmax(S); Amax_S = max P;
    P8 = fp8(P * scale_s) in q's fp8 type (emulated: the kernel feeds an fp8 P to the second GEMM);
    O' = P8 V * descale_s * descale_v; Amax_O = max |O'|; O = O' * scale_o."""
    geo = geo or attention_geometry(call.spec, call.node, call.x)
    fp8 = kind_of(call.node.type).fp8 if fp8 is None else fp8
    q = _attn_input(call, "q", geo)
    k = _expand_heads(_attn_input(call, "k", geo), q.shape[1])
    v = _expand_heads(_attn_input(call, "v", geo), q.shape[1])
    scale = _attn_scale(call)
    bias = call.f("bias") if "bias" in call.x else None
    keep = geo.keep(q.device)
    extra = None
    if fp8:
        extra = call.x["descale_q"].reshape(()) * call.x["descale_k"].reshape(())
        fp8_dtype = torch.float8_e5m2 if call.spec.data_type_of(call.doc("q")) == "FP8_E5M2" else torch.float8_e4m3fn
        top = torch.finfo(fp8_dtype).max
    want_stats = stats if stats is not None else bool(set(call.node.outputs) & {"Stats", "score_max", "score_sum_exp"})
    drop = _dropout_multiplier(call)
    b, h, s_q = q.shape[0], q.shape[1], q.shape[2]
    o = torch.empty(b, h, s_q, v.shape[-1], dtype=torch.promote_types(q.dtype, v.dtype), device=q.device)
    m_all = torch.empty(b, h, s_q, 1, dtype=torch.float32, device=q.device) if want_stats else None
    l_all = torch.empty_like(m_all) if m_all is not None else None
    amax_s = torch.zeros((), dtype=torch.float32, device=q.device)
    for i, hs in _chunks(geo):
        bias_c = None
        if bias is not None:
            bi, hi = _bias_index(bias, i, hs)
            bias_c = bias[bi, hi]
        s = _scores(q[i:i + 1, hs], k[i:i + 1, hs], scale, geo, keep[i:i + 1], bias_c, hs, extra)
        p, m, l = _softmax(s)
        del s
        if drop is not None:  # after the statistics: cuDNN's Stats are those of the undropped row
            p = p * drop[i:i + 1, hs]
        vv = v[i:i + 1, hs]
        if fp8:
            amax_s = torch.maximum(amax_s, p.amax().to(torch.float32))
            p8 = (p * call.x["scale_s"].reshape(())).clamp(-top, top).to(fp8_dtype).to(p.dtype)
            o[i:i + 1, hs] = torch.matmul(p8, vv) * (call.x["descale_s"].reshape(()) * call.x["descale_v"].reshape(()))
        else:
            o[i:i + 1, hs] = torch.matmul(p.to(vv.dtype), vv)
        if m_all is not None and l_all is not None:
            m_all[i:i + 1, hs] = m
            l_all[i:i + 1, hs] = l
    out: dict[str, Tensor] = {}
    if fp8:
        out["Amax_S"] = amax_s.reshape(1, 1, 1, 1)
        out["Amax_O"] = o.abs().amax().reshape(1, 1, 1, 1).to(torch.float32)
        o = o * call.x["scale_o"].reshape(())
    out["O"] = o
    if m_all is not None and l_all is not None:
        lse = _lse(m_all, l_all)
        if call.params.get("stats_use_log2"):
            lse = lse * math.log2(math.e)
        out["Stats"] = lse
        out["score_max"] = m_all
        out["score_sum_exp"] = l_all
    return out


def _fused_attention(call: NodeCall) -> dict[str, Tensor] | None:
    """The eager path (exact=False): torch's fused scaled_dot_product_attention where it applies."""
    if call.exact or call.node.type != "SDPA" or set(call.node.outputs) - {"O"} or "bias" in call.x \
            or _has_dropout(call.node):
        return None
    geo = attention_geometry(call.spec, call.node, call.x)
    if geo.alibi:
        return None
    q = _attn_input(call, "q", geo)
    k = _attn_input(call, "k", geo)
    v = _attn_input(call, "v", geo)
    scale = _attn_scale(call)
    if isinstance(scale, torch.Tensor):
        scale = float(scale)
    gqa = q.shape[1] != k.shape[1]
    plain = not geo.padding and geo.left is None
    if plain and geo.right is None:
        return {"O": F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)}
    if plain and geo.right == 0 and (not geo.bottom_right or geo.s_q == geo.s_kv):
        return {"O": F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)}
    return {"O": F.scaled_dot_product_attention(q, k, v, attn_mask=geo.keep(q.device), scale=scale, enable_gqa=gqa)}


def _sdpa(call: NodeCall) -> dict[str, Tensor]:
    fused = _fused_attention(call)
    return fused if fused is not None else attention_forward(call)


def _sdpa_backward(call: NodeCall) -> dict[str, Tensor]:
    """dQ, dK, dV (and dBias): autograd of the float32 forward recomputed from q, k, v with the node's
    scale and masks, applied to dO (the given o and stats are assumed consistent with q, k, v)."""
    geo = attention_geometry(call.spec, call.node, call.x)
    q = _attn_input(call, "q", geo)
    k0 = _attn_input(call, "k", geo)
    v0 = _attn_input(call, "v", geo)
    h = q.shape[1]
    k, v = _expand_heads(k0, h), _expand_heads(v0, h)
    d_o = _attn_input(call, "dO", geo)
    scale = _attn_scale(call)
    bias = call.f("bias") if "bias" in call.x else None
    want_dbias = bias is not None and "dBias" in call.node.outputs
    keep = geo.keep(q.device)
    drop = _dropout_multiplier(call)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dbias = torch.zeros_like(bias) if bias is not None and want_dbias else None
    for i, hs in _chunks(geo):
        with torch.enable_grad():
            qi = q[i:i + 1, hs].detach().requires_grad_(True)
            ki = k[i:i + 1, hs].detach().requires_grad_(True)
            vi = v[i:i + 1, hs].detach().requires_grad_(True)
            bias_c, bidx = None, None
            if bias is not None:
                bidx = _bias_index(bias, i, hs)
                bias_c = bias[bidx].detach()
                if want_dbias:
                    bias_c = bias_c.expand(1, qi.shape[1], *bias_c.shape[2:]).clone().requires_grad_(True)
            s = _scores(qi, ki, scale, geo, keep[i:i + 1], bias_c, hs)
            p, _, _ = _softmax(s)
            if drop is not None:
                p = p * drop[i:i + 1, hs]
            o = torch.matmul(p, vi)
            wrt = [qi, ki, vi] + ([bias_c] if bias_c is not None and want_dbias else [])
            grads = torch.autograd.grad(o, wrt, d_o[i:i + 1, hs])
        dq[i:i + 1, hs] = grads[0]
        dk[i:i + 1, hs] = grads[1]
        dv[i:i + 1, hs] = grads[2]
        if dbias is not None:
            dbias[bidx] += _sum_to(grads[3], list(dbias[bidx].shape))
    g = h // k0.shape[1]
    if g > 1:  # GQA / MQA: a key head's gradient sums over the query heads that read it
        dk = dk.view(k0.shape[0], k0.shape[1], g, *k0.shape[2:]).sum(2)
    g = h // v0.shape[1]
    if g > 1:
        dv = dv.view(v0.shape[0], v0.shape[1], g, *v0.shape[2:]).sum(2)
    out = {"dQ": dq, "dK": dk, "dV": dv}
    if dbias is not None:
        out["dBias"] = dbias
    return out


def _has_dropout(node: NodeDoc) -> bool:
    return "_dropout_n" in node.params or any(p.startswith("dropout") for p in node.inputs) or "rng_dump" in node.outputs


def dropout_probability(node: NodeDoc) -> float | None:
    """p of an attention node whose dropout cuDNN draws from a seed and an offset (FE's ``dropout=(p, seed,
    offset)``, both tensors), the form the reference checks; None for any other node or form."""
    if kind_of(node.type).group != "attention" or decode_param(node.params.get("_dropout_n")) != 3 \
            or "rng_dump" in node.outputs or not {"dropout_1", "dropout_2"} <= set(node.inputs):
        return None
    p = decode_param(node.params.get("dropout_0"))
    return float(p) if isinstance(p, (int, float)) and not isinstance(p, bool) and 0 < p < 1 else None


def dropout_nodes(spec: GraphSpec) -> list[int]:
    """Indices of the attention nodes of ``spec`` with a reference-checked dropout (:func:`dropout_probability`)."""
    return [i for i, node in enumerate(spec.nodes) if dropout_probability(node) is not None]


#: Params of an attention backward that its forward does not take.
_BACKWARD_ONLY = frozenset({"use_deterministic_algorithm", "max_total_seq_len_q", "max_total_seq_len_kv"})
#: Inputs of an attention backward that its forward does not take.
_BACKWARD_INPUTS = frozenset({"o", "dO", "stats"})


@dataclass(frozen=True)
class DropoutProbe:
    """A forward graph that draws the dropout of one attention node and dumps it (:func:`dropout_probe`)."""

    spec: GraphSpec  # the probe: outputs O, Stats and rng_dump
    checked: GraphSpec  # the same graph without the dump: what the float32 reference evaluates
    dump_uid: int
    p: float


def dropout_probe(spec: GraphSpec, index: int) -> DropoutProbe:
    """The probe of attention node ``index``'s dropout: one SDPA forward node on that node's own inputs (q, k, v,
    bias, sequence lengths, seed and offset, same uids, same masks, scale and p), with outputs O and Stats
    (contiguous) and ``rng_dump`` [b, h_q, s_q, s_kv] float32. cuDNN draws an element's dropout from the seed, the
    offset and the element's position, so a forward and a backward of the same seed and offset drop the same
    elements, and so does this probe."""
    node = spec.nodes[index]
    p = dropout_probability(node)
    if p is None:
        raise TuningError(f"{node_label(spec, node)}: no dropout drawn from a seed and an offset to probe")
    inputs = {port: u for port, u in node.inputs.items() if port not in _BACKWARD_INPUTS}
    produced = [port for port, u in inputs.items() if spec.producer(u) is not None]
    if produced:
        raise TuningError(f"{node_label(spec, node)}: its dropout cannot be probed: input {produced[0]!r} is computed "
                          "in the graph")
    q, v = spec.tensor(inputs["q"]), spec.tensor(inputs["v"])
    b, h, s_q = q.dim[0], q.dim[1], q.dim[2]
    s_kv, d_v = kv_len(spec, node), v.dim[3]
    used = set(inputs.values())
    used |= {r for u in inputs.values() if (r := spec.tensor(u).ragged_offset) is not None}
    top = max(t.uid for t in spec.tensors)
    o_uid, stats_uid, dump_uid = top + 1, top + 2, top + 3
    tensors = [t.model_dump() for t in spec.tensors if t.uid in used]
    for uid, name, dtype, dims in ((o_uid, "O", spec.data_type_of(q), [b, h, s_q, d_v]),
                                   (stats_uid, "Stats", "FLOAT", [b, h, s_q, 1]),
                                   (dump_uid, "rng_dump", "FLOAT", [b, h, s_q, s_kv])):
        strides = [math.prod(dims[i + 1:]) for i in range(4)]
        tensors.append({"uid": uid, "name": f"probe::{name}", "data_type": dtype, "dim": dims, "stride": strides,
                        "uid_assigned": True, "dim_assigned": True, "stride_assigned": True})
    params = {k: v for k, v in node.params.items() if k not in _BACKWARD_ONLY}
    params["generate_stats"] = True  # a training forward: the one cuDNN draws dropout in
    outputs = {"O": o_uid, "Stats": stats_uid}

    def document(outs: dict[str, int]) -> GraphSpec:
        return GraphSpec.model_validate({
            "name": f"dropout probe of {spec.name}"[:200], "context": spec.context.model_dump(),
            "tensors": [t for t in tensors if t["uid"] in used or t["uid"] in outs.values()],
            "nodes": [{"name": "probe", "type": "SDPA", "compute_data_type": node.compute_data_type, "inputs": inputs,
                       "outputs": outs, "params": params}]})

    return DropoutProbe(document({**outputs, "rng_dump": dump_uid}), document(outputs), dump_uid, p)


def _dropout_multiplier(call: NodeCall) -> Tensor | None:
    """The node's dropout multiplier, None without dropout; a node with dropout and no multiplier cannot be
    evaluated (the multiplier is what cuDNN drew)."""
    if not _has_dropout(call.node):
        return None
    if call.dropout is None:
        raise call.fail("its dropout needs the elements cuDNN drops (plancache.gpu.runtime.draw_dropout)")
    return call.dropout


def _sdpa_unsupported(spec: GraphSpec, node: NodeDoc) -> str | None:
    p = {k: decode_param(v) for k, v in node.params.items()}
    if _has_dropout(node) and (dropout_probability(node) is None or kind_of(node.type).fp8):
        return "dropout other than a probability drawn from a seed and an offset (or in fp8) has no reference"
    for port in ("block_mask", "sink_token", "kv_mask"):
        if port in node.inputs:
            return f"{port} has no reference"
    for port in ("sf_o", "dSink_token"):
        if port in node.outputs:
            return f"output {port} has no reference"
    if p.get("attn_scale_prefolded"):
        return "attn_scale_prefolded has no reference"
    if p.get("softmax_precision") not in (None, "FLOAT"):
        return "a reduced softmax_precision has no float32 reference"
    for port in kind_of(node.type).required:
        if port not in node.inputs:
            return f"input {port!r} is missing"
    q = spec.tensor(node.inputs["q"])
    if len(q.dim) != 4:
        return "q is not 4-D [b, h, s, d]"
    if is_paged(node) and kind_of(node.type).backward:
        return "paged K/V in a backward has no reference"
    for port, uid in list(node.inputs.items()) + list(node.outputs.items()):
        t = spec.tensor(uid)
        if t.ragged_offset is not None and spec.producer(t.ragged_offset) is not None:
            return f"ragged offsets of {port!r} are computed in the graph"
    return None


# ------------------------------------------------------------------ the registry

FAMILIES: tuple[Family, ...] = (
    Family("conv_fprop", ("CONV_FPROP",), _conv_fprop, True, ("conv_fprop",),
           "convolution forward, 1-3 spatial dims, any padding/stride/dilation/groups"),
    Family("conv_dgrad", ("CONV_DGRAD",), _conv_dgrad, False, ("conv_dgrad",),
           "convolution data gradient (autograd of the forward)"),
    Family("conv_wgrad", ("CONV_WGRAD",), _conv_wgrad, False, ("conv_wgrad",),
           "convolution weight gradient (autograd of the forward)"),
    Family("matmul", ("MATMUL",), _matmul, False, ("mlp_matmul", "mlp_matmul_bias_gelu", "fp8_matmul"),
           "batched matmul with batch broadcast; fp8 inputs upcast", unsupported=_matmul_unsupported),
    Family("pointwise", ("POINTWISE",), _pointwise, True, ("mlp_matmul_bias_gelu", "fp8_matmul"),
           "elementwise ops with numpy broadcasting", modes=POINTWISE_MODES, unsupported=_pointwise_unsupported),
    Family("reduction", ("REDUCTION",), _reduction, False, ("fp8_matmul",),
           "reductions to the output dims", modes=REDUCTION_MODES, unsupported=_reduction_unsupported),
    Family("norm_forward", ("LAYERNORM", "RMSNORM", "INSTANCENORM", "BATCHNORM"), _norm_forward, False,
           ("layernorm_fwd_train", "rmsnorm_infer"), "normalization forward (training / inference)",
           unsupported=_norm_unsupported),
    Family("batchnorm_inference", ("BATCHNORM_INFERENCE",), _batchnorm_inference, False, (),
           "batchnorm with given statistics"),
    Family("norm_backward", ("LAYERNORM_BWD", "RMSNORM_BWD", "INSTANCENORM_BWD", "BATCHNORM_BWD"), _norm_backward,
           False, ("layernorm_bwd",), "normalization backward with the given saved statistics",
           unsupported=_norm_unsupported),
    Family("sdpa", ("SDPA",), _sdpa, False,
           ("sdpa_fwd_train", "chunked_prefill", "sliding_window", "paged_decode", "varlen_sdpa"),
           "attention forward: masks, GQA, padding, paged and ragged K/V, alibi, bias", unsupported=_sdpa_unsupported),
    Family("sdpa_bwd", ("SDPA_BWD",), _sdpa_backward, False, ("sdpa_bwd",),
           "attention backward by autograd of the float32 forward", unsupported=_sdpa_unsupported),
    Family("sdpa_fp8", ("SDPA_FP8",), attention_forward, False, ("fp8_sdpa",),
           "fp8 attention forward with descale/scale factors and amax outputs", unsupported=_sdpa_unsupported,
           tolerance_of={"Amax_O": "O"}),
)

_BY_TYPE: dict[str, Family] = {t: f for f in FAMILIES for t in f.node_types}


def family_of(node: NodeDoc) -> Family | None:
    """The family covering ``node`` (None for a node type, or a POINTWISE/REDUCTION mode, without a reference)."""
    fam = _BY_TYPE.get(node.type)
    if fam is not None and fam.modes and decode_param(node.params.get("mode")) not in fam.modes:
        return None
    return fam


def uncovered(spec: GraphSpec) -> list[str]:
    """The graph's nodes the reference cannot evaluate, each described (empty: the graph is covered)."""
    out = []
    for node in spec.nodes:
        fam = family_of(node)
        if fam is None or fam.reference is None:
            out.append(f"{node_label(spec, node)}: no float32 reference for this node type"
                       if node.type not in _BY_TYPE else f"{node_label(spec, node)}: this mode has no reference")
            continue
        why = fam.unsupported(spec, node) if fam.unsupported else None
        if why:
            out.append(f"{node_label(spec, node)}: {why}")
    return out


def kernel_cache_safe(spec: GraphSpec) -> bool:
    """True when every node's family allows plans from a kernel cache (CONV_FPROP and POINTWISE only)."""
    for node in spec.nodes:
        fam = _BY_TYPE.get(node.type)
        if fam is None or not fam.kernel_cache_safe:
            return False
    return True
