"""The float32 torch reference (plancache.gpu.reference / .families) against independent torch computations, on
the CPU: graphs are built with cuDNN FE's pure-Python pygraph (no GPU) and converted with ``from_pygraph``."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
cudnn = pytest.importorskip("cudnn")

import torch.nn.functional as F  # noqa: E402

from examples.fe import graphs as G  # noqa: E402
from plancache.errors import TuningError  # noqa: E402
from plancache.gpu import families as FAM  # noqa: E402
from plancache.gpu import reference as R  # noqa: E402
from plancache.spec import from_pygraph  # noqa: E402

BF16, FP16, FP32, INT32 = cudnn.data_type.BFLOAT16, cudnn.data_type.HALF, cudnn.data_type.FLOAT, cudnn.data_type.INT32


def build(builder, seed=0, **kw):
    """(spec, name -> uid, inputs on the CPU, float32 reference by name)."""
    g, _ = builder(**kw)
    spec = from_pygraph(g)
    names = spec.io_names()
    x = R.make_inputs(spec, "cpu", seed=seed)
    ref = R.reference_outputs(spec, x)
    return spec, names, x, {n: ref[u] for n, u in names.items() if u in ref}


def f32(x, names, name):
    return x[names[name]].float()


def graph(io=BF16):
    return cudnn.pygraph(io_data_type=io, intermediate_data_type=FP32, compute_data_type=FP32)


def close(a, b, tol=1e-4):
    a, b = a.float(), b.float()
    assert a.shape == b.shape, (a.shape, b.shape)
    err = float((a - b).abs().max()) / max(float(b.abs().max()), 1e-6)
    assert err < tol, err


def attention(q, k, v, scale, mask=None):
    """Independent float32 attention (torch's math SDPA) with an explicit boolean mask [b|1, 1, s_q, s_kv]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


# ------------------------------------------------------------------ convolution


def test_conv_fprop_dgrad_wgrad_match_torch():
    shapes = dict(n=2, c=4, hw=6, k=3, rs=3)
    spec, n, x, ref = build(G.conv_fprop, **shapes)
    assert x[n["x"]].stride() == tuple(spec.tensor(n["x"]).stride)  # channels-last, as the doc says
    close(ref["y"], F.conv2d(f32(x, n, "x"), f32(x, n, "w"), padding=1))
    _, n, x, ref = build(G.conv_dgrad, **shapes)
    close(ref["dx"], torch.nn.grad.conv2d_input([2, 4, 6, 6], f32(x, n, "w"), f32(x, n, "dy"), padding=1))
    _, n, x, ref = build(G.conv_wgrad, **shapes)
    close(ref["dw"], torch.nn.grad.conv2d_weight(f32(x, n, "x"), [3, 4, 3, 3], f32(x, n, "dy"), padding=1))


def test_conv_3d_strided_dilated_and_asymmetric_padding():
    g = graph()
    x = g.tensor(name="x", dim=[1, 2, 5, 6, 7], data_type=BF16)
    w = g.tensor(name="w", dim=[3, 2, 2, 3, 3], data_type=BF16)
    g.conv_fprop(image=x, weight=w, padding=[1, 0, 2], stride=[2, 1, 2], dilation=[1, 2, 1]).set_name("y").set_output(True)
    g2 = graph()
    x2 = g2.tensor(name="x", dim=[1, 2, 6, 6], data_type=BF16)
    w2 = g2.tensor(name="w", dim=[4, 2, 3, 3], data_type=BF16)
    g2.conv_fprop(image=x2, weight=w2, pre_padding=[0, 1], post_padding=[2, 1], stride=[1, 2]).set_name("y").set_output(True)
    for gr, fn in ((g, lambda a, b: F.conv3d(a, b, padding=[1, 0, 2], stride=[2, 1, 2], dilation=[1, 2, 1])),
                   (g2, lambda a, b: F.conv2d(F.pad(a, [1, 1, 0, 2]), b, stride=[1, 2]))):
        spec = from_pygraph(gr)
        n = spec.io_names()
        xs = R.make_inputs(spec, "cpu", seed=3)
        out = R.reference_outputs(spec, xs)[n["y"]]
        close(out, fn(f32(xs, n, "x"), f32(xs, n, "w")))


# ------------------------------------------------------------------ matmul, pointwise, reduction


def test_matmul_bias_gelu_and_fp8_matmul_with_descales_and_amax():
    _, n, x, ref = build(G.mlp_matmul_bias_gelu, batch=2, m=8, k=32, n=16)
    close(ref["y"], F.gelu(f32(x, n, "a") @ f32(x, n, "w") + f32(x, n, "bias")))
    _, n, x, ref = build(G.fp8_matmul, batch=2, m=8, k=32, n=16)
    assert x[n["a"]].dtype == torch.float8_e4m3fn and x[n["b"]].stride() == (32 * 16, 1, 32)
    assert all(0.75 <= float(x[n[p]]) <= 1.25 for p in ("descale_a", "descale_b"))  # scale factors around 1
    y = (f32(x, n, "a") @ f32(x, n, "b")) * f32(x, n, "descale_a") * f32(x, n, "descale_b")
    close(ref["y"], y)
    assert float(ref["amax"].reshape(())) == pytest.approx(float(y.abs().max()), rel=1e-6)


def test_matmul_batch_broadcast():
    g = graph()
    a = g.tensor(name="a", dim=[3, 4, 8], data_type=BF16)
    b = g.tensor(name="b", dim=[1, 8, 5], data_type=BF16)
    g.matmul(A=a, B=b).set_name("c").set_output(True).set_dim([3, 4, 5])
    spec = from_pygraph(g)
    n = spec.io_names()
    x = R.make_inputs(spec, "cpu")
    close(R.reference_outputs(spec, x)[n["c"]], f32(x, n, "a") @ f32(x, n, "b"))


def test_pointwise_modes_broadcast_and_pass_by_value():
    g = graph()
    a = g.tensor(name="a", dim=[2, 3, 4], data_type=BF16)
    b = g.tensor(name="b", dim=[1, 3, 1], data_type=BF16)
    alpha = g.tensor(name="alpha", dim=[1, 1, 1], data_type=FP32, is_pass_by_value=True)
    ops = {
        "add": lambda: g.add(a=a, b=b), "sub": lambda: g.sub(a=a, b=b), "mul": lambda: g.mul(a=a, b=b),
        "div": lambda: g.div(a=a, b=b), "max": lambda: g.max(input0=a, input1=b), "min": lambda: g.min(input0=a, input1=b),
        "scale": lambda: g.scale(input=a, scale=alpha), "bias": lambda: g.bias(input=a, bias=b),
        "relu": lambda: g.relu(input=a),
        "relu_clip": lambda: g.relu(input=a, negative_slope=0.1, lower_clip=-0.5, upper_clip=0.7),
        "leaky": lambda: g.leaky_relu(input=a, negative_slope=0.2), "swish": lambda: g.swish(input=a, swish_beta=1.5),
        "gelu": lambda: g.gelu(input=a), "gelu_tanh": lambda: g.gelu_approx_tanh(input=a), "sigmoid": lambda: g.sigmoid(input=a),
        "tanh": lambda: g.tanh(input=a), "exp": lambda: g.exp(input=a), "neg": lambda: g.neg(input=a),
        "abs": lambda: g.abs(input=a),
        "cmp_gt": lambda: g.cmp_gt(input=a, comparison=b), "identity": lambda: g.identity(input=a),
        "relu_bwd": lambda: g.relu_backward(loss=b, input=a), "sigmoid_bwd": lambda: g.sigmoid_backward(loss=b, input=a),
    }
    for name, op in ops.items():
        op().set_name(name).set_output(True).set_dim([2, 3, 4]).set_data_type(FP32)
    sel = g.binary_select(input0=a, input1=b, mask=g.cmp_gt(input=a, comparison=b))
    sel.set_name("select").set_output(True).set_dim([2, 3, 4]).set_data_type(FP32)
    spec = from_pygraph(g)
    assert FAM.uncovered(spec) == [] and FAM.kernel_cache_safe(spec)
    n = spec.io_names()
    x = R.make_inputs(spec, "cpu", seed=7)
    assert x[n["alpha"]].device.type == "cpu" and x[n["alpha"]].dtype == torch.float32 and float(x[n["alpha"]]) > 0
    ref = {k: v for k, v in R.reference_outputs(spec, x).items()}
    A, B, al = f32(x, n, "a"), f32(x, n, "b"), f32(x, n, "alpha")
    sig = torch.sigmoid(A)
    expect = {
        "add": A + B, "sub": A - B, "mul": A * B, "div": A / B, "max": torch.maximum(A, B), "min": torch.minimum(A, B),
        "scale": A * al, "bias": A + B, "relu": torch.relu(A),
        "relu_clip": torch.where(A > -0.5, A, -0.5 + 0.1 * (A + 0.5)).clamp(max=0.7),
        "leaky": F.leaky_relu(A, 0.2), "swish": A * torch.sigmoid(1.5 * A), "gelu": F.gelu(A),
        "gelu_tanh": F.gelu(A, approximate="tanh"), "sigmoid": sig, "tanh": torch.tanh(A), "exp": torch.exp(A),
        "neg": -A, "abs": A.abs(), "cmp_gt": (A > B).float(), "identity": A,
        "relu_bwd": B * (A > 0).float(), "sigmoid_bwd": B * sig * (1 - sig), "select": torch.where(A > B, A, B),
    }
    for name, e in expect.items():
        close(ref[n[name]], e.expand(2, 3, 4), 1e-5)


@pytest.mark.parametrize("mode,fn", [
    ("ADD", lambda t, d: t.sum(d, keepdim=True)), ("MAX", lambda t, d: t.amax(d, keepdim=True)),
    ("MIN", lambda t, d: t.amin(d, keepdim=True)), ("AMAX", lambda t, d: t.abs().amax(d, keepdim=True)),
    ("AVG", lambda t, d: t.mean(d, keepdim=True)), ("NORM1", lambda t, d: t.abs().sum(d, keepdim=True)),
    ("NORM2", lambda t, d: t.pow(2).sum(d, keepdim=True).sqrt()),
    ("MUL", lambda t, d: t.prod(d[0], keepdim=True).prod(d[1], keepdim=True)),
])
def test_reduction_modes_reduce_to_the_output_dims(mode, fn):
    g = graph()
    a = g.tensor(name="a", dim=[2, 3, 4], data_type=FP32)
    r = g.reduction(input=a, mode=getattr(cudnn.reduction_mode, mode))
    r.set_name("r").set_output(True).set_dim([2, 1, 1]).set_data_type(FP32)
    spec = from_pygraph(g)
    n = spec.io_names()
    x = R.make_inputs(spec, "cpu", seed=2)
    close(R.reference_outputs(spec, x)[n["r"]], fn(f32(x, n, "a"), [1, 2]), 1e-5)


# ------------------------------------------------------------------ normalization


def test_layernorm_and_rmsnorm_forward():
    spec, n, x, ref = build(G.layernorm_fwd_train, tokens=6, hidden=16)
    xx, w, b = f32(x, n, "x"), f32(x, n, "scale"), f32(x, n, "bias")
    eps = float(x[n["epsilon"]])
    assert eps == pytest.approx(1e-5) and x[n["epsilon"]].device.type == "cpu"
    y = F.layer_norm(xx.reshape(6, 16), [16], w.reshape(16), b.reshape(16), eps).reshape(6, 16, 1, 1)
    close(ref["y"], y)
    close(ref["mean"], xx.mean(dim=(1, 2, 3), keepdim=True))
    close(ref["inv_var"], torch.rsqrt(xx.var(dim=(1, 2, 3), unbiased=False, keepdim=True) + eps))
    assert list(ref["mean"].shape) == spec.tensor(n["mean"]).dim == [6, 1, 1, 1]
    _, n, x, ref = build(G.rmsnorm_infer, tokens=6, hidden=16)
    xx, w = f32(x, n, "x"), f32(x, n, "scale")
    close(ref["y"], xx * torch.rsqrt(xx.pow(2).mean(1, keepdim=True) + 1e-5) * w)


def test_layernorm_backward_matches_autograd_and_uses_the_given_statistics():
    spec, n, x, ref = build(G.layernorm_bwd, tokens=6, hidden=16)
    xx, w, dy = f32(x, n, "x"), f32(x, n, "scale"), f32(x, n, "dy")
    # make_inputs gives the actual statistics of x
    close(f32(x, n, "mean"), xx.mean(1, keepdim=True))
    close(f32(x, n, "inv_var"), torch.rsqrt(xx.var(1, unbiased=False, keepdim=True) + 1e-5))
    xr, wr, br = xx.reshape(6, 16).requires_grad_(), w.reshape(16).requires_grad_(), torch.zeros(16, requires_grad=True)
    y = F.layer_norm(xr, [16], wr, br, 1e-5)
    gx, gw, gb = torch.autograd.grad(y, (xr, wr, br), dy.reshape(6, 16))
    close(ref["dx"], gx.reshape(6, 16, 1, 1))
    close(ref["dscale"], gw.reshape(1, 16, 1, 1))
    close(ref["dbias"], gb.reshape(1, 16, 1, 1))
    # with other (given) statistics the analytic formula uses them: d/dx of (x - m) * s * w with m, s
    # the functions of x the kernel assumes, evaluated at the given values
    x[n["mean"]] += 0.25
    x[n["inv_var"]] *= 1.5
    ref2 = R.reference_outputs(spec, x)
    m, s = f32(x, n, "mean"), f32(x, n, "inv_var")
    xhat, gg = (xx - m) * s, dy * w
    dx = s * (gg - gg.mean(1, keepdim=True) - xhat * (gg * xhat).mean(1, keepdim=True))
    close(ref2[n["dx"]], dx)
    close(ref2[n["dscale"]], (dy * xhat).sum(0, keepdim=True))


def test_rmsnorm_backward_and_batchnorm_family():
    g = graph()
    xd = [4, 8, 3, 3]
    t = {k: g.tensor(name=k, dim=d, data_type=FP32) for k, d in
         (("dy", xd), ("x", xd), ("w", [1, 8, 3, 3]), ("inv", [4, 1, 1, 1]))}
    dx, dw, _ = g.rmsnorm_backward(grad=t["dy"], input=t["x"], scale=t["w"], inv_variance=t["inv"], has_dbias=False)
    dx.set_name("dx").set_output(True)
    dw.set_name("dw").set_output(True)
    spec = from_pygraph(g)
    n = spec.io_names()
    x = R.make_inputs(spec, "cpu", seed=4)
    ref = R.reference_outputs(spec, x)
    xx, w, dy = f32(x, n, "x"), f32(x, n, "w"), f32(x, n, "dy")
    xr, wr = xx.clone().requires_grad_(), w.clone().requires_grad_()
    y = xr * torch.rsqrt(xr.pow(2).mean((1, 2, 3), keepdim=True) + 1e-5) * wr
    gx, gw = torch.autograd.grad(y, (xr, wr), dy)
    close(ref[n["dx"]], gx)
    close(ref[n["dw"]], gw)

    g = graph()
    c = 6
    xi = g.tensor(name="x", dim=[4, c, 3, 3], data_type=FP32)
    ps = {k: g.tensor(name=k, dim=[1, c, 1, 1], data_type=FP32) for k in ("w", "b", "rm", "rv")}
    eps = g.tensor(name="eps", dim=[1, 1, 1, 1], data_type=FP32, is_pass_by_value=True)
    mom = g.tensor(name="mom", dim=[1, 1, 1, 1], data_type=FP32, is_pass_by_value=True)
    outs = g.batchnorm(input=xi, scale=ps["w"], bias=ps["b"], in_running_mean=ps["rm"], in_running_var=ps["rv"],
                       epsilon=eps, momentum=mom)
    for o, name in zip(outs, ("y", "mean", "inv_var", "nrm", "nrv")):
        o.set_name(name).set_output(True)
    spec = from_pygraph(g)
    n = spec.io_names()
    x = R.make_inputs(spec, "cpu", seed=5)
    assert float(x[n["mom"]]) == pytest.approx(0.1) and float(x[n["rv"]].min()) > 0
    ref = R.reference_outputs(spec, x)
    rm, rv = f32(x, n, "rm").reshape(c).clone(), f32(x, n, "rv").reshape(c).clone()
    y = F.batch_norm(f32(x, n, "x"), rm, rv, f32(x, n, "w").reshape(c), f32(x, n, "b").reshape(c), True, 0.1, 1e-5)
    close(ref[n["y"]], y)
    close(ref[n["nrm"]], rm.reshape(1, c, 1, 1))
    close(ref[n["nrv"]], rv.reshape(1, c, 1, 1))

    g = graph()
    t = {k: g.tensor(name=k, dim=d, data_type=FP32) for k, d in
         (("dy", [4, c, 3, 3]), ("x", [4, c, 3, 3]), ("w", [1, c, 1, 1]), ("m", [1, c, 1, 1]), ("iv", [1, c, 1, 1]))}
    for o, name in zip(g.batchnorm_backward(grad=t["dy"], input=t["x"], scale=t["w"], mean=t["m"], inv_variance=t["iv"]),
                       ("dx", "dw", "db")):
        o.set_name(name).set_output(True)
    spec = from_pygraph(g)
    n = spec.io_names()
    x = R.make_inputs(spec, "cpu", seed=6)
    ref = R.reference_outputs(spec, x)
    xr, wr = f32(x, n, "x").requires_grad_(), f32(x, n, "w").reshape(c).requires_grad_()
    br = torch.zeros(c, requires_grad=True)
    y = F.batch_norm(xr, None, None, wr, br, True, 0.0, 1e-5)
    gx, gw, gb = torch.autograd.grad(y, (xr, wr, br), f32(x, n, "dy"))
    close(ref[n["dx"]], gx, 1e-3)
    close(ref[n["dw"]], gw.reshape(1, c, 1, 1), 1e-3)
    close(ref[n["db"]], gb.reshape(1, c, 1, 1))


# ------------------------------------------------------------------ attention


def test_sdpa_forward_causal_and_stats():
    _, n, x, ref = build(G.sdpa_fwd_train, b=2, h=2, s=16, d=8)
    q, k, v = (f32(x, n, p) for p in "qkv")
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=8 ** -0.5)
    close(ref["o"], o)
    s = (q @ k.transpose(-1, -2)) * 8 ** -0.5
    s = s.masked_fill(~torch.ones(16, 16, dtype=torch.bool).tril(), float("-inf"))
    close(ref["stats"], torch.logsumexp(s, -1, keepdim=True))


