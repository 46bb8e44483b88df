"""A child process for tests/integration/test_sdpa_route_gpu.py: every attention variant through plancache's route.

    python -m tests.sdpa_route_gpu_child --server URL --token T --trusted DIR --cache DIR --mode strict [--cpp]

Installs ``plancache.torch`` and runs each variant of ``F.scaled_dot_product_attention`` under the cuDNN backend,
forward and backward, against a float32 reference; then a CUDA-graph replay against eager, and a block under
``torch.compile(fullgraph=True)``. Prints one JSON line: per variant, what the route did (its counters' change:
``fwd``, ``bwd``, ``load:<source>``, ``fwd_aten:<reason>``) and the worst normalised error; the client's stats.
With ``--cpp`` the extension of the route's steady path in C++ is built first, the route installed as by default
(``attention_cpp`` left to ``PLANCACHE_ATTENTION_CPP``'s default, ``auto``: it takes the build), and each variant
runs twice: what is reported is the second run, the one a configuration handed over at its first is served by.
Without it the route's steady path is Python's (``attention_cpp=False``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests import gpu_util

B, H, S, D = 2, 8, 256, 64
_cache: Any = None  # the process's PlanCache (main)
OUTPUTS = ("out", "dq", "dk", "dv")  # what a forward + backward gives: its output, the gradients of q, k, v


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", generator=_gen(seed)).to(dtype)


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-6))


def _qkv(kv_heads: int = H, dtype: torch.dtype = torch.bfloat16, layout: str = "bhsd",
         s: int = S) -> list[torch.Tensor]:
    out = []
    for i, heads in enumerate((H, kv_heads, kv_heads)):
        if layout == "bshd":  # a projection's output viewed as (b, h, s, d): the layout models hand over
            t = _rand(B, s, heads, D, seed=i, dtype=dtype).transpose(1, 2)
        else:
            t = _rand(B, heads, s, D, seed=i, dtype=dtype)
        out.append(t.requires_grad_())
    return out


def _attention(q: Any, k: Any, v: Any, **kwargs: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Forward + backward under the cuDNN backend, and the same in float32 math (the reference)."""
    do = _rand(*q.shape[:3], v.shape[-1], seed=9, dtype=q.dtype)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o = F.scaled_dot_product_attention(q, k, v, **kwargs)
        grads = torch.autograd.grad(o, (q, k, v), do)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_kwargs = dict(kwargs)
    if isinstance(ref_kwargs.get("attn_mask"), torch.Tensor) and ref_kwargs["attn_mask"].dtype != torch.bool:
        ref_kwargs["attn_mask"] = ref_kwargs["attn_mask"].float()
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(*ref_in, **ref_kwargs)
        ref_grads = torch.autograd.grad(ref, ref_in, do.float())
    return [o, *grads], [ref, *ref_grads]


def _errors(got: Any, want: Any) -> dict[str, float]:
    """The normalised error of each of ``got`` (the output, then the gradients of q, k, v) against ``want``."""
    return {name: _error(g, w) for name, g, w in zip(OUTPUTS, got, want)}


def _checked(q: Any, k: Any, v: Any, **kwargs: Any) -> dict[str, float]:
    return _errors(*_attention(q, k, v, **kwargs))


def _dropout() -> dict[str, float]:
    """Dropout through the cuDNN backend against torch's own cuDNN kernels (called directly: the route replaces only
    the kernels behind ``F.scaled_dot_product_attention``) from the same generator state: cuDNN draws each element
    from the seed, the offset and its position, so both drop the same elements. ``generator``: 0 where both advanced
    torch's generator alike (reported, not required)."""
    q, k, v = _qkv()
    do = _rand(B, H, S, D, seed=9)
    state = torch.cuda.get_rng_state()
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        grads = torch.autograd.grad(o, (q, k, v), do)
    advanced = torch.cuda.get_rng_state()
    torch.cuda.set_rng_state(state)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    fwd = torch.ops.aten._cudnn_attention_forward(qd, kd, vd, None, None, None, S, S, True, 0.1, True, False)
    want = torch.ops.aten._cudnn_attention_backward(do, qd, kd, vd, fwd[0], fwd[1], fwd[6], fwd[7], None, None, None,
                                                    S, S, 0.1, True)
    errors = _errors((o, *grads), [w.float() for w in (fwd[0], *want)])
    return {**errors, "generator": float(not torch.equal(advanced, torch.cuda.get_rng_state()))}


