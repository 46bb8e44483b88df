"""Float32 torch reference of a GraphSpec (schema 2), test inputs, and the numerics check.

Needs torch only (no cuDNN), so it also runs on a CPU. The reference upcasts every input to
float32 (fp8 values included), evaluates the nodes in graph order with TF32 disabled -- each
node by its family's reference (:mod:`plancache.gpu.families`) -- and is compared with a
plan's outputs by the normalised max error ``max|out - ref| / max|ref|`` over the compared
elements (padding rows and rows that see no key are don't-care, see :func:`compare_mask`).

API (what the worker and the autotuner call):

* :func:`make_inputs` -- a valid, deterministic, non-zero tensor for every graph input;
* :func:`allocate_outputs` -- NaN-filled output buffers in the plan's layouts;
* :func:`reference_outputs` -- the float32 reference of every output;
* :func:`compare_mask`, :func:`output_errors`, :func:`compare_outputs` -- the check;
* :func:`required_bytes` -- device bytes all of that needs;
* :func:`evaluate` -- the reference, or (``exact_float32=False``) the eager-torch equivalent.

Tensors are keyed by uid (``spec.input_tensors()`` / ``spec.output_tensors()``) and have the
document's logical dims (cuDNN order, e.g. NCHW, [b, h, s, d]) with its strides.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TypeAlias

import torch

from ..errors import TuningError
from ..spec import GraphSpec
from ..spec.document import NodeDoc, TensorDoc, storage_elements
from ..spec.nodes import NodeKind, decode_param, kind_of
from . import families as fam
from .families import (  # noqa: F401  (re-exported: the family registry beside the reference)
    FAMILIES,
    NodeCall,
    attention_geometry,
    family_of,
    kernel_cache_safe,
    uncovered,
)

Tensor: TypeAlias = torch.Tensor

__all__ = [
    "TOLERANCE", "TORCH_DTYPES", "allocate_outputs", "compare_mask", "compare_outputs", "evaluate", "first_mismatch",
    "make_inputs", "output_errors", "redraw_saved_attention", "reference_outputs", "required_bytes", "storage_elements",
    "tensor_bytes", "tolerance", "torch_dtype",
]

#: cuDNN data type name -> torch dtype.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "FLOAT": torch.float32, "DOUBLE": torch.float64, "HALF": torch.float16, "BFLOAT16": torch.bfloat16,
    "INT8": torch.int8, "UINT8": torch.uint8, "INT32": torch.int32, "INT64": torch.int64, "BOOLEAN": torch.bool,
    "FP8_E4M3": torch.float8_e4m3fn, "FP8_E5M2": torch.float8_e5m2,
}
if hasattr(torch, "float8_e8m0fnu"):
    TORCH_DTYPES["FP8_E8M0"] = torch.float8_e8m0fnu

#: Normalised max-error tolerance by output data type. bf16 keeps 8 mantissa bits (2^-8 ~ 0.004 per
#: rounding), fp16 11; e4m3 keeps 3 (2^-4 = 0.0625 per rounding), e5m2 2.
TOLERANCE: dict[str, float] = {
    "BFLOAT16": 2e-2, "HALF": 5e-3, "FLOAT": 5e-3, "DOUBLE": 5e-3, "FP8_E4M3": 0.125, "FP8_E5M2": 0.25,
    "INT8": 0.0, "UINT8": 0.0, "INT32": 0.0, "INT64": 0.0, "BOOLEAN": 0.0,
}

_FP8_MAX = {"FP8_E4M3": 448.0, "FP8_E5M2": 57344.0}


def torch_dtype(spec: GraphSpec, doc: TensorDoc) -> torch.dtype:
    name = spec.data_type_of(doc)
    dt = TORCH_DTYPES.get(name)
    if dt is None:
        raise TuningError(f"tensor {_label(doc)}: data type {name} has no torch equivalent")
    return dt


def _label(doc: TensorDoc) -> str:
    return f"{doc.name!r} (uid {doc.uid})" if doc.name else f"uid {doc.uid}"


def _contiguous(dims: list[int]) -> list[int]:
    stride: list[int] = []
    acc = 1
    for d in reversed(dims):
        stride.insert(0, acc)
        acc *= max(d, 1)
    return stride


def _layout(doc: TensorDoc) -> tuple[list[int], list[int]]:
    dims = list(doc.dim) or [1]
    stride = list(doc.stride) if doc.stride and len(doc.stride) == len(dims) else _contiguous(dims)
    return dims, stride


def tensor_bytes(spec: GraphSpec, doc: TensorDoc) -> int:
    """Bytes of the buffer a plan reads or writes for ``doc``."""
    dims, stride = _layout(doc)
    name = spec.data_type_of(doc)
    size = TORCH_DTYPES[name].itemsize if name in TORCH_DTYPES else 4
    return storage_elements(dims, stride) * size


@contextlib.contextmanager
def _exact_float32() -> Iterator[None]:
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ------------------------------------------------------------------ inputs


def _consumers(spec: GraphSpec) -> dict[int, list[tuple[NodeDoc, str]]]:
    out: dict[int, list[tuple[NodeDoc, str]]] = {}
    for node in spec.nodes:
        for port, uid in node.inputs.items():
            out.setdefault(uid, []).append((node, port))
    return out


def _fan_in(spec: GraphSpec, node: NodeDoc, port: str) -> int | None:
    """Weight-like inputs (:attr:`NodeKind.fan_in`) are scaled by 1/sqrt(fan-in) so a node's outputs stay O(1)."""
    doc = spec.tensor(node.inputs[port])
    fan_in = kind_of(node.type).fan_in.get(port)
    if fan_in is None or spec.data_type_of(doc) in _FP8_MAX:
        return None  # fp8 values keep their range; the graph's descale factors scale them
    return fan_in(list(doc.dim))