def sdpa_graph(*, b=2, h_q=4, h_kv=2, s_q=6, s_kv=10, d=8, padding=False, stats=True, **params):
    g = graph()
    q = g.tensor(name="q", dim=[b, h_q, s_q, d], data_type=BF16)
    k = g.tensor(name="k", dim=[b, h_kv, s_kv, d], data_type=BF16)
    v = g.tensor(name="v", dim=[b, h_kv, s_kv, d], data_type=BF16)
    if padding:
        params.update(use_padding_mask=True,
                      seq_len_q=g.tensor(name="seq_len_q", dim=[b, 1, 1, 1], data_type=INT32),
                      seq_len_kv=g.tensor(name="seq_len_kv", dim=[b, 1, 1, 1], data_type=INT32))
    o, st = g.sdpa(q=q, k=k, v=v, generate_stats=stats, attn_scale=0.3, **params)
    o.set_name("o").set_output(True).set_data_type(BF16)
    if stats:
        st.set_name("stats").set_output(True).set_data_type(FP32)
    spec = from_pygraph(g)
    return spec, spec.io_names()


def _band(b, s_q, s_kv, left=None, right=None, br=False, lq=None, lkv=None):
    row, col = torch.arange(s_q).view(-1, 1), torch.arange(s_kv).view(1, -1)
    masks = []
    for i in range(b):
        sq, skv = (lq[i] if lq else s_q), (lkv[i] if lkv else s_kv)
        shift = skv - sq if br else 0
        m = torch.ones(s_q, s_kv, dtype=torch.bool)
        if lq:
            m &= (row < sq) & (col < skv)
        if right is not None:
            m &= col <= row + shift + right
        if left is not None:
            m &= col > row + shift - left
        masks.append(m)
    return torch.stack(masks).unsqueeze(1)


