"""Schema 1, plancache's earlier op-list format, and :class:`SpecBuilder`: a front end to the graph document.

Schema-1 JSON and the builder are validated here (shape inference, errors naming the node)
and converted by :func:`legacy_document` into the schema-2 document of :mod:`plancache.spec`,
exactly as ``cudnn.pygraph`` would record the same calls. Nothing else in plancache reads
schema 1: there is one spec format, and this is a way to write it.

A spec mirrors the ``cudnn.pygraph`` calls: graph data types, named input tensors
(dims, strides, dtype, pass-by-value scalars), an ordered node list (op, named
inputs, attributes, named outputs), the graph outputs with dims/strides/dtype, and
tuning constraints. Dims are in cuDNN's logical order (N, C, spatial... / batch, M, N
/ B, H, S, D); strides give the physical layout. Validation infers every tensor's
shape and refuses a spec with a :class:`~plancache.errors.SpecError` naming the node
or tensor at fault. No GPU is needed for any of this.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import ConfigDict, Field, PrivateAttr, StringConstraints, ValidationError, model_validator

from .errors import SpecError
from .spec import MAX_DIM, MAX_NAME, MAX_PARAMS, MAX_PORTS, MAX_TENSORS, GraphSpec, TuningSpec
from .validation import StrictModel, validation_message

#: The schema-1 version number.
LEGACY_SCHEMA_VERSION = 1

DType = Literal["float16", "bfloat16", "float32", "int32", "int64"]
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
MAX_RANK = 8
MAX_ELEMENTS = 1 << 40
#: A tensor name (a key of ``tensors``/``outputs``, a node's port value).
Name = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME)]
#: A dim, stride, padding…: bounded like the schema-2 document's dims.
Size = Annotated[int, Field(ge=-MAX_DIM, le=MAX_DIM)]


class TensorSpec(StrictModel):
    """A non-virtual tensor: a graph input, or a graph output in :attr:`LegacySpec.outputs`."""

    dims: list[Size] = Field(min_length=1, max_length=MAX_RANK)
    strides: list[Size] = Field(min_length=1, max_length=MAX_RANK)
    dtype: DType
    pass_by_value: bool = False


class NodeSpec(StrictModel):
    op: str = Field(min_length=1, max_length=64)
    name: str | None = Field(default=None, max_length=128, description="cosmetic; not part of the key")
    inputs: dict[Annotated[str, StringConstraints(max_length=64)], Name] = Field(max_length=MAX_PORTS)
    attrs: dict[str, Any] = Field(default_factory=dict, max_length=MAX_PARAMS)
    outputs: dict[Annotated[str, StringConstraints(max_length=64)], Name] = Field(max_length=MAX_PORTS)


# ---------------------------------------------------------------- op attributes


class NoAttrs(StrictModel):
    pass


class ConvAttrs(StrictModel):
    padding: list[Size] | None = Field(default=None, max_length=MAX_RANK)
    stride: list[Size] | None = Field(default=None, max_length=MAX_RANK)
    dilation: list[Size] | None = Field(default=None, max_length=MAX_RANK)


class ReluAttrs(StrictModel):
    negative_slope: float | None = None


class SwishAttrs(StrictModel):
    swish_beta: float | None = None


class ReductionAttrs(StrictModel):
    mode: Literal["AMAX", "SUM"]
    dims: list[Size] = Field(min_length=1, max_length=MAX_RANK, description="output dims: 1 where reduced")


class SdpaAttrs(StrictModel):
    attn_scale: float | None = Field(default=None, description="baked into the plan; default 1/sqrt(d)")
    causal: bool = False


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's resolved properties after validation."""

    name: str
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    virtual: bool
    pass_by_value: bool = False


Attrs = TypeVar("Attrs", bound=StrictModel)
#: Output dims by port, from a node, its attributes and the tensors so far.
Infer = Callable[[NodeSpec, Attrs, dict[str, TensorInfo]], dict[str, tuple[int, ...]]]