def _causal_step(q: Any, k: Any, v: Any, do: torch.Tensor) -> list[torch.Tensor]:
    """Causal attention forward + backward under the cuDNN backend: the output and the gradients of q, k, v."""
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return [o, *torch.autograd.grad(o, (q, k, v), do)]


def _graph_replay() -> dict[str, float]:
    """One forward + backward captured in a CUDA graph, replayed on new data: equal to eager on that data."""
    q, k, v = _qkv()
    do = _rand(B, H, S, D, seed=11)
    step = partial(_causal_step, q, k, v, do)
    graph, captured = gpu_util.captured(step)
    with torch.no_grad():
        for i, t in enumerate((q, k, v)):
            t.copy_(_rand(*t.shape, seed=100 + i))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    return _errors(captured, [e.float() for e in eager])


def _steady_steps() -> dict[str, float]:
    """Six forward + backward steps of causal's configuration on the same inputs, as a training loop makes them:
    each step's buffers at the addresses of the step before (torch's caching allocator hands the same blocks back),
    so the C++ path replays the launches it captured there. The worst error of any step against float32, and
    ``repeat_out``: the largest difference of a step's output from the first step's (the same kernels on the same
    inputs: 0)."""
    q, k, v = _qkv()
    do = _rand(B, H, S, D, seed=9)
    _, want = _attention(q, k, v, is_causal=True)
    worst = dict.fromkeys(OUTPUTS, 0.0)
    first = None
    repeat = 0.0
    for _ in range(6):
        got = _causal_step(q, k, v, do)
        o = got[0]
        for name, g, w in zip(worst, got, want):
            worst[name] = max(worst[name], _error(g, w))
        if first is None:
            first = o.detach().clone()
        else:
            repeat = max(repeat, float((o.detach() - first).abs().max()))
        del o, got
    return {**worst, "repeat_out": repeat}


def _queued_steps() -> dict[str, float]:
    """Causal's configuration stepped while a spin kernel holds the GPU up, after steps that captured and replayed
    its launches at these addresses: each step's graph from the step before is still queued, so the C++ path
    executes rather than wait for it. The worst error of the last step against float32, and ``host_over_spin``: the
    host time of three queued steps over the spin's (far below 1 where no step waited for the GPU)."""
    q, k, v = _qkv()
    do = _rand(B, H, S, D, seed=9)
    _, want = _attention(q, k, v, is_causal=True)
    step = partial(_causal_step, q, k, v, do)
    for _ in range(3):
        step()
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(200_000_000)
    end.record()
    began = time.perf_counter()
    step()
    step()
    got = step()
    host_s = time.perf_counter() - began
    torch.cuda.synchronize()
    spin_s = start.elapsed_time(end) / 1e3
    return {**_errors(got, want), "host_over_spin": host_s / spin_s}


