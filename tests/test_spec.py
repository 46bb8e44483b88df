"""GraphSpec validation, canonical form and graph-key stability (no GPU)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from examples.generate import EXAMPLES, conv_bias_relu, matmul_epilogue, sdpa_causal
from plancache.errors import SpecError
from plancache.spec import SpecBuilder, channels_last_strides, contiguous_strides, graph_key, parse_spec

ROOT = Path(__file__).resolve().parents[1]


def conv_doc() -> dict:
    return conv_bias_relu(n=2, c=8, hw=8, k=16).to_json()


def _reorder(obj):
    """The same JSON with every object's keys in reverse order."""
    if isinstance(obj, dict):
        return {k: _reorder(obj[k]) for k in reversed(list(obj))}
    if isinstance(obj, list):
        return [_reorder(v) for v in obj]
    return obj


def test_example_files_match_the_generator():
    for name, spec in EXAMPLES.items():
        on_disk = json.loads((ROOT / "examples" / f"{name}.json").read_text())
        assert on_disk == spec.to_json(), f"examples/{name}.json is stale: run python examples/generate.py"
        assert graph_key(on_disk) == spec.graph_key


def test_key_is_independent_of_key_order_and_cosmetic_names():
    doc = conv_doc()
    reordered = _reorder(doc)
    assert list(reordered) != list(doc)
    assert graph_key(reordered) == graph_key(doc)
    renamed = copy.deepcopy(doc)
    renamed["name"] = "another name"
    for n in renamed["nodes"]:
        n["name"] = "x" + (n.get("name") or "")
    assert graph_key(renamed) == graph_key(doc)
    # explicit defaults are the same as omitted ones
    explicit = copy.deepcopy(doc)
    explicit["tuning"] = {"heuristic_modes": ["A", "B", "FALLBACK"], "max_workspace_bytes": None, "deterministic_only": False}
    assert graph_key(explicit) == graph_key(doc)
    assert len(graph_key(doc)) == 64


@pytest.mark.parametrize("other", [
    lambda: conv_bias_relu(n=3, c=8, hw=8, k=16),
    lambda: conv_bias_relu(n=2, c=8, hw=8, k=32),
    lambda: conv_bias_relu(n=2, c=8, hw=8, k=16, rs=1),
    lambda: parse_spec({**conv_doc(), "io_data_type": "float16"}),
    lambda: parse_spec({**conv_doc(), "tuning": {"deterministic_only": True}}),
    lambda: parse_spec({**conv_doc(), "tuning": {"max_workspace_bytes": 1024}}),
    lambda: parse_spec({**conv_doc(), "tuning": {"heuristic_modes": ["A"]}}),
    lambda: parse_spec(_with(conv_doc(), lambda d: d["tensors"]["X"].__setitem__("dtype", "float16"))),
    lambda: parse_spec(_with(conv_doc(), lambda d: d["nodes"][2].__setitem__("op", "gelu"))),
    lambda: parse_spec(_with(conv_doc(), lambda d: d["nodes"][0]["attrs"].__setitem__("dilation", [1, 1]) or
                             d["nodes"][0]["attrs"].__setitem__("padding", [1, 1]) or
                             d["tensors"]["X"].__setitem__("strides", contiguous_strides(d["tensors"]["X"]["dims"])))),
], ids=["batch", "filters", "kernel_size", "io_type", "deterministic", "workspace_cap", "modes", "dtype", "op", "layout"])
def test_any_relevant_change_changes_the_key(other):
    assert other().graph_key != parse_spec(conv_doc()).graph_key


def _with(doc: dict, mutate) -> dict:
    mutate(doc)
    return doc


def test_shape_change_through_with_dims_changes_key_and_reinfers_outputs():
    spec = conv_bias_relu(n=2, c=8, hw=8, k=16)
    bigger = spec.with_dims({"X": [4, 8, 8, 8]})
    assert bigger.graph_key != spec.graph_key
    assert bigger.outputs["Y"].dims == [4, 16, 8, 8]
    assert bigger.outputs["Y"].strides == channels_last_strides([4, 16, 8, 8])