@dataclass(frozen=True)
class OpDef(Generic[Attrs]):
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: type[Attrs]
    infer: Infer[Attrs]
    output_dtype: Callable[[LegacySpec, Attrs], str] | None = None


def _fail(node: NodeSpec, index: int, msg: str) -> SpecError:
    return SpecError(f"node {index} ({node.name or node.op}): {msg}")


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    if len(a) != len(b):
        return None
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            return None
        out.append(max(x, y))
    return tuple(out)


def _infer_conv(node: NodeSpec, attrs: ConvAttrs, t: dict[str, TensorInfo]) -> dict[str, tuple[int, ...]]:
    x, w = t[node.inputs["image"]].dims, t[node.inputs["weight"]].dims
    if len(x) < 4 or len(x) != len(w):
        raise ValueError(f"image {x} and weight {w} must both have rank >= 4 and equal rank")
    spatial = len(x) - 2
    pad = attrs.padding if attrs.padding is not None else [0] * spatial
    stride = attrs.stride if attrs.stride is not None else [1] * spatial
    dil = attrs.dilation if attrs.dilation is not None else [1] * spatial
    for label, v, lo in (("padding", pad, 0), ("stride", stride, 1), ("dilation", dil, 1)):
        if len(v) != spatial or any(e < lo for e in v):
            raise ValueError(f"{label} {v} needs {spatial} values >= {lo}")
    if w[1] != x[1]:
        raise ValueError(f"weight input channels {w[1]} != image channels {x[1]} (grouped conv is not supported)")
    out = [x[0], w[0]]
    for i in range(spatial):
        size = (x[2 + i] + 2 * pad[i] - dil[i] * (w[2 + i] - 1) - 1) // stride[i] + 1
        if size < 1:
            raise ValueError(f"spatial dim {i}: filter {w[2 + i]} does not fit image {x[2 + i]} with padding {pad[i]}")
        out.append(size)
    return {"Y": tuple(out)}


def _infer_matmul(node: NodeSpec, attrs: NoAttrs, t: dict[str, TensorInfo]) -> dict[str, tuple[int, ...]]:
    a, b = t[node.inputs["A"]].dims, t[node.inputs["B"]].dims
    if len(a) < 3 or len(a) != len(b):
        raise ValueError(f"A {a} and B {b} must have equal rank >= 3 (batch, M, K) @ (batch, K, N)")
    if a[-1] != b[-2]:
        raise ValueError(f"A {a} and B {b}: inner dims {a[-1]} != {b[-2]}")
    batch = _broadcast(a[:-2], b[:-2])
    if batch is None:
        raise ValueError(f"batch dims of A {a[:-2]} and B {b[:-2]} do not broadcast")
    return {"C": batch + (a[-2], b[-1])}


def _infer_elementwise(first: str, second: str | None, same_as_first: bool) -> Infer[StrictModel]:
    def infer(node: NodeSpec, attrs: StrictModel, t: dict[str, TensorInfo]) -> dict[str, tuple[int, ...]]:
        a = t[node.inputs[first]].dims
        if second is None:
            return {"output": a}
        b = t[node.inputs[second]].dims
        out = _broadcast(a, b)
        if out is None or (same_as_first and out != a):
            raise ValueError(f"{second} {b} does not broadcast to {first} {a}")
        return {"output": out}

    return infer


def _infer_reduction(node: NodeSpec, attrs: ReductionAttrs, t: dict[str, TensorInfo]) -> dict[str, tuple[int, ...]]:
    x = t[node.inputs["input"]].dims
    if len(attrs.dims) != len(x) or any(o not in (1, i) for o, i in zip(attrs.dims, x)):
        raise ValueError(f"reduction dims {attrs.dims} must match input {x} with 1 on reduced axes")
    return {"output": tuple(attrs.dims)}