def _compiled_block() -> dict[str, float]:
    """LayerNorm -> QKV -> attention -> projection + residual under torch.compile(fullgraph=True), against eager."""
    hidden = H * D
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(hidden, device="cuda", dtype=torch.bfloat16)
    w_qkv = (torch.randn(hidden, 3 * hidden, device="cuda") * hidden ** -0.5).bfloat16()
    w_o = (torch.randn(hidden, hidden, device="cuda") * hidden ** -0.5).bfloat16()

    def block(x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (ln(x) @ w_qkv).view(b, s, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + o.transpose(1, 2).reshape(b, s, hidden) @ w_o

    x = _rand(B, S, hidden, seed=5).requires_grad_()
    dy = _rand(B, S, hidden, seed=6)
    compiled = torch.compile(block, fullgraph=True)
    y = compiled(x)
    (gx,) = torch.autograd.grad(y, (x,), dy)
    y_ref = block(x)
    (gx_ref,) = torch.autograd.grad(y_ref, (x,), dy)
    return {"out": _error(y, y_ref.float()), "dx": _error(gx, gx_ref.float())}


def _bool_padding() -> dict[str, float]:
    q, k, v = _qkv()
    keep = torch.arange(S, device="cuda") < S - 40
    return _checked(q, k, v, attn_mask=keep.view(1, 1, 1, S))


def _padding_per_batch() -> dict[str, float]:
    """A key-padding mask of its own length per sequence, (B, 1, 1, S): what a padded batch hands over. In float16:
    cuDNN reads every mask dense (B, 1, S, S), so in bfloat16 it would be bool_padding_mask's graph again."""
    q, k, v = _qkv(dtype=torch.float16)
    lengths = torch.tensor([S - 40 * (i + 1) for i in range(B)], device="cuda")
    keep = torch.arange(S, device="cuda") < lengths.view(B, 1)
    return _checked(q, k, v, attn_mask=keep.view(B, 1, 1, S))


def _causal_lower_right() -> dict[str, float]:
    """Causal attention aligned bottom-right (a shorter query block over a longer key cache), as a boolean mask."""
    q = _rand(B, H, S // 2, D, seed=20).requires_grad_()
    k, v = (_rand(B, H, S, D, seed=21 + i).requires_grad_() for i in range(2))
    keep = torch.ones(S // 2, S, dtype=torch.bool, device="cuda").tril(diagonal=S - S // 2)
    return _checked(q, k, v, attn_mask=keep)


def _other_shape() -> dict[str, float]:
    """``causal`` at twice its sequence length: a sibling of its graphs, whose plans came with causal's, fetched ahead
    in the background (plancache.client.siblings; waited for here, so that the test does not race it)."""
    _cache.siblings.join(60)
    return _checked(*_qkv(s=2 * S), is_causal=True)


VARIANTS: dict[str, Callable[[], dict[str, float]]] = {
    "causal": lambda: _checked(*_qkv(), is_causal=True),
    "no_mask_fp16": lambda: _checked(*_qkv(dtype=torch.float16)),
    "bshd_layout": lambda: _checked(*_qkv(layout="bshd"), is_causal=True),
    "gqa": lambda: _checked(*_qkv(kv_heads=2), is_causal=True, enable_gqa=True),
    "additive_bias": lambda: _checked(*_qkv(), attn_mask=_rand(B, 1, S, S, seed=7) * 0.5),
    "bool_padding_mask": _bool_padding,
    "padding_per_batch": _padding_per_batch,
    "causal_lower_right": _causal_lower_right,
    "scale": lambda: _checked(*_qkv(), is_causal=True, scale=0.3),
    "dropout": _dropout,
    "cuda_graph_replay": _graph_replay,
    "compiled_block": _compiled_block,
    "steady_steps": _steady_steps,
    "queued_steps": _queued_steps,
    "causal_other_shape": _other_shape,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", default="")
    parser.add_argument("--token")
    parser.add_argument("--trusted")
    parser.add_argument("--cache")
    parser.add_argument("--mode", default="normal")
    parser.add_argument("--attention", default="plan", help="plancache.client.sdpa.CHOICES")
    parser.add_argument("--cpp", action="store_true", help="the route as by default, its C++ extension built first; "
                        "each variant twice")
    parser.add_argument("variants", nargs="*")
    args = parser.parse_args()

    import plancache.torch
    from plancache.client import PlanCache, sdpa, sdpa_ext

    cpp_error = None
    if args.cpp:  # built here first, so that a failure's reason reaches the test (the route only logs it)
        try:
            sdpa_ext.load()
        except sdpa_ext.ExtensionUnavailable as exc:
            cpp_error = str(exc)

    cache = plancache.torch.install(PlanCache(args.server, token=args.token, trusted_keys=args.trusted or [],
                                              cache_dir=args.cache, mode=args.mode), attention=args.attention,
                                      attention_cpp=None if args.cpp else False)
    global _cache
    _cache = cache
    out: dict[str, Any] = {"variants": {}, "cpp_unavailable": sdpa.stats().get("cpp_unavailable", 0),
                           "cpp_error": cpp_error}
    for name in args.variants or VARIANTS:
        if args.cpp:
            with contextlib.suppress(Exception):  # the second run says what failed
                VARIANTS[name]()  # the first run hands its configurations over
        before = sdpa.stats()
        try:
            errors = VARIANTS[name]()
            torch.cuda.synchronize()
            result: dict[str, Any] = {"errors": errors}
        except Exception as exc:  # noqa: BLE001 - reported per variant, the test names it
            result = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
        after = sdpa.stats()
        result["route"] = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        out["variants"][name] = result
    out["stats"] = cache.stats().as_dict()
    # a training forward's backward plan loaded on the route's loader thread (the C++ path's first calls)
    out["loader_used"] = sdpa._route is not None and sdpa._route.loader is not None
    cache.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
