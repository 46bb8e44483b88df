"""Run in a fresh process by tests/integration/test_fe_ops_gpu.py and bench/fe_ops.py: FE's own PyTorch-facing build
paths with ``plancache.torch.install`` -- ``cudnn.sdpa_torch`` forward + backward (dense causal, GQA, padded,
THD varlen, bottom-right causal, sliding window), ``cudnn.ops.norm`` layer_norm / rms_norm forward + backward, a
``cudnn.Graph`` block, a ``@cudnn.graph_cache`` function, ``F.scaled_dot_product_attention`` under the cuDNN
backend -- each checked against a float32 torch reference (normalised max error per output).

usage: python -m tests.fe_ops_gpu_child --server URL --token T --trusted DIR --cache DIR --mode MODE [PATH ...]
prints one JSON line: {"paths": {name: {"errors": {...}, "first_ms": ..., "op_ms": ..., "error": ...}}, "stats": ...}
(``first_ms``: the whole path, its inputs and reference included; ``op_ms``: FE's op alone, where measured)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any

T0 = time.perf_counter()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DEV = torch.device("cuda", 0)
BF16 = torch.bfloat16
#: A path's own op alone, forward + backward, synchronised wall ms (its inputs and float32 reference left out).
OP_MS: dict[str, float] = {}


def _err(out: torch.Tensor, ref: torch.Tensor, keep: torch.Tensor | None = None) -> float:
    out, ref = out.detach().float(), ref.detach().float()
    if keep is not None:
        out, ref = out[keep], ref[keep]
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def _mask(b: int, sq: int, skv: int, *, causal: bool = False, bottom_right: bool = False, left: int = -1,
          lens_q: list[int] | None = None, lens_kv: list[int] | None = None) -> torch.Tensor:
    """FE's attention mask, [b, 1, sq, skv] (True: the key is seen); see plancache.gpu.families' mask notes."""
    i = torch.arange(sq, device=DEV)[:, None]
    j = torch.arange(skv, device=DEV)[None, :]
    masks = []
    for n in range(b):
        lq = lens_q[n] if lens_q else sq
        lkv = lens_kv[n] if lens_kv else skv
        shift = (lkv - lq) if bottom_right else 0
        keep = (i < lq) & (j < lkv)
        if causal:
            keep &= j <= i + shift
        if left >= 0:
            keep &= j > i + shift - left
        masks.append(keep)
    return torch.stack(masks)[:, None]


def _attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, mask: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, ...]:
    """float32 O, dQ, dK, dV of masked attention (GQA by repetition); rows seeing no key give O = 0."""
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    s = (qf @ kf.repeat_interleave(rep, 1).transpose(-1, -2)) * scale
    p = torch.softmax(s.masked_fill(~mask, -math.inf), -1).nan_to_num(0.0)
    o = p @ vf.repeat_interleave(rep, 1)
    o.backward(do.float())
    assert qf.grad is not None and kf.grad is not None and vf.grad is not None
    return o.detach(), qf.grad, kf.grad, vf.grad


def _qkv(b: int, hq: int, hk: int, sq: int, skv: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    q, k, v = (torch.randn(*shape, device=DEV, generator=g).to(BF16).requires_grad_()
               for shape in ((b, hq, sq, d), (b, hk, skv, d), (b, hk, skv, d)))
    do = torch.randn(b, hq, sq, d, device=DEV, generator=g).to(BF16)
    return q, k, v, do


def _sdpa_case(b: int = 2, hq: int = 8, hk: int = 8, sq: int = 256, skv: int = 256, d: int = 64, *,
               causal: bool = False, bottom_right: bool = False, left: int = -1, padded: bool = False,
               seed: int = 1) -> Callable[[], dict[str, float]]:
    import cudnn

    def run() -> dict[str, float]:
        q, k, v, do = _qkv(b, hq, hk, sq, skv, d, seed)
        scale = d ** -0.5
        extra: dict[str, Any] = {}
        lens_q = lens_kv = None
        if padded:
            lens_q, lens_kv = [sq, sq // 2 + 3][:b], [skv, skv // 2 + 7][:b]
            extra = dict(seq_len_q=torch.tensor(lens_q, device=DEV, dtype=torch.int32).view(b, 1, 1, 1),
                         seq_len_kv=torch.tensor(lens_kv, device=DEV, dtype=torch.int32).view(b, 1, 1, 1))
        if padded:  # FE's autograd has no padded dense backward: the forward alone, as FE serves it
            q, k, v = (t.detach() for t in (q, k, v))
        o, _ = cudnn.sdpa_torch(q, k, v, scale=scale, is_causal=causal, causal_bottom_right=bottom_right,
                                window_left=left, return_lse=True, **extra)  # autograd needs the stats
        if not padded:
            o.backward(do)
        mask = _mask(b, sq, skv, causal=causal, bottom_right=bottom_right, left=left, lens_q=lens_q, lens_kv=lens_kv)
        ro, rdq, rdk, rdv = _attention_ref(q, k, v, do, mask, scale)
        rows = mask.any(-1, keepdim=True).expand_as(ro)  # rows that see some key (padding rows are don't-care)
        keys = torch.ones_like(rdk, dtype=torch.bool)
        if lens_kv:
            keys = torch.arange(skv, device=DEV)[None, None, :, None] < torch.tensor(lens_kv, device=DEV)[:, None, None,
                                                                                                        None]
            keys = keys.expand_as(rdk)
        if padded:
            return {"O": _err(o, ro, rows)}
        assert q.grad is not None and k.grad is not None and v.grad is not None
        return {"O": _err(o, ro, rows), "dQ": _err(q.grad, rdq, rows), "dK": _err(k.grad, rdk, keys),
                "dV": _err(v.grad, rdv, keys)}

    return run


def _sdpa_thd(seed: int = 2) -> dict[str, float]:
    import cudnn

    lens, h, d = [192, 64, 128], 8, 64
    total, b = sum(lens), len(lens)
    g = torch.Generator(device=DEV).manual_seed(seed)
    q, k, v = (torch.randn(total, h, d, device=DEV, generator=g).to(BF16).requires_grad_() for _ in range(3))
    do = torch.randn(total, h, d, device=DEV, generator=g).to(BF16)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV, dtype=torch.int32)
    scale = d ** -0.5
    o, _ = cudnn.sdpa_torch(q, k, v, scale=scale, is_causal=True, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                            max_seqlen_q=max(lens), max_seqlen_kv=max(lens), return_lse=True)
    o.backward(do)
    errs: dict[str, float] = {}
    outs: dict[str, list[torch.Tensor]] = {"O": [], "dQ": [], "dK": [], "dV": []}
    refs: dict[str, list[torch.Tensor]] = {"O": [], "dQ": [], "dK": [], "dV": []}
    for n in range(b):
        sl = slice(int(cu[n]), int(cu[n + 1]))
        part = [t[sl].transpose(0, 1)[None] for t in (q, k, v)]
        ro, rdq, rdk, rdv = _attention_ref(*part, do[sl].transpose(0, 1)[None],
                                           _mask(1, lens[n], lens[n], causal=True), scale)
        assert q.grad is not None and k.grad is not None and v.grad is not None
        for name, mine, ref in (("O", o, ro), ("dQ", q.grad, rdq), ("dK", k.grad, rdk), ("dV", v.grad, rdv)):
            outs[name].append(mine[sl].transpose(0, 1)[None].flatten())
            refs[name].append(ref.flatten())
    for name in outs:
        errs[name] = _err(torch.cat(outs[name]), torch.cat(refs[name]))
    return errs


def _norm(kind: str, rows: int = 4096, hidden: int = 1024, seed: int = 3) -> Callable[[], dict[str, float]]:
    def run() -> dict[str, float]:
        from cudnn.ops.norm import layer_norm, rms_norm

        g = torch.Generator(device=DEV).manual_seed(seed)
        x = torch.randn(rows, hidden, device=DEV, generator=g).to(BF16).requires_grad_()
        w = (1 + 0.1 * torch.randn(hidden, device=DEV, generator=g)).to(BF16).requires_grad_()
        b = (0.1 * torch.randn(hidden, device=DEV, generator=g)).to(BF16).requires_grad_()
        dy = torch.randn(rows, hidden, device=DEV, generator=g).to(BF16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = layer_norm(x, (hidden,), w, b, 1e-5) if kind == "layer_norm" else rms_norm(x, w, None, 1e-5)
        y.backward(dy)
        torch.cuda.synchronize()
        OP_MS[kind] = (time.perf_counter() - t0) * 1e3
        xf, wf, bf = (t.detach().float().requires_grad_() for t in (x, w, b))
        if kind == "layer_norm":
            ref = F.layer_norm(xf, (hidden,), wf, bf, 1e-5)
        else:
            ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * wf
        ref.backward(dy.float())
        assert x.grad is not None and w.grad is not None and xf.grad is not None and wf.grad is not None
        errs = {"Y": _err(y, ref), "dX": _err(x.grad, xf.grad), "dW": _err(w.grad, wf.grad)}
        if kind == "layer_norm":
            assert b.grad is not None and bf.grad is not None
            errs["dB"] = _err(b.grad, bf.grad)
        return errs

    return run


def _handles_in_stock() -> int:
    """cuDNN handles a warm start made ahead for FE's norm ops that no thread took
    (:func:`plancache.client.fe_ops.stock_handles`)."""
    from plancache.client import fe_ops

    return sum(len(handles) for handles in fe_ops._stock.values())


def _whole() -> int:
    """Graphs FE's norm ops hold as served plans loaded on their own (:class:`plancache.client.fe_ops.Loaded`)."""
    from plancache.client.fe_ops import Loaded

    held = 0
    for name in ("cudnn.ops.norm.layernorm", "cudnn.ops.norm.rmsnorm"):
        module = sys.modules.get(name)
        for cache in (getattr(module, "_fprop_cache", None), getattr(module, "_bprop_cache", None)):
            held += sum(isinstance(graph, Loaded) for graph, _ in getattr(cache, "_entries", {}).values())
    return held


