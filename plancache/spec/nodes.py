"""Node types: every FE 1.32 node type, declared once in :data:`NODES`.

As FE's ``_STRUCTURED_OPS`` declares each op, a :class:`NodeKind` says what the rest of plancache needs to know of a
node type: the role of each input port (how test inputs are made for it), the shape of each output (inferred from the
inputs and params), the params dropped from the graph key at their defaults, and how FE fills an output it was not
told about. The spec's canonical form, its builder, the GPU reference and the node families read this table; a
node type FE adds is one entry here.

Plain Python (no cudnn, no torch): the server and CPU clients import it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Dims = list[int]
#: An output's shape rule: (input dims by port, decoded params) → the output's dims, or None where they cannot be
#: inferred (the output then takes the shape of its node's data input, see :meth:`NodeKind.output_dims`).
Infer = Callable[[Mapping[str, Dims], Mapping[str, Any]], "Dims | None"]
#: A weight-like input's fan-in from its dims: test values are scaled by 1/sqrt(fan-in) so outputs stay O(1).
FanIn = Callable[[Dims], "int | None"]
#: What a node computes, in the groups the reference and the builder treat alike.
Group = Literal["", "conv", "matmul", "pointwise", "reduction", "norm", "attention"]
#: How a normalization reduces its statistics (see :func:`plancache.gpu.families.norm_axes`).
Statistics = Literal["", "layer", "rms", "batch", "instance"]

#: Roles of input ports: how a valid test value is made for each (anything else is ``data``: random values).
ROLES = ("data", "epsilon", "momentum", "running_mean", "running_var", "attn_scale", "scale_s", "descale_s",
         "fp8_scale", "seq_len", "page_table", "saved_mean", "saved_inv_variance", "saved_o", "saved_stats")
#: Input roles every node type shares, whatever its kind declares.
COMMON_INPUTS: Mapping[str, str] = {"epsilon": "epsilon", "momentum": "momentum", "in_running_mean": "running_mean",
                                    "in_running_var": "running_var"}


def decode_param(value: Any) -> Any:
    """A document param as plain Python: an enum reads as its NAME, a tensor ref as its uid."""
    if isinstance(value, dict):
        keys = set(value)
        if keys == {"$enum", "name"}:
            return value["name"]
        if keys == {"$tensor"}:
            return value["$tensor"]
        if keys == {"$tuple"}:
            return [decode_param(v) for v in value["$tuple"]]
        if keys == {"$dict"}:
            return {k: decode_param(v) for k, v in value["$dict"].items()}
        return {k: decode_param(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_param(v) for v in value]
    return value


def broadcast(*shapes: Dims) -> Dims:
    """The numpy broadcast of the non-empty ``shapes``; the largest of them where they do not broadcast."""
    given = [s for s in shapes if s]
    out = [1] * max((len(s) for s in given), default=0)
    for s in given:
        for i, d in enumerate(s, len(out) - len(s)):
            if out[i] == 1:
                out[i] = d
            elif d not in (1, out[i]):
                return list(max(given, key=math.prod))
    return out


def _match(by_port: Mapping[str, Any], port: str) -> Any:
    if port in by_port:
        return by_port[port]
    return next((v for k, v in by_port.items() if k.endswith("*") and port.startswith(k[:-1])), None)


@dataclass(frozen=True)
class NodeKind:
    """One node type: its input roles and its outputs' shape rules by port (a port name ending in ``*`` matches by
    prefix, in the order declared, after the exact names), the params the graph key drops at these defaults
    (``"zeros"`` / ``"ones"``: a list of 0s / 1s of any length), and the weight-like inputs' fan-in."""

    type: str
    group: Group = ""
    inputs: Mapping[str, str] = field(default_factory=dict)
    outputs: Mapping[str, Infer] = field(default_factory=dict)
    params: Mapping[str, Any] = field(default_factory=dict)
    fan_in: Mapping[str, FanIn] = field(default_factory=dict)
    #: inputs the node's reference needs (its family says what a missing one means)
    required: tuple[str, ...] = ()
    #: FE pushes this node's output dims to the backend even when the user did not set them
    pushed_output_dims: bool = False
    #: FE's lowering passes every output's dims and strides to cuDNN as the document holds them, set or not
    lowers_output_layouts: bool = False
    #: outputs FE types FLOAT when their data type is unset
    float_outputs: frozenset[str] = frozenset()
    statistics: Statistics = ""
    #: fp8 attention: inputs carry descale factors
    fp8: bool = False

    @property
    def backward(self) -> bool:
        return self.type.endswith("_BWD")

    def role(self, port: str) -> str:
        """The role of input ``port`` (:data:`ROLES`)."""
        role = _match(self.inputs, port)
        return role if role is not None else COMMON_INPUTS.get(port, "data")

    def output_dims(self, port: str, inputs: Mapping[str, Dims], params: Mapping[str, Any]) -> Dims:
        """Dims of output ``port`` from the node's input dims and decoded params: its rule's, else those of the
        ``input`` port, else of the first input with dims ([] when none has)."""
        rule: Infer | None = _match(self.outputs, port)
        dims = rule(inputs, params) if rule is not None else None
        if dims is not None:
            return dims
        return list(inputs.get("input") or next((d for d in inputs.values() if d), []))