@pytest.mark.parametrize("params,band", [
    (dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=0), dict(right=0)),
    (dict(use_causal_mask=True), dict(right=0)),
    (dict(diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT, diagonal_band_right_bound=0), dict(right=0, br=True)),
    (dict(use_causal_mask_bottom_right=True), dict(right=0, br=True)),
    (dict(diagonal_band_left_bound=3, diagonal_band_right_bound=0), dict(left=3, right=0)),
    (dict(sliding_window_length=3, diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT,
          diagonal_band_right_bound=1), dict(left=3, right=1, br=True)),
    (dict(), dict()),
])
def test_sdpa_masks_gqa_match_explicit_masks(params, band):
    spec, n = sdpa_graph(**params)
    x = R.make_inputs(spec, "cpu", seed=11)
    ref = R.reference_outputs(spec, x)
    q, k, v = (f32(x, n, p) for p in "qkv")
    mask = _band(2, 6, 10, **band)
    close(ref[n["o"]], attention(q, k, v, 0.3, mask))


def test_sdpa_top_left_and_bottom_right_differ_when_s_q_differs_from_s_kv():
    tl, n = sdpa_graph(use_causal_mask=True)
    br, _ = sdpa_graph(use_causal_mask_bottom_right=True)
    x = R.make_inputs(tl, "cpu", seed=1)
    o_tl = R.reference_outputs(tl, x)[n["o"]]
    o_br = R.reference_outputs(br, x)[n["o"]]
    assert float((o_tl - o_br).abs().max()) > 1e-2
    sq, n2 = sdpa_graph(s_q=10, s_kv=10, use_causal_mask=True)
    sq_br, _ = sdpa_graph(s_q=10, s_kv=10, use_causal_mask_bottom_right=True)
    x = R.make_inputs(sq, "cpu", seed=1)
    assert torch.equal(R.reference_outputs(sq, x)[n2["o"]], R.reference_outputs(sq_br, x)[n2["o"]])