def _cudnn_graph_block(seed: int = 4) -> dict[str, float]:
    import cudnn

    g = torch.Generator(device=DEV).manual_seed(seed)
    a = torch.randn(4, 256, 512, device=DEV, generator=g).to(BF16)
    w = torch.randn(4, 512, 384, device=DEV, generator=g).to(BF16)
    with cudnn.Graph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                     compute_data_type=cudnn.data_type.FLOAT, handle="auto") as graph:
        y = graph.matmul(name="mm", A=a, B=w)
        r = graph.relu(name="act", input=y)
        r.set_output(True).set_data_type(cudnn.data_type.BFLOAT16)
    graph.set_io_tuples(["mm::A", "mm::B"], [r.get_name()])
    out = graph(a, w)
    return {"Y": _err(out, torch.relu(a.float() @ w.float()))}


def _graph_cache_fn(seed: int = 5) -> dict[str, float]:
    import cudnn

    handle = cudnn.create_handle()
    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)

    @cudnn.graph_cache(key_fn=lambda m, n, k: (m, n, k))
    def matmul_gelu(m: int, n: int, k: int) -> tuple[Any, Any, Any, Any]:
        gr = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                           compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        a = gr.tensor(name="A", dim=[1, m, k], stride=[m * k, k, 1], data_type=cudnn.data_type.BFLOAT16)
        b = gr.tensor(name="B", dim=[1, k, n], stride=[k * n, n, 1], data_type=cudnn.data_type.BFLOAT16)
        y = gr.gelu(gr.matmul(a, b, name="mm"), name="gelu")
        y.set_output(True).set_data_type(cudnn.data_type.BFLOAT16)
        gr.build([cudnn.heur_mode.A])
        return gr, a, b, y

    gr, ta, tb, ty = matmul_gelu(512, 256, 384)
    g = torch.Generator(device=DEV).manual_seed(seed)
    a = torch.randn(1, 512, 384, device=DEV, generator=g).to(BF16)
    b = torch.randn(1, 384, 256, device=DEV, generator=g).to(BF16)
    y = torch.empty(1, 512, 256, device=DEV, dtype=BF16)
    ws = torch.empty(max(gr.get_workspace_size(), 1), device=DEV, dtype=torch.uint8)
    gr.execute({ta: a, tb: b, ty: y}, ws, handle=handle)
    torch.cuda.synchronize()
    assert matmul_gelu(512, 256, 384)[0] is gr  # the decorator's cache
    return {"Y": _err(y, F.gelu(a.float() @ b.float()))}


