"""Regenerate the example specs in this folder: ``python examples/generate.py``.

The seed graphs of plancache: fused conv→bias→relu, a matmul epilogue with a
pass-by-value scale, bias, gelu and an AMAX reduction, causal SDPA, and batch variants.
"""

from __future__ import annotations

import json
from pathlib import Path

from plancache.spec import GraphSpec, SpecBuilder, channels_last_strides

HERE = Path(__file__).resolve().parent


def conv_bias_relu(n: int = 32, c: int = 128, hw: int = 56, k: int = 256, rs: int = 3, stride: int = 1,
                   name: str | None = None) -> GraphSpec:
    """bf16 NHWC conv ("same" padding rs//2) + per-channel bias + relu."""
    b = SpecBuilder(io_data_type="bfloat16", name=name or f"conv_bias_relu_n{n}")
    x = b.tensor("X", dim=[n, c, hw, hw], stride=channels_last_strides([n, c, hw, hw]))
    w = b.tensor("W", dim=[k, c, rs, rs], stride=channels_last_strides([k, c, rs, rs]))
    bias = b.tensor("B", dim=[1, k, 1, 1], stride=[k, 1, k, k])
    pad = rs // 2
    y = b.relu(b.bias(b.conv_fprop(x, w, padding=[pad, pad], stride=[stride, stride], dilation=[1, 1]), bias))
    out = (hw + 2 * pad - rs) // stride + 1
    y.set_output(True).set_name("Y").set_stride(channels_last_strides([n, k, out, out]))
    return b.build()


def matmul_epilogue(batch: int = 16, m: int = 512, k: int = 1024, n: int = 512, act: str = "gelu",
                    name: str | None = None) -> GraphSpec:
    """bf16 batched matmul, * alpha (pass-by-value), + bias, gelu/relu, and the AMAX of the result."""
    b = SpecBuilder(io_data_type="bfloat16", name=name or f"matmul_scale_bias_{act}_amax_b{batch}")
    a = b.tensor("A", dim=[batch, m, k])
    w = b.tensor("B", dim=[batch, k, n])
    alpha = b.tensor("alpha", dim=[1, 1, 1], data_type="float32", is_pass_by_value=True)
    bias = b.tensor("bias", dim=[1, 1, n])
    h = b.bias(b.scale(b.matmul(a, w), alpha), bias)
    y = b.gelu(h) if act == "gelu" else b.relu(h)
    y.set_output(True).set_name("Y")
    b.reduction(y, mode="AMAX", dims=[1, 1, 1]).set_output(True).set_name("amax")
    return b.build()


def sdpa_causal(batch: int = 4, heads: int = 16, seq: int = 1024, d: int = 64, kv_heads: int | None = None) -> GraphSpec:
    """bf16 causal SDPA inference, BSHD physical layout, optional GQA."""
    kvh = kv_heads or heads
    b = SpecBuilder(io_data_type="bfloat16", name=f"sdpa_causal_b{batch}_h{heads}_kv{kvh}_s{seq}_d{d}")

    def bshd(h: int) -> list[int]:
        return [seq * h * d, d, h * d, 1]

    q = b.tensor("q", dim=[batch, heads, seq, d], stride=bshd(heads))
    k = b.tensor("k", dim=[batch, kvh, seq, d], stride=bshd(kvh))
    v = b.tensor("v", dim=[batch, kvh, seq, d], stride=bshd(kvh))
    o = b.sdpa(q, k, v, attn_scale=d ** -0.5, causal=True)
    o.set_output(True).set_name("O").set_stride(bshd(heads))
    return b.build()


EXAMPLES = {
    "conv_bias_relu": conv_bias_relu(),
    "matmul_scale_bias_gelu_amax": matmul_epilogue(),
    "sdpa_causal": sdpa_causal(),
    "conv_bias_relu_n8": conv_bias_relu(n=8),
    "conv_bias_relu_n16": conv_bias_relu(n=16),
    "matmul_scale_bias_relu_amax_b4": matmul_epilogue(batch=4, act="relu"),
    "sdpa_causal_s512": sdpa_causal(seq=512),
}


if __name__ == "__main__":
    for name, spec in EXAMPLES.items():
        (HERE / f"{name}.json").write_text(json.dumps(spec.to_json(), indent=2) + "\n")
        print(f"{name}.json  {spec.graph_key}")
