"""Specs bound the element count of every tensor and the bytes of a graph's tensors (docs/SPEC.md, "Limits"),
naming the tensor, without changing the key of any spec within them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from plancache.errors import SpecError
from plancache.spec import parse_spec
from plancache.spec.limits import MAX_ELEMENTS, MAX_GRAPH_BYTES

ROOT = Path(__file__).resolve().parents[2]


def matmul(a: list[int], b: list[int], *, dtype: str = "BFLOAT16", a_stride: list[int] | None = None,
           y: list[int] | None = None) -> dict[str, Any]:
    """Y = A @ B with ``a``, ``b`` (and ``y``) as dims; Y's dims are FE's to infer unless given."""
    def tensor(uid: int, name: str, dim: list[int], **kw: Any) -> dict[str, Any]:
        return {"uid": uid, "name": name, "data_type": dtype, "dim": dim, **kw}

    return {"schema": 2, "tensors": [tensor(1, "A", a, stride=a_stride or []), tensor(2, "B", b),
                                     tensor(3, "Y", y or [])],
            "nodes": [{"type": "MATMUL", "inputs": {"A": 1, "B": 2}, "outputs": {"C": 3}}]}


def test_the_128_tib_tensor_a_reader_once_stored_is_refused_naming_it():
    with pytest.raises(SpecError, match=r"tensor 'A': dims \[1048576, 1048576, 64\] make 70368744177664 elements, "
                                        r"over the limit of 2\^40 elements per tensor"):
        parse_spec(matmul([2**20, 2**20, 64], [2**20, 64, 1]))


def test_a_tensor_at_the_element_limit_is_accepted_and_one_more_is_not():
    parse_spec(matmul([1, 2**20, 2**20], [1, 2**20, 1], dtype="FP4_E2M1"))  # 2^40 elements, half a byte each
    assert MAX_ELEMENTS == 2**40
    with pytest.raises(SpecError, match="tensor 'B'"):
        parse_spec(matmul([1, 1, 2**20], [1, 2**20, 2**20 + 1], dtype="FP4_E2M1"))


def test_a_graph_over_the_byte_limit_is_refused_naming_its_largest_tensor():
    half = [1, 2**19, 2**19]  # 2^38 elements: 2^39 bytes in bf16
    parse_spec(matmul(half, half))  # 2^40 bytes: at the limit
    assert MAX_GRAPH_BYTES == 2**40
    with pytest.raises(SpecError, match=r"need 1099511627778 bytes \(1.0 TiB\), over the limit of 2\^40 bytes "
                                        r"\(1 TiB\); the largest is tensor 'A'"):
        parse_spec(matmul(half, half, y=[1, 1, 1]))  # and one element of output


def test_strides_count_the_memory_a_tensor_spans_not_its_element_count():
    # 2 x 2 elements, but rows 2^40 elements apart: the buffer spans 2^40 + 2 elements, 2 TiB in bf16
    with pytest.raises(SpecError, match="over the limit of 2\\^40 bytes.*tensor 'A'"):
        parse_spec(matmul([1, 2, 2], [1, 2, 2], a_stride=[4, 2**40, 1]))
    parse_spec(matmul([1, 2, 2], [1, 2, 2], a_stride=[0, 0, 1]))  # broadcast strides span less


#: The examples' keys as the code before these limits computed them.
EXAMPLE_KEYS = {
    "conv_bias_relu.json": "ada9963c74ff73f22282e23a6a992eb90746a3591716bdbc56dd86f8388af261",
    "conv_bias_relu_n16.json": "61361ab19f60f27bae003ca224f57239e85fd7e4c18f7820f696ad5c4d25e9b4",
    "conv_bias_relu_n8.json": "8672b8c83f9b4c4660982f1268e8ecfca5a8854a0cb07f949c3f75452e9fbe67",
    "matmul_scale_bias_gelu_amax.json": "a52734363f2997120a2ca452c2cee9ce0d7ef2ec92ac5bfd6ac5d68010be578d",
    "matmul_scale_bias_relu_amax_b4.json": "ad3f76c8a418fd3ab62e3164ccfe0d79854a1773fc2280156a3c75a1bb8a03aa",
    "sdpa_causal.json": "824e8d9b56606b079581a8a3c85afc6a0084388c242b69e15cd6517b0553d06b",
    "sdpa_causal_s512.json": "36442c3048ae6642f85da5b14f22d7bc366da24088f3662e9329ecae36a532b1",
}


def test_every_example_is_within_the_limits_with_its_key_unchanged():
    assert {p.name: parse_spec(p.read_text()).graph_key for p in (ROOT / "examples").glob("*.json")} == EXAMPLE_KEYS
