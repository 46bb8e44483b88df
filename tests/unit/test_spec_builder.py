"""SpecBuilder: the keys of every spec it writes across the repository are pinned (no GPU, no FE).

``tests/data/builder_keys.json`` was recorded from the schema-1 implementation of the builder (it converted
an op list into the schema-2 document); the builder that writes schema 2 directly must give the same keys,
or every stored plan of those graphs would be orphaned.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from plancache.errors import SpecError
from plancache.spec import GraphSpec, SpecBuilder, graph_key, parse_spec

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "data" / "builder_keys.json"


def _docs_spec() -> GraphSpec:
    """The builder example of docs/SPEC.md's "Writing a spec" section, run as written."""
    section = (ROOT / "docs" / "SPEC.md").read_text().split("## Writing a spec", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    scope: dict[str, object] = {}
    exec(code.group(1), scope)  # noqa: S102 - the docs' own example
    spec = scope["spec"]
    assert isinstance(spec, GraphSpec)
    return spec


def _huge_relu() -> GraphSpec:
    """tests/integration/test_gpu_core.py's spec larger than the device."""
    b = SpecBuilder(io_data_type="bfloat16")
    x = b.tensor("X", dim=[1, 1 << 20, 1 << 17])
    b.relu(x).set_output(True).set_name("Y")
    return b.build()


def _bias_like() -> GraphSpec:
    """tests/unit/test_client_plan.py's bias-only spec."""
    b = SpecBuilder(io_data_type="bfloat16")
    a = b.tensor("A", dim=[1, 4, 8])
    bias = b.tensor("bias", dim=[1, 1, 8])
    b.bias(a, bias).set_output(True).set_name("Y")
    return b.build()


def builder_specs() -> Iterator[tuple[str, Callable[[], GraphSpec | dict[str, object]]]]:
    """(label, maker) of every spec the repository writes with SpecBuilder."""
    from bench.claim_throughput import _spec as claim_spec
    from bench.load_server import synthetic_spec
    from bench.workload import workload
    from examples.generate import EXAMPLES
    from tests.conftest import _spec as conftest_spec

    for name, spec in EXAMPLES.items():
        yield f"examples/{name}", lambda spec=spec: spec
    for spec in workload():
        yield f"bench/workload/{spec.name}", lambda spec=spec: spec
    for i in range(8):
        yield f"tests/conftest/make_spec({i})", lambda i=i: conftest_spec(i)
        yield f"bench/claim_throughput/_spec({i})", lambda i=i: claim_spec(i)
        yield f"bench/load_server/synthetic_spec({i})", lambda i=i: synthetic_spec(i)
    yield "docs/SPEC/writing-a-spec", _docs_spec
    yield "tests/integration/test_gpu_core/huge_relu", _huge_relu
    yield "tests/unit/test_client_plan/bias_like", _bias_like
    if _has_torch():
        from tests.unit.test_client_plan import conv_spec, matmul_spec

        yield "tests/unit/test_client_plan/matmul_spec", matmul_spec
        yield "tests/unit/test_client_plan/conv_spec", conv_spec


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def current_keys() -> dict[str, str]:
    return {label: graph_key(make()) for label, make in builder_specs()}


def test_every_builder_spec_keeps_its_key():
    golden = json.loads(GOLDEN.read_text())
    keys = current_keys()
    missing = sorted(set(keys) - set(golden))
    assert not missing, f"specs without a golden key: {missing}"
    changed = {label: (golden[label], key) for label, key in keys.items() if golden[label] != key}
    assert not changed, f"{len(changed)} of {len(keys)} keys changed: {changed}"
    assert len(keys) >= 80


def test_the_schema_1_files_converted_to_schema_2_keep_their_keys():
    """tests/data's two schema-1 documents were the schema-1 spelling of examples/conv_bias_relu.json and
    examples/sdpa_causal.json: the keys recorded from them are those of the schema-2 files."""
    golden = json.loads(GOLDEN.read_text())
    for legacy, example in (("legacy_conv_bias_relu", "conv_bias_relu"), ("legacy_sdpa_causal", "sdpa_causal")):
        doc = parse_spec((ROOT / "examples" / f"{example}.json").read_text())
        assert doc.schema_version == 2
        assert golden[f"tests/data/{legacy}.json"] == doc.graph_key


if __name__ == "__main__":  # python -m tests.unit.test_spec_builder > tests/data/builder_keys.json
    print(json.dumps(current_keys(), indent=1))


# ------------------------------------------------------------------ what the builder refuses


def _conv(b: SpecBuilder, c: int = 8, k_c: int = 8, **kw: object):
    x = b.tensor("X", dim=[2, c, 6, 6])
    w = b.tensor("W", dim=[4, k_c, 3, 3])
    return b.conv_fprop(x, w, **kw)


def _matmul(b: SpecBuilder, k: int = 8, k2: int = 8):
    return b.matmul(b.tensor("A", dim=[1, 4, k]), b.tensor("B", dim=[1, k2, 2]))


def _sdpa(b: SpecBuilder, hq: int = 4, hkv: int = 4, **kw: object):
    return b.sdpa(b.tensor("q", dim=[1, hq, 8, 16]), b.tensor("k", dim=[1, hkv, 8, 16]),
                  b.tensor("v", dim=[1, hkv, 8, 16]), **kw)


def _other_builder(b: SpecBuilder):
    other = SpecBuilder(io_data_type="float16").tensor("X", dim=[2, 2])
    return b.relu(other)


def _output(b: SpecBuilder):
    return b.relu(b.tensor("X", dim=[2, 3]), name="r")


@pytest.mark.parametrize("call, needle", [
    (lambda b: _conv(b, k_c=4), "node 0 (conv_fprop_0): weight input channels 4 != image channels 8"),
    (lambda b: _conv(b, padding=[1]), "node 0 (conv_fprop_0): padding [1] needs 2 values"),
    (lambda b: _conv(b, stride=[0, 1]), "stride [0, 1] must all be in [1, 2^40]"),
    (lambda b: _conv(b, name="conv", dilation=[1, 9]), "node 0 (conv): spatial dim 1: filter 3 does not fit image 6"),
    (lambda b: _matmul(b, k2=9), "node 0 (matmul_0): A (1, 4, 8) and B (1, 9, 2): inner dims 8 != 9"),
    (lambda b: b.bias(b.tensor("X", dim=[1, 4, 8]), b.tensor("B", dim=[1, 2, 8])),
     "node 0 (bias_0): bias (1, 2, 8) does not broadcast to input (1, 4, 8)"),
    (lambda b: b.relu(b.tensor("alpha", dim=[1], is_pass_by_value=True)),
     "node 0 (relu_0): pass-by-value tensor 'alpha' can only feed bias, scale, add or mul"),
    (lambda b: b.relu(b.tensor("X", dim=[4]), negative_slope=float("nan")), "negative_slope nan must be a finite number"),
    (lambda b: b.reduction(b.tensor("X", dim=[2, 3]), mode="AMAX", dims=[2, 2]),
     "reduction dims [2, 2] must match input (2, 3) with 1 on reduced axes"),
    (lambda b: b.reduction(b.tensor("X", dim=[2, 3]), mode="MEDIAN", dims=[1, 1]), "mode 'MEDIAN' is not one of AMAX, SUM"),
    (lambda b: _sdpa(b, hq=3, hkv=2), "heads: q 3 must be a multiple of k/v heads 2/2"),
    (lambda b: _sdpa(b, causal="yes"), "causal 'yes' must be True or False"),
    (lambda b: b.tensor("X", dim=[2, 2], stride=[1, 1]), "tensor 'X': strides [1, 1] make elements of dims [2, 2] overlap"),
    (lambda b: b.tensor("X", dim=[0, 4]), "tensor 'X': dims [0, 4] must all be in [1, 2^40]"),
    (lambda b: b.tensor("X", dim=[1] * 9), "tensor 'X': dims [1, 1, 1, 1, 1, 1, 1, 1, 1] needs 1 to 8 values"),
    (lambda b: b.tensor("X", dim=[2, 2], stride=[2]), "tensor 'X': strides [2] needs 2 values"),
    (lambda b: b.tensor("X", dim=[2], data_type="float64"), "tensor 'X': data type 'float64' is not one of float16"),
    (lambda b: b.tensor("s", dim=[1], data_type="float16", is_pass_by_value=True),
     "tensor 's': a pass-by-value scalar must be float32 with all dims 1"),
    (lambda b: [b.tensor("X", dim=[2]), b.tensor("X", dim=[2])], "tensor 'X' is already defined"),
    (lambda b: b.tensor("", dim=[2]), "tensor name '': 1 to 256 characters"),
    (_other_builder, "node 0 (relu_0): input is not a tensor of this SpecBuilder"),
    (lambda b: _output(b).set_dim([3, 2]), "tensor 'r.output': set_dim [3, 2], but relu gives [2, 3]"),
    (lambda b: _output(b).set_stride([1, 1]), "tensor 'r.output': strides [1, 1] make elements of dims [2, 3] overlap"),
    (lambda b: _output(b).set_data_type("fp8"), "tensor 'r.output': data type 'fp8' is not one of"),
    (lambda b: b.tensor("X", dim=[2]).set_name("Z"), "tensor 'X' is an input; set_name is for op outputs"),
    (lambda b: [b.tensor("Y", dim=[2]), _output(b).set_name("Y")], "tensor 'Y' is already defined"),
    (lambda b: SpecBuilder(io_data_type="float8"), "io_data_type: data type 'float8' is not one of"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_bad_call_is_refused_where_it_is_made_naming_the_node_or_tensor(call, needle):
    b = SpecBuilder(io_data_type="bfloat16")
    with pytest.raises(SpecError) as exc:
        call(b)
    assert needle in str(exc.value)


def test_build_refuses_a_graph_without_outputs_or_with_loose_ends():
    b = SpecBuilder(io_data_type="bfloat16")
    y = b.relu(b.tensor("X", dim=[2, 3]))
    with pytest.raises(SpecError, match=r"no tensor is marked as an output \(call .set_output\(True\)\)"):
        b.build()
    y.set_output(True).set_output(False)
    with pytest.raises(SpecError, match="no tensor is marked as an output"):
        b.build()
    y.set_output(True)
    b.tensor("W", dim=[2])
    with pytest.raises(SpecError, match="input tensor 'W' is not used by any node"):
        b.build()
    b = SpecBuilder(io_data_type="bfloat16")
    x = b.tensor("X", dim=[2, 3])
    b.gelu(x)
    b.relu(x).set_output(True)
    with pytest.raises(SpecError, match=r"tensor 'gelu_0.output' is neither used by a node nor marked with set_output"):
        b.build()
    b = SpecBuilder(io_data_type="bfloat16")
    b.relu(b.tensor("X", dim=[1 << 21, 1 << 20])).set_output(True)  # 2^41 elements: checked where the document is
    with pytest.raises(SpecError, match="tensor 'X': dims .* over the limit of 2\\^40 elements"):
        b.build()


def test_the_document_is_the_graph_fe_would_record():
    """Node types, FE port names, params with defaults filled, output dtypes, and which dims FE pushes."""
    b = SpecBuilder(io_data_type="bfloat16", name="epilogue")
    a, w = b.tensor("A", dim=[1, 4, 8]), b.tensor("B", dim=[1, 8, 2])
    alpha = b.tensor("alpha", dim=[1, 1, 1], is_pass_by_value=True)
    y = b.swish(b.scale(b.matmul(a, w), alpha), swish_beta=2)
    y.set_output(True).set_name("Y")
    b.reduction(y, mode="SUM", dims=[1, 1, 1]).set_output(True).set_name("total")
    doc = b.build().to_json()
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert [t["uid"] for t in doc["tensors"]] == [1, 2, 3, 4, 5, 6, 7]
    assert [n for n in tensors][:5] == ["A", "B", "Y", "alpha", "total"]  # inputs and outputs by name, then virtual
    assert tensors["alpha"]["is_pass_by_value"] and tensors["alpha"]["data_type"] == "FLOAT"
    assert tensors["total"]["data_type"] == "FLOAT" and tensors["Y"]["data_type"] == "BFLOAT16"
    assert tensors["matmul_0.C"]["is_virtual"] and tensors["matmul_0.C"]["data_type"] is None
    assert tensors["matmul_0.C"]["dim"] == [1, 4, 2] and not tensors["matmul_0.C"]["dim_assigned"]
    assert [(n["type"], n["inputs"], n["outputs"], n["params"]) for n in doc["nodes"]] == [
        ("MATMUL", {"A": 1, "B": 2}, {"C": 6}, {"padding": 0.0}),
        ("POINTWISE", {"IN_0": 6, "IN_1": 4}, {"OUT_0": 7}, {"mode": "scale"}),
        ("POINTWISE", {"IN_0": 7}, {"OUT_0": 3}, {"mode": "swish", "swish_beta": 2.0}),
        ("REDUCTION", {"input": 3}, {"OUT_0": 5}, {"mode": {"$enum": "reduction_mode", "name": "ADD"}}),
    ]
    b = SpecBuilder(io_data_type="bfloat16")
    o = _sdpa(b, hq=4, hkv=2, causal=True)
    o.set_output(True).set_name("O")
    b.relu(b.reduction(o, mode="AMAX", dims=[1, 1, 1, 1])).set_output(True).set_name("m")
    doc = b.build().to_json()
    sdpa, reduction = doc["nodes"][0], doc["nodes"][1]
    assert sdpa["params"] == {
        "generate_stats": False, "attn_scale": 0.25,
        "diagonal_alignment": {"$enum": "diagonal_alignment", "name": "TOP_LEFT"}, "diagonal_band_right_bound": 0}
    virtual = next(t for t in doc["tensors"] if t["uid"] == reduction["outputs"]["OUT_0"])
    assert virtual["is_virtual"] and virtual["dim_assigned"]  # FE pushes a reduction's output dims: part of the key


def test_tensor_like_reads_a_torch_tensor():
    torch = pytest.importorskip("torch", reason="torch is not installed (the gpu extra)")
    b = SpecBuilder(io_data_type="bfloat16")
    x = b.tensor_like(torch.empty(2, 3, 4, dtype=torch.bfloat16).permute(0, 2, 1), "X", is_pass_by_value=False)
    alpha = b.tensor_like(torch.ones(1, 1, 1), "alpha")  # a CPU tensor: pass-by-value, as in cudnn
    b.scale(x, alpha).set_output(True).set_name("Y")
    t = {t.name: t for t in b.build().tensors}
    assert t["X"].dim == [2, 4, 3] and t["X"].stride == [12, 1, 4] and t["X"].data_type == "BFLOAT16"
    assert t["alpha"].is_pass_by_value and t["alpha"].data_type == "FLOAT"
    with pytest.raises(SpecError, match=r"tensor_like\('i'\): unsupported dtype torch.float64"):
        b.tensor_like(torch.empty(2, dtype=torch.float64), "i")
