"""Shape axes: a graph at another batch size or sequence length, and what the graphs that differ only there share.

:func:`vary` rewrites a graph at another size of a shape axis (:data:`AXES`) exactly as the graph's own code would
have built it: the axis' dim of every tensor that carries it, and each such tensor's strides recomputed in its own
layout (the strides of the dims outside the varied one are scaled, the inner ones kept). Warm starts and
``plancache enqueue --vary`` take a captured graph's variants from it; :func:`sibling_key` names what a graph's
variants share, so that the server can list the tuned plans of a graph's other shapes (``POST /v1/plans/siblings``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from ..errors import SpecError
from .document import GraphSpec, graph_key, parse_spec

__all__ = ["AXES", "AXIS_ALIASES", "axes_of", "setters", "sibling_key", "stored_sibling_key", "variants", "vary"]

#: Shape axes :func:`vary` moves: per node type, per axis, the (port, dim index) pairs that move together.
#: SDPA tensors are (batch, heads, sequence, head_dim); ``Stats`` is (batch, heads, s_q, 1). ``s`` is self-attention:
#: ``s_q`` and ``s_kv`` together.
AXES: dict[str, dict[str, tuple[tuple[str, int], ...]]] = {
    "SDPA": {
        "b": (("q", 0), ("k", 0), ("v", 0), ("O", 0), ("Stats", 0)),
        "s_q": (("q", 2), ("O", 2), ("Stats", 2)),
        "s_kv": (("k", 2), ("v", 2)),
    },
    "SDPA_BWD": {
        "b": (("q", 0), ("k", 0), ("v", 0), ("o", 0), ("dO", 0), ("stats", 0), ("dQ", 0), ("dK", 0), ("dV", 0)),
        "s_q": (("q", 2), ("o", 2), ("dO", 2), ("stats", 2), ("dQ", 2)),
        "s_kv": (("k", 2), ("v", 2), ("dK", 2), ("dV", 2)),
    },
}
#: Axes that stand for several of :data:`AXES`.
AXIS_ALIASES = {"s": ("s_q", "s_kv")}
#: Ports of those node types that :func:`vary` leaves alone (scalars); a graph with any other port is refused, since
#: its tensors (a bias, a mask, sequence lengths, page tables) would have to move too.
_SCALAR_PORTS = frozenset({"attn_scale"})
#: The sizes a graph is varied to for :func:`sibling_key`: distinct, so that no two axes' dims coincide.
_SIBLING_SIZES = {"b": 3, "s_q": 5, "s_kv": 7}


def axes_of(spec: GraphSpec) -> list[str]:
    """The axes :func:`vary` can move in this graph (empty: none)."""
    types = {n.type for n in spec.nodes}
    if not types or not types <= set(AXES):
        return []
    common = set.intersection(*(set(AXES[t]) for t in types))
    return sorted(common | {a for a, parts in AXIS_ALIASES.items() if set(parts) <= common})


def setters(axes: Iterable[str]) -> dict[str, list[str]]:
    """Each dimension that ``axes`` set (an alias of :data:`AXIS_ALIASES` sets all of its parts) and the axes that set
    it, in order: more than one, and one would override the other."""
    found: dict[str, list[str]] = {}
    for axis in axes:
        for part in AXIS_ALIASES.get(axis, (axis,)):
            found.setdefault(part, []).append(axis)
    return found


def vary(spec: GraphSpec, sizes: dict[str, int]) -> GraphSpec:
    """``spec`` with each axis of ``sizes`` (:data:`AXES`, :data:`AXIS_ALIASES`) at that size: the graph the same
    code builds at that shape. :class:`SpecError` when the graph has no such axis or tensors :func:`vary` cannot
    move consistently (other node types; a bias, mask or sequence-length input)."""
    for axis, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise SpecError(f"axis {axis}: a size is a positive integer, not {size!r}")
    wanted: dict[str, int] = {}
    for part, by in setters(sizes).items():
        if len(by) > 1:  # s and s_q: one would silently override the other
            raise SpecError(f"axes {by[0]} and {by[1]} both set {part}; give one of them")
        wanted[part] = sizes[by[0]]
    available = axes_of(spec)
    missing = [a for a in sizes if a not in available]
    if missing:
        raise SpecError(f"graph {spec.name or spec.graph_key[:12]} has no axis {', '.join(missing)} to vary; it has "
                        f"{', '.join(available) or 'none'} (axes are defined for node types {', '.join(AXES)})")
    doc = spec.to_json()
    tensors = {t["uid"]: t for t in doc["tensors"]}
    moves: dict[int, dict[int, int]] = {}  # uid -> dim index -> new size
    for node in doc["nodes"]:
        ports = {**node.get("inputs", {}), **node["outputs"]}
        axes = AXES[node["type"]]
        known = {p for parts in axes.values() for p, _ in parts} | _SCALAR_PORTS
        unknown = sorted(set(ports) - known)
        if unknown:
            raise SpecError(f"node {node.get('name') or node['type']}: its ports {', '.join(unknown)} would have to "
                            "move with the shape; vary supports plain attention (q, k, v, O, Stats) only")
        for axis, size in wanted.items():
            for port, index in axes[axis]:
                if port in ports:
                    moves.setdefault(ports[port], {})[index] = size
    for uid, dims in moves.items():
        _resize(tensors[uid], dims)
    return parse_spec(doc)


def variants(spec: GraphSpec, axes: Mapping[str, Sequence[int]]) -> Iterator[tuple[dict[str, int], GraphSpec]]:
    """``spec`` (:func:`vary`) at every combination of the sizes of ``axes`` (axis -> sizes), each with its sizes,
    one at a time (any number of them in bounded memory); :class:`SpecError` as :func:`vary`'s."""
    for sizes in itertools.product(*axes.values()):
        chosen = dict(zip(axes, sizes))
        yield chosen, vary(spec, chosen)