def test_sdpa_alibi_matches_fe_slopes():
    spec, n = sdpa_graph(h_q=4, h_kv=4, s_q=8, s_kv=8, use_alibi_mask=True, use_causal_mask=True)
    x = R.make_inputs(spec, "cpu", seed=2)
    q, k, v = (f32(x, n, p) for p in "qkv")
    slopes = torch.tensor([2 ** (-8 * (i + 1) / 4) for i in range(4)]).view(1, 4, 1, 1)
    pos = torch.arange(8)
    bias = (pos.view(1, -1) - pos.view(-1, 1)).float() * slopes
    bias = bias.masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf"))
    close(R.reference_outputs(spec, x)[n["o"]], attention(q, k, v, 0.3, bias))
    assert FAM.alibi_slopes(6) == pytest.approx([2 ** (-8 * s / 4) for s in (1, 2, 3, 4, 0.5, 1.5)])


def test_sdpa_padding_rows_are_excluded_from_the_comparison():
    spec, n = sdpa_graph(padding=True, b=4, s_q=8, s_kv=8, use_causal_mask=True)
    x = R.make_inputs(spec, "cpu", seed=3)
    lq, lkv = x[n["seq_len_q"]].reshape(-1).tolist(), x[n["seq_len_kv"]].reshape(-1).tolist()
    assert all(1 <= v <= 8 for v in lq + lkv) and lq[0] == 8 and min(lq) < 8
    ref = R.reference_outputs(spec, x)
    q, k, v = (f32(x, n, p) for p in "qkv")
    mask = _band(4, 8, 8, right=0, lq=lq, lkv=lkv)
    rows = mask.any(-1, keepdim=True)
    close(ref[n["o"]] * rows, torch.nan_to_num(attention(q, k, v, 0.3, mask)) * rows)
    masks = R.compare_mask(spec, x)
    assert torch.equal(masks[n["o"]].expand(4, 1, 8, 1), rows) and torch.equal(masks[n["stats"]], masks[n["o"]])
    # a plan that leaves the padding rows unwritten (NaN) passes; one wrong in a live row fails
    out = R.allocate_outputs(spec, "cpu")
    for name in ("o", "stats"):
        out[n[name]].copy_(torch.where(rows, ref[n[name]], torch.tensor(float("nan"))).to(out[n[name]].dtype))
    errs = R.output_errors(spec, out, ref, inputs=x)
    assert errs[n["o"]] < R.TOLERANCE["BFLOAT16"] and errs[n["stats"]] < 1e-6
    assert math.isinf(R.output_errors(spec, out, ref)[n["o"]])  # without the masks the NaN rows count
    out[n["o"]][0, 0, 0, 0] = float("nan")
    assert math.isinf(R.output_errors(spec, out, ref, inputs=x)[n["o"]])