# ------------------------------------------------------------------ shape rules


def conv_padding(params: Mapping[str, Any], spatial: int) -> tuple[Dims, Dims, Dims, Dims]:
    """(pre, post, stride, dilation): ``padding`` sets both sides; absent padding is 0, stride and dilation 1."""
    pre = params.get("pre_padding") or params.get("padding") or [0] * spatial
    post = params.get("post_padding") or params.get("padding") or [0] * spatial
    return list(pre), list(post), list(params.get("stride") or [1] * spatial), list(params.get("dilation") or [1] * spatial)


def _conv_y(ins: Mapping[str, Dims], params: Mapping[str, Any]) -> Dims | None:
    x, w = ins.get("image"), ins.get("weight")
    if not x or not w:
        return None
    spatial = len(x) - 2
    pre, post, st, dl = conv_padding(params, spatial)
    return [x[0], w[0]] + [(x[2 + i] + pre[i] + post[i] - dl[i] * (w[2 + i] - 1) - 1) // st[i] + 1
                           for i in range(spatial)]


def _conv_dx(ins: Mapping[str, Dims], params: Mapping[str, Any]) -> Dims | None:
    dy, w = ins.get("loss"), ins.get("filter")
    if not dy or not w:
        return None
    spatial = len(dy) - 2
    pre, post, st, dl = conv_padding(params, spatial)
    return [dy[0], w[1]] + [(dy[2 + i] - 1) * st[i] - pre[i] - post[i] + dl[i] * (w[2 + i] - 1) + 1
                            for i in range(spatial)]


def _matmul_c(ins: Mapping[str, Dims], params: Mapping[str, Any]) -> Dims | None:
    a, b = ins.get("A"), ins.get("B")
    if not a or not b:
        return None
    return broadcast(a[:-2], b[:-2]) + [a[-2], b[-1]]


def _pointwise_out(ins: Mapping[str, Dims], params: Mapping[str, Any]) -> Dims | None:
    return broadcast(*ins.values())


def _attention(rule: Callable[[Dims, Mapping[str, Dims]], Dims]) -> Infer:
    """An attention output's rule from q's dims (None without q)."""
    return lambda ins, params: rule(ins["q"], ins) if ins.get("q") else None


_ROW_STAT = _attention(lambda q, ins: q[:-1] + [1])
_ATTENTION_OUTPUTS: dict[str, Infer] = {
    "O": _attention(lambda q, ins: q[:-1] + [(ins.get("v") or q)[-1]]),
    **dict.fromkeys(("Stats", "score_max", "score_sum_exp"), _ROW_STAT),
    "Amax*": _attention(lambda q, ins: [1, 1, 1, 1]),
    "*": _attention(lambda q, ins: q),  # dQ, dK, dV and the rest
}


# ------------------------------------------------------------------ the table

_CONV_PARAMS = {"padding": "zeros", "pre_padding": "zeros", "post_padding": "zeros", "stride": "ones", "dilation": "ones",
                "convolution_mode": {"$enum": "convolution_mode", "name": "CROSS_CORRELATION"}}
_ATTENTION_FLAGS = ("use_alibi_mask", "use_padding_mask", "use_causal_mask", "use_causal_mask_bottom_right",
                    "attn_scale_prefolded", "is_inference", "use_deterministic_algorithm", "generate_stats")
_TOP_LEFT = {"$enum": "diagonal_alignment", "name": "TOP_LEFT"}
_ATTENTION_INPUTS = {
    "attn_scale": "attn_scale", "scale_s": "scale_s", "descale_s": "descale_s", "descale_*": "fp8_scale",
    "scale_*": "fp8_scale", "seq_len_q": "seq_len", "seq_len_kv": "seq_len", "cu_seq_len_q": "seq_len",
    "cu_seq_len_kv": "seq_len", "paged_attention_k_table": "page_table", "paged_attention_v_table": "page_table",
}
_FP8_FACTORS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
_SAVED_STATS = {"mean": "saved_mean", "inv_variance": "saved_inv_variance"}
_SAVED_FORWARD = {"o": "saved_o", "stats": "saved_stats"}


def _attention_kind(node_type: str, *, required: tuple[str, ...] = ("q", "k", "v"), fp8: bool = False,
                    saved: bool = False) -> NodeKind:
    """``saved``: a backward whose ``o`` and ``stats`` inputs are the forward's (test inputs recompute them)."""
    flags = {f: False for f in _ATTENTION_FLAGS if node_type != "SDPA" or f != "generate_stats"}
    return NodeKind(node_type, "attention", {**_ATTENTION_INPUTS, **(_SAVED_FORWARD if saved else {})},
                    _ATTENTION_OUTPUTS, {**flags, "diagonal_alignment": _TOP_LEFT}, required=required,
                    float_outputs=frozenset() if node_type.endswith("_BWD") else frozenset({"Stats"}), fp8=fp8,
                    lowers_output_layouts=True)


