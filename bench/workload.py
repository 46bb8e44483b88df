"""The start-up benchmark workload: 49 distinct graphs a real fleet would load at process start.

- every distinct conv layer of ResNet-50 at batch 32 (bf16 NHWC, each with bias+relu; the
  3-channel stem is padded to 8 channels, as NHWC tensor-core kernels want);
- transformer matmul epilogues (scale, bias, gelu/relu, AMAX) for hidden sizes 1024–8192 at
  2048 tokens: QKV, attention out, MLP up (gelu), MLP down (relu);
- causal SDPA (d=128) at sequence lengths 512–4096 with 32 query heads and 32/8/4 KV heads.
"""

from __future__ import annotations

from examples.generate import conv_bias_relu, matmul_epilogue, sdpa_causal
from plancache.spec import GraphSpec

# (in_channels, out_channels, spatial size of the input, kernel, stride) of each distinct ResNet-50 conv
RESNET50_CONVS = [
    (8, 64, 224, 7, 2),                                                          # stem (3 channels padded to 8)
    (64, 64, 56, 1, 1), (64, 64, 56, 3, 1), (64, 256, 56, 1, 1), (256, 64, 56, 1, 1),
    (256, 128, 56, 1, 1), (128, 128, 56, 3, 2), (128, 512, 28, 1, 1), (256, 512, 56, 1, 2),
    (512, 128, 28, 1, 1), (128, 128, 28, 3, 1),
    (512, 256, 28, 1, 1), (256, 256, 28, 3, 2), (256, 1024, 14, 1, 1), (512, 1024, 28, 1, 2),
    (1024, 256, 14, 1, 1), (256, 256, 14, 3, 1),
    (1024, 512, 14, 1, 1), (512, 512, 14, 3, 2), (512, 2048, 7, 1, 1), (1024, 2048, 14, 1, 2),
    (2048, 512, 7, 1, 1), (512, 512, 7, 3, 1),
]
HIDDEN_SIZES = [1024, 2048, 4096, 8192]
TOKENS = 2048
SDPA_SEQ = [512, 1024, 2048, 4096]
SDPA_KV_HEADS = [32, 8, 4]


def resnet50_convs(batch: int = 32) -> list[GraphSpec]:
    return [conv_bias_relu(n=batch, c=c, hw=hw, k=k, rs=rs, stride=s, name=f"resnet50_c{c}_k{k}_hw{hw}_r{rs}_s{s}")
            for c, k, hw, rs, s in RESNET50_CONVS]


def transformer_epilogues() -> list[GraphSpec]:
    specs = []
    for h in HIDDEN_SIZES:
        for kind, k, n, act in (("qkv", h, 3 * h, "relu"), ("out", h, h, "relu"), ("up", h, 4 * h, "gelu"),
                                ("down", 4 * h, h, "relu")):
            if h == 8192 and kind in ("qkv", "out"):
                continue  # keep the workload's memory and tuning time bounded; up/down cover h=8192
            specs.append(matmul_epilogue(batch=1, m=TOKENS, k=k, n=n, act=act, name=f"mlp_h{h}_{kind}_{act}"))
    return specs


def attention() -> list[GraphSpec]:
    return [sdpa_causal(batch=2, heads=32, kv_heads=kvh, seq=s, d=128) for s in SDPA_SEQ for kvh in SDPA_KV_HEADS]


def workload() -> list[GraphSpec]:
    """All graphs, distinct keys guaranteed."""
    specs = resnet50_convs() + transformer_epilogues() + attention()
    keys = [s.graph_key for s in specs]
    assert len(set(keys)) == len(keys), "workload graphs must be distinct"
    return specs


if __name__ == "__main__":
    for s in workload():
        print(s.graph_key[:12], s.name)


def family(name: str) -> str:
    """``conv``, ``matmul`` or ``sdpa``: the family of a workload graph, by its name."""
    return "conv" if name.startswith("resnet") else "matmul" if name.startswith("mlp") else "sdpa"