def _infer_sdpa(node: NodeSpec, attrs: SdpaAttrs, t: dict[str, TensorInfo]) -> dict[str, tuple[int, ...]]:
    q, k, v = (t[node.inputs[p]].dims for p in ("q", "k", "v"))
    if not (len(q) == len(k) == len(v) == 4):
        raise ValueError(f"q {q}, k {k}, v {v} must all be 4-D (batch, heads, seq, head_dim)")
    if not (q[0] == k[0] == v[0]):
        raise ValueError(f"batch sizes differ: q {q[0]}, k {k[0]}, v {v[0]}")
    if k[1] != v[1] or q[1] % k[1]:
        raise ValueError(f"heads: q {q[1]} must be a multiple of k/v heads {k[1]}/{v[1]} (GQA), k and v equal")
    if k[2] != v[2]:
        raise ValueError(f"k seq {k[2]} != v seq {v[2]}")
    if q[3] != k[3]:
        raise ValueError(f"q head_dim {q[3]} != k head_dim {k[3]}")
    return {"O": (q[0], q[1], q[2], v[3])}


def _float32(spec: LegacySpec, attrs: StrictModel) -> str:
    return "float32"


_UNARY = _infer_elementwise("input", None, False)
OPS: dict[str, OpDef[Any]] = {
    "conv_fprop": OpDef(("image", "weight"), ("Y",), ConvAttrs, _infer_conv),
    "matmul": OpDef(("A", "B"), ("C",), NoAttrs, _infer_matmul),
    "bias": OpDef(("input", "bias"), ("output",), NoAttrs, _infer_elementwise("input", "bias", True)),
    "scale": OpDef(("input", "scale"), ("output",), NoAttrs, _infer_elementwise("input", "scale", True)),
    "add": OpDef(("a", "b"), ("output",), NoAttrs, _infer_elementwise("a", "b", False)),
    "mul": OpDef(("a", "b"), ("output",), NoAttrs, _infer_elementwise("a", "b", False)),
    "relu": OpDef(("input",), ("output",), ReluAttrs, _UNARY),
    "gelu": OpDef(("input",), ("output",), NoAttrs, _UNARY),
    "sigmoid": OpDef(("input",), ("output",), NoAttrs, _UNARY),
    "tanh": OpDef(("input",), ("output",), NoAttrs, _UNARY),
    "swish": OpDef(("input",), ("output",), SwishAttrs, _UNARY),
    "reduction": OpDef(("input",), ("output",), ReductionAttrs, _infer_reduction, _float32),
    "sdpa": OpDef(("q", "k", "v"), ("O",), SdpaAttrs, _infer_sdpa),
}


def contiguous_strides(dims: list[int] | tuple[int, ...]) -> list[int]:
    """Row-major strides for ``dims``."""
    strides, acc = [], 1
    for d in reversed(dims):
        strides.append(acc)
        acc *= d
    return strides[::-1]


def channels_last_strides(dims: list[int] | tuple[int, ...]) -> list[int]:
    """NHWC-style strides for logical N, C, spatial... dims."""
    n, c, *spatial = dims
    strides = [0] * len(dims)
    strides[1] = 1
    acc = c
    for i in range(len(spatial) - 1, -1, -1):
        strides[2 + i] = acc
        acc *= spatial[i]
    strides[0] = acc
    return strides


def _check_layout(name: str, t: TensorSpec) -> None:
    if len(t.dims) != len(t.strides):
        raise SpecError(f"tensor {name!r}: {len(t.dims)} dims but {len(t.strides)} strides")
    if any(d < 1 for d in t.dims):
        raise SpecError(f"tensor {name!r}: dims {t.dims} must all be >= 1")
    if any(s < 0 for s in t.strides):
        raise SpecError(f"tensor {name!r}: strides {t.strides} must be >= 0")
    if math.prod(t.dims) > MAX_ELEMENTS:
        raise SpecError(f"tensor {name!r}: {math.prod(t.dims)} elements is more than {MAX_ELEMENTS}")
    # A dense layout: no two elements may alias (strides of non-unit dims, sorted, must nest).
    spans = sorted((s, d) for s, d in zip(t.strides, t.dims) if d > 1)
    reach = 1
    for s, d in spans:
        if s < reach:
            raise SpecError(f"tensor {name!r}: strides {t.strides} make elements of dims {t.dims} overlap")
        reach = s * d
    if t.pass_by_value and (any(d != 1 for d in t.dims) or t.dtype != "float32"):
        raise SpecError(f"tensor {name!r}: a pass-by-value scalar must be float32 with all dims 1")