def _torch_sdpa(seed: int = 6) -> dict[str, float]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from plancache.client import sdpa

    q, k, v, do = _qkv(2, 8, 8, 384, 384, 64, seed)
    before = sdpa.stats()
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.backward(do)
    after = sdpa.stats()
    served = {k: after.get(k, 0) - before.get(k, 0) for k in ("fwd", "bwd")}
    if not served["fwd"] or not served["bwd"]:
        raise RuntimeError(f"plancache's attention route did not serve the call (torch {torch.__version__}, "
                           f"counters {after})")
    ro, rdq, rdk, rdv = _attention_ref(q, k, v, do, _mask(2, 384, 384, causal=True), 64 ** -0.5)
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return {"O": _err(o, ro), "dQ": _err(q.grad, rdq), "dK": _err(k.grad, rdk), "dV": _err(v.grad, rdv),
            "route_fwd_calls": served["fwd"], "route_bwd_calls": served["bwd"]}


def _cuda_graph_replay(seed: int = 7) -> dict[str, float]:
    """A served causal sdpa_torch forward + backward captured in a CUDA graph and replayed on new data."""
    import cudnn

    q, k, v, do = _qkv(2, 8, 8, 256, 256, 64, seed)
    static = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sdo = do.clone()

    def step() -> torch.Tensor:
        for t in static:
            t.grad = None
        o, _ = cudnn.sdpa_torch(*static, scale=0.125, is_causal=True, return_lse=True)
        o.backward(sdo)
        return o

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up outside capture: the graphs are built (served) here
    torch.cuda.current_stream().wait_stream(s)
    cg = torch.cuda.CUDAGraph()
    for t in static:
        t.grad = None
    with torch.cuda.graph(cg):
        o, _ = cudnn.sdpa_torch(*static, scale=0.125, is_causal=True, return_lse=True)
        o.backward(sdo)
    q2, k2, v2, do2 = _qkv(2, 8, 8, 256, 256, 64, seed + 100)
    with torch.no_grad():
        for dst, src in zip(static, (q2, k2, v2)):
            dst.copy_(src)
        sdo.copy_(do2)
    cg.replay()
    torch.cuda.synchronize()
    ro, rdq, _, _ = _attention_ref(q2, k2, v2, do2, _mask(2, 256, 256, causal=True), 0.125)
    assert static[0].grad is not None
    return {"O": _err(o, ro), "dQ": _err(static[0].grad, rdq)}


