"""The graph document (schema 2): validation, canonical form and graph-key stability (no GPU).

Graphs are written with FE's own ``cudnn.pygraph`` (its IR is pure Python: no GPU needed) and read
with :func:`plancache.spec.from_pygraph`; SpecBuilder's documents are tested in ``test_spec_builder``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from examples.generate import EXAMPLES, conv_bias_relu
from plancache.errors import SpecError, UnsupportedGraph
from plancache.spec import from_pygraph, graph_key, parse_spec

cudnn = pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed (pip install -e '.[gpu]')")

ROOT = Path(__file__).resolve().parents[2]
NHWC = [200704, 1, 3584, 64]


def fe_conv(*, explicit_defaults: bool = False, weights_first: bool = False, names: tuple[str, str] = ("X", "W"),
            padding: tuple[int, int] = (1, 1), x_stride: list[int] | None = None, out_stride: bool = False,
            dtype: str = "HALF") -> object:
    """conv(8x64x56x56, 32 3x3) + bias + relu, written the ordinary FE way."""
    dt = cudnn.data_type.__members__[dtype]
    g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT)
    make_x = lambda: g.tensor(name=names[0], dim=[8, 64, 56, 56], stride=x_stride or NHWC)  # noqa: E731
    make_w = lambda: g.tensor(name=names[1], dim=[32, 64, 3, 3], stride=[576, 1, 192, 64])  # noqa: E731
    if weights_first:
        W, X = make_w(), make_x()
    else:
        X, W = make_x(), make_w()
    B = g.tensor(name="B", dim=[1, 32, 1, 1], stride=[32, 1, 32, 32])
    kw = {"padding": list(padding)}
    if explicit_defaults:
        kw.update(stride=[1, 1], dilation=[1, 1])
    Y = g.relu(g.bias(g.conv_fprop(X, W, **kw), B))
    Y.set_output(True)
    if out_stride:
        Y.set_stride([100352, 3136, 56, 1])
    return g


def fe_sdpa(**kw: object) -> object:
    g = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT)
    dims, strides = [2, 8, 256, 64], [131072, 64, 512, 1]
    q, k, v = (g.tensor(name=n, dim=dims, stride=strides) for n in "qkv")
    o, _ = g.sdpa(q, k, v, generate_stats=False, **kw)
    o.set_output(True).set_dim(dims).set_stride(strides)
    return g


def _reorder(obj):
    if isinstance(obj, dict):
        return {k: _reorder(obj[k]) for k in reversed(list(obj))}
    if isinstance(obj, list):
        return [_reorder(v) for v in obj]
    return obj


def test_example_files_match_the_generator():
    for name, spec in EXAMPLES.items():
        on_disk = json.loads((ROOT / "examples" / f"{name}.json").read_text())
        assert on_disk == spec.to_json(), f"examples/{name}.json is stale: run python examples/generate.py"
        assert on_disk["schema"] == 2
        assert graph_key(on_disk) == spec.graph_key


def test_a_schema_1_document_is_refused_saying_how_to_write_it_again():
    """Before: schema 1 (the op-list format) was converted on parse. After: a SpecError (422 from the server) that
    says it is no longer read and names SpecBuilder and from_pygraph."""
    legacy = {"schema": 1, "io_data_type": "float32",
              "tensors": {"X": {"dims": [1], "strides": [1], "dtype": "float32"}},
              "nodes": [{"op": "relu", "inputs": {"input": "X"}, "outputs": {"output": "Y"}}],
              "outputs": {"Y": {"dims": [1], "strides": [1], "dtype": "float32"}}}
    for form in (legacy, json.dumps(legacy)):
        with pytest.raises(SpecError, match=r"schema 1 .* is no longer read.*SpecBuilder .*from_pygraph"):
            parse_spec(form)


def test_builder_defaults_and_explicit_defaults_get_one_key():
    spelled = parse_spec(_with(conv_bias_relu(n=2, c=8, hw=8, k=16).to_json(), lambda d: None))
    implicit = conv_bias_relu(n=2, c=8, hw=8, k=16)
    assert spelled.graph_key == implicit.graph_key
    doc = implicit.to_json()
    conv = doc["nodes"][0]
    assert conv["params"]["stride"] == [1, 1] and conv["params"]["dilation"] == [1, 1]
    del conv["params"]["stride"], conv["params"]["dilation"]
    assert graph_key(doc) == implicit.graph_key


def test_same_computation_same_key_however_it_was_written():
    base = from_pygraph(fe_conv()).graph_key
    assert from_pygraph(fe_conv(explicit_defaults=True)).graph_key == base       # stride=[1,1], dilation=[1,1]
    assert from_pygraph(fe_conv(weights_first=True)).graph_key == base           # other creation order: other auto uids
    assert from_pygraph(fe_conv(names=("image", "filter"))).graph_key == base    # other tensor names
    doc = from_pygraph(fe_conv()).canonical_document().to_json()
    assert graph_key(_reorder(doc)) == base                                      # JSON key order
    for t in doc["tensors"]:
        t["name"], t["uid_assigned"] = "", True                                  # no names; the same uids set by hand
    doc["name"] = "renamed"
    assert graph_key(doc) == base
    user_uids = from_pygraph(fe_conv()).to_json()
    for t in user_uids["tensors"]:
        t["uid"] += 100 * t["uid_assigned"] or 100                               # uids the user's code binds: kept
        t["uid_assigned"] = True
    for n in user_uids["nodes"]:
        n["inputs"] = {p: u + 100 for p, u in n["inputs"].items()}
        n["outputs"] = {p: u + 100 for p, u in n["outputs"].items()}
    assert graph_key(user_uids) != base


def test_key_is_the_same_in_another_process():
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from tests.unit.test_spec import fe_conv; "
            "from plancache.spec import from_pygraph; print(from_pygraph(fe_conv(weights_first=True)).graph_key)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == from_pygraph(fe_conv()).graph_key


@pytest.mark.parametrize("other", [
    lambda: fe_conv(padding=(0, 0)),
    lambda: fe_conv(x_stride=[200704, 3136, 56, 1]),
    lambda: fe_conv(dtype="BFLOAT16"),
    lambda: fe_conv(out_stride=True),
    lambda: fe_sdpa(attn_scale=0.1),
    lambda: fe_sdpa(attn_scale=0.125, use_causal_mask=True),
    lambda: fe_sdpa(attn_scale=0.125, diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT,
                    diagonal_band_right_bound=0),
], ids=["padding", "input_layout", "dtype", "output_layout", "scale", "causal", "bottom_right"])
def test_anything_that_changes_the_computation_changes_the_key(other):
    base = {from_pygraph(fe_conv()).graph_key, from_pygraph(fe_sdpa(attn_scale=0.125)).graph_key}
    assert from_pygraph(other()).graph_key not in base


def test_tuning_constraints_are_part_of_the_key():
    doc = from_pygraph(fe_conv()).to_json()
    keys = {graph_key(doc)}
    for tuning in ({"deterministic_only": True}, {"max_workspace_bytes": 0}, {"heuristic_modes": ["A"]}):
        keys.add(graph_key({**doc, "tuning": tuning}))
    assert len(keys) == 4


def test_a_spec_is_changed_by_a_copy_that_has_the_key_of_its_new_content():
    """A spec works its key and canonical form out once, so it is frozen; a copy with ``update`` made with the old
    content's key (pydantic's copy keeps private state) would fetch, and run, the plan of another graph."""
    spec = from_pygraph(fe_conv())
    before, canon_before = spec.graph_key, spec.canonical_document()
    other = from_pygraph(fe_conv(padding=(0, 0)))
    copy = spec.model_copy(update={"nodes": other.nodes})
    assert copy.graph_key == graph_key(copy.to_json()) == other.graph_key != before
    assert copy.canonical_document().graph_key == other.graph_key
    assert spec.graph_key == before and spec.canonical_document() is canon_before  # the original is untouched
    assert spec.model_copy().graph_key == spec.model_copy(deep=True).graph_key == before
    assert spec.model_copy(update={"name": "renamed"}).graph_key == before  # cosmetic: the same key
    with pytest.raises(ValueError, match="frozen"):
        spec.nodes = other.nodes
    assert spec.nodes != other.nodes and spec.graph_key == before
    with pytest.raises(SpecError, match="names tensor uid 999"):
        spec.model_copy(update={"nodes": [other.nodes[0].model_copy(update={"inputs": {"X": 999}})]})


def test_graph_key_of_a_spec_is_its_memo_unless_asked_fresh():
    """Worked out once whichever way it is asked for; ``fresh=True`` (the store's check of a key against a document)
    hashes the content as it is now, so a spec whose tensor was changed in place cannot vouch for its old key."""
    spec = from_pygraph(fe_conv())
    assert graph_key(spec) is spec.graph_key
    x = next(t for t in spec.tensors if t.name == "X")
    x.dim[0] = 16  # in place: not seen by the memo (documented), seen by a fresh key
    assert graph_key(spec) == spec.graph_key != graph_key(spec, fresh=True) == graph_key(spec.to_json())


def test_canonical_document_has_canonical_uids_and_the_same_key():
    spec = from_pygraph(fe_conv(weights_first=True))
    canon = spec.canonical_document()
    assert canon.graph_key == spec.graph_key
    assert [t.uid for t in canon.tensors] == sorted(t.uid for t in canon.tensors)
    x = next(t for t in canon.tensors if t.name == "X")
    assert x.uid == 1  # the conv's image port is visited first


def _with(doc: dict, mutate) -> dict:
    mutate(doc)
    return doc


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d["nodes"][0].__setitem__("type", "CONV_WIBBLE"), "unknown node type 'CONV_WIBBLE'"),
    (lambda d: d["tensors"][0].__setitem__("data_type", "FLOAT128"), "unknown data type 'FLOAT128'"),
    (lambda d: d["nodes"][0]["params"].__setitem__("mode", {"$enum": "os_system", "name": "X"}),
     "'os_system' is not a cudnn enum"),
    (lambda d: d["nodes"][0]["params"].__setitem__("cb", {"$call": "x"}), "unknown value form"),
    (lambda d: d["nodes"][0]["params"].__setitem__("alpha", float("nan")), "not a finite number"),
    (lambda d: d["nodes"][0]["inputs"].__setitem__("image", 999), "uid 999"),
    (lambda d: d["tensors"][1].__setitem__("uid", d["tensors"][0]["uid"]), "used twice"),
    (lambda d: d.__setitem__("schema", 99), "schema version 99"),
    (lambda d: d.__setitem__("extra_field", 1), "extra_field"),
    (lambda d: d["tensors"][0].__setitem__("secret", 1), "secret"),
    (lambda d: d["tensors"][0].__setitem__("dim", [10 ** 50] * 4), "out of range"),
    (lambda d: d["tensors"][0].__setitem__("stride", [1]), "4 dims but 1 strides"),
    (lambda d: d["nodes"].reverse(), "not produced by an earlier node"),
    (lambda d: d["nodes"][0]["params"].__setitem__("deep", [[[[[[[[1]]]]]]]]), "nested deeper"),
    (lambda d: d["nodes"][0]["params"].__setitem__("bad key", 1), "not an identifier"),
], ids=["node_type", "dtype", "enum_type", "value_form", "nan", "dangling", "dup_uid", "schema", "extra", "tensor_field",
        "huge_dim", "rank", "order", "depth", "param_name"])
def test_bad_documents_are_refused_naming_the_problem(mutate, needle):
    doc = from_pygraph(fe_conv()).to_json()
    mutate(doc)
    with pytest.raises(SpecError) as exc:
        parse_spec(json.dumps(doc, allow_nan=True))
    assert needle in str(exc.value)


def test_parse_spec_refuses_non_objects_and_bad_json():
    for bad, needle in (("[1, 2]", "JSON object"), ("{", "not valid JSON"), ("[" * 100_000, "nested too deeply|not valid JSON")):
        with pytest.raises(SpecError, match=needle):
            parse_spec(bad)


def test_graphs_that_cannot_be_represented_are_refused():
    g = fe_sdpa(attn_scale=0.125)
    g._nodes[0].params["score_mod"] = lambda graph, score: score
    with pytest.raises(UnsupportedGraph, match="score_mod"):
        from_pygraph(g)
    built = fe_conv()
    built._planning_done = True
    with pytest.raises(UnsupportedGraph, match="before build"):
        from_pygraph(built)
    with pytest.raises(UnsupportedGraph, match="not a cudnn.pygraph"):
        from_pygraph(object())


def test_documents_are_keyed_without_cudnn():
    """The server's path: parse and key a document in a process where cudnn cannot be imported."""
    doc = from_pygraph(fe_conv()).to_json()
    code = ("import sys, json; sys.modules['cudnn'] = None; sys.modules['torch'] = None; "
            "from plancache.spec import graph_key; print(graph_key(sys.stdin.read()))")
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(doc), capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == graph_key(doc)


def fe_sub() -> object:
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT)
    a, b = (g.tensor(name=n, dim=[1, 4, 8], stride=[32, 8, 1]) for n in "ab")
    g.sub(a, b).set_output(True)
    return g


