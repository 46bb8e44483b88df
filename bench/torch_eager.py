"""The PyTorch eager equivalent of a spec, in its native dtype, for the plan-quality comparison.

conv2d / matmul / pointwise ops in the spec's io dtype (cudnn.benchmark=True for convs), and
``F.scaled_dot_product_attention`` (flash / cuDNN backends as torch picks) for SDPA.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from plancache.spec import GraphSpec


def eager(spec: GraphSpec, inputs: dict[str, torch.Tensor]) -> Callable[[], dict[str, torch.Tensor]]:
    """A closure running ``spec`` with torch ops on ``inputs``; returns the outputs."""
    torch.backends.cudnn.benchmark = True

    def run() -> dict[str, torch.Tensor]:
        env = dict(inputs)
        for i, node in enumerate(spec.nodes):
            a = spec.node_attrs(i)
            x = {p: env[n] for p, n in node.inputs.items()}
            if node.op == "conv_fprop":
                y = F.conv2d(x["image"], x["weight"], padding=a.padding or 0, stride=a.stride or 1, dilation=a.dilation or 1)
            elif node.op == "matmul":
                y = torch.matmul(x["A"], x["B"])
            elif node.op in ("bias", "add"):
                y = x.get("input", x.get("a")) + x.get("bias", x.get("b"))
            elif node.op in ("scale", "mul"):
                other = x.get("scale", x.get("b"))
                y = x.get("input", x.get("a")) * (float(other) if other.device.type == "cpu" else other)
            elif node.op == "relu":
                y = torch.relu(x["input"])
            elif node.op == "gelu":
                y = F.gelu(x["input"])
            elif node.op == "sigmoid":
                y = torch.sigmoid(x["input"])
            elif node.op == "tanh":
                y = torch.tanh(x["input"])
            elif node.op == "swish":
                y = F.silu(x["input"])
            elif node.op == "reduction":
                y = x["input"].abs().amax() if a.mode == "AMAX" else x["input"].sum()
            elif node.op == "sdpa":
                q, k, v = x["q"], x["k"], x["v"]
                y = F.scaled_dot_product_attention(q, k, v, is_causal=a.causal, scale=a.attn_scale,
                                                   enable_gqa=q.shape[1] != k.shape[1])
            else:
                raise ValueError(f"no eager equivalent for {node.op}")
            (tname,) = node.outputs.values()
            env[tname] = y
        return {n: env[n] for n in spec.outputs}

    return run