def _resize(tensor: dict[str, Any], sizes: dict[int, int]) -> None:
    """Set dims of one tensor document and recompute its strides in its own layout: a dim is outside dim ``j``
    when its stride is larger (or equal, and it comes first) and at least dim ``j``'s extent; those strides scale."""
    dim, stride = list(tensor["dim"]), list(tensor["stride"])
    for j, new in sorted(sizes.items()):
        if j >= len(dim):
            raise SpecError(f"tensor {tensor.get('name') or tensor['uid']} has {len(dim)} dims, not {j + 1}")
        old = dim[j]
        if stride:
            extent = stride[j] * old
            for k in range(len(dim)):
                outer = stride[k] > stride[j] or (stride[k] == stride[j] and k < j)
                if k != j and outer and stride[k] >= extent:
                    if stride[k] % old:
                        raise SpecError(f"tensor {tensor.get('name') or tensor['uid']}: stride {stride[k]} is not "
                                        f"a multiple of dim {j} ({old}); its layout is not dense")
                    stride[k] = stride[k] // old * new
        dim[j] = new
    tensor["dim"], tensor["stride"] = dim, stride


def sibling_key(spec: GraphSpec) -> str | None:
    """The graph key of ``spec`` varied to fixed sizes along all of its shape axes: the same for every graph that
    differs from it only in batch size and sequence lengths (its variants), different otherwise. None for a graph
    :func:`vary` cannot move (no shape axes, or tensors that would have to move too: a bias, a mask)."""
    axes = [axis for axis in axes_of(spec) if axis in _SIBLING_SIZES]
    if not axes:
        return None
    try:
        return graph_key(vary(spec, {axis: _SIBLING_SIZES[axis] for axis in axes}))
    except SpecError:
        return None


def stored_sibling_key(document: str) -> str | None:
    """:func:`sibling_key` of a stored spec document; None also when this release cannot read it (a document written
    in another format keeps no sibling key rather than failing the read of the others)."""
    try:
        return sibling_key(parse_spec(document))
    except SpecError:
        return None