def test_attn_scale_is_part_of_the_key_but_runtime_scalars_are_not():
    a, b = sdpa_causal(seq=128).to_json(), sdpa_causal(seq=128).to_json()
    b["nodes"][0]["attrs"]["attn_scale"] = 0.1
    assert graph_key(a) != graph_key(b)
    # the pass-by-value alpha has no value in the spec at all: only its shape/dtype are keyed
    mm = matmul_epilogue(batch=2, m=64, k=64, n=64).to_json()
    assert set(mm["tensors"]["alpha"]) == {"dims", "strides", "dtype", "pass_by_value"}


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d["nodes"][0].__setitem__("op", "conv_wibble"), "unknown op 'conv_wibble'"),
    (lambda d: d["nodes"][1]["inputs"].__setitem__("input", "nope"), "tensor 'nope'"),
    (lambda d: d["tensors"]["W"]["dims"].__setitem__(1, 7), "input channels"),
    (lambda d: d["tensors"]["X"].__setitem__("dtype", "float64"), "dtype"),
    (lambda d: d["tensors"]["X"]["strides"].pop(), "4 dims but 3 strides"),
    (lambda d: d["outputs"]["Y"]["dims"].__setitem__(0, 1), "declared with dims"),
    (lambda d: d["nodes"][0]["attrs"].__setitem__("padding", [1]), "padding"),
    (lambda d: d["nodes"][0]["attrs"].__setitem__("groups", 2), "bad attributes"),
    (lambda d: d["nodes"][0]["inputs"].pop("weight"), "takes inputs"),
    (lambda d: d["tensors"]["B"]["dims"].__setitem__(1, 3), "does not broadcast"),
    (lambda d: d["tensors"]["X"]["strides"].__setitem__(0, 1), "overlap"),
    (lambda d: d.__setitem__("schema", 99), "schema version 99"),
    (lambda d: d.__setitem__("extra_field", 1), "extra_field"),
], ids=["unknown_op", "dangling", "channels", "dtype", "rank", "out_shape", "padding", "attr", "port", "bias", "alias", "schema", "extra"])
def test_bad_specs_are_refused_naming_the_problem(mutate, needle):
    doc = conv_doc()
    mutate(doc)
    with pytest.raises(SpecError) as exc:
        parse_spec(doc)
    assert needle in str(exc.value)


def test_node_errors_name_the_node():
    doc = conv_doc()
    doc["nodes"][1]["inputs"]["input"] = "ghost"
    with pytest.raises(SpecError, match=r"node 1 \(bias_1\)"):
        parse_spec(doc)


def test_unused_and_unproduced_tensors_are_refused():
    doc = conv_doc()
    doc["tensors"]["spare"] = {"dims": [1], "strides": [1], "dtype": "bfloat16"}
    with pytest.raises(SpecError, match="'spare' is not used"):
        parse_spec(doc)
    doc = conv_doc()
    doc["outputs"]["Z"] = doc["outputs"]["Y"]
    with pytest.raises(SpecError, match="'Z' is not produced"):
        parse_spec(doc)


def test_parse_spec_refuses_non_objects_and_bad_json():
    with pytest.raises(SpecError, match="not valid JSON"):
        parse_spec("{nope")
    with pytest.raises(SpecError, match="JSON object"):
        parse_spec("[1, 2]")


def test_shape_inference_for_every_seed_graph():
    conv = conv_bias_relu(n=2, c=8, hw=9, k=16, rs=3)
    assert conv.outputs["Y"].dims == [2, 16, 9, 9]
    mm = matmul_epilogue(batch=2, m=32, k=64, n=48)
    infos = mm.tensor_infos()
    assert mm.outputs["Y"].dims == [2, 32, 48] and mm.outputs["amax"].dims == [1, 1, 1]
    assert mm.outputs["amax"].dtype == "float32" and infos["alpha"].pass_by_value
    assert any(i.virtual for i in infos.values())
    gqa = sdpa_causal(batch=1, heads=8, kv_heads=2, seq=64, d=32)
    assert gqa.outputs["O"].dims == [1, 8, 64, 32]


def test_sdpa_gqa_head_counts_are_checked():
    b = SpecBuilder(io_data_type="bfloat16")
    q = b.tensor("q", dim=[1, 6, 16, 32])
    k = b.tensor("k", dim=[1, 4, 16, 32])
    v = b.tensor("v", dim=[1, 4, 16, 32])
    b.sdpa(q, k, v, causal=True).set_output(True)
    with pytest.raises(SpecError, match="multiple of k/v heads"):
        b.build()


def test_uids_are_deterministic_and_cover_non_virtual_tensors():
    mm = matmul_epilogue(batch=2, m=32, k=64, n=48)
    uids = mm.uids()
    assert set(uids) == set(mm.tensors) | set(mm.outputs)
    assert sorted(uids.values()) == list(range(1, len(uids) + 1))
    assert parse_spec(_reorder(mm.to_json())).uids() == uids


def test_builder_tensor_like_reads_torch_layout():
    torch = pytest.importorskip("torch")
    x = torch.empty(2, 8, 4, 4).to(memory_format=torch.channels_last).to(torch.bfloat16)
    b = SpecBuilder(io_data_type="bfloat16")
    X = b.tensor_like(x, "X", is_pass_by_value=False)
    s = b.tensor_like(torch.tensor([[[[0.5]]]]), "s")
    b.scale(b.relu(X), s).set_output(True).set_name("Y")
    spec = b.build()
    assert spec.tensors["X"].strides == list(x.stride())
    assert spec.tensors["s"].pass_by_value and spec.tensors["s"].dtype == "float32"


def test_builder_refuses_a_graph_without_outputs_and_duplicate_names():
    b = SpecBuilder(io_data_type="float16")
    x = b.tensor("X", dim=[2, 2, 2])
    b.relu(x)
    with pytest.raises(SpecError, match="no tensor is marked"):
        b.build()
    with pytest.raises(SpecError, match="already defined"):
        b.tensor("X", dim=[1, 1, 1])
