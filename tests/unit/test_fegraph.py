"""The bridge between documents and pygraphs, on the CPU (constructing a graph needs FE but no GPU): a user's
graph renumbered to canonical uids keeps every tensor bound to its own name, and a decoded document is the
same graph again (same key, same canonical uids)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest

cudnn = pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed (the gpu extra)")
pytest.importorskip("torch", reason="torch is not installed (the gpu extra)")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "fe"))
import graphs  # noqa: E402

from plancache.gpu import fegraph, reference  # noqa: E402
from plancache.gpu.runtime import canonical  # noqa: E402
from plancache.spec import from_pygraph, parse_spec  # noqa: E402

NAMES = sorted(graphs.EXAMPLES)


@pytest.mark.parametrize("name", NAMES)
def test_canonicalized_user_graph_binds_each_name_to_the_canonical_uid(name):
    g, tensors = graphs.EXAMPLES[name]()
    key = from_pygraph(g).graph_key
    spec = fegraph.canonicalize_uids(g)
    assert spec.graph_key == key
    assert spec == spec.canonical_document()
    by_uid = {t.uid: t for t in tensors.values()}
    for doc in spec.input_tensors() + spec.output_tensors():
        assert by_uid[doc.uid].name == doc.name, (doc.uid, doc.name)
    now = from_pygraph(g)  # the graph itself now carries the canonical uids
    assert all(old == new for old, new in now.canonical_uids().items())
    assert now.canonical_document().to_json() == spec.to_json()


@pytest.mark.parametrize("name", NAMES)
def test_a_decoded_document_is_the_same_graph(name):
    doc = json.loads(json.dumps(from_pygraph(graphs.EXAMPLES[name]()[0]).to_json()))
    spec = canonical(doc)
    again = from_pygraph(fegraph.decode(spec))
    assert again.graph_key == spec.graph_key
    assert [(t.uid, t.name) for t in again.tensors] == [(t.uid, t.name) for t in spec.tensors]


@pytest.mark.parametrize("name", NAMES)
def test_inputs_are_made_for_exactly_the_graphs_inputs_by_canonical_uid(name):
    """The autotuner feeds the decoded graph by uid: every input of the canonical document gets a buffer of
    its dims, host scalars on the host (a wrong uid here once swapped q and k and crashed native execute)."""
    spec = canonical(from_pygraph(graphs.EXAMPLES[name]()[0]).to_json())
    inputs = reference.make_inputs(spec, "cpu", seed=1)
    assert set(inputs) == {t.uid for t in spec.input_tensors()}
    for t in spec.input_tensors():
        if not t.is_pass_by_value:
            assert list(inputs[t.uid].shape) == list(t.dim), t.name
    assert parse_spec(doc_json := spec.to_json()).canonical_document().to_json() == doc_json


def _attention(o_stride: list[int] | None = None):
    import cudnn

    g = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT)
    q, k, v = (g.tensor(name=n, dim=[2, 8, 128, 64], stride=[65536, 8192, 64, 1], data_type=cudnn.data_type.BFLOAT16)
               for n in ("q", "k", "v"))
    o, stats = g.sdpa(q=q, k=k, v=v, attn_scale=0.125, generate_stats=True, use_causal_mask=True)
    o.set_output(True)
    if o_stride is not None:
        o.set_stride(o_stride)
    stats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    return from_pygraph(g)


def _inferred_shapes(spec) -> dict[str, tuple[list[int], list[int]]]:
    """Each tensor's dims and strides once FE's validate() has inferred what the decoded graph leaves to it (the C++
    check that follows needs libcudnn, absent on a CPU machine; the inference before it is FE's Python)."""
    g = fegraph.decode(spec)
    with contextlib.suppress(Exception):  # the backend's own validation, after the inference looked at here
        g.validate()
    return {t.name: (list(t.dim), list(t.stride)) for t in g._tensors.values()}


def test_an_attention_output_the_caller_left_unset_is_built_as_fe_infers_it_whatever_the_document_says():
    """Before (found by an audit of graph keys): the key leaves out an SDPA output's dims and strides the caller did
    not set, but FE's lowering passes them to cuDNN as the document holds them, so a document registered first with
    another layout under an honest graph's key had that layout tuned and served to every honest process. Now the
    decoded graph leaves them to FE's inference: an honest document builds as before, a doctored one as the honest."""
    honest = _attention()
    doc = honest.to_json()
    o = next(t for t in doc["tensors"] if t["name"].endswith("::O"))
    o["dim"], o["stride"] = [2, 8, 256, 64], [131072, 64, 512, 1]  # still "not set by the caller"
    doctored = parse_spec(doc)
    assert doctored.graph_key == honest.graph_key
    assert _inferred_shapes(doctored) == _inferred_shapes(honest)
    name = o["name"]
    assert _inferred_shapes(honest)[name] == ([2, 8, 128, 64], [65536, 8192, 64, 1])


def test_an_attention_output_whose_stride_the_caller_set_keeps_it():
    bshd = [131072, 64, 1024, 1]
    spec = _attention(o_stride=bshd)
    name = next(t.name for t in spec.tensors if t.name.endswith("::O"))
    assert _inferred_shapes(spec)[name] == ([2, 8, 128, 64], bshd)


def _scaled(scalar_type, value=2.0):
    g = cudnn.pygraph(io_data_type=cudnn.data_type.HALF, compute_data_type=cudnn.data_type.FLOAT)
    x = g.tensor(name="x", dim=[4, 8], data_type=cudnn.data_type.HALF)
    g.scale(x, g.tensor_scalar(value, scalar_type)).set_output(True)
    return g


def test_a_tensor_scalar_is_encoded_keyed_by_its_scalar_type_and_decoded_as_one():
    """Before (found by an audit of graph keys): ``scalar_type`` was checked as a data type, but FE's ``tensor_scalar``
    takes a ``cudnn.scalar_type`` (RUNTIME_PARAM, COMPILE_TIME_CONST), so from_pygraph raised SpecError for every
    graph embedding a scalar, and the hook's validate() raised it into the user's program."""
    const = from_pygraph(_scaled(cudnn.scalar_type.COMPILE_TIME_CONST))
    runtime = from_pygraph(_scaled(cudnn.scalar_type.RUNTIME_PARAM))
    assert const.graph_key != runtime.graph_key
    assert const.graph_key != from_pygraph(_scaled(cudnn.scalar_type.COMPILE_TIME_CONST, 3.0)).graph_key
    t = next(t for t in fegraph.decode(const)._tensor_by_uid.values() if t.pass_by_value is not None)
    assert (t.pass_by_value, t.scalar_type) == (2.0, cudnn.scalar_type.COMPILE_TIME_CONST)
    assert from_pygraph(fegraph.decode(const)).graph_key == const.graph_key


def _conv(**kw):
    g = cudnn.pygraph(io_data_type=cudnn.data_type.HALF, compute_data_type=cudnn.data_type.FLOAT)
    x = g.tensor(name="x", dim=[1, 8, 16, 16], stride=[2048, 1, 128, 8])
    w = g.tensor(name="w", dim=[8, 8, 3, 3], stride=[72, 1, 24, 8])
    g.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1], **kw).set_output(True)
    return g