def test_the_document_workers_build_lists_ports_in_the_order_the_key_reads_them():
    """FE lowers a POINTWISE node's inputs by position, in the order the node's dict holds them, and the key reads
    ports sorted. Before: a document listing IN_1 before IN_0 had a - b's key, was stored as it came (the first
    registered document of a key is what workers build), and built b - a. After: the stored document lists them
    sorted, so what is built is a function of the key."""
    from plancache.gpu.fegraph import decode

    honest = from_pygraph(fe_sub())
    doc = honest.to_json()
    node = doc["nodes"][0]
    assert list(node["inputs"]) == ["IN_0", "IN_1"] and node["params"] == {"mode": "sub"}
    node["inputs"] = dict(reversed(list(node["inputs"].items())))
    swapped = parse_spec(doc)
    assert swapped.graph_key == honest.graph_key
    for spec in (honest, swapped):
        canon = spec.canonical_document()
        assert list(canon.nodes[0].inputs) == ["IN_0", "IN_1"]
        built = decode(parse_spec(canon.to_json()))  # the store keeps to_json() of the canonical document
        assert [t.name for t in built._nodes[0].inputs.values()] == ["a", "b"]


def test_a_lone_surrogate_in_a_string_param_is_a_spec_error():
    """Before: JSON's "\\ud800" in a param string passed validation and graph_key raised UnicodeEncodeError (HTTP 500
    from POST /v1/specs, any token). After: a SpecError naming the param (422)."""
    text = json.dumps(from_pygraph(fe_sub()).to_json()).replace('"mode": "sub"', '"mode": "sub", "note": "\\ud800"')
    with pytest.raises(SpecError, match=r"param 'note'.*not valid Unicode"):
        parse_spec(text)


