"""torch's own attention kernels as plancache calls them (:mod:`plancache.gpu.native`), on the CPU: which graphs they
can run, the layouts and log-sum-exp they hand back, and the worker's measurement (checked against the float32
reference before it is timed). Their CUDA runs: tests/integration/test_sdpa_route_gpu.py and test_gpu_core.py."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
cudnn = pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed (the gpu extra)")

from plancache.client import sdpa  # noqa: E402
from plancache.gpu import native, reference  # noqa: E402
from plancache.spec import from_pygraph  # noqa: E402


def qkv(b: int = 2, h: int = 4, s: int = 64, d: int = 32, kv_heads: int | None = None, s_kv: int | None = None):
    kv, skv = kv_heads or h, s_kv or s
    return (torch.randn(b, h, s, d, dtype=torch.bfloat16), torch.randn(b, kv, skv, d, dtype=torch.bfloat16),
            torch.randn(b, kv, skv, d, dtype=torch.bfloat16))


def forward_spec(q, k, v, bias=None, *, causal: bool = True, scale: float | None = None):
    graph = sdpa._forward_graph(q, k, v, bias, True, causal, scale)[0]
    return from_pygraph(graph, name="fwd").canonical_document()


def backward_spec(q, k, v, *, causal: bool = True, deterministic: bool = False):
    o = torch.empty_like(q)
    lse = torch.empty(*q.shape[:3], 1)
    graph = sdpa._backward_graph(q, k, v, o, lse, None, causal, None, deterministic)[0]
    return from_pygraph(graph, name="bwd").canonical_document()


def test_the_route_s_forward_and_backward_are_calls_torchs_kernels_make():
    q, k, v = qkv()
    fwd = native.native_call(forward_spec(q, k, v, scale=0.25))
    assert fwd is not None and not fwd.backward and fwd.is_causal and fwd.scale == 0.25
    assert fwd.kernels == ("flash", "cudnn_aten") and {"q", "k", "v", "O", "Stats"} <= set(fwd.ports)
    bwd = native.native_call(backward_spec(q, k, v, causal=False))
    assert bwd is not None and bwd.backward and not bwd.is_causal and bwd.kernels == ("flash", "cudnn_aten")
    assert {"dO", "o", "stats", "dQ", "dK", "dV"} <= set(bwd.ports)


def test_flash_is_no_candidate_with_a_bias_or_fewer_key_heads():
    q, k, v = qkv()
    assert native.native_call(forward_spec(q, k, v, torch.zeros(2, 1, 64, 64, dtype=torch.bfloat16))).kernels == \
        ("cudnn_aten",)
    q, k, v = qkv(kv_heads=2)
    assert native.native_call(forward_spec(q, k, v)).kernels == ("cudnn_aten",)


def test_graphs_torchs_kernels_do_not_express_have_no_native_call():
    q, k, v = qkv()
    assert native.native_call(backward_spec(q, k, v, deterministic=True)) is None
    spec = forward_spec(q, k, v).model_dump(by_alias=True)
    spec["nodes"][0]["params"]["diagonal_alignment"] = "BOTTOM_RIGHT"
    q2, k2, v2 = qkv(s=32, s_kv=64)  # bottom-right causal over a longer key sequence: not torch's is_causal
    br = forward_spec(q2, k2, v2).model_dump(by_alias=True)
    br["nodes"][0]["params"]["diagonal_alignment"] = "BOTTOM_RIGHT"
    from plancache.spec import parse_spec

    assert native.native_call(parse_spec(br)) is None
    assert native.native_call(parse_spec(spec)).is_causal, "Sq == Skv: both alignments are torch's is_causal"
    examples = __import__("pathlib").Path(__file__).resolve().parents[2] / "examples"
    assert native.native_call(parse_spec((examples / "matmul_scale_bias_gelu_amax.json").read_text())) is None


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_flash_hands_back_the_layouts_cudnn_s_op_promises(layout):
    """Through flash's meta kernels (torch's C++ cuDNN path has none; both run in the GPU tests): O in the cuDNN op's
    layout, LSE (B, H, S, 1) float32, gradients in their inputs' layouts."""
    kernel = "flash"
    base = (2, 4, 64, 32) if layout == "bhsd" else (2, 64, 4, 32)
    q, k, v = (torch.empty(base, dtype=torch.bfloat16, device="meta") for _ in range(3))
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out, lse = native.forward(kernel, q, k, v, None, True, None)
    meta = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)
    assert out.stride() == meta[0].stride() and lse.shape == (2, 4, 64, 1) and lse.dtype == torch.float32
    grads = native.backward(kernel, torch.empty_like(out), q, k, v, out, lse, None, True, None)
    assert [g.stride() for g in grads] == [t.stride() for t in (q, k, v)]


def test_an_unknown_kernel_and_a_bias_for_flash_are_refused():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="unknown native attention kernel 'xformers'"):
        native.forward("xformers", q, k, v, None, True, None)
    with pytest.raises(ValueError, match="flash kernel takes no attention bias"):
        native.forward("flash", q, k, v, torch.zeros(2, 1, 64, 64, dtype=torch.bfloat16), True, None)


def _check(spec: Any, inputs: dict[int, Any]):
    ref = reference.reference_outputs(spec, inputs)
    tol = {t.uid: reference.tolerance(spec, t) for t in spec.output_tensors()}

    def check(outputs: dict[int, Any]) -> str | None:
        errs = reference.output_errors(spec, outputs, ref, inputs=inputs)
        bad = [u for u, e in errs.items() if not e <= tol[u]]
        return f"uid {bad[0]}" if bad else None
    return check


def test_the_worker_times_only_kernels_whose_outputs_pass_the_reference(monkeypatch):
    """A kernel whose O and LSE are right (computed here in float32, as cuDNN states them: natural-log log-sum-exp,
    (B, H, S, 1)) passes the float32 reference and is timed; one that raises (torch's CUDA kernels do on the CPU)
    or fails the check is left out."""
    q, k, v = qkv()
    spec = forward_spec(q, k, v)
    inputs = reference.make_inputs(spec, "cpu", seed=3)
    pack = {**inputs, **reference.allocate_outputs(spec, "cpu")}

    def fake(kernel, q, k, v, bias, is_causal, scale):
        if kernel != "flash":
            raise NotImplementedError(f"{kernel}: no CPU kernel")
        s = (q.float() @ k.float().transpose(-1, -2)) * scale
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        return (torch.softmax(s, -1) @ v.float()).to(q.dtype), torch.logsumexp(s, -1, keepdim=True)

    monkeypatch.setattr(native, "forward", fake)
    timed: list[Any] = []

    def timer(run):
        run()
        timed.append(run)
        return 0.125

    assert native.measure(spec, pack, _check(spec, inputs), timer) == {"flash": 0.125}
    assert len(timed) == 1
    assert native.measure(spec, pack, lambda outputs: "output uid 1 normalised error 1", timer) == {}, \
        "a kernel failing the check is not a candidate"
    assert native.measure(backward_spec(q, k, v, deterministic=True), pack, _check(spec, inputs), timer) == {}
