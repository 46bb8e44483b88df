"""Example cuDNN Frontend (FE 1.32) graphs, written as ordinary ``cudnn.pygraph`` user code.

Every builder has the form ``NAME(handle=None, **kw) -> (graph, tensors)``:

* it creates ``cudnn.pygraph(...)`` (the handle is passed only when given), adds the tensors and
  ops, marks the outputs and declares their dims / strides / data types, and returns
  **without** calling ``validate()`` / ``build()`` -- constructing a graph needs no GPU;
* ``tensors`` maps a stable name to every non-virtual tensor (all graph inputs and outputs),
  and each tensor carries that same name, so a caller can bind torch tensors by name
  (``{tensors[k]: buf for k, buf in bufs.items()}`` is a variant pack);
* keyword arguments (all optional, keyword-only) change the sizes and the 16-bit I/O type.

Layouts follow the FE samples: convolutions are channels-last (NHWC / KRSC strides), attention
tensors are declared in the logical ``[b, h, s, d]`` order with BSHD physical strides
(``[s*h*d, d, h*d, 1]``), norms use ``[tokens, hidden, 1, 1]`` with channels-last strides.
I/O is bf16 by default (``io_dtype=cudnn.data_type.HALF`` for fp16); intermediates and compute
are float32.

Some inputs must hold particular values at run time (sequence lengths, page tables, ragged
offsets, epsilon, fp8 scales): see ``RUNTIME_VALUES`` and README.md next to this file.

``python examples/fe/graphs.py`` constructs every example on the CPU, encodes it with
``cudnn._plan_serdes._encode_graph`` and prints its nodes and tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import cudnn

BF16 = cudnn.data_type.BFLOAT16
FP16 = cudnn.data_type.HALF
FP32 = cudnn.data_type.FLOAT
FP8_E4M3 = cudnn.data_type.FP8_E4M3
INT32 = cudnn.data_type.INT32

TensorMap = dict[str, object]  # name -> cudnn tensor (cudnn._pygraph Tensor)
Built = tuple["cudnn.pygraph", TensorMap]


# ---------------------------------------------------------------------------------------------
# layout helpers
# ---------------------------------------------------------------------------------------------


def bshd_strides(b: int, h: int, s: int, d: int) -> list[int]:
    """Strides of a logical [b, h, s, d] tensor stored as [b, s, h, d] (BSHD)."""
    return [s * h * d, d, h * d, 1]


def bhsd_strides(b: int, h: int, s: int, d: int) -> list[int]:
    """Strides of a logical [b, h, s, d] tensor stored densely in that order (BHSD)."""
    return [h * s * d, s * d, d, 1]


def stats_strides(b: int, h: int, s: int) -> list[int]:
    """Strides of the float32 softmax stats [b, h, s, 1] (dense, head-major, as FE samples)."""
    return [h * s, s, 1, 1]


def nhwc_strides(n: int, c: int, h: int, w: int) -> list[int]:
    """Channels-last strides of a logical NCHW (or KCRS filter) tensor."""
    return [c * h * w, 1, w * c, c]


def row_major(dim: list[int]) -> list[int]:
    stride, acc = [], 1
    for extent in reversed(dim):
        stride.insert(0, acc)
        acc *= extent
    return stride


SCALAR4 = {"dim": [1, 1, 1, 1], "stride": [1, 1, 1, 1]}  # a 1-element 4-D tensor
SCALAR3 = {"dim": [1, 1, 1], "stride": [1, 1, 1]}  # a 1-element 3-D tensor (matmul epilogues)


def _graph(name: str, handle, io_dtype) -> cudnn.pygraph:
    kwargs = {
        "name": name,
        "io_data_type": io_dtype,
        "intermediate_data_type": FP32,
        "compute_data_type": FP32,
    }
    if handle is not None:
        kwargs["handle"] = handle
    return cudnn.pygraph(**kwargs)


def _out(t, name: str, dim: list[int], stride: list[int], dtype):
    """Mark an op result as a graph output with an explicit name, layout and data type."""
    return t.set_name(name).set_output(True).set_dim(list(dim)).set_stride(list(stride)).set_data_type(dtype)


def _seq_lens(g, b: int) -> tuple[object, object]:
    """Per-sequence lengths, int32 [b, 1, 1, 1] (actual lengths; padding mask reads them)."""
    q = g.tensor(name="seq_len_q", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=INT32)
    kv = g.tensor(name="seq_len_kv", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=INT32)
    return q, kv


# ---------------------------------------------------------------------------------------------
# attention (bf16 / fp16)
# ---------------------------------------------------------------------------------------------


def sdpa_fwd_train(handle=None, *, b: int = 2, h: int = 8, s: int = 512, d: int = 64, io_dtype=BF16) -> Built:
    """Causal SDPA forward for training: O and the float32 softmax Stats (log-sum-exp)."""
    g = _graph("sdpa_fwd_train", handle, io_dtype)
    qkv_stride = bshd_strides(b, h, s, d)
    q = g.tensor(name="q", dim=[b, h, s, d], stride=qkv_stride, data_type=io_dtype)
    k = g.tensor(name="k", dim=[b, h, s, d], stride=qkv_stride, data_type=io_dtype)
    v = g.tensor(name="v", dim=[b, h, s, d], stride=qkv_stride, data_type=io_dtype)

    o, stats = g.sdpa(
        name="sdpa_fwd",
        q=q,
        k=k,
        v=v,
        generate_stats=True,
        attn_scale=1.0 / math.sqrt(d),
        # causal: keys j <= query i (the preferred spelling of use_causal_mask=True)
        diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
        diagonal_band_right_bound=0,
    )
    _out(o, "o", [b, h, s, d], qkv_stride, io_dtype)
    _out(stats, "stats", [b, h, s, 1], stats_strides(b, h, s), FP32)
    return g, {"q": q, "k": k, "v": v, "o": o, "stats": stats}


def sdpa_bwd(handle=None, *, b: int = 2, h: int = 8, s: int = 512, d: int = 64, io_dtype=BF16,
             deterministic: bool = False) -> Built:
    """Causal SDPA backward matching ``sdpa_fwd_train``: dQ, dK, dV from q, k, v, o, dO, stats."""
    g = _graph("sdpa_bwd", handle, io_dtype)
    stride = bshd_strides(b, h, s, d)
    q = g.tensor(name="q", dim=[b, h, s, d], stride=stride, data_type=io_dtype)
    k = g.tensor(name="k", dim=[b, h, s, d], stride=stride, data_type=io_dtype)
    v = g.tensor(name="v", dim=[b, h, s, d], stride=stride, data_type=io_dtype)
    o = g.tensor(name="o", dim=[b, h, s, d], stride=stride, data_type=io_dtype)
    d_o = g.tensor(name="dO", dim=[b, h, s, d], stride=stride, data_type=io_dtype)
    stats = g.tensor(name="stats", dim=[b, h, s, 1], stride=stats_strides(b, h, s), data_type=FP32)

    dq, dk, dv = g.sdpa_backward(
        name="sdpa_bwd",
        q=q,
        k=k,
        v=v,
        o=o,
        dO=d_o,
        stats=stats,
        attn_scale=1.0 / math.sqrt(d),
        diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
        diagonal_band_right_bound=0,
        use_deterministic_algorithm=deterministic,
    )
    _out(dq, "dQ", [b, h, s, d], stride, io_dtype)
    _out(dk, "dK", [b, h, s, d], stride, io_dtype)
    _out(dv, "dV", [b, h, s, d], stride, io_dtype)
    return g, {"q": q, "k": k, "v": v, "o": o, "dO": d_o, "stats": stats, "dQ": dq, "dK": dk, "dV": dv}


def chunked_prefill(
    handle=None, *, b: int = 2, h_q: int = 8, h_kv: int = 2, s_q: int = 128, s_kv: int = 512, d: int = 64, io_dtype=BF16
) -> Built:
    """Prefill of the last s_q tokens against s_kv keys (s_q < s_kv): bottom-right causal, GQA."""
    g = _graph("chunked_prefill", handle, io_dtype)
    q_stride = bshd_strides(b, h_q, s_q, d)
    kv_stride = bshd_strides(b, h_kv, s_kv, d)
    q = g.tensor(name="q", dim=[b, h_q, s_q, d], stride=q_stride, data_type=io_dtype)
    k = g.tensor(name="k", dim=[b, h_kv, s_kv, d], stride=kv_stride, data_type=io_dtype)
    v = g.tensor(name="v", dim=[b, h_kv, s_kv, d], stride=kv_stride, data_type=io_dtype)

    o, _ = g.sdpa(
        name="sdpa_prefill",
        q=q,
        k=k,
        v=v,
        generate_stats=False,
        attn_scale=1.0 / math.sqrt(d),
        # causal with the diagonal anchored at the bottom-right corner: query i (of s_q) sees
        # keys j <= i + (s_kv - s_q)   (= use_causal_mask_bottom_right=True)
        diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT,
        diagonal_band_right_bound=0,
    )
    _out(o, "o", [b, h_q, s_q, d], q_stride, io_dtype)
    return g, {"q": q, "k": k, "v": v, "o": o}


def sliding_window(handle=None, *, b: int = 2, h: int = 8, s: int = 1024, d: int = 64, window: int = 256, io_dtype=BF16) -> Built:
    """Causal sliding-window SDPA (inference): query i sees keys j with i - window < j <= i."""
    g = _graph("sliding_window", handle, io_dtype)
    stride = bshd_strides(b, h, s, d)
    q = g.tensor(name="q", dim=[b, h, s, d], stride=stride, data_type=io_dtype)
    k = g.tensor(name="k", dim=[b, h, s, d], stride=stride, data_type=io_dtype)
    v = g.tensor(name="v", dim=[b, h, s, d], stride=stride, data_type=io_dtype)

    o, _ = g.sdpa(
        name="sdpa_swa",
        q=q,
        k=k,
        v=v,
        generate_stats=False,
        attn_scale=1.0 / math.sqrt(d),
        diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
        diagonal_band_left_bound=window,  # (the preferred spelling of sliding_window_length)
        diagonal_band_right_bound=0,
    )
    _out(o, "o", [b, h, s, d], stride, io_dtype)
    return g, {"q": q, "k": k, "v": v, "o": o}


def paged_decode(
    handle=None,
    *,
    b: int = 4,
    h_q: int = 8,
    h_kv: int = 2,
    d: int = 128,
    max_seq_len_kv: int = 1024,
    block_size: int = 64,
    num_blocks: int | None = None,
    io_dtype=BF16,
) -> Built:
    """Decode step (s_q = 1) over a paged K/V cache with page tables, padding mask and GQA."""
    g = _graph("paged_decode", handle, io_dtype)
    pages_per_seq = math.ceil(max_seq_len_kv / block_size)
    num_blocks = num_blocks or b * pages_per_seq  # pool size; any value >= the pages in use

    q_stride = bshd_strides(b, h_q, 1, d)
    q = g.tensor(name="q", dim=[b, h_q, 1, d], stride=q_stride, data_type=io_dtype)
    # K/V page pools ("containers"): [num_blocks, h_kv, block_size, d], dense as in the FE samples
    pool_dim = [num_blocks, h_kv, block_size, d]
    k_cache = g.tensor(name="k_cache", dim=pool_dim, stride=row_major(pool_dim), data_type=io_dtype)
    v_cache = g.tensor(name="v_cache", dim=pool_dim, stride=row_major(pool_dim), data_type=io_dtype)
    # page tables: [b, 1, pages_per_seq, 1] int32, entry p of sequence i = pool block holding its
    # tokens [p*block_size, (p+1)*block_size)
    table_dim = [b, 1, pages_per_seq, 1]
    table_stride = [pages_per_seq, pages_per_seq, 1, 1]
    page_table_k = g.tensor(name="page_table_k", dim=table_dim, stride=table_stride, data_type=INT32)
    page_table_v = g.tensor(name="page_table_v", dim=table_dim, stride=table_stride, data_type=INT32)
    seq_len_q, seq_len_kv = _seq_lens(g, b)

    o, _ = g.sdpa(
        name="sdpa_decode",
        q=q,
        k=k_cache,
        v=v_cache,
        generate_stats=False,
        attn_scale=1.0 / math.sqrt(d),
        use_padding_mask=True,
        seq_len_q=seq_len_q,
        seq_len_kv=seq_len_kv,
        paged_attention_k_table=page_table_k,
        paged_attention_v_table=page_table_v,
        paged_attention_max_seq_len_kv=max_seq_len_kv,
    )
    _out(o, "o", [b, h_q, 1, d], q_stride, io_dtype)
    return g, {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "page_table_k": page_table_k,
        "page_table_v": page_table_v,
        "seq_len_q": seq_len_q,
        "seq_len_kv": seq_len_kv,
        "o": o,
    }


def varlen_sdpa(
    handle=None, *, b: int = 4, h: int = 8, max_s_q: int = 512, max_s_kv: int = 512, d: int = 64, causal: bool = True,
    io_dtype=BF16,
) -> Built:
    """Packed variable-length (THD / ragged) attention: ragged offsets on q/k/v/o, padding mask."""
    g = _graph("varlen_sdpa", handle, io_dtype)
    # Logical [b, h, max_s, d] with BSHD strides; the ragged offsets move each sequence's start
    # into a packed [total_tokens, h, d] buffer, so only the (h, s, d) strides are read.
    q_stride = bshd_strides(b, h, max_s_q, d)
    kv_stride = bshd_strides(b, h, max_s_kv, d)
    ragged = {"dim": [b + 1, 1, 1, 1], "stride": [1, 1, 1, 1], "data_type": INT32}
    q_offsets = g.tensor(name="q_ragged_offset", **ragged)
    k_offsets = g.tensor(name="k_ragged_offset", **ragged)
    v_offsets = g.tensor(name="v_ragged_offset", **ragged)
    o_offsets = g.tensor(name="o_ragged_offset", **ragged)

    q = g.tensor(name="q", dim=[b, h, max_s_q, d], stride=q_stride, data_type=io_dtype)
    k = g.tensor(name="k", dim=[b, h, max_s_kv, d], stride=kv_stride, data_type=io_dtype)
    v = g.tensor(name="v", dim=[b, h, max_s_kv, d], stride=kv_stride, data_type=io_dtype)
    q.set_ragged_offset(q_offsets)
    k.set_ragged_offset(k_offsets)
    v.set_ragged_offset(v_offsets)
    seq_len_q, seq_len_kv = _seq_lens(g, b)

    mask = {"diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT, "diagonal_band_right_bound": 0} if causal else {}
    o, _ = g.sdpa(
        name="sdpa_varlen",
        q=q,
        k=k,
        v=v,
        generate_stats=False,
        attn_scale=1.0 / math.sqrt(d),
        use_padding_mask=True,
        seq_len_q=seq_len_q,
        seq_len_kv=seq_len_kv,
        **mask,
    )
    _out(o, "o", [b, h, max_s_q, d], q_stride, io_dtype)
    o.set_ragged_offset(o_offsets)
    return g, {
        "q": q,
        "k": k,
        "v": v,
        "o": o,
        "seq_len_q": seq_len_q,
        "seq_len_kv": seq_len_kv,
        "q_ragged_offset": q_offsets,
        "k_ragged_offset": k_offsets,
        "v_ragged_offset": v_offsets,
        "o_ragged_offset": o_offsets,
    }


# ---------------------------------------------------------------------------------------------
# attention (fp8)
# ---------------------------------------------------------------------------------------------


def fp8_sdpa(
    handle=None,
    *,
    b: int = 2,
    h: int = 8,
    s: int = 512,
    d: int = 64,
    causal: bool = True,
    generate_stats: bool = True,
    o_dtype=FP8_E4M3,
    with_amax_s: bool = False,
) -> Built:
    """FP8 (e4m3) SDPA forward with per-tensor descale/scale factors and the amax of O.

    ``Amax_S`` stays virtual unless ``with_amax_s``: FE 1.32 documents it as deprecated
    ("leave it virtual and set scale_s from the bounds"; declaring it restricts the graph to
    backend engines), and FE's own fp8 tests leave it undeclared.
    """
    g = _graph("fp8_sdpa", handle, FP8_E4M3)
    stride = bshd_strides(b, h, s, d)
    q = g.tensor(name="q", dim=[b, h, s, d], stride=stride, data_type=FP8_E4M3)
    k = g.tensor(name="k", dim=[b, h, s, d], stride=stride, data_type=FP8_E4M3)
    v = g.tensor(name="v", dim=[b, h, s, d], stride=stride, data_type=FP8_E4M3)
    factors = {n: g.tensor(name=n, data_type=FP32, **SCALAR4)
               for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")}

    mask = {"diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT, "right_bound": 0} if causal else {}
    o, stats, amax_s, amax_o = g.sdpa_fp8(
        name="sdpa_fp8",
        q=q,
        k=k,
        v=v,
        **factors,  # descale_q, descale_k, descale_v, descale_s, scale_s, scale_o
        generate_stats=generate_stats,
        attn_scale=1.0 / math.sqrt(d),
        **mask,  # sdpa_fp8 spells the band bounds left_bound / right_bound
    )
    _out(o, "o", [b, h, s, d], stride, o_dtype)
    _out(amax_o, "amax_o", [1, 1, 1, 1], [1, 1, 1, 1], FP32)
    tensors = {"q": q, "k": k, "v": v, **factors, "o": o, "amax_o": amax_o}
    if generate_stats:
        tensors["stats"] = _out(stats, "stats", [b, h, s, 1], stats_strides(b, h, s), FP32)
    if with_amax_s:
        tensors["amax_s"] = _out(amax_s, "amax_s", [1, 1, 1, 1], [1, 1, 1, 1], FP32)
    return g, tensors


# ---------------------------------------------------------------------------------------------
# norms
# ---------------------------------------------------------------------------------------------


def _norm_io(g, tokens: int, hidden: int, io_dtype, *, bias: bool = True):
    x_dim, w_dim = [tokens, hidden, 1, 1], [1, hidden, 1, 1]
    x = g.tensor(name="x", dim=x_dim, stride=nhwc_strides(*x_dim), data_type=io_dtype)
    scale = g.tensor(name="scale", dim=w_dim, stride=nhwc_strides(*w_dim), data_type=io_dtype)
    shift = g.tensor(name="bias", dim=w_dim, stride=nhwc_strides(*w_dim), data_type=io_dtype) if bias else None
    # host scalar, bound at execute from a CPU float32 tensor of shape [1, 1, 1, 1]
    eps = g.tensor(name="epsilon", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=FP32, is_pass_by_value=True)
    return x, scale, shift, eps


def layernorm_fwd_train(handle=None, *, tokens: int = 2048, hidden: int = 1024, io_dtype=BF16) -> Built:
    """LayerNorm forward, TRAINING phase: Y plus the float32 per-row mean and inverse std."""
    g = _graph("layernorm_fwd_train", handle, io_dtype)
    x, scale, shift, eps = _norm_io(g, tokens, hidden, io_dtype)
    y, mean, inv_var = g.layernorm(
        name="layernorm",
        norm_forward_phase=cudnn.norm_forward_phase.TRAINING,
        input=x,
        scale=scale,
        bias=shift,
        epsilon=eps,
    )
    _out(y, "y", [tokens, hidden, 1, 1], nhwc_strides(tokens, hidden, 1, 1), io_dtype)
    _out(mean, "mean", [tokens, 1, 1, 1], [1, 1, 1, 1], FP32)
    _out(inv_var, "inv_var", [tokens, 1, 1, 1], [1, 1, 1, 1], FP32)
    return g, {"x": x, "scale": scale, "bias": shift, "epsilon": eps, "y": y, "mean": mean, "inv_var": inv_var}


def layernorm_bwd(handle=None, *, tokens: int = 2048, hidden: int = 1024, io_dtype=BF16) -> Built:
    """LayerNorm backward matching ``layernorm_fwd_train``: dX, dScale, dBias."""
    g = _graph("layernorm_bwd", handle, io_dtype)
    x_dim, w_dim = [tokens, hidden, 1, 1], [1, hidden, 1, 1]
    dy = g.tensor(name="dy", dim=x_dim, stride=nhwc_strides(*x_dim), data_type=io_dtype)
    x = g.tensor(name="x", dim=x_dim, stride=nhwc_strides(*x_dim), data_type=io_dtype)
    scale = g.tensor(name="scale", dim=w_dim, stride=nhwc_strides(*w_dim), data_type=io_dtype)
    mean = g.tensor(name="mean", dim=[tokens, 1, 1, 1], stride=[1, 1, 1, 1], data_type=FP32)
    inv_var = g.tensor(name="inv_var", dim=[tokens, 1, 1, 1], stride=[1, 1, 1, 1], data_type=FP32)

    dx, dscale, dbias = g.layernorm_backward(
        name="layernorm_bwd",
        grad=dy,
        input=x,
        scale=scale,
        mean=mean,
        inv_variance=inv_var,
    )
    _out(dx, "dx", x_dim, nhwc_strides(*x_dim), io_dtype)
    _out(dscale, "dscale", w_dim, nhwc_strides(*w_dim), io_dtype)
    _out(dbias, "dbias", w_dim, nhwc_strides(*w_dim), io_dtype)
    return g, {"dy": dy, "x": x, "scale": scale, "mean": mean, "inv_var": inv_var, "dx": dx, "dscale": dscale, "dbias": dbias}


def rmsnorm_infer(handle=None, *, tokens: int = 2048, hidden: int = 1024, io_dtype=BF16) -> Built:
    """RMSNorm forward, INFERENCE phase (no statistics output, no bias)."""
    g = _graph("rmsnorm_infer", handle, io_dtype)
    x, scale, _, eps = _norm_io(g, tokens, hidden, io_dtype, bias=False)
    y, inv_var = g.rmsnorm(
        name="rmsnorm",
        norm_forward_phase=cudnn.norm_forward_phase.INFERENCE,
        input=x,
        scale=scale,
        epsilon=eps,
    )
    assert inv_var is None  # no statistics in the inference phase
    _out(y, "y", [tokens, hidden, 1, 1], nhwc_strides(tokens, hidden, 1, 1), io_dtype)
    return g, {"x": x, "scale": scale, "epsilon": eps, "y": y}


# ---------------------------------------------------------------------------------------------
# matmul
# ---------------------------------------------------------------------------------------------


def mlp_matmul(handle=None, *, batch: int = 1, m: int = 2048, k: int = 1024, n: int = 4096, io_dtype=BF16) -> Built:
    """Transformer MLP up-projection: [batch, m, k] @ [batch, k, n] (row-major)."""
    g = _graph("mlp_matmul", handle, io_dtype)
    a = g.tensor(name="a", dim=[batch, m, k], stride=[m * k, k, 1], data_type=io_dtype)
    w = g.tensor(name="w", dim=[batch, k, n], stride=[k * n, n, 1], data_type=io_dtype)
    c = g.matmul(name="mlp_fc1", A=a, B=w, compute_data_type=FP32)
    _out(c, "c", [batch, m, n], [m * n, n, 1], io_dtype)
    return g, {"a": a, "w": w, "c": c}


def mlp_matmul_bias_gelu(handle=None, *, batch: int = 1, m: int = 2048, k: int = 1024, n: int = 4096, io_dtype=BF16) -> Built:
    """The same matmul with the epilogue + bias[n] -> gelu (erf form), fused."""
    g = _graph("mlp_matmul_bias_gelu", handle, io_dtype)
    a = g.tensor(name="a", dim=[batch, m, k], stride=[m * k, k, 1], data_type=io_dtype)
    w = g.tensor(name="w", dim=[batch, k, n], stride=[k * n, n, 1], data_type=io_dtype)
    bias = g.tensor(name="bias", dim=[1, 1, n], stride=[n, n, 1], data_type=io_dtype)
    c = g.matmul(name="mlp_fc1", A=a, B=w, compute_data_type=FP32)
    c.set_data_type(FP32)  # virtual float32 accumulator
    h = g.bias(name="bias_add", input=c, bias=bias)
    h.set_data_type(FP32)
    y = g.gelu(name="gelu", input=h)
    _out(y, "y", [batch, m, n], [m * n, n, 1], io_dtype)
    return g, {"a": a, "w": w, "bias": bias, "y": y}


def fp8_matmul(handle=None, *, batch: int = 1, m: int = 2048, k: int = 1024, n: int = 4096, io_dtype=BF16) -> Built:
    """FP8 e4m3 GEMM: y = (a @ b) * descale_a * descale_b in bf16, plus amax(|y|) in float32.

    ``a`` is row-major (K contiguous) and ``b`` column-major (K contiguous), the layout
    Hopper's FP8 tensor-core GEMMs take (as in FE's fp8_matmul sample).
    """
    g = _graph("fp8_matmul", handle, io_dtype)
    a = g.tensor(name="a", dim=[batch, m, k], stride=[m * k, k, 1], data_type=FP8_E4M3)
    bmat = g.tensor(name="b", dim=[batch, k, n], stride=[k * n, 1, k], data_type=FP8_E4M3)
    descale_a = g.tensor(name="descale_a", data_type=FP32, **SCALAR3)
    descale_b = g.tensor(name="descale_b", data_type=FP32, **SCALAR3)

    c = g.matmul(name="gemm", A=a, B=bmat, compute_data_type=FP32)
    c.set_data_type(FP32)
    c_a = g.mul(name="descale_a_mul", a=c, b=descale_a)
    c_a.set_data_type(FP32)
    y = g.mul(name="descale_b_mul", a=c_a, b=descale_b)
    _out(y, "y", [batch, m, n], [m * n, n, 1], io_dtype)
    amax = g.reduction(name="amax", input=y, mode=cudnn.reduction_mode.AMAX, compute_data_type=FP32)
    _out(amax, "amax", [1, 1, 1], [1, 1, 1], FP32)
    return g, {"a": a, "b": bmat, "descale_a": descale_a, "descale_b": descale_b, "y": y, "amax": amax}


# ---------------------------------------------------------------------------------------------
# convolution (one layer's training set: fprop, dgrad, wgrad)
# ---------------------------------------------------------------------------------------------

_CONV = {"padding": [1, 1], "stride": [1, 1], "dilation": [1, 1]}


def _conv_shapes(n: int, c: int, hw: int, k: int, rs: int):
    out_hw = hw + 2 * 1 - rs + 1  # padding 1, stride 1
    return [n, c, hw, hw], [k, c, rs, rs], [n, k, out_hw, out_hw]


def conv_fprop(handle=None, *, n: int = 8, c: int = 64, hw: int = 28, k: int = 64, rs: int = 3, io_dtype=BF16) -> Built:
    """Convolution forward, channels-last: y = conv(x, w), padding 1, stride 1."""
    g = _graph("conv_fprop", handle, io_dtype)
    x_dim, w_dim, y_dim = _conv_shapes(n, c, hw, k, rs)
    x = g.tensor(name="x", dim=x_dim, stride=nhwc_strides(*x_dim), data_type=io_dtype)
    w = g.tensor(name="w", dim=w_dim, stride=nhwc_strides(*w_dim), data_type=io_dtype)
    y = g.conv_fprop(name="fprop", image=x, weight=w, compute_data_type=FP32, **_CONV)
    _out(y, "y", y_dim, nhwc_strides(*y_dim), io_dtype)
    return g, {"x": x, "w": w, "y": y}


def conv_dgrad(handle=None, *, n: int = 8, c: int = 64, hw: int = 28, k: int = 64, rs: int = 3, io_dtype=BF16) -> Built:
    """Convolution data gradient of the same layer: dx = conv_dgrad(dy, w)."""
    g = _graph("conv_dgrad", handle, io_dtype)
    x_dim, w_dim, y_dim = _conv_shapes(n, c, hw, k, rs)
    dy = g.tensor(name="dy", dim=y_dim, stride=nhwc_strides(*y_dim), data_type=io_dtype)
    w = g.tensor(name="w", dim=w_dim, stride=nhwc_strides(*w_dim), data_type=io_dtype)
    dx = g.conv_dgrad(name="dgrad", loss=dy, filter=w, compute_data_type=FP32, **_CONV)
    _out(dx, "dx", x_dim, nhwc_strides(*x_dim), io_dtype)
    return g, {"dy": dy, "w": w, "dx": dx}


def conv_wgrad(handle=None, *, n: int = 8, c: int = 64, hw: int = 28, k: int = 64, rs: int = 3, io_dtype=BF16) -> Built:
    """Convolution weight gradient of the same layer: dw = conv_wgrad(x, dy)."""
    g = _graph("conv_wgrad", handle, io_dtype)
    x_dim, w_dim, y_dim = _conv_shapes(n, c, hw, k, rs)
    x = g.tensor(name="x", dim=x_dim, stride=nhwc_strides(*x_dim), data_type=io_dtype)
    dy = g.tensor(name="dy", dim=y_dim, stride=nhwc_strides(*y_dim), data_type=io_dtype)
    dw = g.conv_wgrad(name="wgrad", image=x, loss=dy, compute_data_type=FP32, **_CONV)
    _out(dw, "dw", w_dim, nhwc_strides(*w_dim), io_dtype)
    return g, {"x": x, "dy": dy, "dw": dw}


# ---------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------

EXAMPLES: dict[str, Callable[..., Built]] = {
    "sdpa_fwd_train": sdpa_fwd_train,
    "sdpa_bwd": sdpa_bwd,
    "layernorm_fwd_train": layernorm_fwd_train,
    "layernorm_bwd": layernorm_bwd,
    "rmsnorm_infer": rmsnorm_infer,
    "mlp_matmul": mlp_matmul,
    "mlp_matmul_bias_gelu": mlp_matmul_bias_gelu,
    "conv_fprop": conv_fprop,
    "conv_dgrad": conv_dgrad,
    "conv_wgrad": conv_wgrad,
    "fp8_matmul": fp8_matmul,
    "fp8_sdpa": fp8_sdpa,
    "paged_decode": paged_decode,
    "chunked_prefill": chunked_prefill,
    "sliding_window": sliding_window,
    "varlen_sdpa": varlen_sdpa,
}

FAMILIES: dict[str, str] = {
    "sdpa_fwd_train": "SDPA forward, training (O + float32 Stats), causal, bf16 BSHD b2 h8 s512 d64",
    "sdpa_bwd": "SDPA backward (dQ, dK, dV from q, k, v, o, dO, stats), causal, same shapes",
    "layernorm_fwd_train": "LayerNorm forward TRAINING (Y, mean, inv_var), 2048 tokens x 1024, epsilon by value",
    "layernorm_bwd": "LayerNorm backward (dX, dScale, dBias), 2048 tokens x 1024",
    "rmsnorm_infer": "RMSNorm forward INFERENCE (Y only), 2048 tokens x 1024, epsilon by value",
    "mlp_matmul": "MLP matmul [1,2048,1024] @ [1,1024,4096], bf16, fp32 accumulate",
    "mlp_matmul_bias_gelu": "MLP matmul with fused bias + gelu epilogue",
    "conv_fprop": "conv forward, NHWC bf16, X [8,64,28,28] W [64,64,3,3], pad 1 stride 1",
    "conv_dgrad": "conv data gradient of the same layer (dY, W -> dX)",
    "conv_wgrad": "conv weight gradient of the same layer (X, dY -> dW)",
    "fp8_matmul": "FP8 e4m3 matmul with descale_a/descale_b, bf16 output and float32 AMAX",
    "fp8_sdpa": "FP8 e4m3 SDPA forward (sdpa_fp8) with descale/scale factors, Stats and Amax_O, causal",
    "paged_decode": "decode (s_q=1) over paged K/V caches with page tables, padding mask, GQA 8/2",
    "chunked_prefill": "prefill s_q=128 against s_kv=512, bottom-right causal, GQA 8/2",
    "sliding_window": "causal sliding-window SDPA (left bound 256), s=1024",
    "varlen_sdpa": "packed variable-length (THD) SDPA with ragged offsets on q/k/v/o, padding mask, causal",
}

# Inputs whose contents matter (every other input can be random). example -> tensor -> rule.
# All were exercised on an H200 (cuDNN 9.19) by run_gpu.py with values that follow these rules.
RUNTIME_VALUES: dict[str, dict[str, str]] = {
    "layernorm_fwd_train": {"epsilon": "host (CPU) float32 tensor of shape [1,1,1,1], e.g. 1e-5; > 0"},
    "layernorm_bwd": {
        "mean": "float32 per-row mean of x, as layernorm_fwd_train writes it",
        "inv_var": "float32 per-row 1/sqrt(var(x) + eps) (biased var), as layernorm_fwd_train writes it; > 0",
    },
    "rmsnorm_infer": {"epsilon": "host (CPU) float32 tensor of shape [1,1,1,1], e.g. 1e-5; > 0"},
    "sdpa_bwd": {
        "o": "the forward output for these q, k, v (sdpa_fwd_train)",
        "stats": "the forward float32 Stats: natural-log log-sum-exp of the scaled, masked scores",
    },
    "fp8_matmul": {
        "descale_a": "device float32 [1,1,1]: 1 / (scale a was quantized with), > 0",
        "descale_b": "device float32 [1,1,1]: 1 / (scale b was quantized with), > 0",
    },
    "fp8_sdpa": {
        "descale_q": "device float32 [1,1,1,1]: 1 / (scale q was quantized with), > 0",
        "descale_k": "device float32 [1,1,1,1]: 1 / (scale k was quantized with), > 0",
        "descale_v": "device float32 [1,1,1,1]: 1 / (scale v was quantized with), > 0",
        "scale_s": "device float32 [1,1,1,1]: scale of the probabilities P in [0, 1]; 448 for e4m3",
        "descale_s": "device float32 [1,1,1,1]: 1 / scale_s (1/448)",
        "scale_o": "device float32 [1,1,1,1]: O is written as O_true * scale_o, e.g. 448 / amax(O_true); > 0",
    },
    "paged_decode": {
        "seq_len_q": "int32 [b,1,1,1], all 1 (one new token per sequence)",
        "seq_len_kv": "int32 [b,1,1,1], each in [1, max_seq_len_kv]",
        "page_table_k": "int32 [b,1,pages_per_seq,1]: entry p of sequence i = pool block in [0, num_blocks) holding "
        "tokens [p*block_size, (p+1)*block_size); keep every entry a valid index",
        "page_table_v": "same rule as page_table_k (usually the same table)",
    },
    "varlen_sdpa": {
        "seq_len_q": "int32 [b,1,1,1], each in [1, max_s_q]",
        "seq_len_kv": "int32 [b,1,1,1], each in [1, max_s_kv]",
        "q_ragged_offset": "int32 [b+1,1,1,1], element offsets of each sequence's first token: cumsum([0]+seq_len_q) * h*d",
        "o_ragged_offset": "same values as q_ragged_offset",
        "k_ragged_offset": "int32 [b+1,1,1,1]: cumsum([0]+seq_len_kv) * h*d",
        "v_ragged_offset": "same values as k_ragged_offset",
    },
}


def describe(tensors: TensorMap) -> list[str]:
    """One line per tensor: name, dims, strides, data type, and pass-by-value / ragged marks."""
    lines = []
    for key, t in tensors.items():
        dtype = getattr(t.get_data_type(), "name", t.get_data_type())
        marks = []
        if t.get_is_pass_by_value():
            marks.append("pass-by-value")
        if t.ragged_offset is not None:
            marks.append(f"ragged_offset={t.ragged_offset.get_name()}")
        lines.append(f"{key:>16}  {t.get_dim()!s:<22} {t.get_stride()!s:<30} {dtype}{'  ' + ', '.join(marks) if marks else ''}")
    return lines


def _self_check() -> int:
    from cudnn import _plan_serdes

    failures = 0
    for name, builder in EXAMPLES.items():
        try:
            g, tensors = builder()
            encoded = _plan_serdes._encode_graph(g)
            nonvirtual = {t["uid"] for t in encoded["tensors"] if not t["is_virtual"]}
            assert nonvirtual == {t.get_uid() for t in tensors.values()}, "returned tensors != non-virtual tensors"
            assert all(t.get_name() == key for key, t in tensors.items()), "tensor names != keys"
            assert set(RUNTIME_VALUES.get(name, {})) <= set(tensors), "RUNTIME_VALUES names an unknown tensor"
        except Exception as exc:  # noqa: BLE001 -- report every example
            failures += 1
            print(f"[FAIL] {name}: {type(exc).__name__}: {exc}")
            continue
        nodes = ", ".join(f"{n['name']}:{n['node_type']}" for n in encoded["nodes"])
        print(f"[ok] {name} -- {FAMILIES[name]}\n  nodes: {nodes}")
        for line in describe(tensors):
            print("  " + line)
    print(f"{len(EXAMPLES) - failures}/{len(EXAMPLES)} examples construct and encode")
    return failures


if __name__ == "__main__":
    raise SystemExit(1 if _self_check() else 0)