class LegacySpec(StrictModel):
    """A schema-1 document (validated; convert it with :func:`legacy_document`)."""

    schema_version: int = Field(default=LEGACY_SCHEMA_VERSION, alias="schema")
    name: str = Field(default="", max_length=256, description="cosmetic; not part of the key")
    io_data_type: DType
    intermediate_data_type: DType = "float32"
    compute_data_type: DType = "float32"
    tensors: dict[Name, TensorSpec] = Field(min_length=1, max_length=MAX_TENSORS)
    nodes: list[NodeSpec] = Field(min_length=1, max_length=256)
    outputs: dict[Name, TensorSpec] = Field(min_length=1, max_length=MAX_TENSORS)
    tuning: TuningSpec = Field(default_factory=TuningSpec)

    model_config = ConfigDict(populate_by_name=True)
    _infos: dict[str, TensorInfo] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _validate_graph(self) -> LegacySpec:
        if self.schema_version != LEGACY_SCHEMA_VERSION:
            raise SpecError(f"schema version {self.schema_version} is not schema 1")
        self._infos = self._infer()
        return self

    def _infer(self) -> dict[str, TensorInfo]:
        infos: dict[str, TensorInfo] = {}
        for name, t in self.tensors.items():
            _check_layout(name, t)
            infos[name] = TensorInfo(name, tuple(t.dims), tuple(t.strides), t.dtype, False, t.pass_by_value)
        produced: set[str] = set()
        for i, node in enumerate(self.nodes):
            op = OPS.get(node.op)
            if op is None:
                raise _fail(node, i, f"unknown op {node.op!r}; known ops: {', '.join(sorted(OPS))}")
            if set(node.inputs) != set(op.inputs):
                raise _fail(node, i, f"{node.op} takes inputs {list(op.inputs)}, got {sorted(node.inputs)}")
            if set(node.outputs) != set(op.outputs):
                raise _fail(node, i, f"{node.op} has outputs {list(op.outputs)}, got {sorted(node.outputs)}")
            for port, tname in node.inputs.items():
                if tname not in infos:
                    raise _fail(node, i, f"input {port!r} names tensor {tname!r}, which is not defined before this node")
                if infos[tname].pass_by_value and node.op not in ("scale", "mul", "add", "bias"):
                    raise _fail(node, i, f"pass-by-value tensor {tname!r} can only feed a pointwise op")
            try:
                attrs = op.attrs.model_validate(node.attrs)
                shapes = op.infer(node, attrs, infos)
            except ValidationError as exc:
                raise _fail(node, i, f"bad attributes: {validation_message(exc.errors(), None)}") from None
            except ValueError as exc:
                raise _fail(node, i, str(exc)) from None
            for port, tname in node.outputs.items():
                if tname in infos:
                    raise _fail(node, i, f"output {port!r} names tensor {tname!r}, which already exists")
                dims = shapes[port]
                declared = self.outputs.get(tname)
                if declared is not None:
                    _check_layout(tname, declared)
                    if tuple(declared.dims) != dims:
                        raise _fail(node, i, f"output tensor {tname!r} declared with dims {declared.dims}, "
                                             f"but {node.op} gives {list(dims)}")
                    if declared.pass_by_value:
                        raise _fail(node, i, f"output tensor {tname!r} cannot be pass-by-value")
                    infos[tname] = TensorInfo(tname, dims, tuple(declared.strides), declared.dtype, False)
                else:
                    dtype = op.output_dtype(self, attrs) if op.output_dtype else self.intermediate_data_type
                    infos[tname] = TensorInfo(tname, dims, tuple(contiguous_strides(dims)), dtype, True)
                produced.add(tname)
        for tname in self.outputs:
            if tname not in produced:
                raise SpecError(f"output tensor {tname!r} is not produced by any node")
        consumed = {t for n in self.nodes for t in n.inputs.values()}
        for name, info in infos.items():
            if info.virtual and name not in consumed:
                raise SpecError(f"tensor {name!r} is produced but neither used nor declared in outputs")
            if name in self.tensors and name not in consumed:
                raise SpecError(f"input tensor {name!r} is not used by any node")
        return infos

    # ----------------------------------------------------------- derived views

    def tensor_infos(self) -> dict[str, TensorInfo]:
        """Every tensor (inputs, virtual intermediates, outputs) with its resolved properties."""
        return dict(self._infos)

    def uids(self) -> dict[str, int]:
        """Deterministic uids of the non-virtual tensors: 1-based rank of the sorted names."""
        names = sorted(set(self.tensors) | set(self.outputs))
        return {n: i + 1 for i, n in enumerate(names)}

    def node_attrs(self, index: int) -> Any:
        """The validated attribute model of node ``index`` (defaults filled)."""
        node = self.nodes[index]
        return OPS[node.op].attrs.model_validate(node.attrs)

