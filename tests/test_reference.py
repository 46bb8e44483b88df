"""The float32 torch reference evaluator and the numerics check, on the CPU."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from examples.generate import conv_bias_relu, matmul_epilogue, sdpa_causal  # noqa: E402
from plancache.errors import TuningError  # noqa: E402
from plancache.gpu import reference as R  # noqa: E402


def test_inputs_are_fresh_non_zero_and_laid_out_as_the_spec_says():
    spec = conv_bias_relu(n=2, c=8, hw=6, k=4)
    a = R.make_inputs(spec, "cpu", seed=1)
    b = R.make_inputs(spec, "cpu", seed=2)
    for name, t in a.items():
        ts = spec.tensors[name]
        assert list(t.shape) == ts.dims and list(t.stride()) == ts.strides
        assert t.dtype == R.TORCH_DTYPES[ts.dtype]
        assert t.float().abs().sum() > 0
        assert not torch.equal(t, b[name])


def test_conv_reference_matches_torch_conv2d():
    spec = conv_bias_relu(n=2, c=8, hw=6, k=4)
    x = R.make_inputs(spec, "cpu", seed=3)
    ref = R.reference_outputs(spec, x)["Y"]
    expect = torch.relu(torch.nn.functional.conv2d(x["X"].float(), x["W"].float(), padding=1) + x["B"].float())
    assert torch.allclose(ref, expect, atol=1e-5)


def test_matmul_epilogue_reference_applies_scale_bias_gelu_and_amax():
    spec = matmul_epilogue(batch=2, m=8, k=16, n=4)
    x = R.make_inputs(spec, "cpu", seed=4)
    out = R.reference_outputs(spec, x)
    y = torch.nn.functional.gelu(torch.matmul(x["A"].float(), x["B"].float()) * x["alpha"] + x["bias"].float())
    assert torch.allclose(out["Y"], y, atol=1e-5)
    assert out["amax"].shape == (1, 1, 1)
    assert float(out["amax"]) == pytest.approx(float(y.abs().max()))


def test_sdpa_reference_matches_torch_sdpa_causal_and_gqa():
    spec = sdpa_causal(batch=1, heads=4, kv_heads=2, seq=16, d=8)
    x = R.make_inputs(spec, "cpu", seed=5)
    ref = R.reference_outputs(spec, x)["O"]
    q, k, v = (x[n].float() for n in "qkv")
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    expect = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=8 ** -0.5)
    assert torch.allclose(ref, expect, atol=1e-5)


def test_compare_outputs_accepts_rounding_and_refuses_garbage_and_unwritten():
    spec = conv_bias_relu(n=1, c=4, hw=4, k=4)
    x = R.make_inputs(spec, "cpu", seed=6)
    ref = R.reference_outputs(spec, x)
    good = {"Y": ref["Y"].to(torch.bfloat16)}
    assert R.compare_outputs(spec, good, ref) < R.TOLERANCE["bfloat16"]
    with pytest.raises(TuningError, match="exceeds tolerance"):
        R.compare_outputs(spec, {"Y": (ref["Y"] * 1.5).to(torch.bfloat16)}, ref)
    unwritten = R.allocate_outputs(spec, "cpu")
    assert torch.isnan(unwritten["Y"].float()).all()
    assert math.isinf(R.output_errors(spec, unwritten, ref)["Y"])
    with pytest.raises(TuningError):
        R.compare_outputs(spec, unwritten, ref)


def test_required_memory_counts_strided_storage_and_sdpa_scores():
    spec = sdpa_causal(batch=1, heads=2, seq=32, d=16)
    scratch = R.reference_scratch_bytes(spec)
    assert scratch >= 3 * 1 * 2 * 32 * 32 * 4
    assert R.storage_elements([2, 3], [3, 1]) == 6
    assert R.storage_elements([2, 3], [1, 2]) == 6


def test_native_evaluation_keeps_dtypes_and_agrees_with_the_reference():
    spec = matmul_epilogue(batch=2, m=8, k=16, n=4)
    x = R.make_inputs(spec, "cpu", seed=7)
    native = R.evaluate(spec, x, exact_float32=False)
    ref = R.reference_outputs(spec, x)
    assert native["Y"].dtype == torch.bfloat16
    assert max(R.output_errors(spec, native, ref).values()) < 2e-2  # bf16 rounding, amax of the rounded Y
    sd = sdpa_causal(batch=1, heads=4, kv_heads=2, seq=16, d=8)
    xs = R.make_inputs(sd, "cpu", seed=8)
    assert R.compare_outputs(sd, R.evaluate(sd, xs, exact_float32=False), R.reference_outputs(sd, xs)) < 2e-2
