"""SpecBuilder: a graph document written with the cudnn.pygraph method names, without FE.

Each op is one entry of :data:`_OPS`: the FE node it writes, which of its ports each argument feeds, and how its
arguments become the node's params; its output's dims are the node type's rule in :data:`plancache.spec.nodes.NODES`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

from .. import SPEC_SCHEMA_VERSION
from ..errors import SpecError
from .document import GraphSpec, TuningSpec, parse_spec
from .limits import MAX_DIM, MAX_NAME, MAX_RANK
from .nodes import kind_of
from .vocabulary import TORCH_DTYPES

#: The data types :class:`SpecBuilder` takes, by their torch names.
DType = Literal["float16", "bfloat16", "float32", "int32", "int64"]
_FE_DTYPE = {torch_name: fe for fe, torch_name in TORCH_DTYPES.items() if torch_name in get_args(DType)}
Dims = tuple[int, ...]
#: An op's lowering: (op, input dims by argument, other arguments) → (output dims, the node's FE params), the dims
#: by the node type's rule (a reduction's: the call's);
#: a ValueError says what is wrong with the call.
Lower = Callable[[str, dict[str, Dims], dict[str, Any]], tuple[Dims, dict[str, Any]]]


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


def _infer(op: str, dims: dict[str, Dims], params: dict[str, Any]) -> Dims:
    """The output dims of builder op ``op`` (input dims by argument): its node type's rule in
    :data:`plancache.spec.nodes.NODES`."""
    spec = _OPS[op]
    ports = {spec.inputs[arg]: list(d) for arg, d in dims.items()}
    return tuple(kind_of(spec.node_type).output_dims(spec.output, ports, params))


def _broadcast(a: Dims, b: Dims) -> Dims | None:
    if len(a) != len(b):
        return None
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            return None
        out.append(max(x, y))
    return tuple(out)


def _ints(label: str, values: Any, lo: int, length: int | None = None) -> list[int]:
    """``values`` as a list of integers in [lo, MAX_DIM], of rank 1..MAX_RANK (or exactly ``length``)."""
    if not isinstance(values, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ValueError(f"{label} {values!r} must be a list of integers")
    if length is None and not 1 <= len(values) <= MAX_RANK or length is not None and len(values) != length:
        raise ValueError(f"{label} {list(values)} needs {length or f'1 to {MAX_RANK}'} values")
    if any(not lo <= v <= MAX_DIM for v in values):
        raise ValueError(f"{label} {list(values)} must all be in [{lo}, 2^40]")
    return list(values)


def _number(label: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{label} {value!r} must be a finite number")
    return float(value)


def _conv(op: str, dims: dict[str, Dims], args: dict[str, Any]) -> tuple[Dims, dict[str, Any]]:
    x, w = dims["image"], dims["weight"]
    if len(x) < 4 or len(x) != len(w):
        raise ValueError(f"image {x} and weight {w} must both have rank >= 4 and equal rank")
    spatial = len(x) - 2
    params = {label: [lo] * spatial if args[label] is None else _ints(label, args[label], lo, spatial)
              for label, lo in (("padding", 0), ("stride", 1), ("dilation", 1))}
    if w[1] != x[1]:
        raise ValueError(f"weight input channels {w[1]} != image channels {x[1]} (grouped conv is not supported)")
    out = _infer(op, dims, params)
    for i, size in enumerate(out[2:]):
        if size < 1:
            raise ValueError(f"spatial dim {i}: filter {w[2 + i]} does not fit image {x[2 + i]} with padding "
                             f"{params['padding'][i]}")
    return out, params


def _matmul(op: str, dims: dict[str, Dims], args: dict[str, Any]) -> tuple[Dims, dict[str, Any]]:
    a, b = dims["A"], dims["B"]
    if len(a) < 3 or len(a) != len(b):
        raise ValueError(f"A {a} and B {b} must have equal rank >= 3 (batch, M, K) @ (batch, K, N)")
    if a[-1] != b[-2]:
        raise ValueError(f"A {a} and B {b}: inner dims {a[-1]} != {b[-2]}")
    if _broadcast(a[:-2], b[:-2]) is None:
        raise ValueError(f"batch dims of A {a[:-2]} and B {b[:-2]} do not broadcast")
    return _infer(op, dims, {}), {"padding": 0.0}


def _pointwise(onto_first: bool) -> Lower:
    """A POINTWISE node of mode ``op``: one input, or two that broadcast (onto the first's shape, or to a
    common one); its other arguments (a relu slope, a swish beta) become params."""

    def lower(op: str, dims: dict[str, Dims], args: dict[str, Any]) -> tuple[Dims, dict[str, Any]]:
        (first, a), *rest = dims.items()
        for second, b in rest:
            both = _broadcast(a, b)
            if both is None or onto_first and both != a:
                raise ValueError(f"{second} {b} does not broadcast to {first} {a}")
        return _infer(op, dims, {}), {"mode": op, **{k: _number(k, v) for k, v in args.items() if v is not None}}

    return lower


_REDUCTION_MODES = {"AMAX": "AMAX", "SUM": "ADD"}  # the builder's name → cudnn.reduction_mode


def _reduction(op: str, dims: dict[str, Dims], args: dict[str, Any]) -> tuple[Dims, dict[str, Any]]:
    x, mode = dims["input"], args["mode"]
    if mode not in _REDUCTION_MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(_REDUCTION_MODES)}")
    out = _ints("reduction dims", args["dims"], 1)
    if len(out) != len(x) or any(o not in (1, i) for o, i in zip(out, x)):
        raise ValueError(f"reduction dims {out} must match input {x} with 1 on reduced axes")
    return tuple(out), {"mode": {"$enum": "reduction_mode", "name": _REDUCTION_MODES[mode]}}


def _sdpa(op: str, dims: dict[str, Dims], args: dict[str, Any]) -> tuple[Dims, dict[str, Any]]:
    q, k, v = dims["q"], dims["k"], dims["v"]
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
    if not isinstance(args["causal"], bool):
        raise ValueError(f"causal {args['causal']!r} must be True or False")
    scale = args["attn_scale"]
    params: dict[str, Any] = {"generate_stats": False,
                              "attn_scale": q[3] ** -0.5 if scale is None else _number("attn_scale", scale)}
    if args["causal"]:
        params.update(diagonal_alignment={"$enum": "diagonal_alignment", "name": "TOP_LEFT"},
                      diagonal_band_right_bound=0)
    return _infer(op, dims, params), params


@dataclass(frozen=True)
class _Op:
    """One op of the builder: the FE node it writes, its ports, and how its call becomes the node's params (the
    output's dims: the node type's rule, checked by ``lower``)."""

    node_type: str
    #: builder argument → the FE input port it feeds, in call order
    inputs: dict[str, str]
    output: str
    lower: Lower
    #: whether an output of this op defaults to float32 (else the graph's io_data_type)
    float32_output: bool = False


_ONTO, _BROADCAST = _pointwise(onto_first=True), _pointwise(onto_first=False)
_UNARY = {"input": "IN_0"}
#: Every op of :class:`SpecBuilder`, declared once.
_OPS: dict[str, _Op] = {
    "conv_fprop": _Op("CONV_FPROP", {"image": "image", "weight": "weight"}, "Y", _conv),
    "matmul": _Op("MATMUL", {"A": "A", "B": "B"}, "C", _matmul),
    "bias": _Op("POINTWISE", {"input": "IN_0", "bias": "IN_1"}, "OUT_0", _ONTO),
    "scale": _Op("POINTWISE", {"input": "IN_0", "scale": "IN_1"}, "OUT_0", _ONTO),
    "add": _Op("POINTWISE", {"a": "IN_0", "b": "IN_1"}, "OUT_0", _BROADCAST),
    "mul": _Op("POINTWISE", {"a": "IN_0", "b": "IN_1"}, "OUT_0", _BROADCAST),
    **{op: _Op("POINTWISE", _UNARY, "OUT_0", _ONTO) for op in ("relu", "gelu", "sigmoid", "tanh", "swish")},
    "reduction": _Op("REDUCTION", {"input": "input"}, "OUT_0", _reduction, float32_output=True),
    "sdpa": _Op("SDPA", {"q": "q", "k": "k", "v": "v"}, "O", _sdpa),
}


@dataclass
class _Tensor:
    """A tensor of a builder: an input, or the output of node ``node``."""

    name: str
    dims: Dims
    strides: Dims | None  # None: an op output's, row-major unless set
    dtype: str | None  # None: an op output's, by its op
    pass_by_value: bool = False
    node: int | None = None
    output: bool = False


@dataclass(frozen=True)
class _Node:
    op: str
    name: str
    inputs: tuple[_Tensor, ...]
    output: _Tensor
    params: dict[str, Any]


def _check_layout(where: str, dims: Dims, strides: Any) -> Dims:
    """``strides`` checked for ``dims``: as many, none negative, and no two elements at one address."""
    try:
        checked = tuple(_ints("strides", strides, 0, len(dims)))
    except ValueError as exc:
        raise SpecError(f"{where}: {exc}") from None
    reach = 1
    for s, d in sorted((s, d) for s, d in zip(checked, dims) if d > 1):  # strides of non-unit dims must nest
        if s < reach:
            raise SpecError(f"{where}: strides {list(checked)} make elements of dims {list(dims)} overlap")
        reach = s * d
    return checked


def _data_type(where: str, value: Any) -> str:
    if value not in _FE_DTYPE:
        raise SpecError(f"{where}: data type {value!r} is not one of {', '.join(_FE_DTYPE)}")
    return str(value)


class TensorRef:
    """A tensor handle returned by the builder; mirrors the cudnn tensor setters for outputs."""

    def __init__(self, builder: SpecBuilder, tensor: _Tensor) -> None:
        self._b, self._t = builder, tensor

    @property
    def name(self) -> str:
        return self._t.name

    def set_output(self, is_output: bool = True) -> TensorRef:
        self._op_output("set_output").output = bool(is_output)
        return self

    def set_name(self, name: str) -> TensorRef:
        self._b._rename(self._op_output("set_name"), name)
        return self

    def set_dim(self, dims: list[int]) -> TensorRef:
        t = self._op_output("set_dim")
        if list(dims) != list(t.dims):
            raise SpecError(f"tensor {t.name!r}: set_dim {list(dims)}, but {self._b._nodes[t.node or 0].op} gives "
                            f"{list(t.dims)}")
        return self

    def set_stride(self, strides: list[int]) -> TensorRef:
        t = self._op_output("set_stride")
        t.strides = _check_layout(f"tensor {t.name!r}", t.dims, strides)
        return self

    def set_data_type(self, dtype: DType) -> TensorRef:
        t = self._op_output("set_data_type")
        t.dtype = _data_type(f"tensor {t.name!r}", dtype)
        return self

    def _op_output(self, setter: str) -> _Tensor:
        if self._t.node is None:
            raise SpecError(f"tensor {self._t.name!r} is an input; {setter} is for op outputs")
        return self._t

    def __repr__(self) -> str:
        return f"TensorRef({self.name!r})"


class SpecBuilder:
    """Write a graph document with the cudnn.pygraph method names you know::

        b = SpecBuilder(io_data_type="bfloat16")
        X = b.tensor("X", dim=[32, 128, 56, 56], stride=channels_last_strides([32, 128, 56, 56]))
        ...
        Y = b.relu(b.bias(b.conv_fprop(X, W, padding=[1, 1]), B))
        Y.set_output(True).set_name("Y")
        spec = b.build()

    Each call is checked as it is made (shapes inferred, layouts and arguments checked); a
    :class:`~plancache.errors.SpecError` names the node or tensor at fault.
    """

    def __init__(self, io_data_type: DType, intermediate_data_type: DType = "float32",
                 compute_data_type: DType = "float32", name: str = "", tuning: TuningSpec | None = None) -> None:
        self._io = _data_type("io_data_type", io_data_type)
        self._context = {"io_data_type": _FE_DTYPE[self._io],
                         "intermediate_data_type": _FE_DTYPE[_data_type("intermediate_data_type", intermediate_data_type)],
                         "compute_data_type": _FE_DTYPE[_data_type("compute_data_type", compute_data_type)]}
        self._name, self._tuning = name, tuning or TuningSpec()
        self._tensors: dict[str, _Tensor] = {}
        self._nodes: list[_Node] = []

    # inputs
    def tensor(self, name: str, dim: list[int], stride: list[int] | None = None, data_type: DType | None = None,
               is_pass_by_value: bool = False) -> TensorRef:
        where = f"tensor {name!r}"
        try:
            dims = tuple(_ints("dims", dim, 1))
        except ValueError as exc:
            raise SpecError(f"{where}: {exc}") from None
        strides = _check_layout(where, dims, contiguous_strides(dims) if stride is None else stride)
        dtype = _data_type(where, data_type or ("float32" if is_pass_by_value else self._io))
        if is_pass_by_value and (any(d != 1 for d in dims) or dtype != "float32"):
            raise SpecError(f"{where}: a pass-by-value scalar must be float32 with all dims 1")
        return TensorRef(self, self._add(_Tensor(name, dims, strides, dtype, bool(is_pass_by_value))))

    def tensor_like(self, tensor: Any, name: str, is_pass_by_value: bool | None = None) -> TensorRef:
        """An input shaped like a torch tensor (dims, strides, dtype). As in cudnn, a CPU tensor becomes
        pass-by-value unless ``is_pass_by_value`` says otherwise."""
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _FE_DTYPE:
            raise SpecError(f"tensor_like({name!r}): unsupported dtype {tensor.dtype}")
        by_value = str(tensor.device) == "cpu" if is_pass_by_value is None else is_pass_by_value
        return self.tensor(name, list(tensor.shape), list(tensor.stride()), cast(DType, dtype), is_pass_by_value=by_value)

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
        return self._op("reduction", {"input": input}, {"mode": mode, "dims": dims}, name)

    def sdpa(self, q: TensorRef, k: TensorRef, v: TensorRef, attn_scale: float | None = None,
             causal: bool = False, name: str | None = None) -> TensorRef:
        return self._op("sdpa", {"q": q, "k": k, "v": v}, {"attn_scale": attn_scale, "causal": causal}, name)

    def build(self) -> GraphSpec:
        """The schema-2 document of the graph: outputs are the tensors marked with ``set_output(True)``;
        every input must be used and every other op output consumed."""
        if not any(t.output for t in self._tensors.values()):
            raise SpecError("no tensor is marked as an output (call .set_output(True))")
        consumed = {id(t) for n in self._nodes for t in n.inputs}
        for t in self._tensors.values():
            if id(t) not in consumed and not t.output:
                raise SpecError(f"input tensor {t.name!r} is not used by any node" if t.node is None else
                                f"tensor {t.name!r} is neither used by a node nor marked with set_output(True)")
        # uids: inputs and outputs by name, then the virtual tensors in graph order
        order = sorted((t for t in self._tensors.values() if t.node is None or t.output), key=lambda t: t.name)
        order += [n.output for n in self._nodes if not n.output.output]
        uid = {id(t): i for i, t in enumerate(order, 1)}
        tensors = []
        for t in order:
            op = None if t.node is None else _OPS[self._nodes[t.node].op]
            virtual = op is not None and not t.output
            dtype = t.dtype or ("float32" if op is not None and op.float32_output else self._io)
            tensors.append({
                "uid": uid[id(t)], "name": t.name, "data_type": None if virtual else _FE_DTYPE[dtype],
                "dim": list(t.dims), "stride": list(t.strides or contiguous_strides(t.dims)), "is_virtual": virtual,
                "is_pass_by_value": t.pass_by_value, "uid_assigned": not virtual,
                "dim_assigned": not virtual or op is not None and kind_of(op.node_type).pushed_output_dims,
                "stride_assigned": not virtual,
            })
        nodes = [{
            "name": n.name, "type": _OPS[n.op].node_type, "compute_data_type": self._context["compute_data_type"],
            "inputs": {port: uid[id(t)] for port, t in zip(_OPS[n.op].inputs.values(), n.inputs)},
            "outputs": {_OPS[n.op].output: uid[id(n.output)]}, "params": n.params,
        } for n in self._nodes]
        return parse_spec({"schema": SPEC_SCHEMA_VERSION, "name": self._name, "context": self._context,
                           "tensors": tensors, "nodes": nodes, "tuning": self._tuning.model_dump()})

    def _add(self, t: _Tensor) -> _Tensor:
        self._check_new(t.name)
        self._tensors[t.name] = t
        return t

    def _check_new(self, name: str) -> None:
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME:
            raise SpecError(f"tensor name {str(name)[:40]!r}: 1 to {MAX_NAME} characters")
        if name in self._tensors:
            raise SpecError(f"tensor {name!r} is already defined")

    def _op(self, op: str, operands: dict[str, TensorRef], args: dict[str, Any], name: str | None) -> TensorRef:
        spec, index = _OPS[op], len(self._nodes)
        node_name = name or f"{op}_{index}"
        where = f"node {index} ({node_name})"
        inputs = []
        for arg, ref in operands.items():
            if not isinstance(ref, TensorRef) or ref._b is not self:
                raise SpecError(f"{where}: {arg} is not a tensor of this SpecBuilder")
            if ref._t.pass_by_value and not (spec.node_type == "POINTWISE" and len(spec.inputs) == 2):
                raise SpecError(f"{where}: pass-by-value tensor {ref.name!r} can only feed bias, scale, add or mul")
            inputs.append(ref._t)
        try:
            dims, params = spec.lower(op, {arg: t.dims for arg, t in zip(operands, inputs)}, args)
        except ValueError as exc:
            raise SpecError(f"{where}: {exc}") from None
        out = self._add(_Tensor(f"{node_name}.{'output' if spec.output == 'OUT_0' else spec.output}", dims, None, None,
                                node=index))
        self._nodes.append(_Node(op, node_name, tuple(inputs), out, params))
        return TensorRef(self, out)

    def _rename(self, t: _Tensor, name: str) -> None:
        if name != t.name:
            self._check_new(name)
            del self._tensors[t.name]
            t.name = name
            self._tensors[name] = t


__all__ = ["DType", "SpecBuilder", "TensorRef", "channels_last_strides", "contiguous_strides"]
