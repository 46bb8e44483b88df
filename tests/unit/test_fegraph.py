"""The bridge between documents and pygraphs, on the CPU (constructing a graph needs FE but no GPU): a user's
graph renumbered to canonical uids keeps every tensor bound to its own name, and a decoded document is the
same graph again (same key, same canonical uids)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed (the gpu extra)")
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
