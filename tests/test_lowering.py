"""Lowering constructs the cudnn pygraph on the CPU (no GPU needed to build the IR)."""

from __future__ import annotations

import pytest

from examples.generate import EXAMPLES

cudnn = pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed")

from plancache.gpu.lowering import DATA_TYPES, lower  # noqa: E402


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_example_lowers_with_spec_uids(name):
    spec = EXAMPLES[name]
    low = lower(spec)
    assert len(low.graph.nodes) == len(spec.nodes)
    for tname, uid in spec.uids().items():
        t = low.tensors[tname]
        assert t.get_uid() == uid
        info = spec.tensor_infos()[tname]
        assert list(t.get_dim()) == list(info.dims)
        assert list(t.get_stride()) == list(info.strides)
    for tname in spec.outputs:
        assert low.tensors[tname].get_data_type() == DATA_TYPES[spec.outputs[tname].dtype]


def test_pass_by_value_and_reduction_dims_are_lowered():
    spec = EXAMPLES["matmul_scale_bias_gelu_amax"]
    low = lower(spec)
    assert low.tensors["alpha"].get_is_pass_by_value()
    assert list(low.tensors["amax"].get_dim()) == [1, 1, 1]


def test_causal_sdpa_lowers_with_a_right_bound():
    low = lower(EXAMPLES["sdpa_causal"])
    (node,) = low.graph.nodes
    params = node.params
    assert params.get("diagonal_band_right_bound") == 0
    assert params.get("attn_scale") == pytest.approx(64 ** -0.5)