def _infer_virtual(doc: dict[str, Any], wanted: list[str]) -> dict[str, tuple[int, ...]]:
    """Infer node output dims of a draft document whose outputs section is still empty."""
    infos: dict[str, TensorInfo] = {
        n: TensorInfo(n, tuple(t["dims"]), tuple(t["strides"]), t["dtype"], False, t.get("pass_by_value", False))
        for n, t in doc["tensors"].items()
    }
    for i, raw in enumerate(doc["nodes"]):
        node = NodeSpec.model_validate(raw)
        op = OPS.get(node.op)
        if op is None:
            raise _fail(node, i, f"unknown op {node.op!r}")
        try:
            shapes = op.infer(node, op.attrs.model_validate(node.attrs), infos)
        except (ValueError, KeyError) as exc:
            raise _fail(node, i, str(exc)) from None
        for port, tname in node.outputs.items():
            infos[tname] = TensorInfo(tname, shapes[port], tuple(contiguous_strides(shapes[port])), "float32", True)
    missing = [w for w in wanted if w not in infos]
    if missing:
        raise SpecError(f"output tensor {missing[0]!r} is not produced by any node")
    return {w: infos[w].dims for w in wanted}


def parse_legacy(obj: dict[str, Any]) -> LegacySpec:
    """Validate a schema-1 document; raise :class:`SpecError` naming the problem."""
    try:
        return LegacySpec.model_validate(obj)
    except ValidationError as exc:
        raise SpecError(f"invalid spec: {validation_message(exc.errors(), None)}") from None


_FE_TYPES = {"float16": "HALF", "bfloat16": "BFLOAT16", "float32": "FLOAT", "int32": "INT32", "int64": "INT64"}
_POINTWISE_PORTS = {"bias": ("input", "bias"), "scale": ("input", "scale"), "add": ("a", "b"), "mul": ("a", "b")}


