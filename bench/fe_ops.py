"""A transformer block's forward + backward through FE's PyTorch ops at 8 sequence lengths no process has seen.

    python bench/fe_ops.py            # needs a GPU and the server stack; writes bench/results/fe_ops.json

The block: ``cudnn.ops.norm.layer_norm`` → QKV projection → ``cudnn.sdpa_torch`` (causal, bf16, 16 heads of 128)
→ output projection + residual, then ``backward``: four cuDNN graphs per length (norm and attention, forward and
backward). Every variant runs in a fresh process with ``CUDA_CACHE_DISABLE=1``; per length it times the first
finished step (wall, synchronized: what a new shape costs) and the steady step (median of 50 CUDA-event timings
of the eager step after 10 warm-ups: a step is milliseconds, and FE's norm ops copy their epsilon from the host
per call, so the whole step cannot be captured in a CUDA graph). Variants:

- ``fe``: FE alone (no plancache);
- ``capture``: plancache installed in normal mode against a live server: every graph misses, FE builds it and
  its spec is registered (and counted into a capture file, ``PLANCACHE_CAPTURE``); every registered miss is then
  autotuned (all in one process; one that fails or crashes it, and those a crash left, again in a process each)
  and published signed;
- ``served``: a fresh strict-mode process: every graph from the server, one resolve per graph when it is built;
- ``served_warm``: the same, warm-started from the capture file (``PLANCACHE_WARM``): every graph's plan fetched
  and verified in one resolve at install, in the background; each graph built then loads its own, with no request;
- ``torch_cudnn`` / ``torch_flash``: ``F.layer_norm`` and PyTorch's native ``F.scaled_dot_product_attention``
  under the cuDNN or the flash backend (no plancache, no FE provider).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = [384, 640, 896, 1152, 1408, 1664, 1920, 2176]
BATCH, HEADS, HEAD_DIM = 2, 16, 128


def _block(variant: str) -> Any:
    import torch
    import torch.nn.functional as F

    hidden = HEADS * HEAD_DIM
    gen = torch.Generator(device="cuda").manual_seed(0)
    w_qkv = (torch.randn(hidden, 3 * hidden, device="cuda", generator=gen) * hidden ** -0.5).bfloat16().requires_grad_()
    w_o = (torch.randn(hidden, hidden, device="cuda", generator=gen) * hidden ** -0.5).bfloat16().requires_grad_()
    gamma = torch.ones(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    beta = torch.zeros(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step(x: torch.Tensor, dy: torch.Tensor) -> None:
        if variant.startswith("torch"):
            h = F.layer_norm(x, (hidden,), gamma, beta, 1e-5)
        else:
            from cudnn.ops.norm import layer_norm

            h = layer_norm(x, (hidden,), gamma, beta, 1e-5)
        b, s, _ = x.shape
        q, k, v = (h @ w_qkv).view(b, s, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)
        if variant.startswith("torch"):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backend = SDPBackend.CUDNN_ATTENTION if variant == "torch_cudnn" else SDPBackend.FLASH_ATTENTION
            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            import cudnn

            o, _ = cudnn.sdpa_torch(q, k, v, is_causal=True, return_lse=True)
        y = x + o.transpose(1, 2).reshape(b, s, hidden) @ w_o
        y.backward(dy)

    return step, hidden


def child(variant: str, server: str, token: str | None, trusted: str | None, cache: str | None, mode: str) -> None:
    t_start = time.perf_counter()
    import torch

    pc = None
    if variant in ("capture", "served", "served_warm"):
        import plancache.torch
        from plancache.client import PlanCache

        pc = plancache.torch.install(PlanCache(server, token=token, trusted_keys=trusted, cache_dir=cache, mode=mode),
                                     sdpa_route=False)
    from tests.gpu_util import median_ms

    step, hidden = _block(variant)
    out: dict[str, Any] = {"variant": variant, "import_ms": (time.perf_counter() - t_start) * 1e3, "lengths": {}}
    for s in LENGTHS:
        gen = torch.Generator(device="cuda").manual_seed(s)
        x = torch.randn(BATCH, s, hidden, device="cuda", generator=gen).bfloat16().requires_grad_()
        dy = torch.randn(BATCH, s, hidden, device="cuda", generator=gen).bfloat16()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(x, dy)
        torch.cuda.synchronize()
        first_ms = (time.perf_counter() - t0) * 1e3
        out["lengths"][s] = {"first_ms": first_ms, "steady_ms": median_ms(lambda x=x, dy=dy: step(x, dy))}
    if pc is not None:
        out["stats"] = pc.stats().as_dict()
        pc.close()
    print(json.dumps(out))


def _run(*args: str, settings: dict[str, str] | None = None) -> dict[str, Any]:
    """A child with ``args``; ``settings``: its only ``PLANCACHE_*`` variables."""
    from tests.gpu_util import run_fresh

    return run_fresh([str(Path(__file__)), *args], settings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--server", default="")
    parser.add_argument("--token")
    parser.add_argument("--trusted")
    parser.add_argument("--cache")
    parser.add_argument("--mode", default="normal")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fe_ops.json")
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.server, args.token, args.trusted, args.cache, args.mode)

    import tempfile

    from plancache.signing import Signer, keygen
    from tests.gpu_util import tune_misses
    from tests.live_server import LiveServer

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        priv, _, _ = keygen(root / "keys")
        signer = Signer.from_file(priv)
        for variant in ("fe", "torch_cudnn", "torch_flash"):
            results[variant] = _run("--child", variant)
        with LiveServer(root / "server") as srv:
            common = ["--server", srv.url, "--token", srv.token("reader"), "--trusted", str(root / "keys")]
            captured = {"PLANCACHE_CAPTURE": str(root / "capture.json")}
            results["capture"] = _run("--child", "capture", *common, "--cache", str(root / "c1"), settings=captured)
            t0 = time.perf_counter()
            tuned, failed = tune_misses(srv, root, signer)
            for key, why in failed.items():
                print(f"tuning {key[:12]} failed: {why}")
            results["tuning"] = {"graphs": tuned, "seconds": time.perf_counter() - t0}
            results["served"] = _run("--child", "served", *common, "--cache", str(root / "c2"), "--mode", "strict")
            before = srv.requests["/v1/plans/resolve"]
            results["served_warm"] = _run("--child", "served_warm", *common, "--cache", str(root / "c3"), "--mode",
                                          "strict", settings={"PLANCACHE_WARM": captured["PLANCACHE_CAPTURE"]})
            results["served_warm"]["resolves"] = srv.requests["/v1/plans/resolve"] - before
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"{'seq':>6} | {'first step ms: FE':>18} {'served':>8} {'served, warm':>13} {'torch cuDNN':>12} {'flash':>7} | "
          f"{'steady ms: FE':>14} {'served':>8} {'torch cuDNN':>12} {'flash':>7}")
    for s in LENGTHS:
        row = [results[v]["lengths"][str(s)] for v in ("fe", "served", "served_warm", "torch_cudnn", "torch_flash")]
        print(f"{s:>6} | {row[0]['first_ms']:>18.1f} {row[1]['first_ms']:>8.1f} {row[2]['first_ms']:>13.1f} "
              f"{row[3]['first_ms']:>12.1f} {row[4]['first_ms']:>7.1f} | {row[0]['steady_ms']:>14.3f} "
              f"{row[1]['steady_ms']:>8.3f} {row[3]['steady_ms']:>12.3f} {row[4]['steady_ms']:>7.3f}")
    print(f"tuned {results['tuning']['graphs']} graphs in {results['tuning']['seconds']:.0f} s; "
          f"served stats {results['served'].get('stats', {}).get('hits')}, "
          f"FE builds {results['served'].get('stats', {}).get('fe_builds')}; served, warm: "
          f"{results['served_warm']['resolves']} resolve(s), stats {results['served_warm'].get('stats', {}).get('hits')}")


if __name__ == "__main__":
    main()
