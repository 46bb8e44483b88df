"""Graph keys pinned: plans are stored by key, so the canonical form of a document must not drift.

Each graph below is written with :class:`~plancache.spec.SpecBuilder` or as a document by hand, covering what the
canonical form reads from the node table: params equal to their defaults dropped, conv padding folded, pushed
output dims kept, an unset SDPA ``Stats`` typed FLOAT.
"""

from __future__ import annotations

import hashlib

import pytest

from plancache.spec import GraphSpec, SpecBuilder, parse_spec


def _builder_ops() -> GraphSpec:
    b = SpecBuilder(io_data_type="float16")
    x = b.tensor("x", dim=[2, 8, 4, 4])
    w = b.tensor("w", dim=[8, 8, 3, 3])
    y = b.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1])
    y = b.swish(b.tanh(b.sigmoid(b.gelu(b.relu(y, negative_slope=0.1)))), swish_beta=1.5)
    s = b.tensor("s", dim=[1, 1, 1, 1], data_type="float32", is_pass_by_value=True)
    y = b.mul(b.add(b.scale(y, s), b.tensor("z", dim=[2, 8, 4, 4])), b.tensor("m", dim=[1, 8, 1, 1]))
    y.set_output(True).set_name("y")
    b.reduction(y, mode="SUM", dims=[2, 1, 1, 1]).set_output(True).set_name("sum")
    return b.build()


def _builder_attention() -> GraphSpec:
    b = SpecBuilder(io_data_type="bfloat16", compute_data_type="float32")
    q = b.tensor("q", dim=[2, 8, 16, 32])
    k = b.tensor("k", dim=[2, 2, 24, 32])
    v = b.tensor("v", dim=[2, 2, 24, 16])
    a = b.matmul(b.tensor("A", dim=[2, 16, 32]), b.tensor("B", dim=[1, 32, 8]))
    a.set_output(True).set_name("C").set_data_type("float32")
    b.sdpa(q, k, v).set_output(True).set_name("O")
    b.sdpa(q, k, v, attn_scale=0.5, causal=True, name="causal").set_output(True).set_name("O2")
    return b.build()


def _tensor(uid: int, dim: list[int] | None = None, **kw: object) -> dict[str, object]:
    return {"uid": uid, "name": f"t{uid}", "dim": dim or [], "stride": [], **kw}


def _conv_defaults() -> GraphSpec:
    """Conv params spelled at their defaults and pre == post padding; a CONV_DGRAD's virtual output with pushed
    dims."""
    return parse_spec({"schema": 2, "context": {"io_data_type": "HALF", "compute_data_type": "FLOAT"}, "tensors": [
        _tensor(1, [2, 8, 4, 4], data_type="HALF"), _tensor(2, [8, 8, 3, 3], data_type="HALF"),
        _tensor(3, [2, 8, 4, 4], is_virtual=True, dim_assigned=False), _tensor(4, [8, 8, 3, 3]),
        _tensor(5, [2, 8, 4, 4], is_virtual=True), _tensor(6, [2, 8, 4, 4])], "nodes": [
        {"type": "CONV_FPROP", "inputs": {"image": 1, "weight": 2}, "outputs": {"Y": 3}, "params": {
            "pre_padding": [1, 1], "post_padding": [1, 1], "stride": [1, 1], "dilation": [1, 1],
            "convolution_mode": {"$enum": "convolution_mode", "name": "CROSS_CORRELATION"}}},
        {"type": "CONV_DGRAD", "inputs": {"loss": 3, "filter": 4}, "outputs": {"DX": 5}, "params": {
            "padding": [1, 1], "stride": [1, 1]}},
        {"type": "POINTWISE", "inputs": {"IN_0": 5}, "outputs": {"OUT_0": 6}, "params": {"mode": "relu"}},
    ]})


def _sdpa_defaults() -> GraphSpec:
    """SDPA flags at their defaults (dropped) and an unset Stats data type (FLOAT); MATMUL padding 0.0."""
    return parse_spec({"schema": 2, "context": {"io_data_type": "BFLOAT16"}, "tensors": [
        _tensor(10, [1, 2, 8, 16]), _tensor(11, [1, 2, 8, 16]), _tensor(12, [1, 2, 8, 16]),
        _tensor(13, [1, 2, 8, 16]), _tensor(14, [1, 2, 8, 1]), _tensor(15, [1, 8, 8]), _tensor(16, [1, 8, 8]),
        _tensor(17, [1, 8, 8])], "nodes": [
        {"type": "SDPA", "inputs": {"q": 10, "k": 11, "v": 12}, "outputs": {"O": 13, "Stats": 14}, "params": {
            "use_alibi_mask": False, "use_causal_mask": False, "generate_stats": True, "is_inference": False,
            "diagonal_alignment": {"$enum": "diagonal_alignment", "name": "TOP_LEFT"}, "attn_scale": 0.25}},
        {"type": "MATMUL", "inputs": {"A": 15, "B": 16}, "outputs": {"C": 17}, "params": {"padding": 0.0}},
    ]})


#: (graph key, sha256 of the canonical JSON) of each graph.
PINNED = {
    "builder_ops": ("14c6fc817b54cbe613ca6a742d4fd8bd16d03e6f9112b6f04e0bf1469ceb6d27",
                    "721baaa87fb3956eb4d8db177aa7253e34163815ccfccd96cd093a1a1653357f"),
    "builder_attention": ("0084b85fe507bb4b85cba261842fdc5d9d631925c7059a093c6f455e9058d0f6",
                          "1c6db9cdac7e46c6588eb226ef078289835caaa9ad36cfab3be09a9f20d62677"),
    "conv_defaults": ("c23156cd4026c80559002b344c9c924d36fbb8945ebd4e3ee1834de2c0351fd8",
                      "95ff232746906a7b777de094031cf73de3d98c839ed4e8d55614ce9285e6631a"),
    "sdpa_defaults": ("8413fef45ee2df50331efbba4378e8ec1ed1b41345f133b3935564c299aa8b92",
                      "501a07b027b573c2e82d64f802aa64e772b26983095b70474fac9226995f7df8"),
}
GRAPHS = {"builder_ops": _builder_ops, "builder_attention": _builder_attention, "conv_defaults": _conv_defaults,
          "sdpa_defaults": _sdpa_defaults}


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_the_key_and_canonical_form_of_a_graph_are_pinned(name):
    spec = GRAPHS[name]()
    assert (spec.graph_key, hashlib.sha256(spec.canonical_json().encode()).hexdigest()) == PINNED[name]