def fe_matmul(**kw: object) -> object:
    """bf16 [1,8,16] @ [1,16,4] through FE's ``matmul`` (``kw``: its padding)."""
    g = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT)
    a = g.tensor(name="A", dim=[1, 8, 16], stride=[128, 16, 1])
    b = g.tensor(name="B", dim=[1, 16, 4], stride=[64, 4, 1])
    g.matmul(a, b, **kw).set_output(True)
    return g


def test_a_matmul_padding_of_minus_zero_is_the_default():
    # FE sets CUDNN_ATTR_MATMUL_PADDING_VALUE only where padding != 0.0, so -0.0 and 0.0 are one cuDNN graph
    base = from_pygraph(fe_matmul()).graph_key
    assert from_pygraph(fe_matmul(padding=0.0)).graph_key == base
    assert from_pygraph(fe_matmul(padding=-0.0)).graph_key == base
    assert from_pygraph(fe_matmul(padding=1.0)).graph_key != base


def _set_pass_by_value(doc: dict, value: float) -> None:
    next(t for t in doc["tensors"] if t["name"] == "alpha")["pass_by_value"] = value


def _set_negative_slope(doc: dict, value: float) -> None:
    next(n for n in doc["nodes"] if n["params"].get("mode") == "relu")["params"]["negative_slope"] = value


@pytest.mark.parametrize("set_zero", [_set_pass_by_value, _set_negative_slope], ids=["scale", "negative_slope"])
def test_a_zero_keeps_its_sign_in_the_key_where_a_product_shows_it(set_zero):
    # x * -0.0 and x * 0.0 differ in sign: these floats are not canonicalized
    keys = []
    for zero in (0.0, -0.0):
        doc = EXAMPLES["matmul_scale_bias_relu_amax_b4"].to_json()
        set_zero(doc, zero)
        keys.append(graph_key(doc))
    assert keys[0] != keys[1]