def _lengths(gen: torch.Generator, b: int, s: int) -> list[int]:
    """Mostly full sequences, every other one shorter: lengths in [1, s]."""
    s = max(int(s), 1)
    return [s if i % 2 == 0 else int(torch.randint(1, s + 1, (1,), generator=gen)) for i in range(b)]


def _place(values: Tensor, doc: TensorDoc, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """A tensor with the document's dims and strides holding ``values`` (logical order)."""
    dims, stride = _layout(doc)
    t = torch.empty_strided(dims, stride, dtype=dtype, device=device)
    values = values.reshape(dims)
    if dtype.is_floating_point and dtype.itemsize == 1:
        top = torch.finfo(dtype).max
        values = values.float().clamp(-top, top)
    dst, src = t, values
    for i, s in enumerate(stride):  # a broadcast (stride 0) axis holds one value
        if s == 0 and dims[i] > 1:
            dst, src = dst.narrow(i, 0, 1), src.narrow(i, 0, 1)
    dst.copy_(src.to(dtype))
    return t


def _random(gen: torch.Generator, doc: TensorDoc, name: str, scale: float = 1.0) -> Tensor:
    dims = list(doc.dim) or [1]
    if name == "BOOLEAN":
        return torch.rand(dims, generator=gen) < 0.5
    if name in ("INT8", "UINT8", "INT32", "INT64"):
        return torch.randint(1, 64, dims, generator=gen)
    return torch.randn(dims, generator=gen) * scale


def _scalar(role: str, node: NodeDoc, spec: GraphSpec) -> float | None:
    """The value of a scalar-like input of ``role`` (None: not one)."""
    if role == "epsilon":
        return 1e-5
    if role == "momentum":
        return 0.1
    if role == "attn_scale":
        q = spec.tensor(node.inputs["q"])
        return 1.0 / math.sqrt(q.dim[-1]) if q.dim else 1.0
    if role in ("scale_s", "descale_s"):
        top = _FP8_MAX.get(spec.data_type_of(spec.tensor(node.inputs["q"])), 1.0)
        return top if role == "scale_s" else 1.0 / top
    return None


def _attends(kind: NodeKind, node: NodeDoc) -> bool:
    """An attention node with q and k: its sequence lengths, page tables and ragged offsets get valid values."""
    return kind.group == "attention" and "q" in node.inputs and "k" in node.inputs


def make_inputs(spec: GraphSpec, device: torch.device | str, *, seed: int = 0) -> dict[int, Tensor]:
    """A tensor for every graph input (``spec.input_tensors()``), by uid. Deterministic for a seed.

    Random non-zero values in the document's dtype, dims and strides (fp8 as torch's float8 types);
    weight-like inputs scaled by 1/sqrt(fan-in); one-element float tensors (descale factors, alpha)
    in [0.75, 1.25]; pass-by-value scalars as one-element CPU tensors (float32 for FLOAT). Inputs whose values must
    be valid get valid ones: sequence lengths in
    [1, s] (every other sequence shorter), page tables a permutation of the pool's blocks, ragged
    offsets the cumulative token counts (elements / ragged_offset_multiplier, the offset doc's int
    type), epsilon 1e-5, momentum 0.1, fp8 descale/scale factors around 1 with scale_s the fp8 max
    (descale_s its inverse), running variances positive, the saved mean / inverse std of a norm
    backward (and batchnorm inference) the actual statistics of its input, and SDPA backward ``o``
    / ``stats`` the float32 forward reference of the generated q, k, v (a row that sees no key gets
    Stats 0 and O 0)."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    inputs = spec.input_tensors()
    input_uids = {d.uid for d in inputs}
    values = _random_values(spec, gen, inputs)  # in document order: a stable random stream
    lens: dict[int, list[int]] = {}  # seq-len tensor uid -> lengths
    side_lens: dict[tuple[int, str], list[int] | None] = {}  # (node index, "q"/"kv") -> lengths
    for idx, node in enumerate(spec.nodes):
        kind = kind_of(node.type)
        _role_values(spec, node, kind, input_uids, gen, values)
        if _attends(kind, node):
            _sequence_values(spec, idx, node, input_uids, gen, values, lens, side_lens)
            _page_tables(spec, node, kind, input_uids, gen, values)
    _ragged_offsets(spec, input_uids, side_lens, values)
    out = {doc.uid: _placed(spec, doc, values[doc.uid], device) for doc in inputs}
    # values that depend on others
    _norm_statistics(spec, out, input_uids)
    _attention_saved(spec, out, input_uids)
    return out


def _random_values(spec: GraphSpec, gen: torch.Generator, inputs: list[TensorDoc]) -> dict[int, Tensor]:
    """Random values of every input: weight-like ones scaled by 1/sqrt(fan-in), one-element floats around 1,
    pass-by-value floats positive."""
    uses = _consumers(spec)
    values: dict[int, Tensor] = {}
    for doc in inputs:
        name = spec.data_type_of(doc)
        scale = 1.0
        for node, port in uses.get(doc.uid, []):
            fan = _fan_in(spec, node, port)
            if fan:
                scale = 1.0 / math.sqrt(fan)
                break
        v = _random(gen, doc, name, scale)
        if v.is_floating_point() and v.numel() == 1:
            v = 0.75 + 0.5 * torch.rand(v.shape, generator=gen)  # scalars (descale factors, alpha): around 1
        elif doc.is_pass_by_value and v.is_floating_point():
            v = 0.5 + v.abs()  # a positive host scalar unless its port says otherwise
        values[doc.uid] = v
    return values


def _role_values(spec: GraphSpec, node: NodeDoc, kind: NodeKind, input_uids: set[int], gen: torch.Generator,
                 values: dict[int, Tensor]) -> None:
    """Valid values of the node's scalar-like, fp8-scale and running-statistics inputs (by their roles)."""
    for port, uid in node.inputs.items():
        if uid not in input_uids:
            continue
        dims = list(spec.tensor(uid).dim) or [1]
        role = kind.role(port)
        role_value = _scalar(role, node, spec)
        if role_value is not None:
            values[uid] = torch.full(dims, role_value)
        elif role == "fp8_scale":
            values[uid] = 0.75 + 0.5 * torch.rand(dims, generator=gen)
        elif role == "running_var":
            values[uid] = 0.5 + torch.rand(dims, generator=gen)
        elif role == "running_mean":
            values[uid] = 0.1 * torch.randn(dims, generator=gen)


def _sequence_values(spec: GraphSpec, idx: int, node: NodeDoc, input_uids: set[int], gen: torch.Generator,
                     values: dict[int, Tensor], lens: dict[int, list[int]],
                     side_lens: dict[tuple[int, str], list[int] | None]) -> None:
    """An attention node's sequence lengths (and cumulative ones) per side, one draw per length tensor; the lengths
    each side uses are noted in ``side_lens``."""
    q = spec.tensor(node.inputs["q"])
    b = q.dim[0]
    for side, s_max in (("q", q.dim[2]), ("kv", fam.kv_len(spec, node))):
        chosen = None
        for port in (f"seq_len_{side}", f"cu_seq_len_{side}"):
            uid = node.inputs.get(port, -1)  # uids are >= 0
            if uid not in input_uids:
                continue
            if uid not in lens:
                lens[uid] = _lengths(gen, b, s_max)
            chosen = lens[uid]
            doc = spec.tensor(uid)
            seq = torch.tensor(chosen)
            if port.startswith("cu_"):
                seq = torch.cat([torch.zeros(1, dtype=seq.dtype), seq.cumsum(0)])
            values[uid] = seq.reshape(list(doc.dim) or [-1])
        side_lens[(idx, side)] = chosen


def _page_tables(spec: GraphSpec, node: NodeDoc, kind: NodeKind, input_uids: set[int], gen: torch.Generator,
                 values: dict[int, Tensor]) -> None:
    """Page tables: a permutation of the container's blocks (blocks drawn with repeats where there are too few)."""
    for port, uid in sorted(node.inputs.items()):
        if uid not in input_uids or kind.role(port) != "page_table":
            continue
        doc = spec.tensor(uid)
        blocks = spec.tensor(node.inputs["k" if port.endswith("k_table") else "v"]).dim[0]
        need = math.prod(doc.dim)
        if blocks >= need:
            table = torch.randperm(blocks, generator=gen)[:need]
        else:
            table = torch.randint(0, blocks, (need,), generator=gen)
        values[uid] = table.reshape(doc.dim)


def _ragged_offsets(spec: GraphSpec, input_uids: set[int], side_lens: dict[tuple[int, str], list[int] | None],
                    values: dict[int, Tensor]) -> None:
    """Ragged offsets of attention tensors: each sequence's first token, in elements / multiplier."""
    for idx, node in enumerate(spec.nodes):
        if kind_of(node.type).group != "attention":
            continue
        for port, uid in list(node.inputs.items()) + list(node.outputs.items()):
            doc = spec.tensor(uid)
            off = doc.ragged_offset
            if off is None or off not in input_uids or len(doc.dim) != 4:
                continue
            side = "kv" if port in fam.KV_SIDE else "q"
            b, _, s, _ = doc.dim
            ls = side_lens.get((idx, side)) or [s] * b
            token_stride = doc.stride[2] if doc.stride else doc.dim[1] * doc.dim[3]
            cum = [0]
            for n in ls:
                cum.append(cum[-1] + n)
            mult = doc.ragged_offset_multiplier or 1
            odoc = spec.tensor(off)
            values[off] = torch.tensor([c * token_stride // mult for c in cum]).reshape(list(odoc.dim) or [-1])


def _placed(spec: GraphSpec, doc: TensorDoc, v: Tensor, device: torch.device | str) -> Tensor:
    """An input's value in its data type and layout (an embedded value wins); a pass-by-value one a host tensor."""
    dtype = torch_dtype(spec, doc)
    if doc.pass_by_value is not None:
        v = torch.full(list(doc.dim) or [1], float(doc.pass_by_value))
    if doc.is_pass_by_value:  # a host tensor of the declared type (FLOAT: float32)
        return v.reshape(list(doc.dim) or [1]).to(dtype).clone()
    return _place(v, doc, dtype, device)


def _norm_statistics(spec: GraphSpec, out: dict[int, Tensor], input_uids: set[int]) -> None:
    """Saved statistics of norm backward / batchnorm inference: the actual ones of the input (eps 1e-5)."""
    for node in spec.nodes:
        kind = kind_of(node.type)
        # saved statistics by port, the mean first
        roles = {p: r for r in ("saved_mean", "saved_inv_variance") for p, u in node.inputs.items()
                 if u in input_uids and kind.role(p) == r}
        ports = list(roles)
        if not ports:
            continue
        x_uid = node.inputs.get("input")
        if x_uid not in out:
            for p in ports:  # input computed in the graph: plausible values
                t = out[node.inputs[p]]
                with torch.no_grad():
                    t.copy_(torch.full_like(t, 0.0 if roles[p] == "saved_mean" else 1.0, dtype=torch.float32).to(t.dtype))
            continue
        x = out[x_uid].to(torch.float32)
        scale = spec.tensor(node.inputs["scale"]).dim if "scale" in node.inputs else None
        stat = spec.tensor(node.inputs[ports[0]]).dim
        axes = fam.norm_axes(node.type, list(x.shape), scale, stat)
        with torch.no_grad():
            if kind.statistics == "rms":
                mean = torch.zeros_like(x.mean(dim=axes, keepdim=True)) if axes else torch.zeros_like(x)
                var = (x * x).mean(dim=axes, keepdim=True) if axes else x * x
            else:
                mean = x.mean(dim=axes, keepdim=True) if axes else x.clone()
                var = ((x - mean) ** 2).mean(dim=axes, keepdim=True) if axes else torch.zeros_like(x)
            inv = torch.rsqrt(var + 1e-5)
            for p in ports:
                t = out[node.inputs[p]]
                src = mean if roles[p] == "saved_mean" else inv
                t.copy_(src.reshape(t.shape).to(device=t.device, dtype=t.dtype))


def _attention_saved(spec: GraphSpec, out: dict[int, Tensor], input_uids: set[int],
                     dropout: dict[int, Tensor] | None = None) -> None:
    """SDPA backward ``o`` / ``stats``: the float32 forward of the generated q, k, v (same masks). A node with dropout
    is left for :func:`redraw_saved_attention` unless ``dropout`` (by node index) holds what cuDNN drops there; with
    ``dropout``, only its nodes are recomputed."""
    for idx, node in enumerate(spec.nodes):
        wanted = idx in dropout if dropout is not None else fam.dropout_probability(node) is None
        if not wanted:
            continue
        kind = kind_of(node.type)
        saved = {kind.role(p): p for p, u in node.inputs.items() if u in input_uids}
        if not {"saved_o", "saved_stats"} & set(saved) or any(node.inputs.get(p) not in out for p in ("q", "k", "v")):
            continue
        fp8 = kind.fp8
        device = out[node.inputs["q"]].device
        x: dict[str, Tensor] = {}
        for port, uid in node.inputs.items():
            if uid not in out:
                continue
            t = out[uid]
            x[port] = t.to(device=device, dtype=torch.float32) if t.is_floating_point() else t
        if fp8:  # the forward of the descaled values; o is stored as O / descale_o
            for port in ("q", "k", "v"):
                d = x.get(f"descale_{port}")
                if d is not None:
                    x[port] = x[port] * d.reshape(())
        call = NodeCall(spec, node, x, raw=out, exact=True, dropout=None if dropout is None else dropout[idx])
        with _exact_float32(), torch.no_grad():
            geo = attention_geometry(spec, node, x)
            res = fam.attention_forward(call, geo, fp8=False, stats=True)
            rows = geo.q_rows(device)
            o = res["O"] * rows
            if fp8 and "descale_o" in x:
                o = o / x["descale_o"].reshape(())
            stats = torch.where(rows & torch.isfinite(res["Stats"]), res["Stats"], torch.zeros_like(res["Stats"]))
        for role, dense in (("saved_o", o), ("saved_stats", stats)):
            if role not in saved:
                continue
            uid = node.inputs[saved[role]]
            doc, t = spec.tensor(uid), out[uid]
            with torch.no_grad():
                if doc.ragged_offset is not None and doc.ragged_offset in out:
                    fam.ragged_scatter(t, doc, out[doc.ragged_offset], geo.lens_q, dense)
                else:
                    t.copy_(dense.reshape(t.shape).to(t.dtype))


def redraw_saved_attention(spec: GraphSpec, inputs: dict[int, Tensor], dropout: dict[int, Tensor]) -> None:
    """Rewrite, in place, the saved ``o`` / ``stats`` inputs of the attention backward nodes in ``dropout`` (node index
    -> the multiplier cuDNN applies, :attr:`NodeCall.dropout`): a backward's ``o`` is its dropped forward's output."""
    _attention_saved(spec, inputs, {d.uid for d in spec.input_tensors()}, dropout)


def allocate_outputs(spec: GraphSpec, device: torch.device | str,
                     layouts: dict[int, tuple[list[int], list[int]]] | None = None) -> dict[int, Tensor]:
    """Output buffers by uid (``spec.output_tensors()``) with the given (dims, strides) -- the built graph's
    real layouts; the document's where a uid is missing -- in the document's dtype, filled with NaN (-1 for
    integers) so an output the plan does not write fails the check."""
    out = {}
    layouts = layouts or {}
    for doc in spec.output_tensors():
        dims, stride = layouts.get(doc.uid) or _layout(doc)
        t = torch.empty_strided(list(dims), list(stride), dtype=torch_dtype(spec, doc), device=device)
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.fill_(False)
        else:
            t.fill_(-1)
        out[doc.uid] = t
    return out


# ------------------------------------------------------------------ evaluation


def _device_of(spec: GraphSpec, inputs: dict[int, Tensor]) -> torch.device:
    for doc in spec.input_tensors():
        if not doc.is_pass_by_value and doc.uid in inputs:
            return inputs[doc.uid].device
    return torch.device("cpu")


def _fit(t: Tensor, doc: TensorDoc, where: str) -> Tensor:
    """A node result shaped as its output document says (broadcast or reshaped where they differ); a virtual
    tensor keeps the computed shape."""
    if doc.is_virtual or not doc.dim or list(t.shape) == list(doc.dim):
        return t
    try:
        return t.expand(doc.dim)
    except RuntimeError:
        pass
    if t.numel() == math.prod(doc.dim):
        return t.reshape(doc.dim)
    raise TuningError(f"{where}: result dims {list(t.shape)} do not fit output {_label(doc)} dims {doc.dim}")


def reference_outputs(spec: GraphSpec, inputs: dict[int, Tensor], *,
                      dropout: dict[int, Tensor] | None = None) -> dict[int, Tensor]:
    """The float32 reference of every graph output, by uid, on the inputs' device (logical dims; a ragged
    output as its dense [b, h, s, d] view). ``dropout``: by node index, what cuDNN drops at each attention node with
    dropout (:attr:`NodeCall.dropout`). Raises :class:`TuningError` naming a node without a reference
    (check :func:`plancache.gpu.families.uncovered` first)."""
    return evaluate(spec, inputs, exact_float32=True, dropout=dropout)


def evaluate(spec: GraphSpec, inputs: dict[int, Tensor], *, exact_float32: bool,
             dropout: dict[int, Tensor] | None = None) -> dict[int, Tensor]:
    """Run ``spec`` node by node with torch ops.

    ``exact_float32``: every input upcast to float32 (fp8 values included), TF32 off, attention
    unfused -- the reference. Otherwise the inputs' own dtypes (fp8 as bfloat16) and torch's fused
    ``scaled_dot_product_attention`` where it applies: the eager-PyTorch equivalent benchmarks compare
    plans with."""
    device = _device_of(spec, inputs)
    env: dict[int, Tensor] = {}
    for doc in spec.input_tensors():
        if doc.pass_by_value is not None:
            env[doc.uid] = torch.full(list(doc.dim) or [1], float(doc.pass_by_value), dtype=torch.float32, device=device)
            continue
        t = inputs.get(doc.uid)
        if t is None:
            raise TuningError(f"input tensor {_label(doc)} is not bound")
        if doc.is_pass_by_value:
            env[doc.uid] = t.to(device=device, dtype=torch.float32)
        elif t.is_floating_point():
            if exact_float32:
                env[doc.uid] = t.to(torch.float32)
            else:
                env[doc.uid] = t.to(torch.bfloat16) if t.dtype.itemsize == 1 else t
        else:
            env[doc.uid] = t
    raw = dict(inputs)
    ctx = _exact_float32() if exact_float32 else contextlib.nullcontext()
    with ctx, torch.no_grad():
        for idx, node in enumerate(spec.nodes):
            family = family_of(node)
            where = fam.node_label(spec, node)
            if family is None or family.reference is None:
                raise TuningError(f"{where}: no float32 reference for this node")
            why = family.unsupported(spec, node) if family.unsupported else None
            if why:
                raise TuningError(f"{where}: {why}")
            missing = [p for p, u in node.inputs.items() if u not in env]
            if missing:
                raise TuningError(f"{where}: inputs {missing} are not available")
            call = NodeCall(spec, node, {p: env[u] for p, u in node.inputs.items()}, raw=raw, exact=exact_float32,
                            dropout=(dropout or {}).get(idx))
            results = family.reference(call)
            for port, uid in node.outputs.items():
                if port in results:
                    env[uid] = _fit(results[port], spec.tensor(uid), where)
    out = {}
    for doc in spec.output_tensors():
        if doc.uid not in env:
            raise TuningError(f"output {_label(doc)}: its node computed no reference for it")
        t = env[doc.uid]
        out[doc.uid] = t.to(torch.float32) if exact_float32 else t
    return out


# ------------------------------------------------------------------ the check


def compare_mask(spec: GraphSpec, inputs: dict[int, Tensor]) -> dict[int, Tensor]:
    """Boolean masks (broadcastable to the output's logical dims; True where compared) of the outputs with
    don't-care elements: attention rows past seq_len_q (or that see no key at all) for O / Stats / dQ,
    key rows past seq_len_kv for dK / dV; carried through pointwise nodes. Outputs without one are
    compared everywhere."""
    device = _device_of(spec, inputs)
    masks: dict[int, Tensor] = {}
    for node in spec.nodes:
        kind = kind_of(node.type)
        if _attends(kind, node):
            x = {p: inputs[u] for p, u in node.inputs.items() if u in inputs}
            geo = attention_geometry(spec, node, x)
            q_rows, kv_rows = None, None
            for port, uid in node.outputs.items():
                if port in ("O", "Stats", "score_max", "score_sum_exp", "dQ"):
                    q_rows = geo.q_rows(device) if q_rows is None else q_rows
                    masks[uid] = q_rows
                elif port in ("dK", "dV"):
                    kv_rows = geo.kv_rows(device) if kv_rows is None else kv_rows
                    masks[uid] = kv_rows
        elif kind.group == "pointwise":
            ms = [masks[u] for u in node.inputs.values() if u in masks]
            if ms:
                m = ms[0]
                for other in ms[1:]:
                    with contextlib.suppress(RuntimeError):
                        m = m & other
                for uid in node.outputs.values():
                    masks[uid] = m
    outputs = {d.uid for d in spec.output_tensors()}
    return {u: m for u, m in masks.items() if u in outputs and not bool(m.all())}


def _dense_output(spec: GraphSpec, doc: TensorDoc, t: Tensor, inputs: dict[int, Tensor] | None) -> Tensor:
    """A plan's output in logical dims: a ragged (THD) output unpacked by its offsets."""
    if doc.ragged_offset is None:
        return t
    if inputs is None or doc.ragged_offset not in inputs:
        raise TuningError(f"output {_label(doc)} is ragged: output_errors needs inputs= (its offsets and lengths)")
    node = spec.producer(doc.uid)
    if node is None:
        raise TuningError(f"output {_label(doc)} is no node's output")
    port = next(p for p, u in node.outputs.items() if u == doc.uid)
    x = {p: inputs[u] for p, u in node.inputs.items() if u in inputs}
    geo = attention_geometry(spec, node, x) if kind_of(node.type).group == "attention" else None
    lens = None if geo is None else (geo.lens_kv if port in fam.KV_SIDE else geo.lens_q)
    return fam.ragged_gather(t, doc, inputs[doc.ragged_offset].to(t.device), lens)


def _normalised_error(out: Tensor, ref: Tensor, mask: Tensor | None) -> float:
    if mask is not None:
        m = mask.to(out.device).expand(out.shape)
        out, ref = out[m], ref[m]
    else:
        out, ref = out.reshape(-1), ref.reshape(-1)
    if out.numel() == 0:
        return 0.0
    special = ~torch.isfinite(ref)
    if bool(special.any()):  # e.g. a -inf Stats: the plan must give the same value
        if not bool((out[special] == ref[special]).all()):
            return math.inf
        out, ref = out[~special], ref[~special]
        if out.numel() == 0:
            return 0.0
    if not bool(torch.isfinite(out).all()):
        return math.inf
    scale = max(float(ref.abs().max()), 1e-6)
    return float((out - ref).abs().max()) / scale


def output_errors(spec: GraphSpec, outputs: dict[int, Tensor], reference: dict[int, Tensor], *,
                  valid: dict[int, Tensor] | None = None, inputs: dict[int, Tensor] | None = None) -> dict[int, float]:
    """Normalised max error ``max|out - ref| / max|ref|`` per output uid over the compared elements (``inf``
    where the output has NaN/inf there). ``valid``: masks as :func:`compare_mask` returns; given ``inputs``
    (what the plan ran on) they are computed from them, and ragged outputs are unpacked by their offsets
    (a graph with a ragged output needs ``inputs``)."""
    if valid is None and inputs is not None:
        valid = compare_mask(spec, inputs)
    valid = valid or {}
    errs: dict[int, float] = {}
    for doc in spec.output_tensors():
        out = _dense_output(spec, doc, outputs[doc.uid], inputs).to(torch.float32)
        ref = reference[doc.uid].to(device=out.device, dtype=torch.float32)
        if ref.shape != out.shape:
            try:
                ref = ref.expand(out.shape)
            except RuntimeError:
                raise TuningError(f"output {_label(doc)}: dims {list(out.shape)} differ from the reference's "
                                  f"{list(ref.shape)}") from None
        errs[doc.uid] = _normalised_error(out, ref, valid.get(doc.uid))
    return errs


def tolerance(spec: GraphSpec, doc: TensorDoc) -> float:
    """The normalised error an output may have: :data:`TOLERANCE` of its data type, or of the output its node's
    family says it summarises (:attr:`Family.tolerance_of`)."""
    for node in spec.nodes:
        for port, uid in node.outputs.items():
            if uid == doc.uid:
                family = fam.family_of(node)
                source = family.tolerance_of.get(port) if family else None
                if source is not None and source in node.outputs:
                    doc = spec.tensor(node.outputs[source])
                break
    return TOLERANCE.get(spec.data_type_of(doc), 2e-2)


def first_mismatch(errs: dict[int, float], tolerance: dict[int, float], check: str) -> str | None:
    """Why outputs with these normalised errors (by uid, :func:`output_errors`) fail ``check``: the first past its
    tolerance (:func:`tolerance`); or None."""
    bad = [u for u, e in errs.items() if not e <= tolerance[u]]
    return f"output uid {bad[0]} normalised error {errs[bad[0]]:.3g} ({check})" if bad else None


def compare_outputs(spec: GraphSpec, outputs: dict[int, Tensor], reference: dict[int, Tensor], *,
                    valid: dict[int, Tensor] | None = None, inputs: dict[int, Tensor] | None = None) -> float:
    """The worst normalised error over the outputs; raise :class:`TuningError` when any exceeds its
    :func:`tolerance`."""
    errs = output_errors(spec, outputs, reference, valid=valid, inputs=inputs)
    for uid, err in errs.items():
        doc = spec.tensor(uid)
        dtype = spec.data_type_of(doc)
        tol = tolerance(spec, doc)
        if not err <= tol:
            raise TuningError(f"output {_label(doc)} ({dtype}): normalised max error {err:.3g} exceeds tolerance {tol:g}")
    return max(errs.values(), default=0.0)


# ------------------------------------------------------------------ memory


def infer_dims(spec: GraphSpec) -> dict[int, list[int]]:
    """Dims of every tensor: the document's, else its node type's rule (:meth:`NodeKind.output_dims`)."""
    dims: dict[int, list[int]] = {t.uid: list(t.dim) for t in spec.tensors if t.dim}
    for node in spec.nodes:
        kind = kind_of(node.type)
        ins = {p: dims.get(u, []) for p, u in node.inputs.items()}
        params = {k: decode_param(v) for k, v in node.params.items()}
        for port, uid in node.outputs.items():
            if uid not in dims:
                dims[uid] = kind.output_dims(port, ins, params)
    return dims


def required_bytes(spec: GraphSpec) -> int:
    """Device bytes to check a plan of ``spec``: the plan's input and output buffers, the reference's
    float32 copy of every tensor (virtual ones included), its attention scratch (scores, probabilities
    and mask, batch by batch; twice for autograd in a backward; the dense gathers of paged / ragged
    tensors), and the comparison's float32 copies of the outputs."""
    total = 0
    for doc in spec.input_tensors() + spec.output_tensors():
        if not doc.is_pass_by_value:
            total += tensor_bytes(spec, doc)
    dims = infer_dims(spec)
    for t in spec.tensors:
        if not t.is_pass_by_value:
            total += math.prod(dims.get(t.uid) or [1]) * 4
    for doc in spec.output_tensors():
        total += math.prod(dims.get(doc.uid) or [1]) * 4 * 3
    for node in spec.nodes:
        kind = kind_of(node.type)
        if not _attends(kind, node):
            continue
        q = spec.tensor(node.inputs["q"])
        if len(q.dim) != 4:
            continue
        b, h, s_q, d = q.dim
        s_kv = fam.kv_len(spec, node)
        per_batch = h * s_q * s_kv * 4 * 4 + s_q * s_kv
        backward = kind.backward
        total += per_batch * (3 if backward else 1) + b * s_q * s_kv  # + the boolean mask of all batches
        k = spec.tensor(node.inputs["k"])
        h_kv = k.dim[1] if len(k.dim) == 4 else h
        total += 2 * b * h * s_kv * d * 4 if h_kv != h else 0  # GQA head expansion
        if fam.is_paged(node) or any(spec.tensor(u).ragged_offset is not None for u in node.inputs.values()):
            total += (2 * b * h_kv * s_kv * d + 2 * b * h * s_q * d) * 4
        if backward:
            total += b * h * (s_q + 2 * s_kv) * d * 4  # the forward recomputed in make_inputs, gradients
    return int(total)
