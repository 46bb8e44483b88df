"""Build, run and check every example of ``graphs.py`` on a GPU (needs torch with CUDA + cuDNN).

``python examples/fe/run_gpu.py [NAME ...]`` builds each graph (heuristics A, FALLBACK), binds
torch tensors by the names ``graphs.py`` returns -- random data, plus the valid run-time values
that some inputs need (sequence lengths, page tables, ragged offsets, epsilon, fp8 scales) -- runs
it, and compares the outputs with a float32 PyTorch reference. One line per example; exit status
1 if any example fails.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cudnn
import graphs

DEV = "cuda"
TORCH_DTYPE = {
    cudnn.data_type.BFLOAT16: torch.bfloat16,
    cudnn.data_type.HALF: torch.float16,
    cudnn.data_type.FLOAT: torch.float32,
    cudnn.data_type.FP8_E4M3: torch.float8_e4m3fn,
    cudnn.data_type.INT32: torch.int32,
    cudnn.data_type.INT64: torch.int64,
}
FP8_MAX = 448.0


# ---------------------------------------------------------------------------------------------
# buffers
# ---------------------------------------------------------------------------------------------


def alloc(t, fill: float | None = None, device: str | None = None) -> torch.Tensor:
    """A buffer with the tensor's declared dims / strides / dtype (NaN-filled outputs by default)."""
    dims, strides, dtype = t.get_dim(), t.get_stride(), TORCH_DTYPE[t.get_data_type()]
    size = 1 + sum((d - 1) * s for d, s in zip(dims, strides))
    base = torch.empty(size, dtype=dtype, device=device or DEV)
    if fill is not None:
        base.fill_(fill)
    elif dtype.is_floating_point and dtype != torch.float8_e4m3fn:
        base.fill_(float("nan"))
    else:
        base.zero_()
    return base.as_strided(dims, strides)


def randn_like_decl(t, gen, std: float = 1.0) -> torch.Tensor:
    buf = alloc(t, fill=0.0)
    buf.copy_((torch.randn(buf.shape, generator=gen, device=DEV) * std).to(buf.dtype))
    return buf


def quantize_fp8(x: torch.Tensor):
    """Per-tensor e4m3 quantization: (x * scale).to(e4m3), descale = 1 / scale."""
    scale = FP8_MAX / x.abs().max().clamp_min(1e-6)
    return (x * scale).to(torch.float8_e4m3fn), (1.0 / scale).reshape(1).float()


def copy_into(decl, src: torch.Tensor) -> torch.Tensor:
    buf = alloc(decl, fill=0.0)
    buf.copy_(src.to(buf.dtype).reshape(buf.shape))
    return buf


# ---------------------------------------------------------------------------------------------
# references
# ---------------------------------------------------------------------------------------------


def attn_ref(q, k, v, scale, mask=None):
    """float32 attention on logical [b, h, s, d] tensors (GQA by repeating K/V heads).
    Returns O and the natural-log LSE stats [b, h, s_q, 1]."""
    q, k, v = q.float(), k.float(), v.float()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - lse)
    return torch.einsum("bhqk,bhkd->bhqd", p, v), lse


def band_mask(s_q, s_kv, *, bottom_right=False, left=None, right=0):
    i = torch.arange(s_q, device=DEV)[:, None] + (s_kv - s_q if bottom_right else 0)
    j = torch.arange(s_kv, device=DEV)[None, :]
    m = j <= i + right
    if left is not None:
        m &= j > i - left
    return m


