"""The bridge to FE's Python IR: a spec document → ``cudnn.pygraph``, and a user's graph → canonical uids.

This is the one module that writes FE 1.32's private IR (``graph_types.Tensor``, ``nodes.Node``,
``pygraph._register_tensor`` / ``_nodes`` / ``_tensor_by_uid``); ``tests/unit/test_fe_contract.py``
fails loudly when FE changes under it. Constructing a graph needs nvidia-cudnn-frontend but no GPU.
"""

from __future__ import annotations

from typing import Any

import cudnn
from cudnn.graph_types import NodeType, Tensor
from cudnn.nodes import Node

from ..errors import SpecError
from ..spec import GraphSpec, from_pygraph
from ..spec.nodes import kind_of

#: The FE releases whose IR this module reads and writes (``pyproject.toml`` pins the same range).
SUPPORTED_FE = ((1, 32), (1, 33))


def fe_version() -> tuple[int, int]:
    major, minor = (int(p) for p in str(cudnn.__version__).split(".")[:2])
    return major, minor


def check_fe_version() -> None:
    lo, hi = SUPPORTED_FE
    if not lo <= fe_version() < hi:
        raise SpecError(f"nvidia-cudnn-frontend {cudnn.__version__} is outside the range plancache reads "
                        f"({'.'.join(map(str, lo))} <= FE < {'.'.join(map(str, hi))})")


def _data_type(name: str | None, where: str) -> Any:
    if name is None:
        return None
    member = cudnn.data_type.__members__.get(name)
    if member is None:
        raise SpecError(f"{where}: {name!r} is not a cudnn.data_type of FE {cudnn.__version__}")
    return member


def _enum(type_name: str, name: str, where: str) -> Any:
    # FE 1.32 exports most enums on ``cudnn``; some (convolution_mode) only on its compiled module
    enum_type = getattr(cudnn, type_name, None) or getattr(cudnn._compiled_module, type_name, None)
    members = getattr(enum_type, "__members__", None)
    if members is None:
        raise SpecError(f"{where}: cudnn.{type_name} is not an enum of FE {cudnn.__version__}")
    if name not in members:
        raise SpecError(f"{where}: {name!r} is not a member of cudnn.{type_name}")
    return members[name]


