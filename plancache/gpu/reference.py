"""Float32 torch reference evaluator of a GraphSpec, test inputs, and the numerics check.

Needs torch only (no cuDNN), so it also runs on a CPU. The reference upcasts every
input to float32, evaluates the nodes in order with TF32 disabled, and is compared
with a plan's outputs by the normalised max error ``max|out-ref| / max|ref|``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.nn.functional as F

from ..errors import TuningError
from ..spec import GraphSpec, TensorInfo

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                "int32": torch.int32, "int64": torch.int64}
# Normalised max-error tolerance per output dtype. bf16 keeps 8 mantissa bits (2^-8 ≈ 0.004 per rounding).
TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 5e-3, "int32": 0.0, "int64": 0.0}


def storage_elements(dims: tuple[int, ...] | list[int], strides: tuple[int, ...] | list[int]) -> int:
    """Elements a strided tensor spans in memory."""
    return 1 + sum((d - 1) * s for d, s in zip(dims, strides))


def tensor_bytes(info: TensorInfo) -> int:
    return storage_elements(info.dims, info.strides) * TORCH_DTYPES[info.dtype].itemsize


def reference_scratch_bytes(spec: GraphSpec) -> int:
    """Device bytes the float32 reference needs beyond the plan's own tensors."""
    total = 0
    for info in spec.tensor_infos().values():
        if not info.pass_by_value:
            total += math.prod(info.dims) * 4
    for node in spec.nodes:
        if node.op == "sdpa":
            q = spec.tensor_infos()[node.inputs["q"]].dims
            k = spec.tensor_infos()[node.inputs["k"]].dims
            total += 3 * q[0] * q[1] * q[2] * k[2] * 4  # scores, mask, probabilities
    return total


def _scaled_ports(spec: GraphSpec) -> dict[str, int]:
    """Weight-like inputs scaled by 1/sqrt(fan-in) so outputs stay O(1)."""
    fan: dict[str, int] = {}
    infos = spec.tensor_infos()
    for node in spec.nodes:
        if node.op == "conv_fprop":
            w = infos[node.inputs["weight"]].dims
            fan[node.inputs["weight"]] = math.prod(w[1:])
        elif node.op == "matmul":
            fan[node.inputs["B"]] = infos[node.inputs["B"]].dims[-2]
    return fan


