"""The node-type table (:mod:`plancache.spec.nodes`): roles, shape rules and the facts the key reads (no GPU)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from plancache.spec.nodes import NODE_TYPES, NODES, ROLES, broadcast, kind_of


def test_every_node_type_has_one_entry_and_the_keys_facts_are_the_fe_ones():
    assert len(NODE_TYPES) == len(set(NODE_TYPES)) == 56 and list(NODES) == list(NODE_TYPES)
    assert {t for t, k in NODES.items() if k.pushed_output_dims} == {
        "CONV_DGRAD", "CONV_WGRAD", "MOE_GROUPED_MATMUL_BWD", "REDUCTION", "RESHAPE"}
    assert {t for t, k in NODES.items() if k.float_outputs} == {"SDPA", "SDPA_FP8", "SDPA_MXFP8"}
    assert {t for t, k in NODES.items() if k.lowers_output_layouts} == {
        "SDPA", "SDPA_BWD", "SDPA_FP8", "SDPA_FP8_BWD", "SDPA_MXFP8", "SDPA_MXFP8_BWD"}
    assert "generate_stats" not in kind_of("SDPA").params  # FE's sdpa defaults it to True
    assert kind_of("SDPA_BWD").params["generate_stats"] is False
    assert kind_of("CONV_WGRAD").params["stride"] == "ones" and kind_of("MATMUL").params == {"padding": 0.0}
    assert all(role in ROLES for k in NODES.values() for role in k.inputs.values())


def test_input_roles_by_name_by_prefix_and_shared_by_every_node_type():
    sdpa, fp8_bwd = kind_of("SDPA"), kind_of("SDPA_FP8_BWD")
    assert [sdpa.role(p) for p in ("q", "attn_scale", "descale_s", "descale_q", "scale_o", "seq_len_kv",
                                   "paged_attention_v_table", "epsilon", "o")] == [
        "data", "attn_scale", "descale_s", "fp8_scale", "fp8_scale", "seq_len", "page_table", "epsilon", "data"]
    assert (fp8_bwd.role("o"), fp8_bwd.role("stats"), fp8_bwd.fp8) == ("saved_o", "saved_stats", True)
    assert kind_of("SDPA_MXFP8_BWD").role("o") == "data"  # its forward is not recomputed
    assert [kind_of("BATCHNORM_INFERENCE").role(p) for p in ("mean", "inv_variance", "in_running_var")] == [
        "saved_mean", "saved_inv_variance", "running_var"]
    assert kind_of("LAYERNORM").role("mean") == "data" and kind_of("GENSTATS").role("momentum") == "momentum"


def test_fan_in_of_weight_like_inputs():
    assert kind_of("CONV_FPROP").fan_in["weight"]([32, 64, 3, 3]) == 576
    assert kind_of("CONV_DGRAD").fan_in["filter"]([32, 64, 3, 3]) == 288
    assert kind_of("CONV_WGRAD").fan_in["loss"]([8, 32, 5, 5]) == 200
    assert kind_of("MATMUL").fan_in["B"]([1, 128, 64]) == 128 and kind_of("MATMUL").fan_in["B"]([4]) is None
    assert not kind_of("POINTWISE").fan_in


@pytest.mark.parametrize(("shapes", "expected"), [
    (([2, 1, 4], [3, 1]), [2, 3, 4]), (([], [5, 1]), [5, 1]), (([1, 0], [7, 1]), [7, 0]), ((), []),
    (([2, 3], [4, 3]), [4, 3]), (([3, 2], [2, 3]), [3, 2]),  # no broadcast: the largest, the first of equal size
    (([2, 3], [4, 5, 6]), [4, 5, 6]),
])
def test_broadcast_is_numpys_with_the_largest_shape_where_shapes_do_not_broadcast(shapes, expected):
    assert broadcast(*shapes) == expected


def test_output_shape_rules():
    conv = {"padding": [1, 1], "stride": [2, 2], "dilation": [1, 1]}
    y = kind_of("CONV_FPROP").output_dims("Y", {"image": [8, 64, 28, 28], "weight": [32, 64, 3, 3]}, conv)
    assert y == [8, 32, 14, 14]
    asym = {"pre_padding": [0, 2], "post_padding": [1, 0]}
    assert kind_of("CONV_FPROP").output_dims("Y", {"image": [1, 4, 5, 5], "weight": [2, 4, 3, 3]}, asym) == [1, 2, 4, 5]
    # the data gradient's rule inverts the forward's (up to the stride's rounding)
    same = {"padding": [1, 1]}
    assert kind_of("CONV_DGRAD").output_dims("DX", {"loss": [8, 32, 28, 28], "filter": [32, 64, 3, 3]}, same) == [
        8, 64, 28, 28]
    assert kind_of("MATMUL").output_dims("C", {"A": [4, 16, 32], "B": [1, 32, 8]}, {}) == [4, 16, 8]
    assert kind_of("POINTWISE").output_dims("OUT_0", {"IN_0": [2, 8, 1], "IN_1": [1, 1, 5]}, {}) == [2, 8, 5]
    sdpa = kind_of("SDPA_BWD")
    ins = {"q": [2, 8, 16, 64], "k": [2, 2, 24, 64], "v": [2, 2, 24, 32]}
    assert [sdpa.output_dims(p, ins, {}) for p in ("O", "Stats", "Amax_dQ", "dQ", "dK")] == [
        [2, 8, 16, 32], [2, 8, 16, 1], [1, 1, 1, 1], [2, 8, 16, 64], [2, 8, 16, 64]]
    assert sdpa.output_dims("O", {"k": [1, 2, 3, 4]}, {}) == [1, 2, 3, 4]  # no q: like the first input
    norm = kind_of("LAYERNORM")
    assert norm.output_dims("Y", {"scale": [1, 8], "input": [4, 8]}, {}) == [4, 8]
    assert kind_of("MATMUL").output_dims("C", {"A": [], "B": [3, 4]}, {}) == [3, 4]


def test_the_table_imports_without_torch_or_cudnn():
    code = "import sys, plancache.spec.nodes, plancache.spec; assert not {'torch', 'cudnn'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_family_and_builder_op_names_a_node_type_of_the_table():
    pytest.importorskip("torch")
    from plancache.gpu.families import FAMILIES
    from plancache.spec.builder import _OPS

    assert {t for f in FAMILIES for t in f.node_types} <= set(NODES)
    assert all(kind_of(op.node_type).group for op in _OPS.values())


def test_the_reference_infers_a_data_gradients_dims_by_the_table():
    pytest.importorskip("torch")
    from plancache.gpu.reference import infer_dims
    from plancache.spec import parse_spec

    spec = parse_spec({"schema": 2, "context": {"io_data_type": "HALF"}, "tensors": [
        {"uid": 1, "dim": [2, 8, 6, 6]}, {"uid": 2, "dim": [8, 4, 3, 3]}, {"uid": 3, "is_virtual": True},
        {"uid": 4, "dim": [2, 4, 6, 6]}], "nodes": [
        {"type": "CONV_DGRAD", "inputs": {"loss": 1, "filter": 2}, "outputs": {"DX": 3}, "params": {"padding": [1, 1]}},
        {"type": "POINTWISE", "inputs": {"IN_0": 3}, "outputs": {"OUT_0": 4}, "params": {"mode": "relu"}}]})
    assert infer_dims(spec)[3] == [2, 4, 6, 6]