def _value(value: Any, tensors: dict[int, Tensor], where: str) -> Any:
    if isinstance(value, list):
        return [_value(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, dict):
        return value
    if "$tensor" in value:
        return tensors[value["$tensor"]]
    if "$enum" in value:
        return _enum(value["$enum"], value["name"], where)
    if "$tuple" in value:
        return tuple(_value(v, tensors, where) for v in value["$tuple"])
    return {k: _value(v, tensors, f"{where}.{k}") for k, v in value["$dict"].items()}


def _left_to_fe(doc: GraphSpec) -> set[int]:
    """The outputs whose dims and strides the caller did not set and FE infers (its own table), of nodes whose
    lowering passes output layouts as the document holds them (``NodeKind.lowers_output_layouts``): decoded empty,
    so that ``validate()`` infers them as it did when the graph was captured. The graph key leaves them out, so a
    document carrying other values under an honest key cannot have them built."""
    from cudnn import _pygraph

    left: set[int] = set()
    for n in doc.nodes:
        if not kind_of(n.type).lowers_output_layouts:
            continue
        entry = _pygraph._STRUCTURED_BY_TYPE.get(NodeType[n.type]) or _pygraph._CAPTURED_BY_TYPE.get(NodeType[n.type])
        inferred = entry[1].get("infer", {}) if entry else {}
        for port, uid in n.outputs.items():
            t = doc.tensor(uid)
            if port in inferred and not t.dim_assigned and not t.stride_assigned:
                left.add(uid)
    return left


def decode(spec: GraphSpec, *, handle: Any = None, kernel_cache: Any = None, device_property: Any = None,
           dynamic_shapes: bool = False) -> Any:
    """A ``cudnn.pygraph`` holding ``spec``'s canonical document (canonical uids), ready to validate and build."""
    check_fe_version()
    doc = spec.canonical_document()
    kwargs: dict[str, Any] = {k: v for k, v in (("handle", handle), ("kernel_cache", kernel_cache),
                                                 ("device_property", device_property)) if v is not None}
    flags = doc.graph
    for k in ("sm_count", "sm_version"):
        if getattr(flags, k) is not None:
            kwargs[k] = getattr(flags, k)
    ctx = doc.context
    g = cudnn.pygraph(
        name=doc.name or "plancache",
        io_data_type=_data_type(ctx.io_data_type, "context"),
        intermediate_data_type=_data_type(ctx.intermediate_data_type, "context"),
        compute_data_type=_data_type(ctx.compute_data_type, "context"),
        is_dynamic_shape_enabled=dynamic_shapes or flags.is_dynamic_shape_enabled,
        is_override_shape_enabled=flags.is_override_shape_enabled,
        is_cuda_graph_replay_expected=flags.is_cuda_graph_replay_expected,
        **kwargs,
    )
    tensors: dict[int, Tensor] = {}
    left_to_fe = _left_to_fe(doc)
    for t in doc.tensors:
        where = f"tensor {t.name or t.uid!r}"
        reordering = None if t.reordering_type is None else _enum("tensor_reordering", t.reordering_type, where)
        dim, stride = ([], []) if t.uid in left_to_fe else (list(t.dim), list(t.stride))
        tensors[t.uid] = Tensor(
            name=t.name or f"t{t.uid}", data_type=_data_type(t.data_type, where), dim=dim, stride=stride,
            is_virtual=t.is_virtual, is_pass_by_value=t.is_pass_by_value, pass_by_value=t.pass_by_value, uid=t.uid,
            uid_assigned=True, dim_assigned=t.dim_assigned, stride_assigned=t.stride_assigned,
            reordering_type=reordering, ragged_offset_multiplier=t.ragged_offset_multiplier,
            alignment_value=t.alignment_value,
            scalar_type=None if t.scalar_type is None else _enum("scalar_type", t.scalar_type, where),
        )
    for t in doc.tensors:
        if t.ragged_offset is not None:
            tensors[t.uid].ragged_offset = tensors[t.ragged_offset]
        g._register_tensor(tensors[t.uid])
    for i, n in enumerate(doc.nodes):
        where = f"node {i} ({n.name or n.type})"
        node = Node(n.name or f"{n.type.lower()}_{i}", NodeType[n.type], _data_type(n.compute_data_type, where))
        node.inputs = {p: tensors[u] for p, u in n.inputs.items()}
        node.outputs = {p: tensors[u] for p, u in n.outputs.items()}
        node.params = {k: _value(v, tensors, f"{where} param {k!r}") for k, v in n.params.items()}
        g._nodes.append(node)
    g._next_uid = max(tensors) + 1
    g._reserved_uids = set(tensors)
    return g


def canonicalize_uids(graph: Any, spec: GraphSpec | None = None) -> GraphSpec:
    """Renumber the auto-assigned uids of a user's (unbuilt) graph to the canonical ones, in place, so a plan
    built from the canonical document binds to the user's own tensors. User-assigned uids never change.
    Returns the graph's spec with canonical uids (the ones its tensors now carry)."""
    spec = spec if spec is not None else from_pygraph(graph)
    remap = spec.canonical_uids()
    if all(old == new for old, new in remap.items()):
        return spec.canonical_document()
    by_uid = dict(graph._tensor_by_uid)
    for old, t in by_uid.items():
        t.uid = remap[old]
    graph._tensor_by_uid = {t.uid: t for t in by_uid.values()}
    bindings = getattr(graph, "_data_bindings", None)
    if bindings:
        graph._data_bindings = {remap.get(u, u): v for u, v in bindings.items()}
    graph._next_uid = max(graph._tensor_by_uid) + 1
    return spec.canonical_document()


def graph_layouts(graph: Any) -> dict[int, tuple[list[int], list[int]]]:
    """Dims and strides of every tensor of a graph after ``build_operation_graph`` (the backend's real layouts)."""
    return {uid: (list(t.dim), list(t.stride)) for uid, t in graph._tensor_by_uid.items()}
