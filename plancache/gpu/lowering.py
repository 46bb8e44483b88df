"""Lower a :class:`~plancache.spec.GraphSpec` onto ``cudnn.pygraph`` with deterministic uids.

Constructing the pygraph needs nvidia-cudnn-frontend but no GPU; building it needs both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cudnn

from ..errors import SpecError
from ..spec import GraphSpec

DATA_TYPES = {
    "float16": cudnn.data_type.HALF,
    "bfloat16": cudnn.data_type.BFLOAT16,
    "float32": cudnn.data_type.FLOAT,
    "int32": cudnn.data_type.INT32,
    "int64": cudnn.data_type.INT64,
}
HEURISTIC_MODES = {"A": cudnn.heur_mode.A, "B": cudnn.heur_mode.B, "FALLBACK": cudnn.heur_mode.FALLBACK}
REDUCTION_MODES = {"AMAX": cudnn.reduction_mode.AMAX, "SUM": cudnn.reduction_mode.ADD}


@dataclass
class Lowered:
    """A constructed (not yet built) pygraph and its tensors by spec name."""

    graph: Any
    tensors: dict[str, Any]
    uids: dict[str, int]


def lower(spec: GraphSpec, *, handle: Any = None, kernel_cache: Any = None, device_property: Any = None,
          dynamic_shapes: bool = False) -> Lowered:
    """Build the pygraph IR for ``spec``; tensor uids come from ``spec.uids()``."""
    kwargs: dict[str, Any] = {}
    if handle is not None:
        kwargs["handle"] = handle
    if kernel_cache is not None:
        kwargs["kernel_cache"] = kernel_cache
    if device_property is not None:
        kwargs["device_property"] = device_property
    graph = cudnn.pygraph(
        name=spec.name or "plancache",
        io_data_type=DATA_TYPES[spec.io_data_type],
        intermediate_data_type=DATA_TYPES[spec.intermediate_data_type],
        compute_data_type=DATA_TYPES[spec.compute_data_type],
        is_dynamic_shape_enabled=dynamic_shapes,
        **kwargs,
    )
    uids = spec.uids()
    compute = DATA_TYPES[spec.compute_data_type]
    t: dict[str, Any] = {}
    for name, ts in spec.tensors.items():
        t[name] = graph.tensor(name=name, dim=list(ts.dims), stride=list(ts.strides), data_type=DATA_TYPES[ts.dtype],
                               is_pass_by_value=ts.pass_by_value, uid=uids[name])
    for i, node in enumerate(spec.nodes):
        attrs = spec.node_attrs(i)
        ins = {port: t[name] for port, name in node.inputs.items()}
        label = node.name or f"{node.op}_{i}"
        out = _lower_node(graph, node.op, ins, attrs, label, compute)
        (port, tname), = node.outputs.items()
        declared = spec.outputs.get(tname)
        if declared is not None:
            out.set_name(tname).set_output(True).set_dim(list(declared.dims)).set_stride(list(declared.strides))
            out.set_data_type(DATA_TYPES[declared.dtype]).set_uid(uids[tname])
        elif node.op == "reduction":
            out.set_dim(list(attrs.dims))
        t[tname] = out
    return Lowered(graph, t, uids)


def _lower_node(g: Any, op: str, ins: dict[str, Any], attrs: Any, name: str, compute: Any) -> Any:
    if op == "conv_fprop":
        spatial = len(ins["image"].get_dim()) - 2
        return g.conv_fprop(ins["image"], ins["weight"], padding=attrs.padding or [0] * spatial,
                            stride=attrs.stride or [1] * spatial, dilation=attrs.dilation or [1] * spatial,
                            compute_data_type=compute, name=name)
    if op == "matmul":
        return g.matmul(ins["A"], ins["B"], compute_data_type=compute, name=name)
    if op in ("bias", "scale"):
        return getattr(g, op)(ins["input"], ins[op], compute_data_type=compute, name=name)
    if op in ("add", "mul"):
        return getattr(g, op)(ins["a"], ins["b"], compute_data_type=compute, name=name)
    if op == "relu":
        extra = {} if attrs.negative_slope is None else {"negative_slope": attrs.negative_slope}
        return g.relu(ins["input"], compute_data_type=compute, name=name, **extra)
    if op == "swish":
        extra = {} if attrs.swish_beta is None else {"swish_beta": attrs.swish_beta}
        return g.swish(ins["input"], compute_data_type=compute, name=name, **extra)
    if op in ("gelu", "sigmoid", "tanh"):
        return getattr(g, op)(ins["input"], compute_data_type=compute, name=name)
    if op == "reduction":
        return g.reduction(ins["input"], mode=REDUCTION_MODES[attrs.mode], compute_data_type=compute, name=name)
    if op == "sdpa":
        d = ins["q"].get_dim()[-1]
        scale = attrs.attn_scale if attrs.attn_scale is not None else d ** -0.5
        extra: dict[str, Any] = {}
        if attrs.causal:
            extra = {"diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT, "diagonal_band_right_bound": 0}
        o, _stats = g.sdpa(ins["q"], ins["k"], ins["v"], generate_stats=False, attn_scale=scale, name=name, **extra)
        return o
    raise SpecError(f"op {op!r} has no cuDNN lowering")
