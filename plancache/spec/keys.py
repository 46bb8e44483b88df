"""The canonical form of a spec document and its graph key.

In the canonical form the same computation always reads the same: names (graph, tensor, node) and the
``uid_assigned`` flag are dropped; auto-assigned uids are renumbered in graph order (user-assigned uids are kept: code
executes with them); unset data types are filled as FE fills them; a param equal to its node type's default
(:data:`plancache.spec.nodes.NODES`) is dropped (``stride=[1, 1]`` reads as no stride); inferred (not user-set, not
pushed) dims and strides of node outputs are dropped. Dims, strides, dtypes, params, masks and baked-in scale values
stay, so anything that changes the computation changes the key.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from .. import SPEC_SCHEMA_VERSION
from ..canonical import canonical_json
from .nodes import kind_of

if TYPE_CHECKING:
    from .document import GraphSpec


def canonical_uids(spec: GraphSpec) -> dict[int, int]:
    """uid → canonical uid: user-assigned uids stay; the rest are numbered in graph order (node by node, input ports
    then output ports, each by port name; a tensor's ragged offset before the tensor), skipping the user-assigned
    ones."""
    fixed = {t.uid for t in spec.tensors if t.uid_assigned}
    order: list[int] = []
    seen: set[int] = set()

    def visit(uid: int) -> None:
        if uid in seen:
            return
        seen.add(uid)
        ragged = spec.tensor(uid).ragged_offset
        if ragged is not None:
            visit(ragged)
        order.append(uid)

    for node in spec.nodes:
        for ports in (node.inputs, node.outputs):
            for port in sorted(ports):
                visit(ports[port])
        for uid in _param_tensors(node.params):
            visit(uid)
    for t in spec.tensors:
        visit(t.uid)
    mapping, nxt = {}, 1
    for uid in order:
        if uid in fixed:
            mapping[uid] = uid
            continue
        while nxt in fixed:
            nxt += 1
        mapping[uid] = nxt
        nxt += 1
    return mapping


def canonical_form(spec: GraphSpec) -> dict[str, Any]:
    """The key-relevant content of ``spec`` (see the module docstring)."""
    remap = canonical_uids(spec)
    ctx = spec.context
    io = ctx.io_data_type
    tensors = []
    for t in sorted(spec.tensors, key=lambda t: remap[t.uid]):
        node = spec.producer(t.uid)
        keep_dim = node is None or t.dim_assigned or kind_of(node.type).pushed_output_dims
        keep_stride = node is None or t.stride_assigned
        tensors.append({
            "uid": remap[t.uid], "data_type": spec.data_type_of(t),
            "dim": t.dim if keep_dim else None, "stride": t.stride if keep_stride else None,
            "is_virtual": t.is_virtual, "is_pass_by_value": t.is_pass_by_value, "pass_by_value": t.pass_by_value,
            "reordering_type": t.reordering_type,
            "ragged_offset": None if t.ragged_offset is None else remap[t.ragged_offset],
            "ragged_offset_multiplier": t.ragged_offset_multiplier, "alignment_value": t.alignment_value,
            "scalar_type": t.scalar_type,
        })
    nodes = [{
        "type": n.type,
        "compute_data_type": n.compute_data_type or ctx.compute_data_type or io,
        "inputs": {p: remap[u] for p, u in n.inputs.items()},
        "outputs": {p: remap[u] for p, u in n.outputs.items()},
        "params": _canonical_params(n.type, n.params, remap),
    } for n in spec.nodes]
    return {
        "schema": spec.schema_version,
        "context": {"io_data_type": io, "intermediate_data_type": ctx.intermediate_data_type or io,
                    "compute_data_type": ctx.compute_data_type or io},
        "graph": spec.graph.model_dump(),
        "tensors": tensors,
        "nodes": nodes,
        "tuning": spec.tuning.model_dump(),
    }


def graph_key(spec: GraphSpec) -> str:
    """sha256 over the schema version and the canonical JSON of ``spec`` (64 hex chars)."""
    return hashlib.sha256(f"plancache-graphspec/v{SPEC_SCHEMA_VERSION}\n{canonical_json(canonical_form(spec))}".encode()
                          ).hexdigest()


def canonical_layout(spec: GraphSpec) -> dict[str, Any] | None:
    """The document of ``spec`` with canonical uids, tensors in uid order and ports sorted, names and flags kept
    (None: ``spec`` is laid out so already)."""
    remap = canonical_uids(spec)
    uids = [t.uid for t in spec.tensors]
    # ports in the order the key reads them (sorted): FE lowers a POINTWISE node's inputs by position, in the
    # order its dict holds them, so a document listing IN_1 before IN_0 would build b - a under a - b's key
    ports_sorted = all(list(ports) == sorted(ports) for n in spec.nodes for ports in (n.inputs, n.outputs))
    if all(k == v for k, v in remap.items()) and uids == sorted(uids) and ports_sorted:
        return None
    doc = spec.to_json()
    for t in doc["tensors"]:
        t["uid"] = remap[t["uid"]]
        if t.get("ragged_offset") is not None:
            t["ragged_offset"] = remap[t["ragged_offset"]]
    for n in doc["nodes"]:
        for section in ("inputs", "outputs"):
            n[section] = {p: remap[n[section][p]] for p in sorted(n[section])}
        n["params"] = _map_tensors(n["params"], remap)
    doc["tensors"].sort(key=lambda t: t["uid"])
    return doc


def _param_tensors(value: Any) -> list[int]:
    if isinstance(value, dict):
        if "$tensor" in value:
            return [value["$tensor"]]
        return [u for v in value.values() for u in _param_tensors(v)]
    if isinstance(value, list):
        return [u for v in value for u in _param_tensors(v)]
    return []


def _map_tensors(value: Any, remap: dict[int, int]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"$tensor"}:
            return {"$tensor": remap[value["$tensor"]]}
        return {k: _map_tensors(v, remap) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_tensors(v, remap) for v in value]
    return value


def _is_default(value: Any, default: Any) -> bool:
    if default == "zeros":
        return isinstance(value, list) and all(v == 0 for v in value)
    if default == "ones":
        return isinstance(value, list) and all(v == 1 for v in value)
    return value == default and type(value) is type(default)


def _canonical_params(node_type: str, params: dict[str, Any], remap: dict[int, int]) -> dict[str, Any]:
    kind = kind_of(node_type)
    out = {k: _map_tensors(v, remap) for k, v in params.items() if v is not None}
    if kind.group == "conv" and "padding" not in out and out.get("pre_padding") == out.get("post_padding") is not None:
        out["padding"] = out.pop("pre_padding")
        out.pop("post_padding")
    return {k: v for k, v in out.items() if not (k in kind.params and _is_default(v, kind.params[k]))}


__all__ = ["canonical_form", "canonical_layout", "canonical_uids", "graph_key"]