PATHS: dict[str, Callable[[], dict[str, float]]] = {
    "sdpa_causal": _sdpa_case(causal=True),
    "sdpa_gqa": _sdpa_case(hq=8, hk=2, causal=True, seed=11),
    "sdpa_padded": _sdpa_case(padded=True, seed=12),
    "sdpa_thd": _sdpa_thd,
    "sdpa_bottom_right": _sdpa_case(sq=128, skv=320, causal=True, bottom_right=True, seed=13),
    "sdpa_window": _sdpa_case(causal=True, left=64, seed=14),
    "layer_norm": _norm("layer_norm"),
    "rms_norm": _norm("rms_norm"),
    "cudnn_graph": _cudnn_graph_block,
    "graph_cache": _graph_cache_fn,
    "torch_sdpa": _torch_sdpa,
    "cuda_graph_replay": _cuda_graph_replay,
}


def tune(out: str, *spec_paths: str) -> None:
    """Autotune spec documents one after another, writing each one's ``KEY.blob`` and ``KEY.meta.json`` (the
    unsigned record) into ``out`` as it is done; one that fails is reported on stderr and left (the caller tunes
    it again in a process of its own, as it does those a crash left). Exits 1 when any failed."""
    import sys
    import traceback
    from pathlib import Path

    from plancache import gpu
    from plancache.spec import parse_spec

    failures = 0
    for spec_path in spec_paths:
        try:
            spec = parse_spec(Path(spec_path).read_text())
            t = gpu.autotune(spec, warmup=2, repeats=5)
        except Exception:  # noqa: BLE001 - the next spec is tuned all the same
            failures += 1
            print(f"tuning {spec_path} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            continue
        (Path(out) / f"{spec.graph_key}.blob").write_bytes(t.blob)
        (Path(out) / f"{spec.graph_key}.meta.json").write_text(t.to_meta(spec.graph_key, "fe-ops-test").model_dump_json())
        print(json.dumps({"graph_key": spec.graph_key, "winner_ms": t.winner_median_ms, "candidates": len(t.candidates)}),
              flush=True)
    if failures:
        raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tune", nargs="+", metavar="OUT SPEC", help="autotune SPEC files into OUT and exit")
    parser.add_argument("--server", default="")
    parser.add_argument("--token")
    parser.add_argument("--trusted")
    parser.add_argument("--cache")
    parser.add_argument("--mode", default="normal")
    parser.add_argument("--no-plancache", action="store_true", help="FE alone (the baseline)")
    parser.add_argument("paths", nargs="*")
    args = parser.parse_args()
    if args.tune:
        if len(args.tune) < 2:
            parser.error("--tune takes a folder and at least one spec file")
        return tune(*args.tune)
    import plancache.torch
    from plancache.client import PlanCache

    cache = None
    if not args.no_plancache:
        cache = plancache.torch.install(PlanCache(args.server, token=args.token, trusted_keys=args.trusted,
                                                  cache_dir=args.cache, mode=args.mode))
    else:
        import cudnn.torch

        cudnn.torch.install_sdpa_overrides() if hasattr(cudnn.torch, "install_sdpa_overrides") else None
    ready_ms = (time.perf_counter() - T0) * 1e3
    out: dict[str, Any] = {}
    for name in args.paths or list(PATHS):
        before = cache.stats() if cache is not None else None
        whole = _whole()
        t0 = time.perf_counter()
        try:
            errs = PATHS[name]()
            torch.cuda.synchronize()
            out[name] = {"errors": errs, "first_ms": (time.perf_counter() - t0) * 1e3}
            if name in OP_MS:
                out[name]["op_ms"] = OP_MS[name]
        except Exception as exc:  # noqa: BLE001 - reported per path; the test asserts on it
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        if cache is not None and before is not None:
            after = cache.stats()
            out[name]["hits"] = {k: v - before.hits.get(k, 0) for k, v in after.hits.items()
                                 if v != before.hits.get(k, 0)}
            out[name]["fe_builds"] = {k: v - before.fe_builds.get(k, 0) for k, v in after.fe_builds.items()
                                      if v != before.fe_builds.get(k, 0)}
            out[name]["whole"] = _whole() - whole
            out[name]["deserialize_ms"] = (after.deserialize_seconds - before.deserialize_seconds) * 1e3
    print(json.dumps({"paths": out, "stats": cache.stats().as_dict() if cache is not None else None,
                      "ready_ms": ready_ms, "torch": torch.__version__,
                      "sdpa_route": plancache.torch.sdpa_stats(), "handles_in_stock": _handles_in_stock()}))
    if cache is not None:
        cache.close()


if __name__ == "__main__":
    main()
