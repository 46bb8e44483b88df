"""Which calls of ``F.scaled_dot_product_attention`` reach FE's SDPA provider on this torch (needs a GPU).

    python bench/sdpa_route.py

After ``plancache.torch.install``, runs a causal bf16 forward + backward (2, 16, 1024, 128) with torch's default
backend choice and under ``sdpa_kernel([SDPBackend.CUDNN_ATTENTION])``, and prints the provider's call counters
for each (``cudnn.torch.calls``) as one JSON line.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def main() -> None:
    import cudnn.torch

    import plancache.torch
    from plancache.client import PlanCache

    plancache.torch.install(PlanCache("", cache_dir=None, trusted_keys=[]))
    q, k, v = (torch.randn(2, 16, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    report: dict[str, object] = {"torch": torch.__version__, "route": plancache.torch.installed_route(),
                                 "has_varlen": hasattr(torch.nn.attention, "varlen")}
    for label, backends in (("default", None), ("cudnn_backend", [SDPBackend.CUDNN_ATTENTION])):
        before = dict(cudnn.torch.calls)
        if backends is None:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        else:
            with sdpa_kernel(backends):
                F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        torch.cuda.synchronize()
        report[label] = {k: cudnn.torch.calls[k] - before[k] for k in before if cudnn.torch.calls[k] != before[k]}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