def test_a_convolution_mode_is_keyed_and_decoded():
    """Before: ``convolution_mode`` (convolution vs cross-correlation, which FE 1.32 exports only on
    ``cudnn._compiled_module``) was not an enum type of the schema: from_pygraph raised SpecError for any conv that
    named it, the default included, and the hook's validate() raised it into the user's program."""
    mode = cudnn._compiled_module.convolution_mode
    conv = from_pygraph(_conv(convolution_mode=mode.CONVOLUTION))
    assert conv.graph_key != from_pygraph(_conv(convolution_mode=mode.CROSS_CORRELATION)).graph_key
    assert from_pygraph(_conv(convolution_mode=mode.CROSS_CORRELATION)).graph_key == from_pygraph(_conv()).graph_key
    node = fegraph.decode(conv)._nodes[0]
    assert node.params["convolution_mode"] == mode.CONVOLUTION
    assert from_pygraph(fegraph.decode(conv)).graph_key == conv.graph_key


def test_a_graph_fe_takes_but_the_schema_cannot_hold_is_unsupported_not_a_spec_error():
    """The hook leaves an UnsupportedGraph to FE; any other SpecError from reading a user's graph reached the user's
    validate() (here: a node whose compute type is FE's NOT_SET, which the schema has no name for)."""
    from plancache.errors import UnsupportedGraph

    g = cudnn.pygraph(io_data_type=cudnn.data_type.HALF)
    a = g.tensor(name="a", dim=[1, 16, 32])
    b = g.tensor(name="b", dim=[1, 32, 8])
    g.matmul(a, b, compute_data_type=cudnn.data_type.NOT_SET).set_output(True)
    with pytest.raises(UnsupportedGraph, match="NOT_SET"):
        from_pygraph(g)
