"""The spec of a user's ``cudnn.pygraph``: FE 1.32's pure-Python IR read into a schema-2 document.

It needs FE only because the graph does: cudnn is imported where a value is encoded, not when this module is.
"""

from __future__ import annotations

from typing import Any

from .. import SPEC_SCHEMA_VERSION
from ..errors import SpecError, UnsupportedGraph
from .document import GraphSpec, TuningSpec, parse_spec
from .vocabulary import GRAPH_FLAGS


def _enum_name(value: Any, where: str) -> str | None:
    if value is None:
        return None
    name = getattr(value, "name", None)
    if not isinstance(name, str) or not type(value).__module__.startswith("cudnn"):
        if type(value).__module__ == "torch":  # FE accepts torch dtypes where it takes data types
            from cudnn.datatypes import _torch_to_cudnn_data_type

            return _enum_name(_torch_to_cudnn_data_type(value), where)
        raise UnsupportedGraph(f"{where}: {value!r} is not a cudnn enum")
    return name


def _encode_value(value: Any, where: str) -> Any:
    from cudnn.graph_types import Tensor

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Tensor):
        return {"$tensor": value.uid}
    t = type(value)
    if hasattr(t, "__members__") and isinstance(getattr(value, "name", None), str):
        if not t.__module__.startswith("cudnn"):
            raise UnsupportedGraph(f"{where} holds {t.__module__}.{t.__qualname__}, an enum outside cudnn")
        return {"$enum": t.__qualname__, "name": value.name}
    if isinstance(value, (list, tuple)):
        items = [_encode_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else {"$tuple": items}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"$dict": {k: _encode_value(v, f"{where}.{k}") for k, v in value.items()}}
    raise UnsupportedGraph(f"{where} holds a {t.__module__}.{t.__qualname__}, which a graph spec cannot represent "
                           "(callbacks such as score_mod cannot be cached)")


def is_pygraph(obj: Any) -> bool:
    """Whether ``obj`` looks like a ``cudnn.pygraph`` (checked without importing cudnn)."""
    return hasattr(obj, "_nodes") and hasattr(obj, "_tensor_by_uid") and hasattr(obj, "_context")


def from_pygraph(graph: Any, *, tuning: TuningSpec | None = None, name: str | None = None) -> GraphSpec:
    """The spec of a user's ``cudnn.pygraph`` (constructed, not yet built), with ``.graph_key`` and ``.to_json()``.

    Reads FE 1.32's pure-Python IR; raises :class:`UnsupportedGraph` naming what cannot be represented."""
    for attr in ("_nodes", "_tensor_by_uid", "_context", "_cpp_graph_kwargs"):
        if not hasattr(graph, attr):
            raise UnsupportedGraph(f"{type(graph).__name__} is not a cudnn.pygraph of FE 1.32 (no {attr}); "
                                   "plancache reads FE's Python IR")
    if getattr(graph, "_lowered_graph", None) is not None or getattr(graph, "_planning_done", False):
        raise UnsupportedGraph("the graph is already lowered or built; hand it to plancache before build()")
    kwargs = graph._cpp_graph_kwargs
    unknown = sorted(set(kwargs) - set(GRAPH_FLAGS) - {"name", "handle", "kernel_cache", "device_property",
                                                        "cuda_graph_retention"})
    if unknown:
        raise UnsupportedGraph(f"graph argument(s) {', '.join(unknown)} are not part of the spec schema")
    ctx = graph._context
    tensors = []
    for t in graph._tensor_by_uid.values():
        where = f"tensor {t.name!r}"
        tensors.append({
            "uid": int(t.uid), "name": str(t.name or ""), "data_type": _enum_name(t.data_type, where),
            "dim": [int(d) for d in (t.dim or [])], "stride": [int(s) for s in (t.stride or [])],
            "is_virtual": bool(t.is_virtual), "is_pass_by_value": bool(t.is_pass_by_value),
            "pass_by_value": t.pass_by_value, "uid_assigned": bool(t.uid_assigned),
            "dim_assigned": bool(t.dim_assigned), "stride_assigned": bool(t.stride_assigned),
            "reordering_type": _enum_name(t.reordering_type, where),
            "ragged_offset": None if t.ragged_offset is None else int(t.ragged_offset.uid),
            "ragged_offset_multiplier": int(t.ragged_offset_multiplier or 1),
            "alignment_value": int(t.alignment_value or 1), "scalar_type": _enum_name(t.scalar_type, where),
        })
    nodes = []
    for n in graph._nodes:
        where = f"node {n.name!r}"
        nodes.append({
            "name": str(n.name), "type": n.node_type.name,
            "compute_data_type": _enum_name(n.compute_data_type, where),
            "inputs": {p: int(t.uid) for p, t in n.inputs.items() if t is not None},
            "outputs": {p: int(t.uid) for p, t in n.outputs.items() if t is not None},
            "params": {k: _encode_value(v, f"{where} param {k!r}") for k, v in n.params.items()},
        })
    doc = {
        "schema": SPEC_SCHEMA_VERSION,
        "name": str(name if name is not None else kwargs.get("name", "")),
        "context": {f: _enum_name(getattr(ctx, f), f"context.{f}")
                    for f in ("io_data_type", "intermediate_data_type", "compute_data_type")},
        "graph": {**{k: kwargs[k] for k in ("sm_count", "sm_version", "is_dynamic_shape_enabled",
                                            "is_override_shape_enabled") if k in kwargs},
                  "is_cuda_graph_replay_expected": bool(getattr(graph, "is_cuda_graph_replay_expected", False))},
        "tensors": tensors,
        "nodes": nodes,
        "tuning": (tuning or TuningSpec()).model_dump(),
    }
    try:
        return parse_spec(doc)
    except UnsupportedGraph:
        raise
    except SpecError as exc:  # FE built it, the schema cannot hold it: a graph the spec cannot represent
        raise UnsupportedGraph(exc.message) from None



__all__ = ["from_pygraph", "is_pygraph"]