def _fe_node(spec: LegacySpec, index: int, uid: dict[str, int]) -> dict[str, Any]:
    """Node ``index`` as ``cudnn.pygraph`` records the same call (node type, FE's port names, params)."""
    node, attrs = spec.nodes[index], spec.node_attrs(index)
    (out_name,) = node.outputs.values()
    ins = node.inputs
    if node.op == "conv_fprop":
        sp = len(spec.tensor_infos()[ins["image"]].dims) - 2
        body = ("CONV_FPROP", {"image": ins["image"], "weight": ins["weight"]}, "Y",
                {"padding": attrs.padding or [0] * sp, "stride": attrs.stride or [1] * sp,
                 "dilation": attrs.dilation or [1] * sp})
    elif node.op == "matmul":
        body = ("MATMUL", {"A": ins["A"], "B": ins["B"]}, "C", {"padding": 0.0})
    elif node.op == "reduction":
        mode = {"AMAX": "AMAX", "SUM": "ADD"}[attrs.mode]
        body = ("REDUCTION", {"input": ins["input"]}, "OUT_0", {"mode": {"$enum": "reduction_mode", "name": mode}})
    elif node.op == "sdpa":
        d = spec.tensor_infos()[ins["q"]].dims[-1]
        params: dict[str, Any] = {"generate_stats": False,
                                  "attn_scale": attrs.attn_scale if attrs.attn_scale is not None else d ** -0.5}
        if attrs.causal:
            params.update(diagonal_alignment={"$enum": "diagonal_alignment", "name": "TOP_LEFT"},
                          diagonal_band_right_bound=0)
        body = ("SDPA", {"q": ins["q"], "k": ins["k"], "v": ins["v"]}, "O", params)
    else:
        ports = _POINTWISE_PORTS.get(node.op, ("input",))
        extra = {k: v for k, v in attrs.model_dump().items() if v is not None}
        body = ("POINTWISE", {f"IN_{i}": ins[p] for i, p in enumerate(ports)}, "OUT_0", {"mode": node.op, **extra})
    node_type, inputs, out_port, params = body
    return {"name": node.name or f"{node.op}_{index}", "type": node_type, "compute_data_type": _FE_TYPES[spec.compute_data_type],
            "inputs": {p: uid[t] for p, t in inputs.items()}, "outputs": {out_port: uid[out_name]}, "params": params}


def legacy_document(obj: dict[str, Any] | LegacySpec) -> dict[str, Any]:
    """A schema-1 spec as the schema-2 graph document (see :mod:`plancache.spec`)."""
    from . import SPEC_SCHEMA_VERSION

    spec = obj if isinstance(obj, LegacySpec) else parse_legacy(obj)
    infos = spec.tensor_infos()
    uid = spec.uids()
    nxt = len(uid) + 1
    for node in spec.nodes:
        for t in node.outputs.values():
            if t not in uid:
                uid[t], nxt = nxt, nxt + 1
    tensors = []
    for name in sorted(uid, key=lambda n: uid[n]):
        info = infos[name]
        producer = next((n for n in spec.nodes if name in n.outputs.values()), None)
        pushed = producer is not None and producer.op == "reduction"
        tensors.append({
            "uid": uid[name], "name": name, "data_type": None if info.virtual else _FE_TYPES[info.dtype],
            "dim": list(info.dims), "stride": list(info.strides), "is_virtual": info.virtual,
            "is_pass_by_value": info.pass_by_value, "uid_assigned": not info.virtual,
            "dim_assigned": not info.virtual or pushed, "stride_assigned": not info.virtual,
        })
    return {
        "schema": SPEC_SCHEMA_VERSION,
        "name": spec.name,
        "context": {"io_data_type": _FE_TYPES[spec.io_data_type],
                    "intermediate_data_type": _FE_TYPES[spec.intermediate_data_type],
                    "compute_data_type": _FE_TYPES[spec.compute_data_type]},
        "tensors": tensors,
        "nodes": [_fe_node(spec, i, uid) for i in range(len(spec.nodes))],
        "tuning": spec.tuning.model_dump(),
    }


# ---------------------------------------------------------------- the builder


class TensorRef:
    """A tensor handle returned by the builder; mirrors the cudnn tensor setters for outputs."""

    def __init__(self, builder: SpecBuilder, name: str) -> None:
        self._b, self.name = builder, name

    def set_output(self, is_output: bool = True) -> TensorRef:
        self._b._set_output(self.name, is_output)
        return self

    def set_name(self, name: str) -> TensorRef:
        self._b._rename(self.name, name)
        self.name = name
        return self

    def set_dim(self, dims: list[int]) -> TensorRef:
        self._b._out_attr(self.name, "dims", list(dims))
        return self

    def set_stride(self, strides: list[int]) -> TensorRef:
        self._b._out_attr(self.name, "strides", list(strides))
        return self

    def set_data_type(self, dtype: DType) -> TensorRef:
        self._b._out_attr(self.name, "dtype", dtype)
        return self

    def __repr__(self) -> str:
        return f"TensorRef({self.name!r})"