def _norm_kind(node_type: str, statistics: Statistics, *, saved: bool = False) -> NodeKind:
    return NodeKind(node_type, "norm", _SAVED_STATS if saved else {}, statistics=statistics,
                    required=() if node_type.endswith(("_BWD", "_INFERENCE")) else ("epsilon",))


def _plain(*node_types: str, pushed: bool = False) -> tuple[NodeKind, ...]:
    return tuple(NodeKind(t, pushed_output_dims=pushed) for t in node_types)


_KINDS: tuple[NodeKind, ...] = (
    *_plain("COMPOSITE"),
    NodeKind("CONV_FPROP", "conv", outputs={"Y": _conv_y}, params=_CONV_PARAMS,
             fan_in={"weight": lambda d: math.prod(d[1:]) if len(d) > 2 else None}),
    NodeKind("CONV_DGRAD", "conv", outputs={"DX": _conv_dx}, params=_CONV_PARAMS, pushed_output_dims=True,
             fan_in={"filter": lambda d: d[0] * math.prod(d[2:]) if len(d) > 2 else None}),
    NodeKind("CONV_WGRAD", "conv", params=_CONV_PARAMS, pushed_output_dims=True,
             fan_in={"loss": lambda d: d[0] * math.prod(d[2:]) if len(d) > 2 else None}),
    *_plain("GENSTATS"),
    *_plain("RESHAPE", pushed=True),
    *_plain("SLICE", "CONCATENATE", "TRANSPOSE", "ROPE", "ROPE_BWD"),
    *_plain("MOE_GROUPED_MATMUL_BWD", pushed=True),
    NodeKind("MATMUL", "matmul", outputs={"C": _matmul_c}, params={"padding": 0.0},
             fan_in={"B": lambda d: d[-2] if len(d) >= 2 else None}),
    *_plain("MATMUL_FP8"),
    NodeKind("POINTWISE", "pointwise", outputs={"OUT_0": _pointwise_out}),
    NodeKind("REDUCTION", "reduction", pushed_output_dims=True),
    _norm_kind("RMSNORM", "rms"),
    _norm_kind("RMSNORM_BWD", "rms", saved=True),
    _norm_kind("LAYERNORM", "layer"),
    _norm_kind("LAYERNORM_BWD", "layer", saved=True),
    _norm_kind("ADALAYERNORM", "layer"),
    _norm_kind("ADALAYERNORM_BWD", "layer", saved=True),
    _norm_kind("INSTANCENORM", "instance"),
    _norm_kind("INSTANCENORM_BWD", "instance", saved=True),
    _norm_kind("BATCHNORM", "batch"),
    _norm_kind("BATCHNORM_INFERENCE", "batch", saved=True),
    _norm_kind("BATCHNORM_BWD", "batch", saved=True),
    _attention_kind("SDPA"),
    _attention_kind("SDPA_BWD", required=("q", "k", "v", "o", "dO"), saved=True),
    _attention_kind("SDPA_FP8", required=("q", "k", "v", *_FP8_FACTORS), fp8=True),
    _attention_kind("SDPA_FP8_BWD", fp8=True, saved=True),
    _attention_kind("SDPA_MXFP8"),
    _attention_kind("SDPA_MXFP8_BWD"),
    *_plain("GDN", "GDN_BWD", "KDA", "KDA_BWD", "GDN2", "GDN2_BWD", "MOE_GROUPED_MATMUL", "BLOCK_SCALE_QUANTIZE",
            "BLOCK_SCALE_DEQUANTIZE", "GDP", "GDP_BWD", "GDN_SUMMARY", "KDA_SUMMARY", "GDN2_SUMMARY", "GDP_SUMMARY",
            "GDN_SUMMARY_BWD", "KDA_SUMMARY_BWD", "GDN2_SUMMARY_BWD", "GDP_SUMMARY_BWD", "MAMBA2", "MAMBA2_BWD",
            "MAMBA2_SUMMARY", "MAMBA2_SUMMARY_BWD"),
)
#: Every ``cudnn.graph_types.NodeType``, by name.
NODES: Mapping[str, NodeKind] = {k.type: k for k in _KINDS}
#: ``cudnn.graph_types.NodeType`` names.
NODE_TYPES: tuple[str, ...] = tuple(NODES)


def kind_of(node_type: str) -> NodeKind:
    """The table's entry for ``node_type`` (a :class:`KeyError` for a type the spec would have refused)."""
    return NODES[node_type]


__all__ = [
    "COMMON_INPUTS", "Dims", "FanIn", "Group", "Infer", "NODES", "NODE_TYPES", "NodeKind", "ROLES", "Statistics",
    "broadcast", "conv_padding", "decode_param", "kind_of",
]
