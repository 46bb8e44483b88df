"""The contract with FE's private Python IR (FE 1.32): plancache reads and writes ``cudnn.pygraph`` internals
(:mod:`plancache.spec` ``from_pygraph``, :mod:`plancache.gpu.fegraph`). When an FE release changes any of
this, these tests fail by name, before a user's graph is silently mis-encoded. No GPU needed."""

from __future__ import annotations

import dataclasses
import inspect
import re
import tomllib
from pathlib import Path

import pytest

cudnn = pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed (the gpu extra)")

from cudnn.graph_types import NodeType, Tensor  # noqa: E402
from cudnn.nodes import Node  # noqa: E402

from plancache.gpu import fegraph  # noqa: E402
from plancache.spec import document, from_pygraph, nodes, vocabulary  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_installed_fe_is_in_the_supported_range_and_pyproject_pins_the_same_range():
    fegraph.check_fe_version()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    pin = next(d for d in deps if d.startswith("nvidia-cudnn-frontend"))
    lo, hi = re.search(r">=([\d.]+),<([\d.]+)", pin).groups()
    assert (tuple(map(int, lo.split("."))), tuple(map(int, hi.split(".")))) == fegraph.SUPPORTED_FE


def test_node_types_are_exactly_the_spec_vocabulary():
    assert set(NodeType.__members__) == set(nodes.NODE_TYPES)


def test_data_types_are_the_spec_vocabulary():
    assert set(cudnn.data_type.__members__) - {"NOT_SET"} == set(vocabulary.DATA_TYPES)


@pytest.mark.parametrize("name", vocabulary.ENUM_TYPES)
def test_every_enum_the_spec_names_exists_with_members(name):
    enum_type = getattr(cudnn, name, None) or getattr(cudnn._compiled_module, name, None)  # as fegraph._enum looks
    members = getattr(enum_type, "__members__", None)
    assert members, f"cudnn.{name} is not an enum in FE {cudnn.__version__}"


def test_tensor_is_the_dataclass_the_encoder_reads():
    assert dataclasses.is_dataclass(Tensor)
    fields = {f.name for f in dataclasses.fields(Tensor)}
    read = {"name", "data_type", "dim", "stride", "is_virtual", "is_pass_by_value", "pass_by_value", "uid",
            "uid_assigned", "dim_assigned", "stride_assigned", "reordering_type", "ragged_offset",
            "ragged_offset_multiplier", "alignment_value", "scalar_type"}
    assert read <= fields, read - fields
    assert set(document.TensorDoc.model_fields) - {"ragged_offset"} >= read - {"ragged_offset"}


def test_node_constructor_and_ports():
    assert list(inspect.signature(Node.__init__).parameters)[1:] == ["name", "node_type", "compute_data_type"]
    node = Node("n", NodeType.MATMUL, None)
    for attr in ("inputs", "outputs", "params", "node_type", "name", "compute_data_type"):
        assert hasattr(node, attr), attr


def test_pygraph_private_state_the_bridge_uses():
    g = cudnn.pygraph()
    for attr in ("_register_tensor", "_nodes", "_tensor_by_uid", "_next_uid", "_reserved_uids", "_context",
                 "_cpp_graph_kwargs", "_lowered_graph", "_planning_done"):
        assert hasattr(g, attr), f"cudnn.pygraph has no {attr} in FE {cudnn.__version__}"
    params = inspect.signature(cudnn.pygraph).parameters
    missing = [f for f in (*vocabulary.GRAPH_FLAGS, "io_data_type", "intermediate_data_type", "compute_data_type",
                           "handle", "kernel_cache", "device_property") if f not in params]
    assert not missing, missing


def test_a_constructed_graph_records_what_the_spec_encodes():
    g = cudnn.pygraph(io_data_type=cudnn.data_type.HALF, compute_data_type=cudnn.data_type.FLOAT)
    x = g.tensor(name="x", dim=[8, 64, 16, 16], stride=[16384, 1, 1024, 64], data_type=cudnn.data_type.HALF)
    w = g.tensor(name="w", dim=[32, 64, 3, 3], stride=[576, 1, 192, 64], data_type=cudnn.data_type.HALF)
    y = g.conv_fprop(x, w, padding=[1, 1], stride=[1, 1], dilation=[1, 1], name="conv")
    y.set_output(True)
    (node,) = g._nodes
    assert node.node_type is NodeType.CONV_FPROP
    assert node.inputs == {"image": x, "weight": w} and node.outputs == {"Y": y}
    assert node.params == {"padding": [1, 1], "stride": [1, 1], "dilation": [1, 1]}
    assert set(g._tensor_by_uid.values()) == {x, w, y}
    doc = from_pygraph(g)
    assert [n.type for n in doc.nodes] == ["CONV_FPROP"] and len(doc.tensors) == 3