def test_paged_decode_gather_equals_the_dense_reference():
    kw = dict(b=3, h_q=4, h_kv=2, d=8, max_seq_len_kv=40, block_size=8)
    spec, n, x, ref = build(G.paged_decode, **kw)
    table_k, table_v = x[n["page_table_k"]], x[n["page_table_v"]]
    blocks = spec.tensor(n["k_cache"]).dim[0]
    assert int(table_k.min()) >= 0 and int(table_k.max()) < blocks and int(table_v.max()) < blocks
    assert len(set(table_k.reshape(-1).tolist())) == table_k.numel()  # a permutation of blocks
    assert x[n["seq_len_q"]].reshape(-1).tolist() == [1, 1, 1]
    lkv = x[n["seq_len_kv"]].reshape(-1).tolist()
    assert all(1 <= v <= 40 for v in lkv)

    def dense(cache, table):
        c = f32(x, n, cache)
        return torch.stack([torch.cat([c[int(p)] for p in table[i].reshape(-1)], dim=1)[:, :40] for i in range(3)])

    k, v = dense("k_cache", table_k), dense("v_cache", table_v)
    g = graph()
    qd = g.tensor(name="q", dim=[3, 4, 1, 8], data_type=BF16)
    kd = g.tensor(name="k", dim=[3, 2, 40, 8], data_type=FP32)
    vd = g.tensor(name="v", dim=[3, 2, 40, 8], data_type=FP32)
    slq = g.tensor(name="seq_len_q", dim=[3, 1, 1, 1], data_type=INT32)
    slkv = g.tensor(name="seq_len_kv", dim=[3, 1, 1, 1], data_type=INT32)
    o, _ = g.sdpa(q=qd, k=kd, v=vd, generate_stats=False, attn_scale=8 ** -0.5, use_padding_mask=True, seq_len_q=slq,
                  seq_len_kv=slkv)
    o.set_name("o").set_output(True)
    dspec = from_pygraph(g)
    dn = dspec.io_names()
    dx = {dn["q"]: x[n["q"]], dn["k"]: k, dn["v"]: v, dn["seq_len_q"]: x[n["seq_len_q"]], dn["seq_len_kv"]: x[n["seq_len_kv"]]}
    close(ref["o"], R.reference_outputs(dspec, dx)[dn["o"]], 1e-6)
    mask = _band(3, 1, 40, lq=[1, 1, 1], lkv=lkv)
    close(ref["o"], attention(f32(x, n, "q"), k, v, 8 ** -0.5, mask))