def err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max(|ref|, 1): a scale-free error for the pass / fail line."""
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1.0)).item()


# ---------------------------------------------------------------------------------------------
# per example: inputs (name -> buffer) and expected outputs (name -> (float ref, tolerance))
# ---------------------------------------------------------------------------------------------


def prepare(name: str, g, T: dict[str, object], gen):
    bufs, expect = {}, {}

    def rnd(key, std=1.0):
        bufs[key] = randn_like_decl(T[key], gen, std)
        return bufs[key]

    if name == "sdpa_fwd_train":
        q, k, v = rnd("q"), rnd("k"), rnd("v")
        s = q.shape[2]
        o, lse = attn_ref(q, k, v, q.shape[-1] ** -0.5, band_mask(s, s))
        expect = {"o": (o, 2e-2), "stats": (lse, 1e-2)}
    elif name == "sdpa_bwd":
        q, k, v = (rnd(x).float().requires_grad_() for x in ("q", "k", "v"))
        d_o = rnd("dO", 0.1)
        s = q.shape[2]
        o, lse = attn_ref(q, k, v, q.shape[-1] ** -0.5, band_mask(s, s))
        bufs["o"] = copy_into(T["o"], o.detach())
        bufs["stats"] = copy_into(T["stats"], lse.detach())
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), d_o.float())
        expect = {"dQ": (dq, 3e-2), "dK": (dk, 3e-2), "dV": (dv, 3e-2)}
    elif name == "chunked_prefill":
        q, k, v = rnd("q"), rnd("k"), rnd("v")
        o, _ = attn_ref(q, k, v, q.shape[-1] ** -0.5, band_mask(q.shape[2], k.shape[2], bottom_right=True))
        expect = {"o": (o, 2e-2)}
    elif name == "sliding_window":
        q, k, v = rnd("q"), rnd("k"), rnd("v")
        s = q.shape[2]
        window = g.nodes[0].params["diagonal_band_left_bound"]
        o, _ = attn_ref(q, k, v, q.shape[-1] ** -0.5, band_mask(s, s, left=window))
        expect = {"o": (o, 2e-2)}
    elif name == "paged_decode":
        q = rnd("q")
        b, _h_q, _, d = q.shape
        nblk, h_kv, bs, _ = T["k_cache"].get_dim()
        pages = T["page_table_k"].get_dim()[2]
        max_s = pages * bs
        seq_kv = torch.randint(1, max_s + 1, (b,), generator=gen, device=DEV, dtype=torch.int32)
        seq_kv[0] = max_s  # one full sequence
        k_full = torch.randn(b, h_kv, max_s, d, generator=gen, device=DEV)
        v_full = torch.randn(b, h_kv, max_s, d, generator=gen, device=DEV)
        perm = torch.randperm(nblk, generator=gen, device=DEV)[: b * pages].to(torch.int32).reshape(b, pages)
        k_cache, v_cache = alloc(T["k_cache"], 0.0), alloc(T["v_cache"], 0.0)
        for i in range(b):
            for p in range(pages):
                k_cache[perm[i, p]] = k_full[i, :, p * bs : (p + 1) * bs].to(k_cache.dtype)
                v_cache[perm[i, p]] = v_full[i, :, p * bs : (p + 1) * bs].to(v_cache.dtype)
        bufs.update(k_cache=k_cache, v_cache=v_cache)
        bufs["page_table_k"] = copy_into(T["page_table_k"], perm)
        bufs["page_table_v"] = copy_into(T["page_table_v"], perm)
        bufs["seq_len_q"] = copy_into(T["seq_len_q"], torch.ones(b, dtype=torch.int32, device=DEV))
        bufs["seq_len_kv"] = copy_into(T["seq_len_kv"], seq_kv)
        kf, vf = k_full.to(k_cache.dtype), v_full.to(v_cache.dtype)
        mask = (torch.arange(max_s, device=DEV)[None, :] < seq_kv[:, None])[:, None, None, :]
        o, _ = attn_ref(q, kf, vf, d**-0.5, mask)
        expect = {"o": (o, 2e-2)}
    elif name == "varlen_sdpa":
        b, h, max_s, d = T["q"].get_dim()
        seq = torch.randint(1, max_s + 1, (b,), generator=gen, device=DEV, dtype=torch.int32)
        seq[0] = max_s
        total = int(seq.sum())
        cum = torch.zeros(b + 1, dtype=torch.int32, device=DEV)
        cum[1:] = torch.cumsum(seq, 0)
        packed = {x: torch.randn(total, h, d, generator=gen, device=DEV).to(torch.bfloat16) for x in ("q", "k", "v")}
        bufs.update(packed)
        bufs["o"] = torch.full((total, h, d), float("nan"), dtype=torch.bfloat16, device=DEV)
        for key in ("seq_len_q", "seq_len_kv"):
            bufs[key] = copy_into(T[key], seq)
        for key in ("q", "k", "v", "o"):
            bufs[f"{key}_ragged_offset"] = copy_into(T[f"{key}_ragged_offset"], cum * h * d)
        ref = torch.empty(total, h, d, device=DEV)
        for i in range(b):
            lo, hi = int(cum[i]), int(cum[i + 1])
            qi, ki, vi = (packed[x][lo:hi].permute(1, 0, 2)[None] for x in ("q", "k", "v"))
            oi, _ = attn_ref(qi, ki, vi, d**-0.5, band_mask(hi - lo, hi - lo))
            ref[lo:hi] = oi[0].permute(1, 0, 2)
        expect = {"o": (ref, 2e-2)}
    elif name == "fp8_sdpa":
        b, h, s, d = T["q"].get_dim()
        qf, kf, vf = (torch.randn(b, h, s, d, generator=gen, device=DEV) for _ in range(3))
        for key, x in (("q", qf), ("k", kf), ("v", vf)):
            x8, descale = quantize_fp8(x)
            bufs[key] = copy_into(T[key], x8)
            bufs[f"descale_{key}"] = copy_into(T[f"descale_{key}"], descale)
        o, lse = attn_ref(*(bufs[x].float() * bufs[f"descale_{x}"].reshape(()) for x in ("q", "k", "v")), d**-0.5,
                          band_mask(s, s))
        amax_o = o.abs().max()
        bufs["scale_s"] = copy_into(T["scale_s"], torch.tensor([FP8_MAX], device=DEV))
        bufs["descale_s"] = copy_into(T["descale_s"], torch.tensor([1.0 / FP8_MAX], device=DEV))
        scale_o = FP8_MAX / amax_o
        bufs["scale_o"] = copy_into(T["scale_o"], scale_o.reshape(1))
        expect = {"o": (o * scale_o, 0.15), "amax_o": (amax_o.reshape(1, 1, 1, 1), 0.1)}
        if "stats" in T:
            expect["stats"] = (lse, 5e-2)
    elif name == "layernorm_fwd_train":
        x, w, bias = rnd("x"), rnd("scale"), rnd("bias")
        bufs["epsilon"] = torch.full((1, 1, 1, 1), 1e-5, dtype=torch.float32)  # host scalar
        xf = x.float().squeeze(-1).squeeze(-1)
        mean = xf.mean(-1, keepdim=True)
        inv = torch.rsqrt(xf.var(-1, unbiased=False, keepdim=True) + 1e-5)
        y = (xf - mean) * inv * w.float().reshape(1, -1) + bias.float().reshape(1, -1)
        expect = {"y": (y[..., None, None], 2e-2), "mean": (mean[..., None, None], 1e-3), "inv_var": (inv[..., None, None], 1e-3)}
    elif name == "layernorm_bwd":
        x, w, dy = rnd("x"), rnd("scale"), rnd("dy")
        xf = x.float().squeeze(-1).squeeze(-1).requires_grad_()
        wf = w.float().reshape(-1).requires_grad_()
        bf = torch.zeros_like(wf, requires_grad=True)
        mean = xf.detach().mean(-1, keepdim=True)
        inv = torch.rsqrt(xf.detach().var(-1, unbiased=False, keepdim=True) + 1e-5)
        bufs["mean"] = copy_into(T["mean"], mean)
        bufs["inv_var"] = copy_into(T["inv_var"], inv)
        y = F.layer_norm(xf, (xf.shape[-1],), wf, bf, eps=1e-5)
        dx, dw, db = torch.autograd.grad(y, (xf, wf, bf), dy.float().squeeze(-1).squeeze(-1))
        expect = {"dx": (dx[..., None, None], 3e-2), "dscale": (dw.reshape(1, -1, 1, 1), 3e-2),
                  "dbias": (db.reshape(1, -1, 1, 1), 3e-2)}
    elif name == "rmsnorm_infer":
        x, w = rnd("x"), rnd("scale")
        bufs["epsilon"] = torch.full((1, 1, 1, 1), 1e-5, dtype=torch.float32)
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(1, keepdim=True) + 1e-5) * w.float()
        expect = {"y": (y, 2e-2)}
    elif name in ("mlp_matmul", "mlp_matmul_bias_gelu"):
        a, w = rnd("a"), rnd("w", 0.03)
        c = a.float() @ w.float()
        if name == "mlp_matmul":
            expect = {"c": (c, 2e-2)}
        else:
            bias = rnd("bias")
            expect = {"y": (F.gelu(c + bias.float()), 2e-2)}
    elif name == "fp8_matmul":
        bat, m, k = T["a"].get_dim()
        n = T["b"].get_dim()[2]
        a8, da = quantize_fp8(torch.randn(bat, m, k, generator=gen, device=DEV))
        b8, db = quantize_fp8(torch.randn(bat, k, n, generator=gen, device=DEV))
        bufs["a"], bufs["b"] = copy_into(T["a"], a8), copy_into(T["b"], b8)
        bufs["descale_a"], bufs["descale_b"] = copy_into(T["descale_a"], da), copy_into(T["descale_b"], db)
        y = (a8.float() @ b8.float()) * da * db
        expect = {"y": (y, 2e-2), "amax": (y.abs().max().reshape(1, 1, 1), 2e-2)}
    elif name in ("conv_fprop", "conv_dgrad", "conv_wgrad"):
        node = g.nodes[0]
        pad, stride, dil = node.params["padding"], node.params["stride"], node.params["dilation"]
        if name == "conv_fprop":
            x, w = rnd("x"), rnd("w", 0.05)
            expect = {"y": (F.conv2d(x.float(), w.float(), padding=pad, stride=stride, dilation=dil), 2e-2)}
        elif name == "conv_dgrad":
            dy, w = rnd("dy"), rnd("w", 0.05)
            x_shape = T["dx"].get_dim()
            dx = torch.nn.grad.conv2d_input(x_shape, w.float(), dy.float(), padding=pad, stride=stride, dilation=dil)
            expect = {"dx": (dx, 2e-2)}
        else:
            x, dy = rnd("x"), rnd("dy", 0.05)
            dw = torch.nn.grad.conv2d_weight(x.float(), T["dw"].get_dim(), dy.float(), padding=pad, stride=stride, dilation=dil)
            expect = {"dw": (dw, 2e-2)}
    else:
        raise KeyError(name)

    for key, t in T.items():  # outputs (and any input left random)
        if key not in bufs:
            bufs[key] = alloc(t) if key in expect else randn_like_decl(t, gen)
    return bufs, expect


def run_one(name: str, handle) -> bool:
    gen = torch.Generator(device=DEV).manual_seed(0)
    g, T = graphs.EXAMPLES[name](handle)
    t0 = time.perf_counter()
    try:
        g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    except Exception as exc:  # noqa: BLE001
        print(f"[BUILD-FAIL] {name}: {type(exc).__name__}: {str(exc)[:600]}", flush=True)
        return False
    build_s = time.perf_counter() - t0
    bufs, expect = prepare(name, g, T, gen)
    workspace = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device=DEV)
    try:
        g.execute(bufs, workspace, handle=handle)  # bound by tensor name
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            g.execute(bufs, workspace, handle=handle)
        torch.cuda.synchronize()
        exec_ms = (time.perf_counter() - t0) / 5 * 1e3
    except Exception as exc:  # noqa: BLE001
        print(f"[EXEC-FAIL] {name}: {type(exc).__name__}: {str(exc)[:600]}", flush=True)
        return False
    errs = {k: err(bufs[k], ref.reshape(bufs[k].shape)) for k, (ref, _) in expect.items()}
    ok = all(errs[k] <= tol for k, (_, tol) in expect.items())
    engine = g.selected_engine
    plan = g.get_plan_name_at_index(g._plan_index) if hasattr(g, "_plan_index") else "?"
    print(
        f"[{'ok' if ok else 'MISMATCH'}] {name}: build {build_s:.2f}s, execute {exec_ms:.3f} ms, "
        f"engine {engine.name if engine else 'cuDNN backend'} ({plan}); "
        + ", ".join(f"{k} err {v:.2e}" for k, v in errs.items()),
        flush=True,
    )
    return ok


def main(argv) -> int:
    unknown = [n for n in argv if n not in graphs.EXAMPLES]
    if unknown:
        print(f"error: no example named {', '.join(unknown)}\nhint: choose from {', '.join(graphs.EXAMPLES)}",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: these examples run on an NVIDIA GPU, and torch sees none here\n"
              "hint: run them on a GPU machine with torch (CUDA) and nvidia-cudnn-frontend: pip install 'plancache[gpu]'",
              file=sys.stderr)
        return 9  # the CLI's GPU exit code (docs/CLI.md)
    names = argv or list(graphs.EXAMPLES)
    print(f"cudnn frontend {cudnn.__version__}, backend {cudnn.backend_version_string()}, {torch.cuda.get_device_name()}",
          flush=True)
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    failed = [n for n in names if not run_one(n, handle)]
    print(f"{len(names) - len(failed)}/{len(names)} passed" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