def make_inputs(spec: GraphSpec, device: torch.device | str, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Fresh non-zero random inputs in the spec's dtypes and strides; pass-by-value scalars on the CPU."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    fan = _scaled_ports(spec)
    out: dict[str, torch.Tensor] = {}
    for name, ts in spec.tensors.items():
        dtype = TORCH_DTYPES[ts.dtype]
        if ts.pass_by_value:
            out[name] = (0.5 + torch.rand(ts.dims, generator=gen)).to(dtype)
            continue
        if dtype.is_floating_point:
            values = torch.randn(ts.dims, generator=gen) / math.sqrt(fan.get(name, 1))
        else:
            values = torch.randint(1, 64, ts.dims, generator=gen)
        t = torch.empty_strided(ts.dims, ts.strides, dtype=dtype, device=device)
        t.copy_(values.to(dtype))
        out[name] = t
    return out


def allocate_outputs(spec: GraphSpec, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Output buffers in the spec's dtypes and strides, filled with NaN so an unwritten output fails the check."""
    out = {}
    for name, ts in spec.outputs.items():
        t = torch.empty_strided(ts.dims, ts.strides, dtype=TORCH_DTYPES[ts.dtype], device=device)
        t.fill_(float("nan") if t.dtype.is_floating_point else -1)
        out[name] = t
    return out


@contextlib.contextmanager
def _exact_float32() -> Iterator[None]:
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        sq, skv = scores.shape[-2], scores.shape[-1]
        keep = torch.ones(sq, skv, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def reference_outputs(spec: GraphSpec, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Evaluate ``spec`` in float32 on the inputs' device; returns every graph output (float32)."""
    return evaluate(spec, inputs, exact_float32=True)


def evaluate(spec: GraphSpec, inputs: dict[str, torch.Tensor], *, exact_float32: bool) -> dict[str, torch.Tensor]:
    """Run ``spec`` node by node with torch ops.

    ``exact_float32``: every input upcast to float32, TF32 off, attention unfused — the reference.
    Otherwise the inputs' own dtypes and torch's fused ``scaled_dot_product_attention``: the
    PyTorch eager equivalent the benchmarks compare plans with."""
    device = next(t.device for n, t in inputs.items() if not spec.tensors[n].pass_by_value)
    if exact_float32:
        env = {n: t.to(device=device, dtype=torch.float32) for n, t in inputs.items()}
    else:
        env = {n: (float(t) if spec.tensors[n].pass_by_value else t) for n, t in inputs.items()}
    with _exact_float32() if exact_float32 else contextlib.nullcontext(), torch.no_grad():
        for i, node in enumerate(spec.nodes):
            (tname,) = node.outputs.values()
            env[tname] = _node(spec, i, {p: env[n] for p, n in node.inputs.items()}, exact_float32)
    return {name: env[name] for name in spec.outputs}


def _node(spec: GraphSpec, i: int, x: dict, exact: bool):
    node, a = spec.nodes[i], spec.node_attrs(i)
    if node.op == "conv_fprop":
        conv = {4: F.conv2d, 5: F.conv3d}.get(x["image"].dim())
        if conv is None:
            raise TuningError(f"node {i}: reference conv supports 2-D and 3-D only")
        sp = x["image"].dim() - 2
        return conv(x["image"], x["weight"], padding=a.padding or [0] * sp, stride=a.stride or [1] * sp,
                    dilation=a.dilation or [1] * sp)
    if node.op == "matmul":
        return torch.matmul(x["A"], x["B"])
    if node.op == "bias":
        return x["input"] + x["bias"]
    if node.op == "scale":
        return x["input"] * x["scale"]
    if node.op == "add":
        return x["a"] + x["b"]
    if node.op == "mul":
        return x["a"] * x["b"]
    if node.op == "relu":
        return F.leaky_relu(x["input"], a.negative_slope) if a.negative_slope else torch.relu(x["input"])
    if node.op == "gelu":
        return F.gelu(x["input"])
    if node.op == "sigmoid":
        return torch.sigmoid(x["input"])
    if node.op == "tanh":
        return torch.tanh(x["input"])
    if node.op == "swish":
        return x["input"] * torch.sigmoid((a.swish_beta or 1.0) * x["input"])
    if node.op == "reduction":
        src = x["input"].abs() if a.mode == "AMAX" else x["input"]
        axes = [d for d, (o, s) in enumerate(zip(a.dims, src.shape)) if o == 1 and s != 1]
        if not axes:
            return src.clone()
        return src.amax(dim=axes, keepdim=True) if a.mode == "AMAX" else src.sum(dim=axes, keepdim=True)
    if node.op == "sdpa":
        q, k, v = x["q"], x["k"], x["v"]
        scale = a.attn_scale if a.attn_scale is not None else q.shape[-1] ** -0.5
        if exact:
            return _sdpa(q, k, v, scale, a.causal)
        return F.scaled_dot_product_attention(q, k, v, is_causal=a.causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    raise TuningError(f"node {i}: no reference for op {node.op!r}")  # spec validation makes this unreachable


def output_errors(spec: GraphSpec, outputs: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Normalised max error per output (``inf`` for NaN/inf in the output)."""
    errs = {}
    for name in spec.outputs:
        out = outputs[name].to(torch.float32)
        ref = reference[name].to(device=out.device, dtype=torch.float32)
        if not torch.isfinite(out).all():
            errs[name] = math.inf
            continue
        scale = max(float(ref.abs().max()), 1e-6)
        errs[name] = float((out - ref).abs().max()) / scale
    return errs


def compare_outputs(spec: GraphSpec, outputs: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The worst normalised error over the outputs; raise :class:`TuningError` when any exceeds its tolerance."""
    errs = output_errors(spec, outputs, reference)
    for name, err in errs.items():
        tol = TOLERANCE[spec.outputs[name].dtype]
        if not err <= tol:
            raise TuningError(f"output {name!r}: normalised max error {err:.3g} exceeds tolerance {tol:g}")
    return max(errs.values())