def test_varlen_ragged_offsets_and_packed_output():
    spec, n, x, ref = build(G.varlen_sdpa, b=3, h=2, max_s_q=8, max_s_kv=8, d=4, seed=2)
    lq, lkv = x[n["seq_len_q"]].reshape(-1).tolist(), x[n["seq_len_kv"]].reshape(-1).tolist()
    for name, lens in (("q_ragged_offset", lq), ("o_ragged_offset", lq), ("k_ragged_offset", lkv)):
        off = x[n[name]]
        assert off.dtype == torch.int32 and list(off.shape) == [4, 1, 1, 1]
        assert off.reshape(-1).tolist() == [sum(lens[:i]) * 2 * 4 for i in range(4)]  # elements: tokens * h * d
    flat = {p: x[n[p]].as_strided((x[n[p]].numel(),), (1,)).float() for p in "qkv"}

    def seq(p, i, lens):  # sequence i of a packed [tokens, h, d] buffer as [h, s, d]
        start = sum(lens[:i])
        return flat[p][start * 8:(start + lens[i]) * 8].reshape(lens[i], 2, 4).transpose(0, 1)

    for i in range(3):
        qi, ki, vi = seq("q", i, lq), seq("k", i, lkv), seq("v", i, lkv)
        mask = torch.ones(lq[i], lkv[i], dtype=torch.bool).tril()
        expect = F.scaled_dot_product_attention(qi[None], ki[None], vi[None], attn_mask=mask, scale=0.5)[0]
        close(ref["o"][i, :, :lq[i]], expect)
    # a plan writes O packed at its offsets; rows past each sequence stay NaN and are not compared
    out = R.allocate_outputs(spec, "cpu")
    o_doc = spec.tensor(n["o"])
    FAM.ragged_scatter(out[n["o"]], o_doc, x[n["o_ragged_offset"]], lq, ref["o"])
    assert R.output_errors(spec, out, {n["o"]: ref["o"]}, inputs=x)[n["o"]] < R.TOLERANCE["BFLOAT16"]
    with pytest.raises(TuningError, match="ragged"):
        R.output_errors(spec, out, {n["o"]: ref["o"]})


def test_sdpa_backward_matches_autograd_with_consistent_o_and_stats():
    spec, n, x, ref = build(G.sdpa_bwd, b=2, h=2, s=8, d=8)
    q, k, v, do = (f32(x, n, p).requires_grad_(p != "dO") for p in ("q", "k", "v", "dO"))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=8 ** -0.5)
    close(f32(x, n, "o"), o.detach(), 1e-2)  # bf16 copy of the float32 forward
    s = (q @ k.transpose(-1, -2)).detach() * 8 ** -0.5
    s = s.masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf"))
    close(f32(x, n, "stats"), torch.logsumexp(s, -1, keepdim=True), 1e-6)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    close(ref["dQ"], dq)
    close(ref["dK"], dk)
    close(ref["dV"], dv)