_TORCH_DTYPES: dict[str, DType] = {"torch.float16": "float16", "torch.bfloat16": "bfloat16", "torch.float32": "float32",
                 "torch.int32": "int32", "torch.int64": "int64"}


class SpecBuilder:
    """Write a spec with the cudnn.pygraph method names you know::

        b = SpecBuilder(io_data_type="bfloat16")
        X = b.tensor("X", dim=[32, 128, 56, 56], stride=channels_last_strides([32, 128, 56, 56]), data_type="bfloat16")
        ...
        Y = b.relu(b.bias(b.conv_fprop(X, W, padding=[1, 1]), B))
        Y.set_output(True).set_name("Y")
        spec = b.build()
    """

    def __init__(self, io_data_type: DType, intermediate_data_type: DType = "float32",
                 compute_data_type: DType = "float32", name: str = "", tuning: TuningSpec | None = None) -> None:
        self._doc: dict[str, Any] = {
            "name": name, "io_data_type": io_data_type, "intermediate_data_type": intermediate_data_type,
            "compute_data_type": compute_data_type, "tensors": {}, "nodes": [], "outputs": {},
            "tuning": (tuning or TuningSpec()).model_dump(),
        }
        self._out: dict[str, dict[str, Any]] = {}
        self._counter = 0

    # inputs
    def tensor(self, name: str, dim: list[int], stride: list[int] | None = None, data_type: DType | None = None,
               is_pass_by_value: bool = False) -> TensorRef:
        if name in self._doc["tensors"] or self._produced(name):
            raise SpecError(f"tensor {name!r} is already defined")
        self._doc["tensors"][name] = {
            "dims": list(dim), "strides": list(stride) if stride is not None else contiguous_strides(dim),
            "dtype": data_type or ("float32" if is_pass_by_value else self._doc["io_data_type"]),
            "pass_by_value": is_pass_by_value,
        }
        return TensorRef(self, name)

    def tensor_like(self, tensor: Any, name: str, is_pass_by_value: bool | None = None) -> TensorRef:
        """An input shaped like a torch tensor (dims, strides, dtype). As in cudnn, a CPU tensor becomes
        pass-by-value unless ``is_pass_by_value`` says otherwise."""
        dtype = _TORCH_DTYPES.get(str(tensor.dtype))
        if dtype is None:
            raise SpecError(f"tensor_like({name!r}): unsupported dtype {tensor.dtype}")
        by_value = str(tensor.device) == "cpu" if is_pass_by_value is None else is_pass_by_value
        return self.tensor(name, list(tensor.shape), list(tensor.stride()), dtype, is_pass_by_value=by_value)

    # ops
    def conv_fprop(self, image: TensorRef, weight: TensorRef, padding: list[int] | None = None,
                   stride: list[int] | None = None, dilation: list[int] | None = None, name: str | None = None) -> TensorRef:
        return self._op("conv_fprop", {"image": image, "weight": weight},
                        {"padding": padding, "stride": stride, "dilation": dilation}, name)

    def matmul(self, A: TensorRef, B: TensorRef, name: str | None = None) -> TensorRef:  # noqa: N803
        return self._op("matmul", {"A": A, "B": B}, {}, name)

    def bias(self, input: TensorRef, bias: TensorRef, name: str | None = None) -> TensorRef:  # noqa: A002
        return self._op("bias", {"input": input, "bias": bias}, {}, name)

    def scale(self, input: TensorRef, scale: TensorRef, name: str | None = None) -> TensorRef:  # noqa: A002
        return self._op("scale", {"input": input, "scale": scale}, {}, name)

    def add(self, a: TensorRef, b: TensorRef, name: str | None = None) -> TensorRef:
        return self._op("add", {"a": a, "b": b}, {}, name)

    def mul(self, a: TensorRef, b: TensorRef, name: str | None = None) -> TensorRef:
        return self._op("mul", {"a": a, "b": b}, {}, name)

    def relu(self, input: TensorRef, negative_slope: float | None = None, name: str | None = None) -> TensorRef:  # noqa: A002
        return self._op("relu", {"input": input}, {"negative_slope": negative_slope}, name)

    def gelu(self, input: TensorRef, name: str | None = None) -> TensorRef:  # noqa: A002
        return self._op("gelu", {"input": input}, {}, name)

    def sigmoid(self, input: TensorRef, name: str | None = None) -> TensorRef:  # noqa: A002
        return self._op("sigmoid", {"input": input}, {}, name)

    def tanh(self, input: TensorRef, name: str | None = None) -> TensorRef:  # noqa: A002
        return self._op("tanh", {"input": input}, {}, name)

    def swish(self, input: TensorRef, swish_beta: float | None = None, name: str | None = None) -> TensorRef:  # noqa: A002
        return self._op("swish", {"input": input}, {"swish_beta": swish_beta}, name)

    def reduction(self, input: TensorRef, mode: Literal["AMAX", "SUM"], dims: list[int], name: str | None = None) -> TensorRef:  # noqa: A002
        return self._op("reduction", {"input": input}, {"mode": mode, "dims": list(dims)}, name)

    def sdpa(self, q: TensorRef, k: TensorRef, v: TensorRef, attn_scale: float | None = None,
             causal: bool = False, name: str | None = None) -> TensorRef:
        return self._op("sdpa", {"q": q, "k": k, "v": v}, {"attn_scale": attn_scale, "causal": causal}, name)

    def build(self) -> GraphSpec:
        doc = json.loads(json.dumps(self._doc))
        marked = [n for n, o in self._out.items() if o.get("output")]
        if not marked:
            raise SpecError("no tensor is marked as an output (call .set_output(True))")
        dims = _infer_virtual({**doc, "outputs": {}}, marked)
        for name in marked:
            o = self._out[name]
            d = o.get("dims", list(dims[name]))
            doc["outputs"][name] = {"dims": d, "strides": o.get("strides", contiguous_strides(d)),
                                    "dtype": o.get("dtype", self._default_out_dtype(name)), "pass_by_value": False}
        from .spec import parse_spec

        return parse_spec(legacy_document(doc))

    # internals
    def _default_out_dtype(self, name: str) -> str:
        node = next(n for n in self._doc["nodes"] if name in n["outputs"].values())
        op = OPS[node["op"]]
        return "float32" if op.output_dtype else self._doc["io_data_type"]

    def _produced(self, name: str) -> bool:
        return any(name in n["outputs"].values() for n in self._doc["nodes"])

    def _op(self, op: str, inputs: dict[str, TensorRef], attrs: dict[str, Any], name: str | None) -> TensorRef:
        node_name = name or f"{op}_{len(self._doc['nodes'])}"
        out_port = OPS[op].outputs[0]
        out = f"{node_name}.{out_port}"
        self._doc["nodes"].append({
            "op": op, "name": node_name, "inputs": {p: t.name for p, t in inputs.items()},
            "attrs": {k: v for k, v in attrs.items() if v is not None}, "outputs": {out_port: out},
        })
        self._out[out] = {}
        return TensorRef(self, out)

    def _set_output(self, name: str, flag: bool) -> None:
        if name not in self._out:
            raise SpecError(f"tensor {name!r} is not an op output")
        self._out[name]["output"] = flag

    def _out_attr(self, name: str, key: str, value: Any) -> None:
        if name not in self._out:
            raise SpecError(f"tensor {name!r} is not an op output")
        self._out[name][key] = value

    def _rename(self, old: str, new: str) -> None:
        if new in self._doc["tensors"] or new in self._out:
            raise SpecError(f"tensor {new!r} is already defined")
        if old not in self._out:
            raise SpecError(f"only op outputs can be renamed; {old!r} is an input")
        self._out[new] = self._out.pop(old)
        for n in self._doc["nodes"]:
            for ports in (n["inputs"], n["outputs"]):
                for p, t in ports.items():
                    if t == old:
                        ports[p] = new