def test_fp8_sdpa_emulates_the_quantized_probabilities():
    spec, n, x, ref = build(G.fp8_sdpa, b=1, h=2, s=8, d=8)
    assert x[n["q"]].dtype == torch.float8_e4m3fn
    assert float(x[n["scale_s"]].reshape(())) == 448.0 and float(x[n["descale_s"]].reshape(())) == pytest.approx(1 / 448)
    sc = {p: float(x[n[p]].reshape(())) for p in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")}
    assert all(0.5 < sc[p] < 2 for p in ("descale_q", "descale_k", "descale_v", "scale_o"))
    q, k, v = (f32(x, n, p) for p in "qkv")
    s = (q @ k.transpose(-1, -2)) * 8 ** -0.5 * sc["descale_q"] * sc["descale_k"]
    s = s.masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf"))
    p = torch.softmax(s, -1)
    p8 = (p * sc["scale_s"]).to(torch.float8_e4m3fn).float()
    o = (p8 @ v) * sc["descale_s"] * sc["descale_v"]
    close(ref["o"], o * sc["scale_o"], 1e-5)
    close(ref["stats"], torch.logsumexp(s, -1, keepdim=True), 1e-6)
    assert float(ref["amax_o"].reshape(())) == pytest.approx(float(o.abs().max()), rel=1e-5)


# ------------------------------------------------------------------ inputs, outputs, families


def test_make_inputs_deterministic_non_zero_and_laid_out_per_doc():
    g, _ = G.conv_fprop(n=2, c=4, hw=6, k=4, rs=3)
    spec = from_pygraph(g)
    a, a2, b = (R.make_inputs(spec, "cpu", seed=s) for s in (1, 1, 2))
    assert set(a) == {t.uid for t in spec.input_tensors()}
    for uid, t in a.items():
        doc = spec.tensor(uid)
        assert list(t.shape) == doc.dim and list(t.stride()) == doc.stride and t.dtype == torch.bfloat16
        assert torch.equal(t, a2[uid]) and not torch.equal(t, b[uid])
        assert bool((t.float() != 0).any())
    w = a[spec.io_names()["w"]].float()
    assert 0.05 < float(w.std()) < 0.3  # weights scaled by 1/sqrt(fan-in = 36)


def test_allocate_outputs_nan_filled_in_the_given_layout():
    spec, n = sdpa_graph()
    out = R.allocate_outputs(spec, "cpu", {n["o"]: ([2, 4, 6, 8], [192, 8, 32, 1])})
    assert out[n["o"]].stride() == (192, 8, 32, 1) and out[n["o"]].dtype == torch.bfloat16
    assert bool(out[n["o"]].isnan().all()) and bool(out[n["stats"]].isnan().all())
    assert out[n["stats"]].dtype == torch.float32


def test_output_errors_and_compare_outputs():
    spec, n, x, ref = build(G.mlp_matmul, m=4, k=8, n=4)
    out = R.allocate_outputs(spec, "cpu")
    assert math.isinf(R.output_errors(spec, out, R.reference_outputs(spec, x))[n["c"]])
    uid = n["c"]
    out[uid].copy_(ref["c"])
    assert R.compare_outputs(spec, out, {uid: ref["c"]}) < R.TOLERANCE["BFLOAT16"]
    out[uid].copy_(ref["c"] * 1.1)
    with pytest.raises(TuningError, match="exceeds tolerance"):
        R.compare_outputs(spec, out, {uid: ref["c"]})


def test_families_registry_coverage_and_kernel_cache_safety():
    safe = {f.name for f in FAM.FAMILIES if f.kernel_cache_safe}
    assert safe == {"conv_fprop", "pointwise"}
    assert {t for f in FAM.FAMILIES if f.kernel_cache_safe for t in f.node_types} == {"CONV_FPROP", "POINTWISE"}
    for f in FAM.FAMILIES:
        assert all(e in G.EXAMPLES for e in f.examples), f.name
    for name, builder in G.EXAMPLES.items():
        g, _ = builder()
        spec = from_pygraph(g)
        assert FAM.uncovered(spec) == [], name
        assert FAM.kernel_cache_safe(spec) == (name == "conv_fprop"), name
        assert R.required_bytes(spec) > sum(R.tensor_bytes(spec, t) for t in spec.input_tensors())
    g, _ = G.sdpa_fwd_train(b=1, h=1, s=1024, d=64)
    big = R.required_bytes(from_pygraph(g))
    assert big >= 1024 * 1024 * 4 * 3  # the score matrix


def test_uncovered_names_nodes_without_a_reference():
    g = graph()
    x = g.tensor(name="x", dim=[2, 4, 3, 3], data_type=FP32)
    s, sq = g.genstats(input=x)
    s.set_name("sum").set_output(True)
    sq.set_name("sq").set_output(True)
    y = g.sin(input=x)
    y.set_name("y").set_output(True)
    spec = from_pygraph(g)
    [msg] = FAM.uncovered(spec)
    assert "GENSTATS" in msg and "node 0" in msg
    assert FAM.family_of(spec.nodes[0]) is None and FAM.family_of(spec.nodes[1]).name == "pointwise"
    assert not FAM.kernel_cache_safe(spec)
    with pytest.raises(TuningError, match="GENSTATS"):
        R.reference_outputs(spec, R.make_inputs(spec, "cpu"))
    g = graph()  # dropout as a caller's mask and scale: nothing says what cuDNN drops (a seed and an offset do)
    q = g.tensor(name="q", dim=[1, 2, 4, 8], data_type=BF16)
    mask = g.tensor(name="mask", dim=[1, 2, 4, 4], data_type=BF16)
    scale = g.tensor(name="scale", dim=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT)
    o, _ = g.sdpa(q=q, k=q, v=q, generate_stats=False, dropout=(mask, scale))
    o.set_name("o").set_output(True)
    [msg] = FAM.uncovered(from_pygraph(g))
    assert "SDPA" in msg and "dropout" in msg


def test_sdpa_backward_gqa_bias_padding_and_head_chunks(monkeypatch):
    b, hq, hkv, sq, skv, d = 2, 4, 2, 6, 8, 8
    g = graph()
    q = g.tensor(name="q", dim=[b, hq, sq, d], data_type=BF16)
    k = g.tensor(name="k", dim=[b, hkv, skv, d], data_type=BF16)
    v = g.tensor(name="v", dim=[b, hkv, skv, d], data_type=BF16)
    o = g.tensor(name="o", dim=[b, hq, sq, d], data_type=BF16)
    do = g.tensor(name="dO", dim=[b, hq, sq, d], data_type=BF16)
    st = g.tensor(name="stats", dim=[b, hq, sq, 1], data_type=FP32)
    bias = g.tensor(name="bias", dim=[1, hq, sq, skv], data_type=FP32)
    dbias = g.tensor(name="dbias", dim=[1, hq, sq, skv], data_type=FP32)
    slq = g.tensor(name="seq_len_q", dim=[b, 1, 1, 1], data_type=INT32)
    slkv = g.tensor(name="seq_len_kv", dim=[b, 1, 1, 1], data_type=INT32)
    outs = g.sdpa_backward(q=q, k=k, v=v, o=o, dO=do, stats=st, attn_scale=0.4, bias=bias, dBias=dbias,
                           use_padding_mask=True, seq_len_q=slq, seq_len_kv=slkv, use_causal_mask_bottom_right=True)
    for t, name in zip(outs, ("dQ", "dK", "dV")):
        t.set_name(name).set_output(True)
    spec = from_pygraph(g)
    n = spec.io_names()
    assert FAM.uncovered(spec) == []
    x = R.make_inputs(spec, "cpu", seed=9)
    ref = R.reference_outputs(spec, x)
    lq, lkv = x[n["seq_len_q"]].reshape(-1).tolist(), x[n["seq_len_kv"]].reshape(-1).tolist()
    mask = _band(b, sq, skv, right=0, br=True, lq=lq, lkv=lkv)
    qq, kk, vv, bb = (f32(x, n, p).requires_grad_() for p in ("q", "k", "v", "bias"))
    add = (bb + torch.zeros(b, 1, 1, 1)).masked_fill(~mask, float("-inf"))
    rows = mask.any(-1, keepdim=True)
    oo = torch.nan_to_num(attention(qq, kk, vv, 0.4, add)) * rows
    close(f32(x, n, "o") * rows, oo.detach() * rows, 1e-2)  # make_inputs' o is the forward of these inputs
    grads = torch.autograd.grad(oo, (qq, kk, vv, bb), f32(x, n, "dO"))
    kv_rows = (torch.arange(skv).view(1, 1, -1, 1) < torch.tensor(lkv).view(-1, 1, 1, 1))
    close(ref[n["dQ"]] * rows, grads[0] * rows)
    close(ref[n["dK"]] * kv_rows, grads[1] * kv_rows)
    close(ref[n["dV"]] * kv_rows, grads[2] * kv_rows)
    close(ref[n["dbias"]], grads[3])
    masks = R.compare_mask(spec, x)
    assert set(masks) <= {n["dQ"], n["dK"], n["dV"]}
    monkeypatch.setattr(FAM, "SCORE_CHUNK_BYTES", sq * skv * 4)  # one head per chunk
    assert FAM.head_chunk(hq, sq, skv) == 1
    chunked = R.reference_outputs(spec, x)
    for uid, t in ref.items():
        close(chunked[uid], t, 1e-6)


def test_builder_spec_embedded_scalar_and_the_eager_path():
    from examples.generate import conv_bias_relu

    spec = conv_bias_relu(n=2, c=8, hw=6, k=4)  # written with SpecBuilder
    n = spec.io_names()
    x = R.make_inputs(spec, "cpu", seed=3)
    ref = R.reference_outputs(spec, x)[n["Y"]]
    close(ref, torch.relu(F.conv2d(f32(x, n, "X"), f32(x, n, "W"), padding=1) + f32(x, n, "B")))
    eager = R.evaluate(spec, x, exact_float32=False)[n["Y"]]
    assert eager.dtype == torch.bfloat16
    close(eager, ref, R.TOLERANCE["BFLOAT16"])

    g = graph(FP16)
    a = g.tensor(name="a", dim=[2, 3], data_type=FP16)
    c = g.tensor(name="c", dim=[1, 1], data_type=FP32, is_pass_by_value=True, pass_by_value=2.5)
    g.mul(a=a, b=c).set_name("y").set_output(True).set_dim([2, 3])
    spec = from_pygraph(g)
    n = spec.io_names()
    x = R.make_inputs(spec, "cpu")
    assert float(x[n["c"]]) == 2.5
    close(R.reference_outputs(spec, x)[n["y"]], f32(x, n, "a") * 2.5, 1e-6)

    _, n, x, ref = build(G.sdpa_fwd_train, b=1, h=2, s=8, d=8)
    spec = from_pygraph(G.sdpa_fwd_train(b=1, h=2, s=8, d=8)[0])
    eager = R.evaluate(spec, x, exact_float32=False)
    assert max(R.output_errors(spec, eager, R.reference_outputs(spec, x)).values()) < R.TOLERANCE["BFLOAT16"]


def test_ragged_offsets_with_a_multiplier_and_int64():
    b, h, s, d = 3, 2, 8, 4
    g = graph()
    offs = {p: g.tensor(name=f"{p}_off", dim=[b + 1, 1, 1, 1], data_type=cudnn.data_type.INT64) for p in "qkvo"}
    st = [s * h * d, d, h * d, 1]
    t = {p: g.tensor(name=p, dim=[b, h, s, d], stride=st, ragged_offset=offs[p], ragged_offset_multiplier=h * d)
         for p in "qkv"}
    slq = g.tensor(name="seq_len_q", dim=[b, 1, 1, 1], data_type=INT32)
    slkv = g.tensor(name="seq_len_kv", dim=[b, 1, 1, 1], data_type=INT32)
    o, _ = g.sdpa(q=t["q"], k=t["k"], v=t["v"], generate_stats=False, use_padding_mask=True, seq_len_q=slq,
                  seq_len_kv=slkv, attn_scale=0.5)
    o.set_name("o").set_output(True).set_dim([b, h, s, d]).set_stride(st).set_ragged_offset(offs["o"])
    o.set_ragged_offset_multiplier(h * d)
    spec = from_pygraph(g)
    n = spec.io_names()
    x = R.make_inputs(spec, "cpu", seed=3)
    lq = x[n["seq_len_q"]].reshape(-1).tolist()
    assert x[n["q_off"]].dtype == torch.int64
    assert x[n["q_off"]].reshape(-1).tolist() == [sum(lq[:i]) for i in range(b + 1)]  # in tokens (x h*d elements)
    ref = R.reference_outputs(spec, x)
    flat = x[n["q"]].as_strided((x[n["q"]].numel(),), (1,)).float()
    q1 = flat[lq[0] * h * d:(lq[0] + lq[1]) * h * d].reshape(lq[1], h, d).transpose(0, 1)
    dense_q = FAM.ragged_gather(x[n["q"]], spec.tensor(n["q"]), x[n["q_off"]], lq)
    assert torch.equal(dense_q[1, :, :lq[1]], q1) and not bool(dense_q[1, :, lq[1]:].any())
    out = R.allocate_outputs(spec, "cpu")
    FAM.ragged_scatter(out[n["o"]], spec.tensor(n["o"]), x[n["o_off"]], lq, ref[n["o"]])
    assert R.output_errors(spec, out, ref, inputs=x)[n["o"]] < R.TOLERANCE["BFLOAT16"]


@pytest.mark.parametrize("params", [{}, {"use_causal_mask": True}, {"use_causal_mask_bottom_right": True},
                                    {"diagonal_band_left_bound": 3, "diagonal_band_right_bound": 0}])
def test_eager_attention_agrees_with_the_reference(params):
    spec, n = sdpa_graph(stats=False, **params)  # O only: torch's fused attention
    x = R.make_inputs(spec, "cpu", seed=4)
    eager = R.evaluate(spec, x, exact_float32=False)[n["o"]]
    ref = R.reference_outputs(spec, x)[n["o"]]
    assert eager.dtype == torch.bfloat16
    close(eager, ref, R.TOLERANCE["BFLOAT16"])


def test_an_fp8_attentions_amax_of_o_is_held_to_os_tolerance_and_the_rest_to_their_own():
    spec, n, _, _ = build(G.fp8_sdpa, b=1, h=2, s=8, d=8)
    node = next(nd for nd in spec.nodes if nd.type == "SDPA_FP8")
    o, amax_o = spec.tensor(node.outputs["O"]), spec.tensor(node.outputs["Amax_O"])
    assert spec.data_type_of(amax_o) == "FLOAT" and spec.data_type_of(o) == "FP8_E4M3"
    assert R.tolerance(spec, amax_o) == R.TOLERANCE["FP8_E4M3"] == R.tolerance(spec, o)
    stats = spec.tensor(node.outputs["Stats"])
    assert R.tolerance(spec, stats) == R.TOLERANCE["FLOAT"]  # not a summary of a quantized output
    mm, _, _, _ = build(G.fp8_matmul)
    assert {R.tolerance(mm, t) for t in mm.output_tensors()} == {R.TOLERANCE[mm.data_type_of(t)] for t in mm.output_tensors()}
